"""Name rules shared by the spec and the CLI (kept light: the CLI checks names on every call)."""

from __future__ import annotations

import re

POD_NAME_RE = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
