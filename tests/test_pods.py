"""up / down / list / status / hosts, as a user runs them, and the errors for unknown pods."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, described, pod_processes, tpupod_argv, wait_until_gone
from tpupod.errors import PodExists, PodNotFound, StateError
from tpupod.pod.lifecycle import up
from tpupod.pod.record import Pod
from tpupod.pod.spec import LocalPodSpec
from tpupod.pod.state import StateDir


def test_round_trip(cli: Callable[..., CliResult], state_home: Path) -> None:
    made = cli("up", "--name", "dev", "--local", "3", "--devices-per-worker", "2")
    assert made.code == 0, made.err
    assert "pod 'dev' is up: 3 local workers, 2 devices each" in made.out

    listed = cli("list")
    assert listed.out.splitlines()[1].split()[:3] == ["dev", "local", "3"]
    assert "3 local workers, 2 devices each" in listed.out

    hosts = cli("hosts")  # the only pod is the default
    rows = [line.split() for line in hosts.out.splitlines()]
    assert rows[0] == ["WORKER", "HOSTNAME", "INTERNAL", "EXTERNAL"]
    assert [row[0] for row in rows[1:]] == ["0", "1", "2"]
    assert all(row[2] == "127.0.0.1" and row[3] == "-" for row in rows[1:])

    as_json = json.loads(cli("hosts", "--pod", "dev", "--format", "json").out)
    assert [w["id"] for w in as_json] == [0, 1, 2]
    assert set(as_json[0]) == {
        "id",
        "hostname",
        "internal_address",
        "external_address",
        "ssh",
        "slice",
        "login_shell",
    }

    status = cli("status", "--pod", "dev")
    assert status.code == 0, status.err
    assert status.out.count(" yes ") == 3

    status_json = json.loads(cli("status", "--format", "json").out)
    assert status_json["healthy"] is True and len(status_json["workers"]) == 3

    gone = cli("down", "--pod", "dev")
    assert gone.code == 0 and "pod 'dev' is down" in gone.out
    assert cli("list").out == ""
    assert not (state_home / "pods" / "dev").exists()


def test_up_is_idempotent_and_refuses_a_different_spec(cli: Callable[..., CliResult]) -> None:
    assert cli("up", "--name", "dev", "--local", "2").code == 0
    again = cli("up", "--name", "dev", "--local", "2")
    assert again.code == 0 and "was already up" in again.out
    other = cli("up", "--name", "dev", "--local", "3")
    assert other.code == 1
    assert (
        "exists with a different spec" in other.err and "hint: 'tpupod down --pod dev'" in other.err
    )


def test_up_from_the_default_spec_file(
    cli: Callable[..., CliResult], tmp_path: Path, state_home: Path
) -> None:
    (tmp_path / "tpupod.yaml").write_text("name: from-file\nworkers: 2\nenv:\n  GREETING: hello\n")
    proc = subprocess.run(
        [*__import__("tests.conftest").conftest.tpupod_argv("up")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    result = cli("exec", "--pod", "from-file", "--", "echo $GREETING")
    assert result.out.splitlines() == ["[w0] hello", "[w1] hello"] or sorted(
        result.out.splitlines()
    ) == ["[w0] hello", "[w1] hello"]


def test_unknown_pod_and_ambiguous_default(cli: Callable[..., CliResult]) -> None:
    """Bad input exits 2, as the README says: a pod that does not exist, none at all, or
    several and none named (they exited 1), on the fast paths (exec, run) as on the rest."""
    none_yet = cli("hosts")
    assert (
        none_yet.code == 2 and "no pods yet" in none_yet.err and "hint: create one" in none_yet.err
    )
    cli("up", "--name", "a", "--local", "1")
    cli("up", "--name", "b", "--local", "1")
    for command in (["exec", "--", "true"], ["run", "--", "true"], ["hosts"]):
        ambiguous = cli(*command)
        assert ambiguous.code == 2, (command, ambiguous.err)
        assert "2 pods exist (a, b); say which one" in ambiguous.err
    for name in ("exec", "status", "run", "down"):
        unknown = cli(name, "--pod", "nope", *(["--", "true"] if name in "exec run" else []))
        assert unknown.code == 2, (name, unknown.err)
        assert "no pod named 'nope'" in unknown.err and "known pods: a, b" in unknown.err


def test_down_kills_what_a_local_pod_left_running(cli: Callable[..., CliResult]) -> None:
    cli("up", "--name", "bg", "--local", "2")
    result = cli("exec", "--pod", "bg", "--", "nohup sleep 60 >/dev/null 2>&1 &")
    assert result.code == 0
    assert len(pod_processes("bg")) == 2
    assert cli("down", "--pod", "bg").code == 0
    assert wait_until_gone("bg") == []


def test_down_leaves_a_same_named_pod_of_another_state_directory_alone(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    """Two users of one machine (or a test suite beside a user) each have a pod 'p': a
    'tpupod down --pod p' in one state directory killed the other's run 5.5 s in (down
    matched TPUPOD_POD=p on every process of the machine)."""
    home_a, home_b = {"TPUPOD_HOME": str(tmp_path / "a")}, {"TPUPOD_HOME": str(tmp_path / "b")}
    assert cli("up", "--name", "p", "--local", "2", env=home_a).code == 0
    run = subprocess.Popen(
        tpupod_argv("run", "--pod", "p", "--", "sleep 60"),
        env={**os.environ, **home_a},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        # The sleeps themselves: a worker's shell forks short-lived copies of itself (their
        # command lines hold "sleep 60" too), which end on their own.
        while len(sleeping := [p for p in pod_processes("p") if described(p) == "sleep 60"]) < 2:
            assert run.poll() is None and time.monotonic() < deadline, run.stderr
            time.sleep(0.05)
        assert cli("up", "--name", "p", "--local", "1", env=home_b).code == 0
        assert cli("down", "--pod", "p", env=home_b).code == 0
        time.sleep(0.5)  # down waits for what it signalled; anything it hit is dying now
        assert run.poll() is None and all(p.is_running() for p in sleeping)
        assert cli("down", "--pod", "p", "--force", env=home_a).code == 0
        assert run.wait(timeout=30) != 0  # its own pod's down ends it
    finally:
        run.kill()
        run.wait()
        run.stderr.close()  # type: ignore[union-attr]


def test_down_refuses_a_pod_a_run_is_using_and_with_force_stops_it(
    cli: Callable[..., CliResult], state_home: Path
) -> None:
    """'tpupod down' with a 'tpupod run' going killed the run without a word (its summary
    then blamed w0, 'killed by SIGKILL'), though it refused a pod a job runner used."""
    assert cli("up", "--name", "dev", "--local", "2").code == 0
    run = subprocess.Popen(
        tpupod_argv("run", "--pod", "dev", "--", "sleep 60"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while len([p for p in pod_processes("dev") if "sleep" in described(p)]) < 2:
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        refused = cli("down", "--pod", "dev")
        assert refused.code == 1 and run.poll() is None, refused.err
        assert "error: pod 'dev' is in use by tpupod run " in refused.err
        # the hint names the run to cancel (a trial: it said 'tpupod cancel RUN')
        assert re.search(
            r"hint: stop it first \('tpupod cancel \d{8}-\d{6}-[0-9a-f]{6}'\)", refused.err
        )
        assert "--force" in refused.err
        forced = cli("down", "--pod", "dev", "--force")
        assert forced.code == 0, forced.err
        assert forced.out.startswith("stopped tpupod run "), forced.out
        assert run.wait(timeout=30) == 143
        # the run names who stopped it, as after a cancel (a trial: 'stopped by SIGTERM')
        said = run.stderr.read()  # type: ignore[union-attr]
        assert re.search(r"stopped by 'tpupod down --force' \(pid \d+\): 2 workers", said), said
        assert wait_until_gone("dev") == []
    finally:
        run.kill()
        run.wait()
        run.stderr.close()  # type: ignore[union-attr]


def test_corrupt_record_is_a_clear_error(state_home: Path, cli: Callable[..., CliResult]) -> None:
    up(LocalPodSpec(name="dev", workers=1), StateDir())
    (state_home / "pods" / "dev" / "pod.json").write_text("{not json")
    result = cli("hosts", "--pod", "dev")
    assert result.code == 1 and "the record of pod 'dev' is unreadable" in result.err
    with pytest.raises(StateError):
        StateDir().load("dev")


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda r: {**r, "workers": []}, "no workers"),
        (lambda r: {**r, "workers": [r["workers"][0], r["workers"][0]]}, "ids are 0, 0"),
        (lambda r: {**r, "name": "other"}, "names pod 'other'"),
        (lambda r: {**r, "version": 99}, "version 99"),
        (lambda r: {**r, "spec": {**r["spec"], "workers": "two"}}, "spec.workers"),
    ],
    ids=["no-workers", "duplicate-ids", "another-name", "newer-version", "bad-spec"],
)
def test_a_hand_edited_record_that_is_still_json_is_checked(
    state_home: Path, cli: Callable[..., CliResult], edit: Callable[..., object], said: str
) -> None:
    """A new user's trial edited pod.json by hand, keeping it JSON: no workers made 'run'
    an internal error (IndexError) and 'exec' '0/0 ok'; duplicate ids ran a command twice
    as w0; another name was listed but not found. Each is the record's error, naming what."""
    up(LocalPodSpec(name="bad", workers=2), StateDir())
    path = state_home / "pods" / "bad" / "pod.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    # exec's fast path reads only the shape it uses (provider, workers); run reads it all
    commands = [["run", "--pod", "bad", "--", "true"]]
    if said != "spec.workers":
        commands.append(["exec", "--pod", "bad", "--", "true"])
    for args in commands:
        result = cli(*args)
        assert result.code == 1, (args, result)
        assert "the record of pod 'bad' is unreadable" in result.err, (args, result.err)
        assert said in result.err and "internal error" not in result.err, (args, result.err)
    listed = cli("list")
    assert listed.code == 1 and "bad" in listed.out and said in listed.err, listed


def test_a_broken_record_does_not_hide_the_other_pods(
    state_home: Path, cli: Callable[..., CliResult]
) -> None:
    """'tpupod list' with one record broken (emptied) printed only the error: the other
    pods were not listed. They are, the broken one is named, and it exits 1."""
    up(LocalPodSpec(name="dev", workers=1), StateDir())
    up(LocalPodSpec(name="big", workers=2), StateDir())
    (state_home / "pods" / "big" / "pod.json").write_text("")
    result = cli("list")
    rows = [line.split()[:2] for line in result.out.splitlines()]
    assert rows == [["NAME", "PROVIDER"], ["big", "?"], ["dev", "local"]], result.out
    assert "1 local worker, 1 device each" in result.out  # not '1 local workers'
    assert result.code == 1 and "the record of pod 'big' is unreadable" in result.err
    assert cli("exec", "--pod", "dev", "--", "true").code == 0


def test_python_api_errors(state_home: Path) -> None:
    state = StateDir()
    up(LocalPodSpec(name="dev", workers=1), state)
    with pytest.raises(PodExists):
        up(LocalPodSpec(name="dev", workers=2), state)
    with pytest.raises(PodNotFound):
        state.load("other")


def test_the_spec_and_dry_run_requests_are_python_calls(state_home: Path) -> None:
    """What `up --dry-run` and `down --dry-run` print comes from lifecycle, no CLI needed."""
    from tpupod.pod import lifecycle
    from tpupod.pod.spec import UpFlags

    flags = UpFlags(name="t", gcp=True, tpu_type="v4-16", zone="us-central2-b", project="p")
    tpu = lifecycle.spec_for(flags)
    [request] = lifecycle.create_requests(tpu)
    assert request.method == "POST"
    assert request.url.endswith("/projects/p/locations/us-central2-b/nodes?nodeId=t")
    local = lifecycle.spec_for(UpFlags(name="dev", local=2))
    assert local == LocalPodSpec(name="dev", workers=2)
    assert lifecycle.create_requests(local) == []
    pod = up(local, StateDir()).pod
    assert lifecycle.delete_requests(pod) == []


def test_a_half_made_pod_folder_is_reclaimed(state_home: Path) -> None:
    (state_home / "pods" / "dev").mkdir(parents=True)  # as if an earlier `up` crashed
    result = up(LocalPodSpec(name="dev", workers=2), StateDir())
    assert result.created and len(result.pod.workers) == 2


def test_version_and_help(
    cli: Callable[..., CliResult], cli_in_process: Callable[..., CliResult]
) -> None:
    from tpupod import __version__

    assert cli("--version").out.strip() == f"tpupod {__version__}"
    assert "Examples" in cli("exec", "--help").out  # through entry's fast path
    commands = ["up", "down", "list", "status", "hosts", "put", "get", "sync", "setup", "free-tpu"]
    for command in commands:  # the typer app's own help: no process needed
        result = cli_in_process(command, "--help")
        assert result.code == 0 and "Examples" in result.out, command


def test_wait_until_gone_helper_sees_processes(cli: Callable[..., CliResult]) -> None:
    cli("up", "--name", "helper", "--local", "1")
    cli("exec", "--pod", "helper", "--", "nohup sleep 60 >/dev/null 2>&1 &")
    assert wait_until_gone("helper", timeout=0.2) != []  # the helper is not blind
    cli("down", "--pod", "helper")


def test_status_is_a_typed_record_in_the_python_api(make_pod: Callable[..., Pod]) -> None:
    import tpupod
    from tpupod import PodStatus, WorkerStatus

    pod = make_pod(2)
    status = tpupod.pod_status(pod)
    assert isinstance(status, PodStatus) and status.healthy and status.cloud_state is None
    assert [type(w) for w in status.workers] == [WorkerStatus, WorkerStatus]
    assert [(w.worker, w.reachable) for w in status.workers] == [(0, True), (1, True)]
    assert status.workers[0].answer == pod.workers[0].hostname
    assert status.to_json()["healthy"] is True
