"""The benchmark scripts that reach into private parts of the code run, small.

``benchmarks/decode_dispatch.py`` calls ``slots._decode`` and ``slots.Programs``
directly; a change of their signatures (the attention span) broke it unseen until
someone ran it. ``benchmarks/stacked_layers.py`` is the device check's (issue 24
§3); its run on a device is the only one that counts, so a break must show here
first, as must a syntax error in the device call's scripts (``benchmarks/device/``).
The serving benchmarks start servers and go through public interfaces only; they
are run by hand (BENCHMARKS.md).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import IN_CI

if importlib.util.find_spec("flax") is None:
    if IN_CI:
        raise RuntimeError("prerequisite missing in CI: flax (pip install -e '.[test]')")
    pytest.skip("needs the model extra", allow_module_level=True)

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

pytestmark = [pytest.mark.local, pytest.mark.timeout(120)]


def test_the_decode_dispatch_benchmark_runs() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import decode_dispatch
    finally:
        sys.path.remove(str(BENCHMARKS))
    before, after = decode_dispatch.measure(layers=2, calls=3)
    assert before > 0 and after > 0


def test_the_stacked_layers_benchmark_runs() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import stacked_layers
    finally:
        sys.path.remove(str(BENCHMARKS))
    import jax.numpy as jnp

    results = stacked_layers.measure(layers=2, steps=2, dtype=jnp.float32, rows=2)
    assert set(results) == {"listed", "static", "scan"}
    assert all(r["ms"] > 0 and r["temp_per_layer_weights"] >= 0 for r in results.values())


@pytest.mark.parametrize("script", ["prepare.sh", "issue24.sh"])
def test_the_device_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(BENCHMARKS / "device" / script)], check=True)
