"""sgl-router (the ``sglang-router`` package) as the fleet's router: ``serve up --router sgl``.

``python -m tpupod.serve.router.sgl --host H --port P --backends h:p,... --policy P`` is what
ctl's ``ensure router`` starts on worker 0 in place of ``tpupod.serve.router``. It runs
sgl-router as its child and records ``router.json`` (``kind: sgl``, the metrics port) once
sgl-router listens, so ``ctl stop router`` (``serve down``), ``ctl call router`` and
``serve status`` treat it as they treat the builtin router. A child, not sgl-router in this
process: its Rust server holds the GIL while it runs, so nothing here could say when it
listens; and the bearer token reaches it in the environment, never on a command line that
``ps`` shows. The child dies with this process (``PR_SET_PDEATHSIG``), so a KILL after the
stop grace leaves no router behind.

The backends are given up front (``--worker-urls``); sgl-router's own health checks
(every ``--health-interval`` s), its circuit breaker and its retries take a dead server
out and bring it back once it answers again (the agent restarts it on the same port).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tpupod import settings
from tpupod.serve import defaults, services

KEY_ENV = "TPUPOD_SGL_API_KEY"
MISSING = "sglang_router is not installed for"
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# A failed request is retried on another server; three failures in a row open a server's
# circuit (no requests until a trial after CB_TIMEOUT_S), two failed checks take it out.
RETRIES = 5
CB_FAILURES = 3
CB_TIMEOUT_S = 5
HEALTH_FAILURES = 2
STARTUP_TIMEOUT_S = 60  # every backend answered /health before serve up starts the router
CIRCUIT = {0.0: "closed", 1.0: "open", 2.0: "half-open"}  # smg_worker_cb_state


def sgl_argv(
    host: str, port: int, *, metrics_port: int, backends: list[str], policy: str,
    health_interval: float,
) -> list[str]:  # fmt: skip
    """sgl-router's command line (``launch_router``'s flags) for this fleet."""
    interval = max(1, math.ceil(health_interval))
    return [
        "--host", host, "--port", str(port),
        "--prometheus-host", host, "--prometheus-port", str(metrics_port),
        "--worker-urls", *(f"http://{b}" for b in backends),
        "--policy", policy, "--log-level", "warn",
        "--retry-max-retries", str(RETRIES),
        "--cb-failure-threshold", str(CB_FAILURES),
        "--cb-timeout-duration-secs", str(CB_TIMEOUT_S),
        "--health-failure-threshold", str(HEALTH_FAILURES),
        "--health-check-interval-secs", str(interval),
        "--worker-startup-timeout-secs", str(STARTUP_TIMEOUT_S),
        "--shutdown-grace-period-secs", "1",
    ]  # fmt: skip


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def not_importable() -> str | None:
    """Why this Python cannot import sglang_router (``MISSING ...``), or None: what
    ``serve up``'s preflight asks worker 0 before anything starts, and the router's start."""
    try:
        import sglang_router  # noqa: F401  (light: its version only)
    except ImportError as exc:
        return f"{MISSING} {sys.executable} ({exc})"
    return None


def run(state: Path, args: argparse.Namespace) -> int:
    """Start sgl-router, record it once it listens, stop it on TERM; its exit code."""
    if (why := not_importable()) is not None:
        print(why, file=sys.stderr, flush=True)
        return 3
    port = args.port or free_port(args.host)
    metrics = free_port(args.host)
    argv = sgl_argv(
        args.host, port, metrics_port=metrics, backends=args.backends.split(","),
        policy=args.policy, health_interval=args.health_interval,
    )  # fmt: skip
    env = {**os.environ, KEY_ENV: services.token(state, "router")}
    command = [sys.executable, "-m", "tpupod.serve.router.sgl", "--child", *argv]
    child = subprocess.Popen(command, env=env)
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    signal.signal(signal.SIGINT, lambda *_: child.terminate())
    while child.poll() is None and not _listening(args.host, port):
        time.sleep(0.05)
    if child.poll() is None:
        services.when_room(
            lambda: services.write_info(state, "router", args.host, port, kind="sgl",
                                        metrics_port=metrics, child=child.pid),
            "router.json",
        )  # fmt: skip
    try:
        return child.wait()
    finally:
        services.remove_info(state, "router")


def child(argv: list[str]) -> None:
    """sgl-router in this process (it never returns while it serves)."""
    with contextlib.suppress(OSError, AttributeError):  # die with the parent (Linux)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        return
    # the sgl extra's, in the child only
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(argv)
    args.api_key = settings.take(KEY_ENV)
    launch_router(args)


def view(info: dict[str, Any], token: str) -> dict[str, Any]:
    """sgl-router's view of its workers, as ``ctl call`` answers (status and body): the
    body has the builtin router's shape (``backends``: the healthy ones; ``health``: each
    one's state and requests) and sgl-router's own health and circuit states."""
    # a view of the router only (the serve extra): not the child that runs it
    import httpx
    from prometheus_client.parser import text_string_to_metric_families  # a view only

    host, port = info["host"], info["port"]
    auth = {"Authorization": f"Bearer {token}"}
    try:
        workers = httpx.get(f"http://{host}:{port}/workers", headers=auth, timeout=10.0)
        health = httpx.get(f"http://{host}:{port}/health", timeout=10.0)
        metrics = httpx.get(f"http://{host}:{info['metrics_port']}/metrics", timeout=10.0)
    except httpx.HTTPError as exc:
        return {"error": f"sgl-router does not answer: {exc}", "status": None}
    if workers.status_code != 200:
        return {"status": workers.status_code, "body": workers.text}
    samples: dict[str, dict[str, float]] = {}  # worker URL -> metric -> value
    for family in text_string_to_metric_families(metrics.text):
        for s in family.samples:
            if "worker" in s.labels:
                name = s.name + (f":{s.labels['outcome']}" if "outcome" in s.labels else "")
                samples.setdefault(s.labels["worker"], {})[name] = s.value
    seen: dict[str, Any] = {}
    for w in workers.json().get("workers", []):
        m = samples.get(w["url"], {})
        seen[w["url"].removeprefix("http://")] = {
            "state": "up" if w.get("is_healthy") else "down",
            "requests": int(sum(v for k, v in m.items() if k.startswith("smg_worker_cb_outcomes"))),
            "circuit": CIRCUIT.get(m.get("smg_worker_cb_state", 0.0), "unknown"),
            "load": w.get("load"),
        }
    body = {
        "kind": "sgl",
        "at": time.time(),  # when the counts were read (a rate's clock)
        "router_health": f"HTTP {health.status_code} {health.text.strip()}"[:80],
        "backends": [a for a, s in seen.items() if s["state"] == "up" and s["circuit"] != "open"],
        "health": seen,
    }
    return {"status": 200, "body": body}


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["--child"]:
        child(given[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m tpupod.serve.router.sgl")
    parser.add_argument("--state-dir", default=services.STATE_DIR)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--backends", required=True, help="host:port,host:port,...")
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument("--health-interval", type=float, default=defaults.HEALTH_INTERVAL_S)
    args = parser.parse_args(given)
    return run(Path(args.state_dir).expanduser().absolute(), args)


if __name__ == "__main__":
    sys.exit(main())
