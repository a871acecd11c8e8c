"""Every environment variable tpupod itself reads, in one place.

Deferred imports: every command's start, fast paths included, imports this module: pathlib
(exec's local fast path does without it) and the recovery policy's defaults are imported by
the settings that use them.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (mypy reads it as True)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path  # imported where used: exec's local fast path does without it


def state_home() -> Path:
    """Where known pods live.

    ``$TPUPOD_HOME``, else ``$XDG_STATE_HOME/tpupod``, else ``~/.local/state/tpupod``.
    """
    from pathlib import Path

    return Path(state_home_text())


def state_home_text() -> str:
    """:func:`state_home` as a string, for the fast path (without pathlib, ~6 ms to import)."""
    explicit = os.environ.get("TPUPOD_HOME")
    if explicit:
        return os.path.normpath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_STATE_HOME")
    base = os.path.expanduser(xdg) if xdg else os.path.join(os.path.expanduser("~"), ".local/state")
    return os.path.normpath(os.path.join(base, "tpupod"))


def debug() -> bool:
    """Tracebacks for errors, as ``--debug`` gives them (``TPUPOD_DEBUG``, anything but 0)."""
    return os.environ.get("TPUPOD_DEBUG", "") not in ("", "0")


def color_wanted(is_tty: bool) -> bool:
    """Color in a terminal, never when piped; ``NO_COLOR`` and ``FORCE_COLOR`` override."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return is_tty and os.environ.get("TERM") != "dumb"


def runtime_dir() -> Path:
    """Where this user's sockets go: ``$XDG_RUNTIME_DIR/tpupod-UID``, else ``/tmp/tpupod-UID``."""
    from pathlib import Path

    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"tpupod-{os.getuid()}"


def holder_enabled() -> bool:
    """SSH pods keep connections in a holder process unless ``TPUPOD_HOLDER=0``."""
    return os.environ.get("TPUPOD_HOLDER", "1").lower() not in ("0", "no", "false", "off")


def holder_idle_s() -> float:
    """Seconds a holder waits for the next request before it exits (``TPUPOD_HOLDER_IDLE``)."""
    try:
        return float(os.environ.get("TPUPOD_HOLDER_IDLE", "600"))
    except ValueError:
        return 600.0


def accelerator_devices(default: tuple[str, ...]) -> tuple[str, ...]:
    """Device-file patterns that mean "holds the accelerator" (``TPUPOD_ACCELERATOR_DEVICES``,
    colon-separated), for hosts whose accelerator is not at /dev/accel* or /dev/vfio/*."""
    value = os.environ.get("TPUPOD_ACCELERATOR_DEVICES")
    return tuple(p for p in value.split(":") if p) if value else default


def gcp_project() -> str | None:
    """The Google Cloud project named in the environment (as gcloud and Google's libraries)."""
    return os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("CLOUDSDK_CORE_PROJECT") or None


def tpu_api_endpoint() -> str | None:
    """``TPUPOD_TPU_API_ENDPOINT``: another Cloud TPU API (a test stand-in), reached anonymously."""
    return os.environ.get("TPUPOD_TPU_API_ENDPOINT") or None


def gcp_poll_s() -> float:
    """Seconds between state checks while a TPU is created or deleted (``TPUPOD_GCP_POLL_S``)."""
    try:
        return float(os.environ.get("TPUPOD_GCP_POLL_S", "5"))
    except ValueError:
        return 5.0


def progress_every_s() -> float:
    """Seconds between an extraction's progress lines and markers, on each worker
    (``TPUPOD_PROGRESS_S``, default 2; a log that wants fewer: 30)."""
    try:
        return max(0.0, float(os.environ.get("TPUPOD_PROGRESS_S", "2")))
    except ValueError:
        return 2.0


def metadata_url() -> str:
    """A TPU VM's metadata server, as its workers reach it (``TPUPOD_METADATA_URL``: a
    test stand-in's)."""
    default = "http://metadata.google.internal/computeMetadata/v1"
    return os.environ.get("TPUPOD_METADATA_URL") or default


def recovery_watch_s() -> float:
    """Seconds between reads of a TPU's state during a run with --retries
    (``TPUPOD_RECOVERY_WATCH_S``)."""
    try:
        return float(os.environ.get("TPUPOD_RECOVERY_WATCH_S", "5"))
    except ValueError:
        return 5.0


def recovery_probe() -> tuple[float, int]:
    """How long an unreachable worker or a failing API call is retried before a run with
    --retries decides without it, and at most how many times (``TPUPOD_RECOVERY_PROBE_S``,
    ``TPUPOD_RECOVERY_PROBE_TRIES``: 0, the default, sets no count; the defaults are the
    retry policy's). A Cloud TPU API call that fails for a passing reason is retried for
    the same time everywhere (``up`` and ``down`` too)."""
    from tpupod.recovery.policy import DEFAULT_PROBE_S, DEFAULT_PROBE_TRIES

    try:
        seconds = float(os.environ.get("TPUPOD_RECOVERY_PROBE_S", DEFAULT_PROBE_S))
        tries = int(os.environ.get("TPUPOD_RECOVERY_PROBE_TRIES", DEFAULT_PROBE_TRIES))
    except ValueError:
        return DEFAULT_PROBE_S, DEFAULT_PROBE_TRIES
    return seconds, tries


def model_cache_dir() -> Path:
    """Where checkpoints read from remote storage (``gs://``) are copied.

    ``$TPUPOD_MODEL_CACHE``, else ``$XDG_CACHE_HOME/tpupod/models``, else
    ``~/.cache/tpupod/models``.
    """
    from pathlib import Path

    explicit = os.environ.get("TPUPOD_MODEL_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tpupod" / "models"


def environment() -> Mapping[str, str]:
    """The whole environment, for what reads many variables by rule (a worker's identity:
    ``TPUPOD_*``, GKE's ``TPU_WORKER_*``, ``CLOUD_TPU_TASK_ID``; see launch/identity.py)."""
    return os.environ


def rendezvous() -> tuple[str | None, str]:
    """Where this worker's launch meets (``TPUPOD_RENDEZVOUS``, host:port) and its token
    (``TPUPOD_RENDEZVOUS_TOKEN``); ``tpupod run`` sets both."""
    return os.environ.get("TPUPOD_RENDEZVOUS") or None, os.environ.get(
        "TPUPOD_RENDEZVOUS_TOKEN", ""
    )


def launch_id() -> str | None:
    """The launch this process is part of (``TPUPOD_LAUNCH_ID``; set by ``tpupod run``)."""
    return os.environ.get("TPUPOD_LAUNCH_ID") or None


def program_identity() -> tuple[str, str]:
    """What besides the command line makes two workers' programs the same: the synced commit
    (``TPUPOD_CODE_COMMIT``) and the user's ``TPUPOD_CONFIG_DIGEST``."""
    return os.environ.get("TPUPOD_CODE_COMMIT", ""), os.environ.get("TPUPOD_CONFIG_DIGEST", "")


def jax_on_cpu() -> bool:
    """``JAX_PLATFORMS=cpu``: JAX runs on the CPU (cross-process collectives then need gloo)."""
    return os.environ.get("JAX_PLATFORMS", "") == "cpu"


def bench_plan() -> str | None:
    """``TPUPOD_BENCH_PLAN``: what ``tpupod bench checkpoint`` asks each worker to run (JSON)."""
    return os.environ.get("TPUPOD_BENCH_PLAN") or None


def jobs_db() -> str | None:
    """``TPUPOD_JOBS_DB``: the job store's URL (``sqlite:///PATH``, ``postgresql://...``)."""
    return os.environ.get("TPUPOD_JOBS_DB") or None


def jobs_token() -> str | None:
    """``TPUPOD_JOBS_TOKEN``: the job API's bearer token (``tpupod jobs serve`` and clients)."""
    return os.environ.get("TPUPOD_JOBS_TOKEN") or None


def job_code() -> str | None:
    """``TPUPOD_JOB_CODE``: the Python source (base64) a code job's worker runs; set by the
    job runner for ``python -m tpupod.jobs.code``."""
    return os.environ.get("TPUPOD_JOB_CODE") or None


def in_kubernetes_pod() -> bool:
    """``KUBERNETES_SERVICE_HOST``: set in every pod; the Kubernetes job runner then uses the
    pod's service account when given no kubeconfig."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def openai_api_key() -> str | None:
    """``OPENAI_API_KEY``: the bearer token OpenAI clients send (``tpupod serve endpoint``
    prints it for the fleet's router; ``tpupod fanout`` uses it when given no token)."""
    return os.environ.get("OPENAI_API_KEY") or None


# JAX's persistent compilation cache, as its own variables name it
JAX_CACHE_VARIABLES = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
    "JAX_COMPILATION_CACHE_MAX_SIZE",
)


def jax_cache_env() -> dict[str, str]:
    """The JAX compilation cache variables this process was given (none when unset)."""
    return {name: os.environ[name] for name in JAX_CACHE_VARIABLES if os.environ.get(name)}


def named(variable: str) -> str | None:
    """The variable a command was told to read by name (``serve ctl --token-env NAME``)."""
    return os.environ.get(variable) or None


def take(variable: str) -> str | None:
    """A secret handed over in the environment, read once and removed, so no child started
    later inherits it (the sgl-router child's API key)."""
    return os.environ.pop(variable, None) or None


def child_restarts_file() -> str | None:
    """``TPUPOD_SERVE_CHILD_RESTARTS``: where the builtin server's keeper counts its
    engine's and front end's restarts (the fleet's agent names the file; serve status
    shows the counts)."""
    return os.environ.get("TPUPOD_SERVE_CHILD_RESTARTS") or None


def use_uvloop() -> bool:
    """``TPUPOD_NO_UVLOOP`` unset: the serving router and the builtin server's HTTP side run
    on uvloop where it is installed (serve/eventloop.py)."""
    return not os.environ.get("TPUPOD_NO_UVLOOP")
