"""The benchmark scripts that reach into private parts of the code run, small.

``benchmarks/decode_dispatch.py`` calls ``slots._decode`` and ``slots.Programs``
directly; a change of their signatures (the attention span) broke it unseen until
someone ran it. The serving benchmarks start servers and go through public
interfaces only; they are run by hand (BENCHMARKS.md).
"""

from __future__ import annotations

import importlib.util
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
