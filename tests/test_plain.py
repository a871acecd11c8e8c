"""plain.Plain: the value classes of the fast paths behave as the dataclasses they replaced."""

from __future__ import annotations

import pytest

from tpupod.fanout.results import FanoutResult, Outcome, WorkerResult
from tpupod.pod.state import WorkerBrief
from tpupod.transport.base import ExitStatus

pytestmark = pytest.mark.unit


def test_equality_hash_and_repr_come_from_the_fields() -> None:
    assert ExitStatus(0) == ExitStatus(0, None) != ExitStatus(None, 9)
    assert ExitStatus(1) != (1, None)
    assert len({WorkerBrief(1, "a"), WorkerBrief(1, "a"), WorkerBrief(2, "a")}) == 2
    assert repr(ExitStatus(None, 9)) == "ExitStatus(code=None, signal=9)"


def test_replace_copies_with_changes_and_refuses_unknown_fields() -> None:
    row = WorkerResult(WorkerBrief(0, "vm"), Outcome.FAILED, 1.5, ExitStatus(2))
    hinted = row.replace(hint="try again")
    assert (hinted.hint, row.hint) == ("try again", None)
    assert hinted.replace(hint=None) == row
    result = FanoutResult("true", [row], 1.5, [0])
    assert result.replace(workers=[hinted]).workers[0].hint == "try again"
    assert result.failure_order == [0]
    with pytest.raises(TypeError, match="no field 'hnt'"):
        row.replace(hnt="x")
