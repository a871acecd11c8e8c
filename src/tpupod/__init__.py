"""tpupod: make a multi-host accelerator pod feel like one machine.

The Python API mirrors the CLI::

    import tpupod

    pod = tpupod.get_pod("dev")                  # a pod made by `tpupod up`
    result = tpupod.execute(pod, "hostname", workers="0,2-3", timeout=30)
    for r in result.workers:
        print(r.worker.id, r.outcome_text(), r.last_line)
    result.raise_for_failures()
    print(tpupod.pod_status(pod).healthy)        # every worker answers

A program started on every worker by ``tpupod run`` meets the others with::

    identity = tpupod.init_jax()        # rendezvous, then jax.distributed.initialize
    tpupod.assert_same(config, "config")  # raises on every worker if one differs
    mesh = tpupod.mesh(ici={"fsdp": -1}, dcn={"data": -1})  # within and across slices

and the launcher reads its runs back with ``tpupod.get_run("dev")`` (the latest)
or ``tpupod.runs("dev")`` (all, oldest first). A program run with ``--retries`` resumes
from ``tpupod.latest_checkpoint(ckpt_dir)`` (the newest complete Orbax step, or None),
and says how far it got with ``tpupod.heartbeat(step)`` (for ``run --hang-timeout``).
"""

from __future__ import annotations

from tpupod.base.lazy import attributes

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (mypy reads it as True)

__version__ = "0.1.0"

__all__ = [
    "FanoutFailed",
    "FanoutResult",
    "Pod",
    "PodStatus",
    "RunOutcome",
    "RunRecord",
    "TpupodError",
    "Worker",
    "WorkerResult",
    "WorkerStatus",
    "__version__",
    "assert_same",
    "execute",
    "execute_async",
    "get_pod",
    "get_run",
    "heartbeat",
    "init_jax",
    "latest_checkpoint",
    "mesh",
    "pod_status",
    "rendezvous",
    "runs",
    "worker",
]

if TYPE_CHECKING:
    from tpupod.errors import FanoutFailed, TpupodError
    from tpupod.fanout.execute import execute, execute_async
    from tpupod.fanout.results import FanoutResult, WorkerResult
    from tpupod.hang.heartbeat import heartbeat
    from tpupod.launch.client import assert_same, rendezvous
    from tpupod.launch.identity import worker
    from tpupod.launch.jaxinit import init_jax
    from tpupod.launch.mesh import mesh
    from tpupod.launch.records import RunOutcome, RunRecord, get_run, runs
    from tpupod.ops.status import PodStatus, WorkerStatus, pod_status
    from tpupod.pod.record import Pod, Worker
    from tpupod.pod.state import get_pod
    from tpupod.recovery.checkpoints import latest_checkpoint

# Imported on first use so that `import tpupod` (and the CLI) stays fast.
_LAZY = {
    "FanoutFailed": "tpupod.errors",
    "TpupodError": "tpupod.errors",
    "FanoutResult": "tpupod.fanout.results",
    "WorkerResult": "tpupod.fanout.results",
    "execute": "tpupod.fanout.execute",
    "execute_async": "tpupod.fanout.execute",
    "Pod": "tpupod.pod.record",
    "Worker": "tpupod.pod.record",
    "get_pod": "tpupod.pod.state",
    "pod_status": "tpupod.ops.status",
    "PodStatus": "tpupod.ops.status",
    "WorkerStatus": "tpupod.ops.status",
    "worker": "tpupod.launch.identity",
    "rendezvous": "tpupod.launch.client",
    "assert_same": "tpupod.launch.client",
    "init_jax": "tpupod.launch.jaxinit",
    "heartbeat": "tpupod.hang.heartbeat",
    "mesh": "tpupod.launch.mesh",
    "RunRecord": "tpupod.launch.records",
    "RunOutcome": "tpupod.launch.records",
    "runs": "tpupod.launch.records",
    "get_run": "tpupod.launch.records",
    "latest_checkpoint": "tpupod.recovery.checkpoints",
}


__getattr__, __dir__ = attributes("tpupod", _LAZY)
