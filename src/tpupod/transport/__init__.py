"""How commands reach a worker. The fan-out engine sees only :class:`Transport`.

The protocols are imported on first use: the local fast path imports ``base`` and
``lines`` through this package and should not pay for ``typing``.
Design notes: docs/ssh.md.
"""

from tpupod.transport.base import ExitStatus, OutputLine, Stream

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (mypy reads it as True)
if TYPE_CHECKING:
    from tpupod.transport.protocol import RemoteProcess, Transport

__all__ = ["ExitStatus", "OutputLine", "RemoteProcess", "Stream", "Transport"]


def __getattr__(name: str) -> object:
    if name in ("RemoteProcess", "Transport"):
        # typing's Protocol: not on exec's fast path
        from tpupod.transport import protocol

        return getattr(protocol, name)
    raise AttributeError(f"module 'tpupod.transport' has no attribute {name!r}")
