"""``python -m tpupod.serve.replica``: one member of a multi-host replica (``member``)."""

from __future__ import annotations

import os
import sys

from tpupod.serve.replica.member import main

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # JAX's distributed shutdown would wait on the other members
