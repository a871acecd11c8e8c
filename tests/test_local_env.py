"""A local worker sees the environment a pod worker would, and JAX on it sees D CPU devices.

Also the finding behind setting TPU_WORKER_ID / TPU_WORKER_HOSTNAMES on local
workers: JAX reads them only on a Cloud TPU VM (libtpu and TPU chips present),
so on a CPU host they do not start TPU cluster detection.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable

from tests.conftest import require
from tpupod.fanout.execute import execute
from tpupod.pod.record import Pod

PROBE = r"""
import json, os, jax
from jax._src import clusters
from jax._src.cloud_tpu_init import running_in_cloud_tpu_vm
detected = [c.__name__ for c in clusters.ClusterEnv._cluster_types if c.is_env_present()]
print(json.dumps({"devices": len(jax.devices()), "platform": jax.default_backend(),
                  "tpu_vm": running_in_cloud_tpu_vm, "clusters": detected}))
"""


def test_identity_variables(make_pod: Callable[..., Pod]) -> None:
    pod = make_pod(3, devices=2)
    env_names = (
        "TPUPOD_POD TPUPOD_POD_UID TPUPOD_WORKER_ID TPUPOD_NUM_WORKERS TPUPOD_WORKER_HOSTNAMES "
        "TPU_WORKER_ID TPU_WORKER_HOSTNAMES JAX_PLATFORMS JAX_NUM_CPU_DEVICES"
    )
    command = f'for v in {env_names}; do printf "%s=%s;" $v "${{!v}}"; done; echo; pwd'
    result = execute(pod, command)
    for r in result.workers:
        values = dict(item.split("=", 1) for item in r.tail[0].strip(";").split(";"))
        assert values == {
            "TPUPOD_POD": pod.name,
            "TPUPOD_POD_UID": pod.uid,
            "TPUPOD_WORKER_ID": str(r.worker.id),
            "TPUPOD_NUM_WORKERS": "3",
            "TPUPOD_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1,127.0.0.1",
            "TPU_WORKER_ID": str(r.worker.id),
            "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1,127.0.0.1",
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": "2",
        }
        assert r.tail[1] == pod.workers[r.worker.id].workdir


def test_jax_sees_the_devices_and_no_tpu_cluster(make_pod: Callable[..., Pod]) -> None:
    require(
        importlib.util.find_spec("jax") is not None,
        "jax is not installed (pip install -e '.[test]')",
    )
    pod = make_pod(2, devices=3)
    import sys

    result = execute(pod, f"{sys.executable} -c '{PROBE}'", timeout=60)
    assert result.ok, [r.tail for r in result.workers]
    for r in result.workers:
        found = json.loads(r.last_line)
        assert found == {"devices": 3, "platform": "cpu", "tpu_vm": False, "clusters": []}
