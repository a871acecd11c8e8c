"""The ``tpupod`` console script: the fast path for a plain ``exec``, else the full CLI."""

from __future__ import annotations

import sys


def main() -> None:
    from tpupod.execargs import fast_exec

    code = fast_exec(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from tpupod.cli import main as cli_main

    cli_main()
