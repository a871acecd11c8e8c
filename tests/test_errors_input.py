"""Errors that blame the right thing: the flag, the file or the pod the user named (issue 10)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult
from tpupod.pod.record import Pod


def one_error(result: CliResult, code: int = 2) -> str:
    """The error line of a result that must be exactly 'error:' + 'hint:' and ``code``."""
    assert result.code == code, (result.code, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 2, result.err
    assert lines[0].startswith("error: ") and lines[1].startswith("hint: "), result.err
    assert "Traceback" not in result.err
    return lines[0]


def keygen(path: Path, *options: str) -> None:
    subprocess.run(["ssh-keygen", "-q", *options, "-f", str(path)], check=True)


TPU = ("--tpu-type", "v4-8", "--zone", "us-central2-b")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--local", "2", "--ssh", "10.0.0.1"), ("--local", "--ssh")),
        (("--gcp", *TPU, "--local", "2"), ("--gcp", "--local")),
        (("--ssh", "10.0.0.1", *TPU), ("--ssh", "--tpu-type")),
        (("--adopt", "x", "--zone", "us-central2-b", "--key", "k", "--local", "1"), ("--adopt",)),
        (("--devices-per-worker", "2", "--ssh", "10.0.0.1"), ("--devices-per-worker", "--ssh")),
    ],
)
def test_conflicting_pod_kinds_name_the_flags(
    flags: tuple[str, ...], named: tuple[str, ...], cli_in_process: Callable[..., CliResult]
) -> None:
    error = one_error(cli_in_process("up", "--name", "x", *flags, "--dry-run"))
    for flag in named:
        assert flag in error, error
    assert "unknown field" not in error


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--local", "2", "--key", "/k"), "--key"),
        (("--local", "2", "--host-keys", "strict"), "--host-keys"),
        (("--local", "2", "--zone", "us-central2-b"), "--zone"),
        (("--ssh", "10.0.0.1", "--node-count", "2"), "--node-count"),
        (("--local", "2", "--spot"), "--spot"),
    ],
)
def test_a_flag_of_another_kind_of_pod_is_named(
    flags: tuple[str, ...], named: str, cli_in_process: Callable[..., CliResult]
) -> None:
    error = one_error(cli_in_process("up", "--name", "x", *flags, "--dry-run"))
    assert named in error and "unknown field" not in error


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--ssh", "10.0.0.1:99999"), "--ssh"),
        (("--ssh", "10.0.0.1", "--port", "0"), "--port"),
        (("--gcp", "--tpu-type", "v4-8", "--zone", "nowhere"), "--zone"),
        (("--gcp", "--tpu-type", "v9-8", "--zone", "us-central2-b"), "--tpu-type"),
        (("--gcp", *TPU, "--node-count", "0"), "--node-count"),
        (("--local", "2", "--env", "TPUPOD_X=1"), "--env"),
        (("--gcp", "--zone", "us-central2-b"), "--tpu-type"),
    ],
)
def test_spec_errors_from_flags_name_the_flag(
    flags: tuple[str, ...], named: str, cli_in_process: Callable[..., CliResult]
) -> None:
    error = one_error(cli_in_process("up", "--name", "x", *flags, "--dry-run"))
    assert error.startswith(f"error: {named}"), error


def test_a_flag_over_a_file_is_named_as_the_flag(
    tmp_path: Path, cli_in_process: Callable[..., CliResult]
) -> None:
    spec = tmp_path / "pod.yaml"
    spec.write_text("name: dev\nworkers: 2\n")
    error = one_error(
        cli_in_process("up", "-f", str(spec), "--devices-per-worker", "0", "--dry-run")
    )
    assert error.startswith("error: --devices-per-worker: "), error
    from_file = one_error(cli_in_process("up", "-f", str(spec), "--name", "Bad_Name", "--dry-run"))
    assert from_file.startswith("error: --name: "), from_file


@pytest.mark.parametrize("value", ["true", "false", "yes"])
def test_a_boolean_is_not_a_count(
    value: str, tmp_path: Path, cli_in_process: Callable[..., CliResult]
) -> None:
    spec = tmp_path / "pod.yaml"
    spec.write_text(f"name: dev\nworkers: {value}\n")
    error = one_error(cli_in_process("up", "-f", str(spec), "--dry-run"))
    assert "workers" in error and "integer" in error


def test_the_same_host_twice_is_warned(cli_in_process: Callable[..., CliResult]) -> None:
    result = cli_in_process(
        "up", "--name", "x", "--ssh", "10.0.0.1,10.0.0.2,root@10.0.0.1", "--dry-run"
    )
    assert result.code == 0, result.err
    assert "10.0.0.1 is given twice (workers 0 and 2)" in result.err


def test_an_empty_worker_selection_is_an_error(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(2)
    for command in (("exec", "-w", "", "--", "true"), ("put", "-w", " ", "/etc/hostname", "x")):
        error = one_error(cli(*command[:1], "--pod", pod.name, *command[1:]))
        assert "empty worker selection" in error


@pytest.mark.parametrize(
    "pod",
    [
        ("--name", "x", "--ssh", "127.0.0.1:1"),
        ("--name", "x", "--gcp", *TPU, "--project", "p"),
        ("--adopt", "x", "--zone", "us-central2-b", "--project", "p"),
    ],
)
def test_up_with_a_missing_key_says_so(
    pod: tuple[str, ...], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    missing = tmp_path / "missing"
    env = {"TPUPOD_TPU_API_ENDPOINT": "http://127.0.0.1:1"}  # never reached
    error = one_error(cli("up", *pod, "--key", str(missing), env=env))
    assert f"key file {missing} does not exist" in error
    assert not cli("list").out


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"not a key at all\n", "is not a private key"),
        (b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG example\n", "is a public key"),
        (b"", "is empty"),
        (
            b"-----BEGIN OPENSSH PRIVATE KEY-----\n!!!!\n-----END OPENSSH PRIVATE KEY-----\n",
            "is not a valid private key",
        ),
    ],
)
def test_up_with_an_invalid_key_is_one_clear_error(
    content: bytes, problem: str, cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    key = tmp_path / "key"
    key.write_bytes(content)
    error = one_error(cli("up", "--name", "x", "--ssh", "127.0.0.1:1", "--key", str(key)))
    assert f"key file {key} {problem}" in error


def test_a_passphrase_key_is_refused_with_what_to_do(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    key = tmp_path / "locked"
    keygen(key, "-t", "ed25519", "-N", "secret")
    (tmp_path / "locked.pub").unlink()
    result = cli("up", "--name", "x", "--ssh", "127.0.0.1:1", "--key", str(key))
    error = one_error(result)
    assert "passphrase" in error and "ssh-add" in result.err


def test_a_good_key_passes_the_check(tmp_path: Path) -> None:
    from tpupod.providers.ssh import check_key_file

    key = tmp_path / "good"
    keygen(key, "-t", "ed25519", "-N", "")
    check_key_file(str(key))
    rsa = tmp_path / "rsa"
    keygen(rsa, "-t", "rsa", "-b", "2048", "-m", "PEM", "-N", "")
    check_key_file(str(rsa))


def test_get_of_a_missing_path_leaves_no_empty_folders(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = any_pod(2)
    dest = tmp_path / "out"
    result = cli("get", "--pod", pod.name, "/no/such/file", str(dest))
    assert result.code != 0
    assert not dest.exists() or list(dest.iterdir()) == []
    (dest / "worker-0").mkdir(parents=True)  # a folder that was there stays
    cli("get", "--pod", pod.name, "/no/such/file", str(dest))
    assert sorted(p.name for p in dest.iterdir()) == ["worker-0"]


def test_logs_of_an_unknown_pod_says_there_is_no_such_pod(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    make_pod(1)
    error = one_error(cli("logs", "--pod", "nope"), code=2)
    assert "no pod named 'nope'" in error


def test_a_bad_rendezvous_choice_exits_2_before_any_work(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(1)
    result = cli(
        "run",
        "--pod",
        pod.name,
        "--rendezvous-on",
        "bogus",
        "--sync",
        str(tmp_path / "s"),
        "--",
        "true",
    )
    assert result.code == 2, result.err
    assert "bogus" in result.err and "tpupod:" not in result.err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--base-port", "65535", "--servers-per-worker", "2"],
            "--base-port 65535: with 2 servers per worker the last port would be 65536",
        ),
        (["--base-port", "65536"], "--base-port 65536\n"),  # said "with 1 servers a worker"
        (["--base-port", "0"], "--base-port 0"),
        (["--router-port", "99999"], "--router-port 99999"),
        (["--agent-port", "70000"], "--agent-port 70000"),
    ],
)
def test_serve_up_refuses_a_port_out_of_range_at_once(
    cli_in_process: Callable[..., CliResult], flags: list[str], said: str
) -> None:
    """A port past 65535 (or below 1) was tried: a command server sat 'starting' on :65536
    until --startup-timeout ran out, and a local pod ignored --agent-port 70000."""
    cli_in_process("up", "--name", "p", "--local", "2")
    result = cli_in_process("serve", "up", "--model", "m", "--backend", "command",
                            "--command", "true", *flags)  # fmt: skip
    assert result.code == 2, result.err
    assert f"error: {said}" in result.err
    assert "hint: ports are 1 to 65535" in result.err
    one_error(result)
    assert "agent started" not in result.err  # nothing was started


def test_serve_up_refuses_no_servers_with_a_hint(cli: Callable[..., CliResult]) -> None:
    """--servers-per-worker 0 was an error line with no hint."""
    assert cli("up", "--name", "p", "--local", "1").code == 0
    result = cli("serve", "up", "--model", "m", "--backend", "command", "--command", "true",
                 "--servers-per-worker", "0")  # fmt: skip
    assert one_error(result) == "error: --servers-per-worker 0: a worker runs at least 1 server"
    assert "agent started" not in result.err  # nothing was started
    cli("down", "--pod", "p")


@pytest.mark.parametrize("command", [["dashboard", "--token", "t"], ["jobs", "serve"]])
def test_a_host_name_that_does_not_resolve_is_said_so(
    cli: Callable[..., CliResult], command: list[str]
) -> None:
    """'--host nosuchhost.invalid' said 'Unknown error -2' (getaddrinfo's EAI_NONAME)."""
    result = cli(*command, "--host", "nosuchhost.invalid", "--port", "0")
    error = one_error(result)
    assert error.startswith("error: cannot listen on nosuchhost.invalid:0: "), error
    assert error.endswith("the name nosuchhost.invalid does not resolve to an address"), error


@pytest.mark.parametrize(
    ("argv", "said", "help_of"),
    [
        (["exec", "--on-fial", "kill", "--", "true"], ["--on-fial", "--on-fail"], "tpupod exec"),
        (["exec", "--on-fail", "stop", "--", "true"], ["--on-fail", "stop", "kill", "wait"],
         "tpupod exec"),
        (["exec", "--timeout", "-1", "--", "true"], ["--timeout -1", "at least 0.001"],
         "tpupod exec"),
        (["exec", "-t", "soon", "--", "true"], ["--timeout soon", "a number"], "tpupod exec"),
        (["exec"], ["missing", "CMD"], "tpupod exec"),
        (["run", "--grace", "x", "--", "true"], ["--grace x", "a number"], "tpupod run"),
        (["run", "--retries", "2x", "--", "true"], ["--retries 2x", "a whole number"],
         "tpupod run"),
        (["jobs", "submit", "--bogus", "--", "x"], ["--bogus"], "tpupod jobs submit"),
        (["status", "--bogus"], ["--bogus"], "tpupod status"),
        (["up", "--local"], ["--local", "requires an argument"], "tpupod up"),
        (["stauts"], ["stauts"], "tpupod"),
        (["jobs", "sumbit"], ["sumbit"], "tpupod jobs"),
    ],
)  # fmt: skip
def test_a_bad_option_is_an_error_and_a_hint(
    argv: list[str], said: list[str], help_of: str, cli: Callable[..., CliResult]
) -> None:
    """Click's 'Usage: ... Try ... Error: ...' block, and pydantic's wording ('Value error,',
    'Input should be greater than or equal to'), were what a mistyped option got."""
    result = cli(*argv)
    error = one_error(result)
    for text in said:
        assert text in error, error
    for leaked in ("Usage:", "Try '", "Error:", "Value error", "Input should"):
        assert leaked not in result.err, result.err
    assert result.err.splitlines()[1] == f"hint: see '{help_of} --help'", result.err


@pytest.mark.parametrize("command", [["down"], ["status"], ["hosts"], ["serve", "down"]])
def test_a_pod_named_as_an_argument_gets_the_pod_option_as_its_hint(
    command: list[str], cli_in_process: Callable[..., CliResult]
) -> None:
    """A trial (and this session): 'tpupod down dev' was 'got unexpected extra argument(s)
    (dev)' with 'see tpupod down --help' as its hint."""
    error = one_error(cli_in_process(*command, "dev"))
    assert "unexpected extra argument" in error, error
    hint = cli_in_process(*command, "dev").err.splitlines()[1]
    assert hint == f"hint: did you mean 'tpupod {' '.join(command)} --pod dev'?", hint


def test_a_spec_value_out_of_range_is_said_in_plain_words(
    cli_in_process: Callable[..., CliResult],
) -> None:
    """A trial: 'up --local 0' said pydantic's 'Input should be greater than or equal to 1',
    where a command's own option says 'must be at least'."""
    error = one_error(cli_in_process("up", "--name", "dev", "--local", "0"))
    assert error == "error: --local: must be at least 1 (got 0)", error
