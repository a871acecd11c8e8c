"""A simulated pod of network namespaces running real sshd, for tests and benchmarks (root only).

Design notes: docs/testing.md.
"""

from tpupod.sim.pod import SimError, SimHost, SimPod, cleanup_stale, missing_prerequisites

__all__ = ["SimError", "SimHost", "SimPod", "cleanup_stale", "missing_prerequisites"]
