"""tpupod: make a multi-host accelerator pod feel like one machine.

The Python API mirrors the CLI::

    import tpupod

    pod = tpupod.get_pod("dev")                  # a pod made by `tpupod up`
    result = tpupod.execute(pod, "hostname", workers="0,2-3", timeout=30)
    for r in result.workers:
        print(r.worker.id, r.outcome_text(), r.last_line)
    result.raise_for_failures()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "FanoutFailed",
    "FanoutResult",
    "Pod",
    "TpupodError",
    "Worker",
    "WorkerResult",
    "__version__",
    "execute",
    "execute_async",
    "get_pod",
]

if TYPE_CHECKING:
    from tpupod.errors import FanoutFailed, TpupodError
    from tpupod.fanout import execute, execute_async
    from tpupod.pod import Pod, Worker
    from tpupod.results import FanoutResult, WorkerResult
    from tpupod.state import get_pod

# Imported on first use so that `import tpupod` (and the CLI) stays fast.
_LAZY = {
    "FanoutFailed": "tpupod.errors",
    "TpupodError": "tpupod.errors",
    "FanoutResult": "tpupod.results",
    "WorkerResult": "tpupod.results",
    "execute": "tpupod.fanout",
    "execute_async": "tpupod.fanout",
    "Pod": "tpupod.pod",
    "Worker": "tpupod.pod",
    "get_pod": "tpupod.state",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tpupod' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
