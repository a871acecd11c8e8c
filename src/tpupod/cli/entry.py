"""The ``tpupod`` console script: the fast paths for plain ``exec`` (through an SSH
pod's holder, or on a local pod's processes), ``run`` and ``jobs submit``, else the
full CLI. Each fast path reads its command's ``cli.args.Args`` class, the one typer's
signature is made from, and gives up (None: typer decides) on anything unusual."""

from __future__ import annotations

import sys

INTERRUPTED = 130  # 128 + SIGINT, as the shell says of a command stopped by Ctrl-C


def main() -> None:
    """Run the command; a Ctrl-C before the command handles it itself (while Python imports
    the CLI, 0.1 to 0.3 s) ends it with 130 and no traceback, as one after does."""
    try:
        code = run(sys.argv[1:])
    except KeyboardInterrupt:
        code = INTERRUPTED
    sys.exit(code)


def run(argv: list[str]) -> int | None:
    """The command's exit code, by its fast path where it has one and the line is plain;
    else the typer app runs it (and exits)."""
    code: int | None = None
    if argv[:1] == ["exec"]:
        from tpupod.cli.flow.exec import fast_exec

        code = fast_exec(argv)
    elif argv[:1] == ["run"]:
        from tpupod.cli.flow.run import fast_run

        code = fast_run(argv)
    elif argv[:2] == ["jobs", "submit"]:
        from tpupod.cli.flow.submit import fast_submit

        code = fast_submit(argv[2:])
    if code is None:
        from tpupod.cli.app import main as cli_main

        cli_main()  # the typer app: it exits with the command's code
    return code
