"""``tpupod run --retries`` as a user meets it on local and SSH pods (issue 37): a worker
killed from outside is lost (and rerun), a program's own exit is its error (and the end
says which flag reruns it, and ``--resume`` with that flag goes on from the checkpoint), a
host unplugged for good gets a verdict within the probe budget, bad input leaves no
record, and the messages say what happened. Every run uses a user's default options."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CliResult, tpupod_argv, wait_until
from tpupod.pod.record import Pod
from tpupod.sim import SimPod

PYTHON = sys.executable
# Steps of 0.2 s, worker 0 marks each one done (its "checkpoint"), resumed after the last;
# every attempt leaves its pid. With a third argument N, attempt 1 ends itself after step N
# as a program that saved on SIGTERM does (the example's shape): sys.exit(143).
STEPPER = """
import os, sys, time
from pathlib import Path
import tpupod
me = tpupod.rendezvous("start")
ckpt, steps = Path(sys.argv[1]), int(sys.argv[2])
attempt = os.environ["TPUPOD_ATTEMPT"]
done = sorted(int(p.stem) for p in ckpt.glob("*.step"))
start = done[-1] + 1 if done else 0
(ckpt / f"pid-w{me.id}-{attempt}").write_text(str(os.getpid()))
print(f"w{me.id} attempt {attempt} from step {start}", flush=True)
for step in range(start, steps):
    time.sleep(0.2)
    if me.id == 0:
        (ckpt / f"{step}.step").write_text("")
    if len(sys.argv) > 3 and attempt == "1" and step == int(sys.argv[3]):
        print(f"w{me.id}: saved step {step}, leaving", flush=True)
        sys.exit(143)
print(f"w{me.id} done", flush=True)
"""


def stepper(ckpt: Path, steps: int, *leave_after: int) -> list[str]:
    return [PYTHON, "-c", STEPPER, str(ckpt), str(steps), *map(str, leave_after)]


def record_of(state_home: Path, pod: Pod) -> dict[str, Any]:
    [path] = (state_home / "pods" / pod.name / "runs").glob("*/recovery.json")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def popen(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        tpupod_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.timeout(120)
def test_a_worker_killed_from_outside_is_lost_and_rerun(
    make_pod: Callable[..., Pod], state_home: Path, tmp_path: Path
) -> None:
    pod = make_pod(workers=2)
    run = popen("run", "--pod", pod.name, "--retries", "1", "--", *stepper(tmp_path, 15))
    wait_until((tmp_path / "3.step").exists, run, timeout=60)
    os.kill(int((tmp_path / "pid-w1-1").read_text()), signal.SIGKILL)  # the OOM killer, say
    out, err = run.communicate(timeout=90)
    assert run.returncode == 0, err
    record = record_of(state_home, pod)
    assert [a["cause"] for a in record["attempts"]] == ["lost worker", "ok"], err
    assert "w1 (vm) killed by SIGKILL" in record["attempts"][0]["detail"]
    assert "w0 attempt 2 from step" in out and "w1 done" in out


@pytest.mark.timeout(120)
def test_a_program_that_exits_143_itself_is_its_error_and_resume_reruns_it(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path, tmp_path: Path
) -> None:
    pod = make_pod(workers=2)
    first = cli("run", "--pod", pod.name, "--retries", "1", "--",
                *stepper(tmp_path, 10, 3), timeout=60)  # fmt: skip
    assert first.code == 143, first.err
    record = record_of(state_home, pod)
    run_id = record["run_id"]
    assert [a["cause"] for a in record["attempts"]] == ["program error"]
    # its own exit, told as one (not "killed by SIGTERM", which its shell made of 143)
    assert "exit 143: sys.exit(143) after" in first.err, first.err
    assert "killed by SIGTERM" not in first.err
    # the end says which flag would have rerun it, and how to go on now
    assert "--retry-exit-codes 143" in first.err and "--retry-errors" in first.err
    assert f"'tpupod run --resume {run_id} --retry-errors 1'" in first.err
    refused = cli("run", "--pod", pod.name, "--resume", run_id)
    assert refused.code == 2, refused.err
    assert refused.err.startswith(f"error: run {run_id} failed (program error, exit 143)")
    assert f"hint: 'tpupod run --resume {run_id} --retry-errors 1'" in refused.err
    resumed = cli("run", "--pod", pod.name, "--resume", run_id, "--retry-exit-codes", "143",
                  timeout=60)  # fmt: skip
    assert resumed.code == 0, resumed.err
    assert "w0 attempt 2 from step 4" in resumed.out and "w1 done" in resumed.out
    record = record_of(state_home, pod)
    assert record["state"] == "done"
    assert [a["cause"] for a in record["attempts"]] == ["program error", "ok"]


@pytest.mark.timeout(300)
def test_a_host_unplugged_for_good_gets_a_verdict_within_the_probe_budget(
    make_ssh_pod: Callable[..., Pod], sim_hosts_up: SimPod, state_home: Path, tmp_path: Path
) -> None:
    from tpupod.recovery.policy import DEFAULT_PROBE_S

    shared = Path("/dev/shm") / f"tpupod-usage-{tmp_path.name}"
    shared.mkdir()
    pod = make_ssh_pod(2)
    run = popen("run", "--pod", pod.name, "--retries", "2", "--", *stepper(shared, 10_000))
    try:
        wait_until((shared / "3.step").exists, run, timeout=90)
        sim_hosts_up.unplug(1)  # for good
        unplugged = time.monotonic()
        _, err = run.communicate(timeout=DEFAULT_PROBE_S + 90)
        took = time.monotonic() - unplugged
    finally:
        sim_hosts_up.plug(1)
        run.kill()
        subprocess.run(["rm", "-rf", str(shared)], check=False)
    assert run.returncode == 255, err
    assert took < DEFAULT_PROBE_S + 30, (took, err)
    record = record_of(state_home, pod)
    assert [a["cause"] for a in record["attempts"]] == ["lost worker"], err  # no attempt on it
    lines = err.strip().splitlines()
    host = sim_hosts_up.hosts[1].hostname
    assert lines[-2] == (
        f"error: run {record['run_id']}: w1 ({host}) did not answer within the probe budget: "
        "not rerun on a silent host"
    ), err
    assert lines[-1].startswith("hint: bring the host back")
    assert "--zones" not in err and "accelerator" not in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("options", "said"),
    [
        (("--setup", "/nonexistent/setup.sh"), "error: --setup /nonexistent/setup.sh: no such"),
        (("--sync", "code"), "error: --sync: "),
        (("--zones", "us-west4-b"), "error: --zones: pod "),
    ],
)
def test_bad_input_is_refused_before_a_record_exists(
    options: tuple[str, ...],
    said: str,
    make_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    state_home: Path,
    tmp_path: Path,
) -> None:
    pod = make_pod(workers=2)
    outside = tmp_path / "not-a-repository"
    outside.mkdir()
    argv = tpupod_argv("run", "--pod", pod.name, "--retries", "1", *options, "--", "true")
    done = subprocess.run(argv, capture_output=True, text=True, cwd=outside, timeout=30)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(said) and lines[1].startswith("hint: ")
    assert "--script" not in done.stderr and "Traceback" not in done.stderr
    assert not list((state_home / "pods" / pod.name).glob("runs/*/recovery.json"))
    status = cli("status", "--pod", pod.name)
    assert "--resume" not in status.out and "launcher is gone" not in status.out


@pytest.mark.timeout(120)
def test_cancel_is_called_cancel_and_status_names_the_running_launch(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path, tmp_path: Path
) -> None:
    pod = make_pod(workers=2)
    run = popen("run", "--pod", pod.name, "--retries", "1", "--", *stepper(tmp_path, 10_000))
    try:
        wait_until((tmp_path / "1.step").exists, run, timeout=60)
        record = record_of(state_home, pod)
        [launch] = [p.name for p in (state_home / "pods" / pod.name / "runs").iterdir()
                    if (p / "run.json").exists()]  # fmt: skip
        shown = cli("status", "--pod", pod.name).out
        # the attempt's line as it stands: no phase times yet, so no dangling "; "
        assert f"  attempt 1: running (run); launch {launch}\n" in shown, shown
        cancelled = cli("cancel", "--pod", pod.name, record["run_id"], timeout=60)
        assert cancelled.code == 0, cancelled.err
        _, err = run.communicate(timeout=60)
        assert run.returncode == 130, err
        assert "cancelled by 'tpupod cancel': stopping 2 workers" in err, err
        assert "Ctrl-C" not in err
        assert "attempt 1: interrupted (cancelled by 'tpupod cancel')" in err
    finally:  # a failed assertion must not leave the run (and its pipes) to a later test
        run.kill()
        run.communicate()


@pytest.mark.timeout(60)
def test_the_setup_scripts_output_is_shown(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(workers=2)
    script = tmp_path / "setup.sh"
    script.write_text("echo installing the things\n")
    result = cli("run", "--pod", pod.name, "--retries", "1", "--setup", str(script), "--",
                 "true", timeout=60)  # fmt: skip
    assert result.code == 0, result.err
    shown = result.out + result.err
    assert "[w0] installing the things" in shown and "[w1] installing the things" in shown


def test_run_help_says_what_counts_as_lost_and_what_reruns_a_programs_own_end(
    cli: Callable[..., CliResult],
) -> None:
    shown = " ".join(cli("run", "--help", env={"COLUMNS": "200"}).out.split())
    assert "killed by KILL, TERM or HUP without a word of its own" in shown
    assert "A host still silent after the probe budget ends the run (exit 255)" in shown
    assert "143 for a program that saves on SIGTERM and exits 143 itself" in shown
    assert "a run that failed, with the flag that reruns its end" in shown


# Attempt 1: worker 0 holds the coordinator port (as JAX's coordinator in it does) and every
# worker waits; attempt 2 ends at once.
PORT_HOLDER = """
import os, socket, time
if os.environ["TPUPOD_ATTEMPT"] == "1":
    if os.environ["TPUPOD_WORKER_ID"] == "0":
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("0.0.0.0", 8476))
        held.listen()
        print("holding 8476", flush=True)
    time.sleep(600)
print("attempt", os.environ["TPUPOD_ATTEMPT"], "done", flush=True)
"""


@pytest.mark.timeout(240)
def test_what_an_attempt_left_on_a_host_that_came_back_is_stopped_before_the_next(
    make_ssh_pod: Callable[..., Pod], sim_hosts_up: SimPod, state_home: Path
) -> None:
    """The chaos harness (issue 41): w0's network down for 30 s; the attempt ended 'lost
    worker (w0 stopped answering, then came back)', but its program on w0 still ran, held
    JAX's coordinator port, and the next attempt's preflight ended the run as a program
    error ('port 8476 (JAX's coordinator) is in use on w0')."""
    pod = make_ssh_pod(2)
    w0 = next(h.index for h in sim_hosts_up.hosts if h.address == pod.workers[0].internal_address)
    run = popen("run", "--pod", pod.name, "--retries", "2", "--", PYTHON, "-c", PORT_HOLDER)
    assert run.stdout is not None
    try:
        for line in run.stdout:
            if "holding 8476" in line:
                break
        sim_hosts_up.unplug(w0)
        time.sleep(20)
        sim_hosts_up.plug(w0)
        out, err = run.communicate(timeout=180)
    finally:
        sim_hosts_up.plug(w0)
        run.kill()
    assert run.returncode == 0, err
    assert "[w0] attempt 2 done" in out and "[w1] attempt 2 done" in out, out
    assert re.search(r"stopped \d+ process\(es\) attempt 1 left on w0\n", err), err


def test_a_worker_unreachable_at_a_launchs_preflight_is_a_lost_worker_not_a_program_error(
    make_pod: Callable[..., Pod],
) -> None:
    """The chaos harness's 60-minute run: a resumed run's preflight found a host whose
    network was down ('w1 (host-1): unreachable: cannot connect: no answer in 5s'); by
    the time the launcher asked again the link was back, so the attempt was taken for a
    program error and the run ended after 26 attempts, --retries 1000 notwithstanding. A
    worker that did not answer the preflight is a lost worker, as one that stops answering
    mid-run is: probed, and rerun once it answers."""
    import asyncio

    from tpupod.errors import PreflightError
    from tpupod.fanout.context import Interrupt
    from tpupod.pod.state import StateDir
    from tpupod.recovery.loop import Recovery
    from tpupod.recovery.policy import RetryPolicy
    from tpupod.recovery.record import RecoveryRecord

    pod = make_pod(2)
    state = StateDir()
    launches: list[int] = []

    async def launch(*_: Any) -> Any:
        launches.append(1)
        if len(launches) == 1:  # unreachable then; answers by the time anyone asks again
            raise PreflightError(
                "1 worker(s) not ready: w1 (vm): unreachable: cannot connect: no answer in 5s",
                unreachable=("w1",),
            )
        raise PreflightError("1 worker(s) not ready: w0 (vm): exit 1: holder: 123")

    async def main() -> int:
        record = RecoveryRecord.new(state, pod.name, ["true"], {})
        policy = RetryPolicy(retries=3, probe_s=10)
        recovery = Recovery(
            record, state, policy, launch, notice=lambda text: None, interrupt=Interrupt()
        )
        code = await recovery.run()
        causes = [a.cause for a in record.attempts]
        assert causes == ["lost worker", "program error"], (causes, record.attempts)
        assert "w1 stopped answering" in (record.attempts[0].detail or "")
        return code

    assert asyncio.run(main()) == 1
    assert len(launches) == 2


@pytest.mark.timeout(240)
def test_resume_says_at_once_which_worker_did_not_answer_the_stop_of_what_was_left(
    make_ssh_pod: Callable[..., Pod], sim_hosts_up: SimPod, state_home: Path
) -> None:
    """The chaos harness's seed 4: the launcher was killed while host-0's link was down,
    and the `run --resume` that followed stopped what the earlier attempt had left on every
    worker, waited out the host that did not answer and said nothing: nothing named the cut
    until the link was back, 18 s later. The resume names the worker at once (within the
    connect timeout), says what it means, and goes on once the host is back."""
    pod = make_ssh_pod(2)
    w0 = next(h.index for h in sim_hosts_up.hosts if h.address == pod.workers[0].internal_address)
    run = popen("run", "--pod", pod.name, "--retries", "3", "--", PYTHON, "-c", PORT_HOLDER)
    resumed: subprocess.Popen[str] | None = None
    assert run.stdout is not None
    try:
        for line in run.stdout:
            if "holding 8476" in line:
                break
        run.kill()  # the launcher, kill -9; its workers go on
        run.communicate(timeout=10)
        run_id = record_of(state_home, pod)["run_id"]
        sim_hosts_up.unplug(w0)
        resumed = popen("run", "--pod", pod.name, "--resume", run_id)
        assert resumed.stderr is not None
        began, said = time.monotonic(), ""
        for line in resumed.stderr:
            if "not answer" in line:
                said = line
                break
        took = time.monotonic() - began
        sim_hosts_up.plug(w0)
        assert said, "nothing said"
        # the 60-minute chaos run (seed 5): the resume's connection retries (11 s), or the
        # holder's connection from before the cut (until the link came back), came first.
        # 3 s of waiting, after the start of a Python process (5.1 s in all in a loaded run)
        assert took < 8, (took, said)
        assert "w0 (host-0) not answering after 3 s" in said, said
        out, err = resumed.communicate(timeout=180)
    finally:
        sim_hosts_up.plug(w0)
        for proc in (run, resumed):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert resumed.returncode == 0, err
    assert "[w0] attempt" in out and "done" in out, out


@pytest.mark.timeout(60)
def test_the_stop_of_what_attempts_left_is_quick_and_kills_only_theirs(
    make_pod: Callable[..., Pod],
) -> None:
    """Before every retry the launcher stops what earlier attempts left (by their launch
    ids in /proc/PID/environ): a tr and a grep for each process of the machine took 4 s on
    a local pod of 2 workers while the chaos harness ran, each retry's time lost. One grep
    now: a process of the attempt and its child are killed, another launch's is not."""
    import asyncio

    from tpupod.recovery.leftovers import stop_leftovers

    pod = make_pod(2)
    ours, theirs = "20261206-000000-aaaaaa", "20261206-000000-bbbbbb"
    left = subprocess.Popen(["bash", "-c", "sleep 300 & wait"],
                            env={**os.environ, "TPUPOD_LAUNCH_ID": ours})  # fmt: skip
    other = subprocess.Popen(["sleep", "300"], env={**os.environ, "TPUPOD_LAUNCH_ID": theirs})
    try:
        time.sleep(0.3)  # bash has started its sleep
        began = time.monotonic()
        stopped = asyncio.run(stop_leftovers(pod, [ours]))
        took = time.monotonic() - began
        assert sum(n for found in stopped.found.values() for n in found.values()) == 2, stopped
        assert left.wait(5) == -signal.SIGKILL
        assert other.poll() is None
        assert took < 1.5, took
        began = time.monotonic()
        assert not asyncio.run(stop_leftovers(pod, [ours])).found
        assert time.monotonic() - began < 1.0
    finally:
        left.kill()
        other.kill()
        left.wait()
        other.wait()
