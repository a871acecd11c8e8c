"""Hung runs (issue 40): ``tpupod stacks``, ``tpupod.heartbeat``, ``run --hang-timeout`` and
``--retry-hangs``, with real programs (multi-process JAX, or plain Python) on local pods and
simulated SSH hosts, and real py-spy."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, end_run, tpupod_argv, wait_until
from tests.test_launch import needs_jax
from tpupod.pod.record import Pod

PROGRAMS = Path(__file__).parent / "programs"
HANG_JAX = str(PROGRAMS / "hang_jax.py")
HANG_PLAIN = str(PROGRAMS / "hang_plain.py")
PY_SPY = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
needs_py_spy = pytest.mark.skipif(
    PY_SPY is None and os.environ.get("CI") != "true", reason="py-spy is not installed"
)


def start(pod: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        tpupod_argv("run", "--pod", pod, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def logs_say(state_home: Path, pod: str, text: str, count: int) -> Callable[[], bool]:
    """True once ``count`` of the pod's latest run's worker logs hold ``text``."""

    def check() -> bool:
        runs = sorted((state_home / "pods" / pod / "runs").glob("*/w*.log"))
        latest = max((p.parent for p in runs), default=None, key=lambda p: p.name)
        if latest is None:
            return False
        return sum(text in log.read_text() for log in latest.glob("w*.log")) >= count

    return check


@needs_py_spy
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["local", "ssh"])
def test_stacks_name_the_worker_that_is_not_where_the_others_are(
    kind: str,
    make_pod: Callable[..., Pod],
    make_ssh_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    state_home: Path,
) -> None:
    """Four workers of a real JAX program: w3 asleep in its data loader, w0-w2 in a
    cross-host gather. `tpupod stacks` names w3, its file and line, first, in under 5 s."""
    needs_jax()
    pod = make_pod(4) if kind == "local" else make_ssh_pod(4)
    run = start(pod.name, "--", sys.executable, HANG_JAX)
    try:
        wait_until(logs_say(state_home, pod.name, "loading step 2", 1), run, 120)
        wait_until(logs_say(state_home, pod.name, "step 1 sum", 3), run, 60)
        time.sleep(1)  # w0-w2 into the gather of step 2
        taken = cli("stacks", "--pod", pod.name, timeout=60)
        assert taken.code == 0, taken.err
        lines = taken.out.splitlines()
        first = r"w3 \(1 of 4\): next_batch hang_jax\.py:19 <- train hang_jax\.py:25"
        assert re.match(first, lines[0]), taken.out
        assert lines[1].startswith("w0-w2 (3 of 4): ") and "train hang_jax.py:26" in lines[1]
        took = float(re.search(r"stacks of 4 workers in ([0-9.]+)s", taken.err)[1])  # type: ignore[index]
        assert took < 5, taken.err
        saved = Path(re.search(r"saved in (\S+)", taken.err)[1])  # type: ignore[index]
        text = saved.read_text()
        assert text.startswith(lines[0]) and "thread MainThread" in text
        assert json.loads(saved.with_suffix(".json").read_text())["digest"] == lines
        # -w selects as the run numbers its workers
        alone = cli("stacks", "--pod", pod.name, "-w", "3", timeout=60)
        assert alone.out.startswith("w3 (1 of 1): next_batch"), alone.out
    finally:
        end_run(run)


@needs_py_spy
@pytest.mark.timeout(120)
def test_hang_timeout_ends_a_hung_run_with_its_stacks(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    """--hang-timeout 20s: the run is hung within 25 s of its last progress; the digest is
    printed and saved, the odd worker named, exit 124, the record says hung."""
    pod = make_pod(3)
    began = time.monotonic()
    result = cli("run", "--pod", pod.name, "--hang-timeout", "20s", "--", sys.executable,
                 HANG_PLAIN, "hang", timeout=90)  # fmt: skip
    took = time.monotonic() - began
    assert result.code == 124, result.err
    assert took < 1.5 + 25, took  # the last progress came ~1.2 s in (step 3's heartbeat)
    assert "hung: no worker progressed for 20s; taking every worker's stacks" in result.err
    assert re.search(r"  w2 \(1 of 3\): next_batch hang_plain\.py:\d+ <- <module>", result.err)
    assert re.search(r"  w0, w1 \(2 of 3\): wait_for_peers hang_plain\.py:\d+", result.err)
    last = "hung: no worker progressed for 20s; not where the others are: w2"
    assert re.search(f"^{last}$", result.err, re.M), result.err
    assert re.search(r"^steps: w2 at \d, w0, w1 at [45]; ", result.err, re.M), result.err
    [record] = (state_home / "pods" / pod.name / "runs").glob("*/run.json")
    data = json.loads(record.read_text())
    assert data["ending"]["state"] == "hung" and data["ending"]["exit_code"] == 124
    assert data["hung"]["odd"] == [2] and Path(data["hung"]["stacks"]).is_file()
    # said once (a trial: 'ended with exit code 124: hung (exit 124): hung: no worker ...')
    logs = cli("logs", "--pod", pod.name, "-w", "1")
    assert f"hung (exit 124): {last.removeprefix('hung: ')}" in logs.err, logs.err
    progress = json.loads((record.parent / "progress.json").read_text())
    steps = {w: progress["workers"][w]["step"] for w in ("0", "2")}  # as of <= 1 s before
    assert steps["2"] < steps["0"] and steps["0"] >= 4, steps
    log = (record.parent / "w0.log").read_text()
    assert "tpupod-heartbeat" not in log and "step 5" in log  # markers are not output


@needs_py_spy
@pytest.mark.timeout(150)
def test_retry_hangs_runs_it_again_with_the_same_run_id(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    pod = make_pod(2)
    result = cli("run", "--pod", pod.name, "--hang-timeout", "5s", "--retry-hangs", "1", "--",
                 sys.executable, HANG_PLAIN, "hang-once", timeout=120)  # fmt: skip
    assert result.code == 0, result.err
    [path] = (state_home / "pods" / pod.name / "runs").glob("*/recovery.json")
    record = json.loads(path.read_text())
    assert [a["cause"] for a in record["attempts"]] == ["hung", "ok"], result.err
    assert "1 rerun after hangs" in result.err
    assert result.out.count("[w1] done") == 1


@pytest.mark.timeout(60)
def test_a_program_that_prints_on_while_its_heartbeat_stops_is_hung(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(2)
    result = cli("run", "--pod", pod.name, "--hang-timeout", "4s", "--", sys.executable,
                 HANG_PLAIN, "chatty", timeout=50)  # fmt: skip
    assert result.code == 124, result.err
    assert "still here" in result.out
    assert "hung: no worker progressed for 4s" in result.err


@pytest.mark.timeout(60)
def test_a_straggler_is_named_before_the_timeout(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(3)
    result = cli("run", "--pod", pod.name, "--hang-timeout", "8s", "--", sys.executable,
                 HANG_PLAIN, "straggle", timeout=50)  # fmt: skip
    assert result.code == 0, result.err
    said = re.search(
        r"w2 is straggling: at step (\d+).*while another worker is at step (\d+)", result.err
    )
    assert said is not None, result.err
    assert int(said[1]) < int(said[2])
    assert result.err.count("is straggling") == 1
    # the summary's line of steps (each worker's last, as its heartbeat said at exit)
    assert re.search(r"^steps: w0-w2 at 19; [0-9.]+ steps/s \(median\)$", result.err, re.M)


@pytest.mark.timeout(60)
def test_a_worker_without_py_spy_is_named_with_a_hint(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """The program runs on a Python with no py-spy beside it, and none on PATH: each worker
    says so, with the hint, and the command fails (nothing could be read)."""
    pod = make_pod(2)
    bare = tmp_path / "bin"
    bare.mkdir()
    python = shutil.which("python3", path="/usr/bin") or "/usr/bin/python3"
    (bare / "python3").symlink_to(python)
    env = {"PATH": f"{bare}:/usr/bin:/bin"}
    run = start(pod.name, "--", python, "-c", "import time; time.sleep(60)", env=env)
    try:
        runs = Path(os.environ["TPUPOD_HOME"]) / "pods" / pod.name / "runs"
        wait_until(lambda: any(runs.glob("*/w1.log")), run, 30)
        time.sleep(1)
        taken = cli("stacks", "--pod", pod.name, env=env)
        assert taken.code == 1, taken.err
        assert "error: no stacks taken: w0, w1: py-spy is not installed there" in taken.err
        assert "hint: install py-spy where the program runs" in taken.err
        assert "Traceback" not in taken.err and taken.out == ""
    finally:
        end_run(run)


def test_a_refused_ptrace_is_named_with_its_hint() -> None:
    """py-spy's own words when ptrace is refused (run as nobody against a process of root's,
    as a login user against another user's program): the worker's line and hint say so."""
    if PY_SPY is None or os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs py-spy, root and setpriv to run py-spy as nobody")
    from tpupod.hang.stacks import PTRACE_HINT, _parsed
    from tpupod.pod.state import WorkerBrief

    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        refused = subprocess.run(
            ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
             PY_SPY, "dump", "--pid", str(target.pid), "--json"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    finally:
        target.kill()
        target.wait()
    said = (refused.stderr or refused.stdout).strip()
    data = {"processes": [{"pid": target.pid, "parent": 1, "argv": [], "error": said}]}
    found = _parsed(WorkerBrief(1, "h1"), data)
    assert found.problem is not None and found.problem.startswith("ptrace refused"), said
    assert found.hint == PTRACE_HINT


def test_stacks_of_a_run_that_ended_is_an_error_with_a_hint(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(1)
    assert cli("run", "--pod", pod.name, "--", "true").code == 0
    found = cli("stacks", "--pod", pod.name)
    assert found.code == 2, found.err
    assert re.search(r"error: run \S+ is not running \(ok\): no stacks to take", found.err)
    assert "hint: " in found.err


@pytest.mark.parametrize(
    ("given", "words"),
    [("soon", "--hang-timeout: 'soon' is not a duration"), ("0", "must be more than 0 seconds")],
)
def test_a_bad_hang_timeout_is_one_line(
    given: str, words: str, make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(1)
    result = cli("run", "--pod", pod.name, "--hang-timeout", given, "--", "true")
    assert result.code == 2, result.err
    assert words in result.err and "hint: " in result.err and "Traceback" not in result.err


# -- from the new-user trial of issue 40: each fault, with default options -------------------


@needs_py_spy
@pytest.mark.timeout(60)
def test_a_hung_run_whose_others_ended_names_the_one_still_running(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    """w0, w1 exit 0 at step 5, w2 is stuck: it is named, not the finished ones."""
    pod = make_pod(3)
    result = cli("run", "--pod", pod.name, "--hang-timeout", "4s", "--", sys.executable,
                 HANG_PLAIN, "ends", timeout=50)  # fmt: skip
    assert result.code == 124, result.err
    last = "hung: no worker progressed for 4s; still running while the others ended: w2"
    assert re.search(f"^{last}$", result.err, re.M), result.err
    [record] = (state_home / "pods" / pod.name / "runs").glob("*/run.json")
    assert json.loads(record.read_text())["hung"]["odd"] == [2]


@pytest.mark.timeout(60)
def test_a_worker_with_no_step_yet_while_others_step_is_a_straggler(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(3)
    result = cli("run", "--pod", pod.name, "--hang-timeout", "6s", "--", sys.executable,
                 HANG_PLAIN, "nostep", timeout=50)  # fmt: skip
    assert re.search(
        r"w2 is straggling: no step yet, .*while another worker is at step", result.err
    )
    assert result.code == 124, result.err


@needs_py_spy
@pytest.mark.timeout(60)
def test_what_workers_print_once_stopped_as_hung_stays_in_the_logs(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    """The stop's fall (a gloo traceback as peers vanish) does not bury the digest: kept in
    the logs, named in one line, not the summary's last lines."""
    pod = make_pod(2)
    result = cli("run", "--pod", pod.name, "--hang-timeout", "3s", "--grace", "1", "--",
                 sys.executable, HANG_PLAIN, "noisy", timeout=50)  # fmt: skip
    assert result.code == 124, result.err
    assert "ValueError: peer gone" not in result.out + result.err
    logs = (state_home / "pods" / pod.name / "runs").glob("*/w0.log")
    if "ValueError: peer gone" in next(logs).read_text():  # it reached us before the KILL
        assert "more lines after the run was found hung, kept in the logs" in result.err


def test_a_heartbeat_in_a_line_the_program_had_not_ended(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    pod = make_pod(1)
    result = cli("run", "--pod", pod.name, "--", sys.executable, HANG_PLAIN, "partial")
    assert result.code == 0, result.err
    assert result.out.splitlines() == ["[w0] step 0 loss=", "[w0] 0.5"], result.out
    log = next((state_home / "pods" / pod.name / "runs").glob("*/w0.log")).read_text()
    assert "tpupod-heartbeat" not in log + result.err


@needs_py_spy
@pytest.mark.timeout(60)
def test_stacks_of_a_program_that_is_not_python(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    pod = make_pod(1)
    run = start(pod.name, "--", "sleep", "60")
    try:
        runs = state_home / "pods" / pod.name / "runs"
        wait_until(lambda: any(runs.glob("*/w0.log")), run, 30)
        time.sleep(0.5)
        taken = cli("stacks", "--pod", pod.name)
        assert taken.code == 1, taken.err
        assert re.search(
            r"error: no stacks taken: w0: its program is not Python \(sleep \(pid \d+\)\)",
            taken.err,
        ), taken.err
        assert "hint: py-spy reads Python programs" in taken.err
    finally:
        end_run(run)


@needs_py_spy
@pytest.mark.timeout(90)
def test_a_data_loader_child_is_shown_under_its_worker(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    pod = make_pod(2)
    run = start(pod.name, "--", sys.executable, HANG_PLAIN, "pool")
    try:
        wait_until(logs_say(state_home, pod.name, "done", 1), run, 60)  # w0 finished
        time.sleep(1)
        first = cli("stacks", "--pod", pod.name)
        second = cli("stacks", "--pod", pod.name)  # at once: a dump of its own
        lines = first.out.splitlines()
        assert lines[0].startswith("w1 (1 of 2): "), first.out
        children = [line for line in lines if line.startswith("  w1 child ")]
        assert any(re.search(r": load_item hang_plain\.py:\d+", c) for c in children), first.out
        saved = {re.search(r"saved in (\S+)", r.err)[1] for r in (first, second)}  # type: ignore[index]
        assert len(saved) == 2
    finally:
        end_run(run)


def test_hang_options_that_cannot_work_are_refused(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(1)
    short = cli("run", "--pod", pod.name, "--hang-timeout", "0.5", "--", "true")
    assert short.code == 2 and "--hang-timeout: 0.5s is shorter than 2s" in short.err
    alone = cli("run", "--pod", pod.name, "--retry-hangs", "1", "--", "true")
    assert alone.code == 2, alone.err
    assert "error: --retry-hangs reruns a hung run, and nothing finds one hung here" in alone.err
    spec = tmp_path / "tpupod.yaml"
    spec.write_text("name: sp\nprovider: local\nworkers: 1\nhang_timeout: soon\n")
    bad = cli("up", "-f", str(spec))
    assert bad.code == 2 and "hang_timeout: is not a duration (got 'soon')" in bad.err, bad.err


@pytest.mark.timeout(60)
def test_the_spec_s_hang_timeout_is_said_and_can_be_turned_off(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    spec = tmp_path / "tpupod.yaml"
    spec.write_text("name: sp\nprovider: local\nworkers: 1\nhang_timeout: 2s\n")
    assert cli("up", "-f", str(spec)).code == 0
    quiet = (sys.executable, "-c", "import time; time.sleep(10)")
    watched = cli("run", "--pod", "sp", "--", *quiet)
    assert watched.code == 124, watched.err
    assert "hang watchdog: no progress for 2s stops the run" in watched.err
    off = cli("run", "--pod", "sp", "--hang-timeout", "off", "--", *quiet)
    assert off.code == 0 and "hang watchdog" not in off.err, off.err


@needs_py_spy
@pytest.mark.timeout(60)
def test_status_of_a_hung_run_shows_how_long_its_workers_were_silent(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    """A hung run without heartbeats: status said "last line 0s ago" for every worker (the
    log's mtime, which the stop's own line had just moved)."""
    pod = make_pod(2)
    quiet = "print('started', flush=True); import time; time.sleep(60)"
    hung = cli("run", "--pod", pod.name, "--hang-timeout", "3s", "--", sys.executable, "-c", quiet)
    assert hung.code == 124, hung.err
    shown = cli("status", "--pod", pod.name)
    silent = re.findall(r"last line (\d+)s ago", shown.out)
    assert len(silent) == 2 and all(int(s) >= 3 for s in silent), shown.out
