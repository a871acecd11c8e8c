"""How a worker's end is told (launch/exits.py), checked in this process with a recording client."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest

from tpupod.launch.exits import _ExitWatch


class Recorder:
    def __init__(self) -> None:
        self.reports: list[tuple[int | None, str | None]] = []

    def report_exit(self, code: int | None, reason: str | None, timeout: float) -> None:
        self.reports.append((code, reason))


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> _ExitWatch:
    monkeypatch.delattr(sys, "last_value", raising=False)
    return _ExitWatch(Recorder().report_exit)


def ended(watch: _ExitWatch) -> Any:
    watch.at_exit()  # JAX's runtime is not started here, so it only reports
    return watch.report.__self__.reports[-1]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("status", "told"),
    [(3, (3, "sys.exit(3)")), ("bad config", (1, "sys.exit: bad config")), (0, (None, None))],
)
def test_sys_exit_is_told_with_its_code(
    watch: _ExitWatch, status: object, told: tuple[int | None, str | None]
) -> None:
    with pytest.raises(SystemExit):
        watch.exit(status)
    assert ended(watch) == told


def test_an_uncaught_exception_is_told_with_its_type_and_message(
    watch: _ExitWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "last_value", ValueError("bad shard 7\nmore detail"), raising=False)
    assert ended(watch) == (1, "ValueError: bad shard 7")
    monkeypatch.setattr(sys, "last_value", KeyboardInterrupt(), raising=False)
    assert ended(watch) == (130, "KeyboardInterrupt")


def test_sys_exit_in_a_thread_ends_only_the_thread(watch: _ExitWatch) -> None:
    def thread_body() -> None:
        with pytest.raises(SystemExit):
            watch.exit(4)

    thread = threading.Thread(target=thread_body)
    thread.start()
    thread.join()
    assert ended(watch) == (None, None)


def test_a_clean_end_is_told_without_a_code(watch: _ExitWatch) -> None:
    assert ended(watch) == (None, None)
