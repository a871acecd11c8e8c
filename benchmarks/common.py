"""What the benchmark scripts share: the tpupod command and how they call OpenSSH."""

from __future__ import annotations

import sys
from pathlib import Path

TPUPOD = str(Path(sys.executable).with_name("tpupod"))
# A throwaway simulated pod: no host-key prompts or files, no password fallback.
SSH_OPTIONS = [
    "-o", "BatchMode=yes",
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR",
]  # fmt: skip
