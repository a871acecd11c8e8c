"""Small enums and constants the CLI needs when it starts (kept free of heavy imports)."""

from __future__ import annotations

import enum

DEFAULT_SPEC_FILE = "tpupod.yaml"
RECORD_VERSION = 1  # the format of a pod's record (pod.json) this tpupod writes and reads


class HostKeyPolicy(enum.StrEnum):
    TOFU = "tofu"  # trust on first use, remember, refuse a changed key
    STRICT = "strict"  # only keys already remembered for the pod
    INSECURE = "insecure"  # never check (throwaway pods)


class Capacity(enum.StrEnum):
    """How a TPU is paid for and kept (Google Cloud)."""

    ON_DEMAND = "on-demand"
    SPOT = "spot"
    PREEMPTIBLE = "preemptible"
    RESERVED = "reserved"
    BEST_EFFORT = "best-effort"


class TpuApiKind(enum.StrEnum):
    """Which Cloud TPU API makes a TPU (unset: chosen from capacity and slices)."""

    TPU_VM = "tpu-vm"  # the nodes API: one slice
    QUEUED_RESOURCE = "queued-resource"  # one slice or several, each capacity a tier


class RendezvousOn(enum.StrEnum):
    """Where ``tpupod run``'s rendezvous service runs."""

    AUTO = "auto"  # worker 0 for a Cloud TPU reached at external addresses, else the launcher
    LAUNCHER = "launcher"
    WORKER0 = "worker0"
