"""Name rules shared by the spec and the CLI (kept light: the CLI checks names on every call)."""

from __future__ import annotations

import os
import re

POD_NAME_RE = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def new_launch_id() -> str:
    """A launch's id, sortable by its start and unique across launchers: 20261127-041500-a1b2c3."""
    from datetime import UTC, datetime  # here: the CLI's fast paths import this module

    return f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{os.urandom(3).hex()}"
