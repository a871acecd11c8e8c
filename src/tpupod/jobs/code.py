"""``python -m tpupod.jobs.code``: run a code job's source on one worker, as seed 003 did.

The source comes base64-encoded in ``TPUPOD_JOB_CODE`` (an environment variable reaches
every worker of local and SSH pods alike, with no file to copy). It runs with ``logger``
(lines go to stdout, so the runner stores them) and ``result``, whose final value is
reported on a marker line the runner keeps off the log. Inside a pod the worker's
identity is in the environment, so ``tpupod.init_jax()`` works in the source.
"""

from __future__ import annotations

import base64
import json
import linecache
import sys
import traceback
from typing import TYPE_CHECKING, Any, TextIO

from tpupod import settings

if TYPE_CHECKING:
    import logging  # imported where a job runs: submit's fast path checks code with this

MARK = "::tpupod-job::"
STARTED = f"{MARK} started"
RESULT = f"{MARK} result "
END = f"{MARK} end "  # a pool process finished a job: JSON {"error": ...}
TAKEN = f"{MARK} taken"  # a pool process read a job and is about to run it


def render_result(value: Any) -> str | None:
    """The job's ``result`` as JSON text (what is not JSON: its ``repr``, as a string)."""
    if value is None:
        return None
    try:
        return json.dumps(value, allow_nan=False)  # NaN is not JSON: HTTP clients choke
    except (TypeError, ValueError):
        return json.dumps(repr(value))


def job_logger(stream: TextIO) -> logging.Logger:
    """The ``logger`` a job's source sees: INFO and up, one line each, to ``stream``."""
    # a code job's worker only: jobs submit's fast path imports this module
    import logging

    logger = logging.getLogger("job")
    if not logger.handlers:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return logger


SOURCE_NAME = "<job>"


def syntax_problem(source: str, name: str = SOURCE_NAME) -> str | None:
    """Why ``source`` does not compile, with the line (``name line N: why: text``); None
    when it does. Checked at submit, so a typo is refused before it waits in the queue."""
    try:
        compile(source, name, "exec", dont_inherit=True)
    except SyntaxError as exc:  # ValueError (a NUL byte) is not ours to explain: it runs
        text = (exc.text or "").strip()
        return f"{name} line {exc.lineno}: {exc.msg}" + (f": {text}" if text else "")
    return None


def run_source(source: str, logger: logging.Logger) -> str | None:
    """Run a job's source with ``logger`` and ``result``; the final ``result``, rendered."""
    # its lines, for tracebacks (no mtime: linecache never drops them as stale)
    linecache.cache[SOURCE_NAME] = (len(source), None, source.splitlines(True), SOURCE_NAME)
    scope: dict[str, Any] = {"__name__": "__job__", "logger": logger, "result": None}
    exec(compile(source, SOURCE_NAME, "exec"), scope)  # the job's own code: that is the point
    return render_result(scope.get("result"))


def print_job_error(exc: BaseException, file: TextIO) -> None:
    """A job's exception from the job's own frames on, as ``python job.py`` prints it
    (a syntax error has no frames of the job's: its message alone)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != SOURCE_NAME:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=file)


def main() -> int:
    encoded = settings.job_code()
    if encoded is None:
        print("error: TPUPOD_JOB_CODE is not set (the job runner sets it)", file=sys.stderr)
        return 2
    source = base64.b64decode(encoded).decode()
    logger = job_logger(sys.stdout)
    print(STARTED, flush=True)
    try:
        result = run_source(source, logger)
    except Exception as exc:  # SystemExit and KeyboardInterrupt end it as they would
        print_job_error(exc, sys.stderr)
        return 1
    if result is not None:
        print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
