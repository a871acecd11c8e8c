"""``python -m tpupod.serve.agent``: a worker's agent (``server``)."""

from __future__ import annotations

from tpupod.serve.agent.server import main

if __name__ == "__main__":
    main()
