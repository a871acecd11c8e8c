"""SSH users as they are on real machines, on a simulated host with real sshd: a login
shell that is not bash (zsh, fish), and shell start-up files that print (a banner on
stdout, a warning on stderr), with Debian's sftp-server, which sshd starts through the
login shell.

sshd hands every command to the user's login shell. tpupod's commands are bash: under fish
'tpupod exec' printed fish's parse error and said the command succeeded (exit 0, nothing
ran); under zsh the user's command ran as zsh. A start-up file's banner came first in
every command's output, was recorded as the host's name, hid the process group's id (so a
timeout left the command running), and garbled a get's tar stream and every SFTP
transfer ('Max packet size exceeded'). Now ``up`` records the login shell and the host's
name after a marker, every command reaches bash intact, the login's own lines before a
command's markers are dropped, and a garbled SFTP gives way to the tar streams.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CliResult, require
from tpupod.sim import SimPod
from tpupod.sim.pod import missing_prerequisites

pytestmark = pytest.mark.local  # root: users, namespaces, sshd

SHELLS = {"zsh": "/usr/bin/zsh", "fish": "/usr/bin/fish", "bash": "/bin/bash"}
# each user's start-up file (read for every command over SSH), printing as many do
STARTUP = {
    "zsh": (".zshenv", 'echo "Welcome to the lab box"; echo "quota: 95% used" >&2\n'),
    "fish": (".config/fish/config.fish", 'echo "Welcome to the lab box"; echo "quota" >&2\n'),
    "bash": (".bashrc", 'echo "Welcome to the lab box"; echo "quota: 95% used" >&2\n'),
}
SFTP_SERVER = "/usr/lib/openssh/sftp-server"  # Debian's: sshd starts it via the login shell
# quotes, a backslash, $, a glob, unicode and an arithmetic expansion: what a shell would alter
PROGRAM = (
    "echo \"bash=${BASH_VERSION:+yes} 'q' a\\\\b \\$HOME * é\"; echo $((6 * 7)); "
    'for w in a b; do printf "%s\\n" "$w"; done; exit 3'
)


@pytest.fixture(scope="module")
def shell_host() -> Iterator[SimPod]:
    """One simulated host that the users tpupod-zsh, tpupod-fish and tpupod-bash log in to
    with the sim's key (made here and removed after, unless they were there before)."""
    missing = missing_prerequisites()
    require(not missing, f"a simulated pod needs {', '.join(missing)}")
    for shell in [*SHELLS.values(), SFTP_SERVER]:
        require(Path(shell).exists(), f"{shell} (apt-get install zsh fish openssh-server)")
    made: list[str] = []
    keys = Path(tempfile.mkdtemp(prefix="tpupod-keys-"))
    keys.chmod(0o755)  # sshd reads a user's keys as that user
    try:
        for name, shell in SHELLS.items():
            user = f"tpupod-{name}"
            if subprocess.run(["id", user], capture_output=True).returncode != 0:
                added = subprocess.run(["useradd", "-m", "-s", shell, user], capture_output=True)
                if added.returncode == 0:
                    made.append(user)  # (this file's tests share one process: --dist loadfile)
                elif added.returncode != 9:  # 9: made meanwhile by another test process
                    raise AssertionError(f"useradd {user}: {added.stderr.decode()}")
            subprocess.run(["usermod", "-p", "*", user], check=True)  # not locked: keys only
            name_, text = STARTUP[name]
            startup = Path("/home", user, name_)
            startup.parent.mkdir(parents=True, exist_ok=True)
            startup.write_text(text)
            subprocess.run(["chown", "-R", f"{user}:", f"/home/{user}"], check=True)
        options: dict[str, str | None] = {
            "AuthorizedKeysFile": str(keys / "authorized_keys"),
            "SetEnv": None,  # the sim's SHLVL=1 keeps bash from reading ~/.bashrc; real sshd
            "Subsystem": f"sftp {SFTP_SERVER}",  # does not, nor does it use internal-sftp
        }
        with SimPod(1, sshd_options=options) as sim:
            shutil.copy(sim.dir / "authorized_keys", keys / "authorized_keys")
            (keys / "authorized_keys").chmod(0o644)
            yield sim
    finally:
        for user in made:
            subprocess.run(["userdel", "-r", user], capture_output=True)
        shutil.rmtree(keys, ignore_errors=True)


@pytest.fixture(params=sorted(SHELLS))
def shell_pod(
    request: pytest.FixtureRequest, shell_host: SimPod, cli: Callable[..., CliResult]
) -> Iterator[str]:
    """A pod of the host, logged in to as the user whose shell the test is for."""
    name = f"shell-{request.param}"
    target = f"tpupod-{request.param}@{shell_host.hosts[0].address}"
    made = cli("up", "--name", name, "--ssh", target, "--key", str(shell_host.key),
               "--host-keys", "insecure")  # fmt: skip
    assert made.code == 0, made.err
    yield request.param
    cli("down", "--pod", name)


def test_up_records_the_login_shell_and_the_hosts_name(
    shell_pod: str, shell_host: SimPod, cli: Callable[..., CliResult]
) -> None:
    hosts = json.loads(cli("hosts", "--pod", f"shell-{shell_pod}", "--format", "json").out)
    assert hosts[0]["login_shell"] == SHELLS[shell_pod]
    assert hosts[0]["hostname"] == shell_host.hosts[0].hostname  # not the banner


def test_exec_and_run_give_bash_the_command_as_written(
    shell_pod: str, cli: Callable[..., CliResult]
) -> None:
    for how in ("exec", "run"):
        result = cli(how, "--pod", f"shell-{shell_pod}", "--", PROGRAM)
        assert result.code == 3, (how, result.out, result.err)
        shown = [line.removeprefix("[w0] ") for line in result.out.splitlines()]
        assert shown == ["bash=yes 'q' a\\b $HOME * é", "42", "a", "b"], (how, result.err)
        assert "quota" not in result.err, result.err  # the login's, not the command's


def test_a_folder_goes_and_comes_back_through_the_tar_stream(
    shell_pod: str, cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = f"shell-{shell_pod}"
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a b.txt").write_text("été\n")
    put = cli("put", "--pod", pod, str(folder), "data")
    assert put.code == 0, put.err
    assert cli("exec", "--pod", pod, "--", "cat 'data/sub/a b.txt'").out == "[w0] été\n"
    got = cli("get", "--pod", pod, "data", str(tmp_path / "back"))
    assert got.code == 0, got.err
    assert (tmp_path / "back" / "worker-0" / "data" / "sub" / "a b.txt").read_text() == "été\n"


def test_a_file_goes_and_comes_back_though_sftp_is_garbled(
    shell_pod: str, cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = f"shell-{shell_pod}"
    (tmp_path / "one.txt").write_text("one\n")
    put = cli("put", "--pod", pod, str(tmp_path / "one.txt"), "one.txt")
    assert put.code == 0, put.err
    got = cli("get", "--pod", pod, "one.txt", str(tmp_path / "back"))
    assert got.code == 0, got.err
    assert (tmp_path / "back" / "worker-0" / "one.txt").read_text() == "one\n"
    missing = cli("get", "--pod", pod, "nothing-here", str(tmp_path / "none"))
    assert missing.code == 1 and "no such file or folder" in missing.err, missing.err


def test_a_timeout_stops_the_whole_group(shell_pod: str, cli: Callable[..., CliResult]) -> None:
    pod = f"shell-{shell_pod}"
    result = cli("exec", "--pod", pod, "--timeout", "1", "--", "sleep 300 & sleep 301; wait")
    assert result.code != 0 and "timed out" in result.err, result.err
    left = subprocess.run(
        ["pgrep", "-u", f"tpupod-{shell_pod}", "-f", "sleep 30[01]"], capture_output=True
    )
    assert left.stdout == b"", left.stdout
