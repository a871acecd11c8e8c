"""The ``MEGASCALE_*`` variables of a run over slices: set by tpupod, or read from GCP.

JAX's TPU cluster (``jax/_src/clusters/cloud_tpu_cluster.py``) and libtpu join slices
over the data-center network with ``MEGASCALE_COORDINATOR_ADDRESS``, ``_NUM_SLICES``,
``_SLICE_ID`` and ``_PORT``, read from the environment first, then from the VM's
``tpu-env`` metadata. Who provides them:

- slices tpupod made (a local or SSH pod of slices, separate Cloud TPUs with ``--slices``):
  tpupod, in every worker's environment; the coordinator is slice 0's worker 0 at its
  internal address;
- a multislice queued resource: GCP, in ``tpu-env``. tpupod never overrides them; it reads
  every worker's before the launch and refuses, naming both values, where they disagree
  with its own view of the pod (a subset of its slices, a record that is out of date).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence

from tpupod import settings
from tpupod.errors import PreflightError
from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import Outcome
from tpupod.pod.identity import megascale_env
from tpupod.pod.record import Pod, Worker
from tpupod.pod.spec import GcpPodSpec
from tpupod.providers import Connector

# the port multislice launchers (xpk) name; not checked against libtpu here
DEFAULT_MEGASCALE_PORT = 8080
TPU_ENV_TIMEOUT_S = 15.0

_READ_TPU_ENV = (
    "import sys, urllib.request as u\n"
    "r = u.Request(sys.argv[1] + '/instance/attributes/tpu-env',"
    " headers={'Metadata-Flavor': 'Google'})\n"
    "text = u.urlopen(r, timeout=5).read().decode()\n"
    "print('\\n'.join(l for l in text.splitlines() if l.startswith('MEGASCALE_')))"
)


def from_gcp(pod: Pod) -> bool:
    """Does GCP set the pod's ``MEGASCALE_*`` itself (a multislice queued resource)?"""
    return isinstance(pod.spec, GcpPodSpec) and pod.spec.node_count > 1


def worker_megascale(
    pod: Pod, port: int = DEFAULT_MEGASCALE_PORT
) -> Callable[[Worker], dict[str, str]] | None:
    """Each worker's ``MEGASCALE_*`` variables on a pod of slices tpupod made (None: one
    slice, or GCP sets them). ``port``: the coordinator's (a local pod takes a free one)."""
    if pod.slices < 2 or from_gcp(pod):
        return None
    first = pod.workers[0].internal_address

    def env(worker: Worker) -> dict[str, str]:
        assert worker.slice is not None
        return megascale_env(worker.slice, pod.slices, first, port)

    return env


def parse_tpu_env(text: str) -> dict[str, str]:
    """``tpu-env``'s ``KEY: 'value'`` lines, read as JAX reads them."""
    values = {}
    for line in text.splitlines():
        if ":" in line:
            key, value = line.split(":", 1)
            values[key.strip()] = value.strip().strip("'")
    return values


async def check_tpu_env(
    pod: Pod, selected: Sequence[Worker], run_pod: Pod, connector: Connector
) -> None:
    """On a multislice queued resource: the ``tpu-env`` of every ``selected`` worker agrees
    with the run's view (``run_pod``: the same workers, renumbered), else a PreflightError
    naming both values. A worker whose ``tpu-env`` has no ``MEGASCALE_*`` values is refused
    too: JAX would start it as a slice of its own."""
    if not from_gcp(pod):
        return
    url = shlex.quote(settings.metadata_url())
    command = f"python3 -c {shlex.quote(_READ_TPU_ENV)} {url}"
    result = await execute_async(
        pod, command, workers=selected, connector=connector, timeout=TPU_ENV_TIMEOUT_S
    )
    problems = []
    for worker, mine, answer in zip(selected, run_pod.workers, result.workers, strict=True):
        where = f"{worker.label} (slice {worker.slice})"
        if answer.outcome is not Outcome.OK:
            problems.append(f"{where}: cannot read its tpu-env ({answer.last_line or 'no answer'})")
            continue
        found = parse_tpu_env("\n".join(answer.tail))
        expected = {
            "MEGASCALE_NUM_SLICES": str(run_pod.slices),
            "MEGASCALE_SLICE_ID": str(mine.slice or 0),
        }
        for key, value in expected.items():
            if found.get(key) != value:
                said = repr(found[key]) if key in found else "nothing"
                problems.append(f"{where}: tpu-env says {key} {said}, tpupod's run has {value}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PreflightError(
            f"GCP's multislice variables disagree with the pod: {problems[0]}{more}",
            hint="a multislice queued resource's workers join all its slices: run on every "
            "slice; if the record is out of date, 'tpupod down' then 'tpupod up' again",
        )
