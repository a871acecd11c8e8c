"""The chaos harness's verdict as a user reads it (benchmarks/chaos.py), without a run."""

from __future__ import annotations

import importlib.util
import io
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

CHAOS = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py"


@pytest.fixture(scope="module")
def chaos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chaos_harness", CHAOS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def verdict(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "training": {"chaos": {"identical": True, "steps": 40, "redone": 3, "launches": 2,
                               "exit": 0}},
        "jobs": {"acknowledged": 5, "lost": [], "duplicated": [], "unexpected": [],
                 "logs_incomplete": [], "statuses": {"completed": 5}, "rerun": []},
        "requests": {"ok": 9999, "failed": {"APIError": 1}, "longest_gap_s": 3.2},
        "injections": [
            {"t": 12.5, "kind": "network", "target": "host 198.18.0.10 for 30s",
             "named_s": 19.9, "named_by": "run chaos-ssh: tpupod: w0 failed (unreachable): "
             "stopping 1 worker (TERM, then KILL after 5s), and a long line that goes on"},
            {"t": 30.0, "kind": "worker", "target": "chaos pid 7 (/a/long/path/to/python "
             "/a/long/path/examples/multislice_train.py --steps 40)", "named_s": 0.1,
             "named_by": "run chaos: tpupod: w0 failed (killed by SIGKILL)"},
        ],
        "leftovers": [],
    }  # fmt: skip
    base.update(changes)
    return base


def report(chaos: ModuleType, found: dict[str, Any]) -> list[str]:
    found["misses"] = chaos.misses(found)
    out = io.StringIO()
    chaos.report(found, out)
    return out.getvalue().splitlines()


def test_the_verdict_ends_with_one_line_that_says_every_target_was_met(
    chaos: ModuleType,
) -> None:
    """A trial: the verdict never said plainly whether the run passed (a JSON blob ending in
    "misses": [], then the injections; a line only for a miss)."""
    lines = report(chaos, verdict())
    assert lines[-1] == "chaos: every target met (5 checks, 2 injections)", lines
    assert any(re.match(r"  requests .*99\.99 % ok \(target 99\.9 %\).* met$", x) for x in lines)


def test_a_missed_target_is_said_in_the_last_line_and_beside_its_check(
    chaos: ModuleType,
) -> None:
    found = verdict(requests={"ok": 10, "failed": {"APIError": 5}, "longest_gap_s": 12.0})
    lines = report(chaos, found)
    assert lines[-1] == "chaos: 1 of 5 checks MISSED: requests", lines
    assert any(x.startswith("  requests ") and x.endswith("MISSED") for x in lines), lines


def test_each_injection_shows_its_whole_target_its_allowance_and_tpupods_whole_line(
    chaos: ModuleType,
) -> None:
    """A trial: the target and the line that named it were cut mid-word, and the table
    said nothing of the network's longer allowance (the SSH keepalive's)."""
    text = "\n".join(report(chaos, verdict()))
    assert "/a/long/path/examples/multislice_train.py --steps 40)" in text
    assert "and a long line that goes on" in text
    assert "named in 19.9 s of 25 s by run chaos-ssh: tpupod: w0 failed" in text
    assert "named in 0.1 s of 10 s by run chaos: tpupod: w0 failed" in text


def test_a_killed_worker_is_named_by_tpupods_line_not_bashs_job_report(
    chaos: ModuleType,
) -> None:
    """A trial: the worker's kill counted as named by bash's own '[w0] /bin/bash: line 20:
    16317 Killed ...' (the shell that ran it), not by anything tpupod said."""
    named = re.compile(chaos.NAMED["worker"], re.IGNORECASE)
    assert not named.search("[w0] /bin/bash: line 20: 16317 Killed    python train.py")
    assert named.search("tpupod: w0 failed (killed by SIGKILL): stopping 1 worker")
    assert named.search("tpupod: run 2026, attempt 12: lost worker (w0 (vm) killed by SIGKILL)")
