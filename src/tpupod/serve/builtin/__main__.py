"""``python -m tpupod.serve.builtin``: the builtin server's process, in the role its
arguments give: the keeper of the split server (the default), its engine or front end
(``--role``, which the keeper starts), or every engine in one process (``--no-split``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from tpupod.errors import TpupodError
from tpupod.serve.builtin import server, split


def run(args: argparse.Namespace) -> int:
    ports = server.check_args(args)
    if args.role == "engine":
        return split.engine_main(args, ports)
    if args.role == "frontend":
        return split.frontend_main(args, ports)
    sockets = [server.bind(args.host, p) for p in ports]
    server.check_model_folder(args.model)
    if args.no_split:
        return server.serve_here(args, sockets, ports)
    return split.keep(args, sockets)


def main(argv: Sequence[str] | None = None) -> int:
    args = server.parse_args(argv)
    try:
        return run(args)
    except TpupodError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C while loading or compiling (later, a clean stop)
        return 130


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The engines' threads have ended; skip the interpreter's teardown, where
    # XLA's CPU client takes seconds to let go of its devices.
    os._exit(code)
