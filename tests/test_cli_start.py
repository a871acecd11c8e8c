"""The console script has typer build only what a call needs (cli.app_for): the command it
names, or for the command list every command's name and help without its options; what it
prints is what the whole app prints."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer.main

from tpupod.cli.app import COMMAND_MODULES, app_for, load_commands

pytestmark = pytest.mark.unit

# the whole app, every command built with its options (as before app_for)
WHOLE_APP = (
    "import sys; from tpupod.cli.app import app, load_commands; "
    "load_commands(sys.argv[1:]); app(prog_name='tpupod')"
)


def both(*argv: str) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """The console script's answer, and the whole app's."""
    run = [
        subprocess.run([sys.executable, *entry, *argv], capture_output=True, text=True, timeout=60)
        for entry in (["-m", "tpupod"], ["-c", WHOLE_APP])
    ]
    return run[0], run[1]


@pytest.mark.parametrize(
    "argv",
    [["--help"], [], ["stauts"], ["status", "--help"], ["jobs", "--help"], ["jobs", "ls", "-h"]],
)
def test_the_console_script_prints_what_the_whole_app_prints(argv: list[str]) -> None:
    script, whole = both(*argv)
    assert (script.returncode, script.stdout, script.stderr) == (
        whole.returncode,
        whole.stdout,
        whole.stderr,
    )
    assert whole.stdout or whole.stderr


def test_the_command_list_names_every_command_with_its_help() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "tpupod", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    commands = listed.split("Commands:", 1)[1].splitlines()
    names = [line.split()[0] for line in commands if line.strip()]
    # as a user meets them (they were in the order their modules loaded), down last; the
    # workers' agent, which 'serve up' starts, is not listed
    assert names == [name for name in COMMAND_MODULES if name != "agent"]
    assert names[:5] == ["up", "list", "status", "hosts", "exec"] and names[-1] == "down"
    assert all(len(line.split()) > 1 for line in commands if line.strip())


def help_of(*command: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "tpupod", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


@pytest.mark.parametrize(
    ("command", "example"),
    [
        (["run"], "tpupod run --sync ~/code -- python train.py   "
                  "# this repository's HEAD, on every worker"),
        (["run"], "tpupod run --resume RUN --retry-errors 1   "
                  "# a failed run, again from its checkpoint"),
        (["exec"], "tpupod exec -w 0,2-3 -- 'echo $TPUPOD_WORKER_ID of $TPUPOD_NUM_WORKERS'"),
    ],
)  # fmt: skip
def test_examples_are_printed_as_written(command: list[str], example: str) -> None:
    """Click re-wrapped the examples at 80 columns, breaking them mid-command."""
    assert f"    {example}\n" in help_of(*command)


def test_help_says_what_each_option_is() -> None:
    exec_help = help_of("exec")
    assert "see below" not in exec_help  # nothing was below
    assert "-t, --timeout S " in help_of("jobs", "submit")  # as exec's and run's


EVERY_COMMAND = [
    [*words.split()]
    for words in (
        "up", "list", "status", "hosts", "exec", "put", "get", "sync", "setup", "run", "logs",
        "cancel", "jobs submit", "jobs ls", "jobs worker", "jobs serve", "serve up",
        "serve status", "serve logs", "fanout", "image build", "bench checkpoint", "extract",
        "dashboard", "free-tpu", "down",
    )
]  # fmt: skip


@pytest.mark.parametrize("command", EVERY_COMMAND, ids=" ".join)
def test_help_names_values_as_a_user_reads_them(command: list[str]) -> None:
    """A trial: typer's type labels leaked (`--pod <str>`, `--retries <int>`, `-- CMD...
    <list[str]>`, `<float range>`); each value is named (POD, N, S, PORT, PATH, kill|wait)."""
    shown = help_of(*command)
    for label in ("<str>", "<int", "<float", "<list[", "<path>", "<bool>"):
        assert label not in shown, (label, shown)


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        (["put"], "Usage: tpupod put [OPTIONS] LOCAL REMOTE"),
        (["get"], "Usage: tpupod get [OPTIONS] REMOTE LOCAL_DIR"),
        (["logs"], "Usage: tpupod logs [OPTIONS] [RUN]"),
        (["jobs", "show"], "Usage: tpupod jobs show [OPTIONS] ID"),
        (["exec"], "Usage: tpupod exec [OPTIONS] -- CMD..."),
    ],
)
def test_the_usage_line_names_arguments_as_click_does(command: list[str], usage: str) -> None:
    """This session: typer 0.29's usage line read 'tpupod put [OPTIONS] {local} {remote}'
    and 'tpupod logs [OPTIONS] [[RUN]]'."""
    assert help_of(*command).splitlines()[0] == usage


def test_typer_builds_only_what_the_call_needs() -> None:
    load_commands(["--help"])
    listing = typer.main.get_command(app_for(None))
    assert isinstance(listing, typer.core.TyperGroup)
    assert sorted(listing.commands) == sorted(COMMAND_MODULES)
    for name, command in listing.commands.items():
        options = [p.name for p in command.params if p.name != "help"]
        assert options == [], f"{name} was built with its options"
    assert list(typer.main.get_command(app_for("status")).commands) == ["status"]  # type: ignore[attr-defined]
