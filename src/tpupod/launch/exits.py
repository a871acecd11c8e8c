"""How a worker's end reaches the launcher before JAX's shutdown barrier can hold it.

A process that called ``jax.distributed.initialize`` waits at exit, in JAX's
shutdown barrier, for every other process: a worker whose data loader raised
would print its traceback and then sit there until the others finish (or
JAX's heartbeat gives up, ~100 s later), and the launcher could not tell
it from a worker still computing.

So every worker connected to a launch's rendezvous runs :func:`_at_exit`
when its interpreter exits. It is an ``atexit`` hook registered after JAX's
(``jax`` registers its shutdown when imported, and ``init_jax`` imports it
before connecting), so it runs first. It tells the rendezvous how the process
ends:

* an uncaught exception (``sys.last_value``): a failure with exit code 1,
  130 for Ctrl-C, and the exception's type and message as the reason;
* ``sys.exit(N)`` with N not 0 (``sys.exit`` is wrapped to remember N): a
  failure with code N;
* anything else: a deliberate, clean exit.

A failing worker that started JAX's distributed runtime then leaves at once
with its exit code (``os._exit``, after flushing its output and logging),
skipping the barrier; the launcher already knows why, and stops the others.
A clean exit goes through JAX's shutdown as usual: a worker that finishes
early waits there for the others, as JAX wants.

Limits: a bare ``raise SystemExit(N)`` (not through ``sys.exit``) is not
seen as a failure here; such a worker still ends with code N, but only when
the others do. A program that catches the ``SystemExit`` of its own
``sys.exit(N)`` in the main thread and then ends normally is taken to fail
with N. A failing JAX worker skips ``atexit`` hooks registered before
tpupod's (``logging`` is flushed by hand). ``os._exit`` and signals skip every
hook: the launcher learns of those from the process's exit, and the
rendezvous from the connection closing without a word.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

# Tells the rendezvous how this process ends: (code, reason, timeout), best effort and bounded
# (``RendezvousClient.report_exit``; passed in, so this module needs nothing of the client).
Report = Callable[[int | None, str | None, float], None]

REPORT_TIMEOUT_S = 2.0
INTERRUPTED_EXIT = 130


class _ExitWatch:
    def __init__(self, report: Report) -> None:
        self.report = report
        self.pid = os.getpid()
        self.code: int | None = None  # what sys.exit was last asked for
        self.reason: str | None = None
        self.original_exit: Callable[[Any], NoReturn] = sys.exit

    def exit(self, status: Any = None) -> NoReturn:
        """``sys.exit``, remembering the code it gives the process (in another thread it
        ends only that thread, so it is not remembered)."""
        if threading.current_thread() is not threading.main_thread():
            self.original_exit(status)
        if status is None or isinstance(status, int):
            self.code, self.reason = status or 0, f"sys.exit({status})"
        else:  # sys.exit("message"): Python prints it and exits with 1
            self.code, self.reason = 1, f"sys.exit: {status}"
        self.original_exit(status)

    def at_exit(self) -> None:
        if os.getpid() != self.pid:  # a forked child exiting: not this worker
            return
        code, reason = self._outcome()
        self.report(code, reason, REPORT_TIMEOUT_S)
        if code and _jax_distributed_started():
            with contextlib.suppress(Exception):
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _outcome(self) -> tuple[int | None, str | None]:
        error = getattr(sys, "last_value", None)
        if isinstance(error, KeyboardInterrupt):
            return INTERRUPTED_EXIT, "KeyboardInterrupt"
        if isinstance(error, BaseException):
            message = str(error).strip().splitlines()
            return 1, type(error).__name__ + (f": {message[0]}" if message else "")
        if self.code:
            return self.code, self.reason
        return None, None


def watch_exit(report: Report) -> None:
    """Report this process's end with ``report`` (see the module docstring)."""
    watch = _ExitWatch(report)
    sys.exit = watch.exit
    atexit.register(watch.at_exit)


def _jax_distributed_started() -> bool:
    """True when this process joined JAX's distributed runtime (and so waits for it at exit)."""
    if "jax" not in sys.modules:
        return False
    # only where the program loaded JAX: this hook runs in every worker
    from jax._src import distributed

    return distributed.global_state.client is not None
