"""The console script's framework-free reading of ``tpupod run``: the same as the CLI's."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.conftest import CliResult
from tpupod.cli.args import OptionTable, scan
from tpupod.cli.flow.run import RunArgs, parse_plain
from tpupod.pod.record import Pod


@pytest.mark.parametrize(
    "line",
    [
        "-- python train.py",
        "-q -v -- echo hi",
        "--pod dev -w 0,2 --on-fail wait -t 5 --grace 1 -e A=1 -e B=x=y -- echo $A",
        "--pod=dev --worker=1-3 --timeout=2.5 --sync ~/code python x.py --steps 3",
        "--rendezvous-on worker0 --worker-python /opt/py/bin/python --coordinator-port 9000 -- x",
        "--image app:1 --mount /data:/data:ro --mount /a:/b --engine podman --privileged -- x",
        "--image=app:1 -e K=V -- python -c 'import jax'",
    ],
)
def test_the_fast_reader_agrees_with_the_cli(line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_plain(shlex.split(line))
    assert args is not None
    from typer.testing import CliRunner

    from tpupod.cli import run as run_module
    from tpupod.cli.app import app

    seen: dict[str, RunArgs] = {}

    def capture(parsed: RunArgs) -> int:
        seen["args"] = parsed
        return 0

    monkeypatch.setattr(run_module, "run_command", capture)
    result = CliRunner().invoke(app, ["run", *shlex.split(line)])
    assert result.exit_code == 0, result.output
    assert seen["args"] == args


@pytest.mark.parametrize(
    "line",
    [
        "--help",
        "--",
        "--bogus -- x",
        "-t 0 -- x",
        "--grace -1 -- x",
        "-e NOPE -- x",
        "--on-fail never -- x",
        "--rendezvous-on moon -- x",
        "--coordinator-port 12ab -- x",
        "--coordinator-port 1_000 -- x",
        "-qv -- x",
        "-w",
        "--privileged=yes -- x",
    ],
)
def test_unusual_arguments_go_to_the_full_cli(line: str) -> None:
    assert parse_plain(shlex.split(line)) is None


def test_the_scanner_stops_at_the_command() -> None:
    table = OptionTable(valued={"-w": "worker"}, flags={"-q": "quiet"})
    scanned = scan(["-q", "-w", "1", "python", "-w", "2"], table)
    assert scanned is not None
    assert scanned.values == {"worker": "1"} and scanned.flags == {"quiet"}
    assert scanned.rest == ["python", "-w", "2"]


def test_a_plain_run_loads_no_cli_framework(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(workers=2)
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('typer loaded:', 'typer' in sys.modules, file=sys.stderr))\n"
        f"sys.argv = ['tpupod', 'run', '--pod', {pod.name!r}, '--', 'echo', 'ready']\n"
        "from tpupod.cli.entry import main\n"
        "main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ready") == 2
    assert "typer loaded: False" in proc.stderr


@pytest.mark.parametrize(
    "line",
    [
        "-w 7 -- true",  # no such worker: a usage error from the pod's record
        "--mount /a:/b -- true",  # a container option without --image
        "--image x --engine lxc -- true",  # an engine we do not know
        "-- false",  # the program's own exit code
    ],
)
def test_both_readers_report_the_same_way(
    line: str, make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(workers=2)
    argv = ["run", "-q", "--pod", pod.name, *shlex.split(line)]
    fast = cli(*argv)
    full = subprocess.run(
        [sys.executable, "-c", "from tpupod.cli.app import main; main()", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert fast.code == full.returncode != 0
    first = [text.splitlines()[0] for text in (fast.err, full.stderr)]
    if first[0].startswith("error:"):
        assert first[0] == first[1]
        assert "Traceback" not in fast.err
