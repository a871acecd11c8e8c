"""The ``tpupod`` console script: the fast paths for plain ``exec`` and ``run``, else the
full CLI (see ``plainargs``)."""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    code: int | None = None
    if argv[:1] == ["exec"]:
        from tpupod.execargs import fast_exec

        code = fast_exec(argv)
    elif argv[:1] == ["run"]:
        from tpupod.runargs import fast_run

        code = fast_run(argv)
    if code is not None:
        sys.exit(code)
    from tpupod.cli import main as cli_main

    cli_main()
