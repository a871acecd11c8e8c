"""History must not slow the first view (issue 26): the overview and the first page of runs
with 1,000 finished runs cost what they cost with 10. Measured as work, not wall time, so
load cannot make it flake: the run folders the sampler reads, and the CPU time (of this
process alone) of a take of the runs and of making each page, the two histories
interleaved, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from fastapi.testclient import TestClient

from tests.fakes.runs import write_runs
from tpupod.dashboard.app import Config, create_app
from tpupod.dashboard.runs import RunIndex
from tpupod.pod.lifecycle import up
from tpupod.pod.spec import LocalPodSpec
from tpupod.pod.state import StateDir

FEW, MANY = 10, 1000
PAGE_FULL = 60  # runs enough for a first page of 50 rows, as 1,000's
ROUNDS = 15


def history(home: Path, runs: int) -> StateDir:
    """A pod of 8 workers with ``runs`` finished runs and one running."""
    state = StateDir(home)
    up(LocalPodSpec(name="big", workers=8), state)
    write_runs(state, "big", 8, runs)
    return state


def cpu_ms(work: Callable[[], object]) -> float:
    began = time.process_time()
    work()
    return (time.process_time() - began) * 1000


def within(few: list[float], many: list[float], floor_ms: float) -> bool:
    """The 1,000-run median at most 1.5x the 10-run one, or within ``floor_ms`` of it (a
    floor under which the timer's grain and the machine's noise decide)."""
    a, b = statistics.median(few), statistics.median(many)
    return b <= 1.5 * a or b - a <= floor_ms


def test_a_take_of_the_runs_reads_only_what_changed(tmp_path: Path) -> None:
    states = {n: history(tmp_path / str(n), n) for n in (FEW, MANY)}
    indexes = {n: RunIndex() for n in states}
    for n, index in indexes.items():
        first = index.take(states[n])
        assert first["count"] == n + 1 and first["states"] == {
            "ok": n - n // 10,
            "failed": n // 10,
            "running": 1,
        }
        assert index.reads == n + 1  # the first take reads every run once
    taken: dict[int, list[float]] = {n: [] for n in states}
    for _ in range(ROUNDS):
        for n, index in indexes.items():
            before = index.reads
            taken[n].append(cpu_ms(partial(index.take, states[n])))
            assert index.reads - before == 1  # the running run alone, in either history
    assert within(taken[FEW], taken[MANY], floor_ms=0.5), taken
    # a new run: it alone is read, not the history again
    write_runs(StateDir(tmp_path / "new"), "big", 8, 0)
    (tmp_path / "new" / "pods" / "big" / "runs" / "20260101-000000-bench").rename(
        states[MANY].pod_dir("big") / "runs" / "20260102-000000-new"
    )
    before = indexes[MANY].reads
    assert indexes[MANY].take(states[MANY])["count"] == MANY + 2
    assert indexes[MANY].reads - before == 2  # the new run and the running one


def test_the_first_view_costs_the_same_with_1000_runs_as_with_10(tmp_path: Path) -> None:
    """The overview against 10 runs; the first page of runs against a history that fills it
    too: a page of 50 rows against one of 11 costs its 39 more rows, which a loaded CI run
    measured past the floor (9.1 ms against 6.2)."""
    clients = {}
    for n in (FEW, PAGE_FULL, MANY):
        state = history(tmp_path / str(n), n)
        app = create_app(Config())  # no lifespan: told what the sampler would say
        app.state.feed.apply({"source": "runs", "data": RunIndex().take(state), "at": time.time()})
        clients[n] = TestClient(app, base_url="http://127.0.0.1")
    shown = {n: clients[n].get("/api/runs").json()["data"] for n in clients}
    assert len(shown[FEW]["runs"]) == FEW + 1 and len(shown[MANY]["runs"]) == 50
    assert shown[MANY]["pages"] == 21
    overview = clients[MANY].get("/").text
    assert "1001</b> runs, 1 running" in overview
    for path in ("/", "/runs"):
        made: dict[int, list[float]] = {n: [] for n in clients}
        for i in range(ROUNDS):
            for n, client in clients.items():  # a query of its own: made, not from memory
                made[n].append(cpu_ms(partial(client.get, f"{path}?n={i}")))
        assert within(made[PAGE_FULL], made[MANY], floor_ms=3.0), (path, made)
        if path == "/":
            assert within(made[FEW], made[MANY], floor_ms=3.0), (path, made)
