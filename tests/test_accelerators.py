"""The accelerator table: worker counts the runbooks got wrong, and errors that point the way."""

from __future__ import annotations

import pytest

from tpupod.errors import UsageError
from tpupod.pod.accelerators import all_names, lookup


@pytest.mark.parametrize(
    ("name", "chips", "workers", "per_worker"),
    [
        ("v2-8", 4, 1, 4),
        ("v3-32", 16, 4, 4),
        ("v4-8", 4, 1, 4),
        ("v4-16", 8, 2, 4),  # seed 000: a 2-worker pod
        ("v5p-128", 64, 16, 4),
        ("v5litepod-1", 1, 1, 1),
        ("v5litepod-8", 8, 1, 8),  # single host: 8 chips on one VM
        ("v5litepod-16", 16, 4, 4),
        ("v5litepod-64", 64, 16, 4),  # seed 001: 16 workers
        ("v5litepod-256", 256, 64, 4),  # seed 002 says "4 hosts x 64": it is 64 workers
        ("v6e-8", 8, 1, 8),
        ("v6e-16", 16, 4, 4),
    ],
)
def test_known_types(name: str, chips: int, workers: int, per_worker: int) -> None:
    found = lookup(name)
    assert (found.chips, found.workers, found.chips_per_worker) == (chips, workers, per_worker)
    assert found.chips == found.workers * found.chips_per_worker


def test_default_runtimes() -> None:
    assert lookup("v4-16").default_runtime == "tpu-ubuntu2204-base"
    assert lookup("v5litepod-16").default_runtime == "v2-alpha-tpuv5-lite"
    assert lookup("v6e-16").default_runtime == "v2-alpha-tpuv6e"


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("v5e-64", "the API calls it v5litepod-64"),
        ("v4-12", "v4 comes in sizes 8, 16, 32"),
        ("v5litepod-6", "v5litepod comes in sizes 1, 4, 8"),
        ("v5p8", "did you mean v5p-8"),
        ("tpu", "known generations: v2, v3, v4, v5p, v5litepod, v6e"),
    ],
)
def test_unknown_types_point_to_the_nearest(name: str, hint: str) -> None:
    with pytest.raises(UsageError, match="unknown TPU type") as info:
        lookup(name)
    assert info.value.hint is not None and hint in info.value.hint


def test_every_listed_name_resolves() -> None:
    for name in all_names():
        found = lookup(name)
        assert found.name == name and found.workers >= 1
