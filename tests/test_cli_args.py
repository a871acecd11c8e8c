"""Options declared once (``cli/args.py``): the console script's framework-free reading of
``tpupod run`` and ``jobs submit`` is the same as the typer commands', which take their
signatures from the same declaration."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.conftest import CliResult
from tpupod.cli.args import Args, opt, rest
from tpupod.cli.flow.attempt import RunArgs
from tpupod.cli.flow.exec import ExecArgs
from tpupod.cli.flow.run import parse_plain
from tpupod.cli.flow.submit import SubmitArgs
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
        "--retries 3 --retry-errors 1 --retry-exit-codes 42,75 --zones a,b -- python t.py",
        "--notice-grace 10 --setup s.sh --sync ~/code -- x",
        "--resume 20261127-080102-5d1e2a --retry-errors 1",
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
        "--notice-grace -5 -- x",  # below its minimum: typer says so
        "--retries 2x -- x",
    ],
)
def test_unusual_arguments_go_to_the_full_cli(line: str) -> None:
    assert parse_plain(shlex.split(line)) is None


class Small(Args):
    command: list[str] = rest(metavar="-- CMD...")
    worker: str | None = opt("--worker", "-w")
    quiet: bool = opt("--quiet", "-q", default=False)
    count: int = opt("--count", default=1, minimum=0)
    tags: list[str] = opt("--tag")


def test_the_reader_stops_at_the_command_and_types_each_value() -> None:
    read = Small.read(["-q", "-w", "1", "--count=3", "--tag", "a", "--tag", "b", "python", "-w"])
    assert read == Small(command=["python", "-w"], worker="1", quiet=True, count=3, tags=["a", "b"])
    # Args gives an option with no default its own (None, []): mypy sees none given
    assert Small.read(["--count", "-1", "x"]) is None  # below its minimum
    assert Small.read(["-q"]) is None  # the command is required
    assert Small.read(["--", "x"]) == Small(command=["x"])  # type: ignore[call-arg]
    bare = Small(command=["x"])  # type: ignore[call-arg]
    assert bare.tags == [] and bare.replace(count=2).count == 2
    with pytest.raises(TypeError, match="no option 'nope'"):
        Small(nope=1)  # type: ignore[call-arg]


@pytest.mark.parametrize("cls", [ExecArgs, RunArgs, SubmitArgs])
def test_each_option_is_declared_once_and_typer_reads_that(cls: type[Args]) -> None:
    """The typer command's parameters are the declaration's fields, spelled and defaulted
    as declared: there is no second list of them to keep equal."""
    import typer.main

    from tpupod.cli.app import app, load_commands

    load_commands(["run"] if cls is RunArgs else ["exec"] if cls is ExecArgs else ["jobs"])
    name = {ExecArgs: "exec", RunArgs: "run", SubmitArgs: "submit"}[cls]
    group = typer.main.get_group(app)
    found = group.commands[name] if name != "submit" else group.commands["jobs"].commands[name]  # type: ignore[attr-defined]
    params = {p.name: p for p in found.params}
    assert list(params) == cls.names()
    for o in cls.__options__.opts:
        assert set(params[o.name].opts) | set(params[o.name].secondary_opts) == set(o.flags)


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
        "--",  # neither a command nor --resume
        "--retries -1 -- true",  # a count below 0
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
