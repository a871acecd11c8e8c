"""``python -m tpupod.jobs.pool_worker``: one warm process of a local runner's pool.

It reads code jobs from its standard input, one JSON line each (``{"code", "env"}``),
and runs them one at a time with the contract of ``tpupod.jobs.code`` (``logger``,
``result``, the job's id and attempt in the environment). Everything the job prints,
on stdout or stderr, goes to the one pipe the runner reads; after each job it writes
an end marker (``END`` + ``{"error": null | "..."}``) on a line of its own. Before a
job it writes ``TAKEN``: a process that dies before that never ran the job, and the
runner sends it to a fresh process instead of failing it.

The runner keeps our standard input open while it lives. A thread reads it: at EOF
(the runner is gone, even by ``kill -9``) an idle process exits, and a busy one kills
its own process group, the job and whatever it started, as the orphan guard of a
command job does. The job itself reads /dev/null.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import signal
import sys
import threading
import traceback
from typing import Any

from tpupod.jobs.code import END, RESULT, TAKEN, job_logger, run_source


class _Tracked(io.TextIOWrapper):
    """stdout and stderr in one: knows whether the last write ended its line, so the end
    marker never lands on the tail of a job's unterminated line."""

    at_line_start = True

    def write(self, text: str) -> int:
        if text:
            self.at_line_start = text.endswith("\n")
        return super().write(text)

    def mark(self, text: str) -> None:
        """A marker line of ours, on a line of its own."""
        self.write(text + "\n" if self.at_line_start else "\n" + text + "\n")


class _State:
    busy = False
    closed = False


_STATE = _State()


def _guard(jobs_in: io.BufferedReader, jobs: queue.Queue[dict[str, Any] | None]) -> None:
    state = _STATE
    for line in jobs_in:
        jobs.put(json.loads(line))
    state.closed = True
    if state.busy:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    jobs.put(None)


def _run(job: dict[str, Any], out: _Tracked) -> str | None:
    """Run one job; None, or why it failed (as its last line would say)."""
    env: dict[str, str] = job.get("env", {})
    cwd = os.getcwd()
    for name, value in env.items():  # written, never read (settings reads)
        os.environ[name] = value
    error = None
    try:
        result = run_source(job["code"], job_logger(out))
        if result is not None:
            out.mark(RESULT + json.dumps(result))
    except SystemExit as exc:  # sys.exit() in a job ends the job, as it would its process
        code = exc.code
        if code not in (None, 0):
            error = f"exit {code if isinstance(code, int) else 1}"
            if not isinstance(code, int):
                out.write(f"{code}\n")
    except BaseException as exc:
        # from the job's own frames on, as a fresh interpreter would print it
        tb = exc.__traceback__
        for _ in range(2):  # _run, run_source
            tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
        traceback.print_exception(type(exc), exc, tb, file=out)
        error = f"raised {traceback.format_exception_only(exc)[-1].strip()}"
    finally:
        os.chdir(cwd)
        for name in env:
            with contextlib.suppress(KeyError):  # the job may have removed it
                del os.environ[name]
    return error


def main() -> int:
    jobs_in = os.fdopen(os.dup(0), "rb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(os.devnull)  # noqa: SIM115 (the job's stdin, for the process's life)
    # Our own descriptor of the pipe: a job that closes 1 and 2 (or dup2's over them) takes
    # its children's output away, never our end marker (the runner would wait for it); and
    # they are put back after each job, as its working directory is.
    pipe = os.dup(1)
    out = _Tracked(
        open(pipe, "wb", closefd=False),  # noqa: SIM115
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
    sys.stdout = sys.stderr = out
    jobs: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=_guard, args=(jobs_in, jobs), daemon=True).start()
    while (job := jobs.get()) is not None:
        _STATE.busy = True
        if _STATE.closed:
            return 0
        out.mark(TAKEN)
        error = _run(job, out)
        for fd in (1, 2):
            os.dup2(pipe, fd)
        _STATE.busy = False
        out.mark(END + json.dumps({"error": error}))
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
