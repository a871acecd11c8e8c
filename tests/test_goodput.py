"""A ``--retries`` run's goodput (issue 42, part 4): productive step time over wall time,
and what the rest went to, printed at the end of the run and kept in its record."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult
from tpupod.dashboard.runs import find_retried
from tpupod.pod.record import Pod
from tpupod.pod.state import StateDir
from tpupod.recovery.goodput import account
from tpupod.recovery.record import AttemptRecord, RecoveryRecord


def progress_file(folder: Path, *workers: tuple[tuple[float, int], tuple[float, int]]) -> None:
    folder.mkdir(parents=True)
    data = {str(w): {"step": last[1], "first": first, "last": last}
            for w, (first, last) in enumerate(workers)}  # fmt: skip
    (folder / "progress.json").write_text(json.dumps({"at": 0, "workers": data}))


def test_goodput_counts_each_attempts_new_steps_and_names_the_rest(tmp_path: Path) -> None:
    """Two attempts: the first launched at 10 s, stepped 0..12 from 12 s to 24 s (1 s a
    step); the second, after 5 s of TPU creation and a 2 s wait, launched at 40 s and
    stepped 10..19 from 44 s to 53 s: steps 11 and 12 were redone. Worker 1's last beat
    is older (beats come at most once a second): the furthest worker counts."""
    runs = tmp_path / "runs"
    record = RecoveryRecord("r", "p", ["x"], {}, started=0.0, launcher_pid=1,
                            path=runs / "r" / "recovery.json")  # fmt: skip
    first = AttemptRecord(1, started=0.0, phases={"setup": 8.0, "run": 16.0}, launch_id="l1",
                          ended=27.0, launched=10.0)  # fmt: skip
    second = AttemptRecord(2, started=29.0, phases={"create": 5.0, "run": 14.0},
                           launch_id="l2", ended=55.0, launched=40.0)  # fmt: skip
    record.attempts = [first, second]
    progress_file(runs / "l1", ((12.0, 0), (24.0, 12)), ((12.5, 0), (21.5, 9)))
    progress_file(runs / "l2", ((44.0, 10), (53.0, 19)))
    found = account(record, ended=56.0)
    assert found is not None
    # attempt 1: 0..12 in 12 s; attempt 2: 10..19 in 9 s (1 s a step), 10..12 again
    assert found.steps == 12 + 7 and found.steps_redone == 2
    assert found.productive_s == pytest.approx(12.0 + 7.0)
    spent = found.badput_s
    assert spent["capacity"] == 5.0 and spent["setup"] == 8.0
    assert spent["start and restore"] == pytest.approx(2.0 + 4.0)
    assert spent["steps redone"] == pytest.approx(2.0)
    assert spent["after the last step"] == pytest.approx(2.0 + 1.0)
    assert spent["between attempts"] == pytest.approx(2.0 + 1.0)  # 27..29, 55..56
    # in attempts: before their launch (2, 6) and after it (1, 1)
    assert spent["other"] == pytest.approx(2.0 + 6.0 + 1.0 + 1.0)
    assert found.wall_s == 56.0
    assert found.productive_s + sum(spent.values()) == pytest.approx(56.0)
    assert found.describe().startswith("goodput 34%: 19 steps in 19.0 s of 56.0 s; capacity")
    no_beats = RecoveryRecord("r", "p", ["x"], {}, started=0.0, launcher_pid=1,
                              path=tmp_path / "none" / "r" / "recovery.json")  # fmt: skip
    no_beats.attempts = [AttemptRecord(1, started=0.0, launch_id="l9", ended=3.0, launched=1.0)]
    assert account(no_beats, ended=3.0) is None


def test_a_launcher_killed_mid_attempt_is_its_own_badput(tmp_path: Path) -> None:
    """A new user's trial: the 13 s between a launcher's kill -9 and the `run --resume`
    went to 'other' (the dead launcher's attempt ends when the resume begins, and its run
    phase was never timed). From its last heartbeat to the resume: 'launcher gone'."""
    runs = tmp_path / "runs"
    record = RecoveryRecord("r", "p", ["x"], {}, started=0.0, launcher_pid=1,
                            path=runs / "r" / "recovery.json")  # fmt: skip
    lost = AttemptRecord(1, started=0.0, launch_id="l1", ended=40.0, launched=1.0,
                         cause="launcher lost")  # fmt: skip
    again = AttemptRecord(2, started=40.0, phases={"run": 12.0}, launch_id="l2", ended=52.0,
                          launched=40.0, cause="ok")  # fmt: skip
    record.attempts = [lost, again]
    progress_file(runs / "l1", ((3.0, 0), (20.0, 17)))  # killed about 20 s
    progress_file(runs / "l2", ((42.0, 15), (52.0, 25)))
    found = account(record, ended=52.0)
    assert found is not None
    assert found.badput_s["launcher gone"] == pytest.approx(20.0)
    assert found.badput_s["steps redone"] == pytest.approx(2.0)  # 16, 17
    assert found.badput_s["other"] == pytest.approx(1.0)  # attempt 1 before its launch
    assert found.productive_s + sum(found.badput_s.values()) == pytest.approx(52.0)


# 20 steps of 0.1 s with a heartbeat each, a checkpoint every 5 (worker 0 marks it);
# attempt 1 leaves after step 12 as a program that saved on SIGTERM (exit 143).
STEPS = """
import os, sys, time
from pathlib import Path
import tpupod
me = tpupod.rendezvous("start")
ckpt = Path(sys.argv[1])
done = sorted(int(p.stem) for p in ckpt.glob("*.step"))
for step in range(done[-1] + 1 if done else 0, 20):
    time.sleep(0.1)
    if me.id == 0 and step % 5 == 4:
        (ckpt / f"{step}.step").write_text("")
    tpupod.heartbeat(step)
    if os.environ["TPUPOD_ATTEMPT"] == "1" and step == 12:
        sys.exit(143)
"""


@pytest.mark.timeout(120)
def test_a_retries_run_ends_with_its_goodput_and_keeps_it_in_its_record(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path, tmp_path: Path
) -> None:
    pod = make_pod(workers=2)
    done = cli("run", "--pod", pod.name, "--retries", "1", "--retry-exit-codes", "143", "--",
               sys.executable, "-c", STEPS, str(tmp_path), timeout=90)  # fmt: skip
    assert done.code == 0, done.err
    line = next(x for x in done.err.splitlines() if "goodput" in x)
    assert "19 steps in" in line and "steps redone" in line, line
    [path] = (StateDir().pod_dir(pod.name) / "runs").glob("*/recovery.json")
    kept = json.loads(path.read_text())["goodput"]
    # attempt 1: 0..12 (12 timed steps); attempt 2 from 10: 10..19, of which 11-12 again
    assert kept["steps"] == 12 + 7 and kept["steps_redone"] == 2, kept
    assert 0 < kept["goodput"] < 1
    assert kept["productive_s"] + sum(kept["badput_s"].values()) == pytest.approx(kept["wall_s"])
    status = cli("status", "--pod", pod.name)
    assert "goodput" in status.out and "19 steps in" in status.out, status.out
    shown = find_retried(StateDir(), path.parent.name)  # the dashboard's run page
    assert shown is not None and len(shown["attempts"]) == 2, shown
    assert shown["goodput"].startswith("goodput "), shown
