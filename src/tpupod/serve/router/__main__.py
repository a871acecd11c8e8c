"""``python -m tpupod.serve.router``: the fleet's router (``server``)."""

from __future__ import annotations

from tpupod.serve.router.server import main

if __name__ == "__main__":
    main()
