"""How commands reach a worker. The fan-out engine sees only :class:`Transport`.

Design notes: docs/ssh.md.
"""

from tpupod.transport.base import (
    ExitStatus,
    OutputLine,
    RemoteProcess,
    Stream,
    Transport,
)

__all__ = ["ExitStatus", "OutputLine", "RemoteProcess", "Stream", "Transport"]
