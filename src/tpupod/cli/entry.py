"""The ``tpupod`` console script: the fast paths for plain ``exec`` (through an SSH
pod's holder, or on a local pod's processes), ``run`` and ``jobs submit``, else the
full CLI (see ``plainargs``)."""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
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
    if code is not None:
        sys.exit(code)
    from tpupod.cli.app import main as cli_main

    cli_main()
