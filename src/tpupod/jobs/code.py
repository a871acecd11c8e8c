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
import logging
import sys
from typing import Any, TextIO

from tpupod import settings

MARK = "::tpupod-job::"
STARTED = f"{MARK} started"
RESULT = f"{MARK} result "
END = f"{MARK} end "  # a pool process finished a job: JSON {"error": ...}
TAKEN = f"{MARK} taken"  # a pool process read a job and is about to run it


def render_result(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def job_logger(stream: TextIO) -> logging.Logger:
    """The ``logger`` a job's source sees: INFO and up, one line each, to ``stream``."""
    logger = logging.getLogger("job")
    if not logger.handlers:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return logger


def run_source(source: str, logger: logging.Logger) -> str | None:
    """Run a job's source with ``logger`` and ``result``; the final ``result``, rendered."""
    scope: dict[str, Any] = {"__name__": "__job__", "logger": logger, "result": None}
    exec(compile(source, "<job>", "exec"), scope)  # the job's own code: that is the point
    return render_result(scope.get("result"))


def main() -> int:
    encoded = settings.job_code()
    if encoded is None:
        print("error: TPUPOD_JOB_CODE is not set (the job runner sets it)", file=sys.stderr)
        return 2
    source = base64.b64decode(encoded).decode()
    logger = job_logger(sys.stdout)
    print(STARTED, flush=True)
    result = run_source(source, logger)
    if result is not None:
        print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
