"""What a ``kill -9`` of the fleet's router (or of worker 0's agent) costs the clients
(issue 41).

    .venv/bin/python benchmarks/serve_router_kill.py                  # about 2 minutes
    .venv/bin/python benchmarks/serve_router_kill.py --src /tmp/before/src   # other code
    .venv/bin/python benchmarks/serve_router_kill.py --kill agent --serve-again --every 45

``--kill agent`` kills worker 0's agent instead (``python -m tpupod.extras serve
tpupod.serve.agent``, not its keeper); ``--serve-again`` runs the user's ``serve up``
(the same options) 1 s after each kill, in the background, as the chaos harness does:
before agents had a keeper, that was what brought one back.

A fleet as a user starts it (``tpupod up --local 2``, ``tpupod serve up --model
tests/fixtures/qwen2-tiny``, every other option its default but ``--base-port``) under a
steady load: 8 clients (the real ``openai`` client, no retries: a retry would hide the
fault), half of them streaming, each asking again as soon as it has its answer
(``--pause`` seconds after a failure: a client that asked again at once would count
thousands of refusals a second). Two phases in the same run: the anchor (the same load,
no kill) and ``--kills`` kills of the router process (``kill -9``), one every
``--every`` seconds. Per phase: requests, failures by kind, and the longest gap without
a successful answer; per kill: the requests that failed, those in flight in the router
when it was killed, those that failed though they began after it was dead (the outage:
refused connections), the longest gap around it, and how long until the next answer.
Medians over the kills, and the worst.

``--src DIR`` runs the CLI (and so every process of the fleet: a local pod's workers
inherit its environment) on the code in DIR (``PYTHONPATH``): a worktree of an earlier
commit measures the code before a change in the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import psutil

ROOT = Path(__file__).resolve().parent.parent
TPUPOD = str(Path(sys.executable).with_name("tpupod"))
MODEL = ROOT / "tests" / "fixtures" / "qwen2-tiny"
MESSAGES: Any = [{"role": "user", "content": "Say something about routers."}]


@dataclass
class Request:
    began: float
    ended: float
    stream: bool
    error: str | None  # the exception's kind (and cause), None: a whole answer


class Load:
    """``clients`` threads, each asking the endpoint again as soon as it has an answer."""

    def __init__(
        self, base_url: str, key: str, clients: int, max_tokens: int, pause: float
    ) -> None:
        self.done: list[Request] = []
        self.pause = pause
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.threads = [
            threading.Thread(
                target=self._client, args=(base_url, key, i % 2 == 1, max_tokens), daemon=True
            )
            for i in range(clients)
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(60)

    def _client(self, base_url: str, key: str, stream: bool, max_tokens: int) -> None:
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        while not self._stop.is_set():
            began = time.monotonic()
            error = None
            try:
                if stream:
                    chunks = client.chat.completions.create(
                        model=model, messages=MESSAGES, max_tokens=max_tokens, stream=True
                    )
                    finished = [c.choices[0].finish_reason for c in chunks if c.choices]
                    if not finished or finished[-1] is None:
                        error = "stream ended without a finish_reason"
                else:
                    client.chat.completions.create(
                        model=model, messages=MESSAGES, max_tokens=max_tokens
                    )
            except Exception as exc:  # each failure's kind is the result
                error = kind(exc)
            with self._lock:
                self.done.append(Request(began, time.monotonic(), stream, error))
            if error is not None:
                time.sleep(self.pause)  # a client that asks again at once would spin
        client.close()

    def between(self, start: float, end: float) -> list[Request]:
        with self._lock:
            return [r for r in self.done if start <= r.ended < end]


def kind(exc: BaseException) -> str:
    """``APIConnectionError <- ConnectError: [Errno 111] Connection refused`` and the like."""
    said = type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        said += f" <- {type(cause).__name__}: {str(cause)[:80]}"
    elif str(exc):
        said += f": {str(exc)[:80]}"
    return said


def longest_gap(requests: list[Request], start: float, end: float) -> float:
    """The longest time in [start, end] without a successful answer."""
    times = sorted(r.ended for r in requests if r.error is None)
    edges = [start, *times, end]
    return max(b - a for a, b in itertools.pairwise(edges))


def cli(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    done = subprocess.run(
        [TPUPOD, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"tpupod {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def free_base_port() -> int:
    """A port whose next one is free too (the 2 workers' servers), not 31000's range."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 1))
            return port
    raise SystemExit("no two free ports in a row")


def router_pid(pod: str) -> int | None:
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if (
                proc.info["cmdline"][1:3] == ["-m", "tpupod.serve.router"]
                and proc.environ().get("TPUPOD_POD") == pod
                and proc.status() != "zombie"
            ):
                return int(proc.pid)
        except (psutil.Error, TypeError):
            continue
    return None


def agent_pid(pod: str, worker: int = 0, module: str = "tpupod.serve.agent") -> int | None:
    """The agent of ``worker`` (its working folder is the worker's), not its keeper; or
    the process of another ``module`` run the same way (the builtin server's keeper)."""
    for proc in psutil.process_iter(["cmdline"]):
        try:
            argv = proc.info["cmdline"]
            if (
                argv[2:5:2] == ["tpupod.extras", module]
                and proc.environ().get("TPUPOD_POD") == pod
                and Path(proc.cwd()).name == f"w{worker}"
                and proc.status() != "zombie"
            ):
                return int(proc.pid)
        except (psutil.Error, TypeError):
            continue
    return None


def phase(load: Load, start: float, end: float) -> dict[str, Any]:
    done = load.between(start, end)
    failed: dict[str, int] = {}
    for r in done:
        if r.error is not None:
            failed[r.error] = failed.get(r.error, 0) + 1
    return {
        "seconds": round(end - start, 1),
        "requests": len(done),
        "ok": sum(r.error is None for r in done),
        "failed": sum(failed.values()),
        "failed_by_kind": failed,
        "longest_gap_s": round(longest_gap(done, start, end), 3),
    }


def one_kill(
    load: Load, pod: str, every: float, target: str = "router", again: Any = None
) -> dict[str, Any]:
    """Kill the router (or w0's agent) now; what it cost, over the next ``every`` seconds;
    ``again``: what to run 1 s after the kill (the user's serve up), in a thread."""
    find = router_pid if target == "router" else agent_pid
    deadline = time.monotonic() + 30
    while (pid := find(pod)) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"no {target} process to kill after 30s")
        time.sleep(0.05)
    server = agent_pid(pod, 0, "tpupod.serve.builtin")
    before = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie":
        time.sleep(0.001)
    dead = time.monotonic()
    if again is not None:
        threading.Timer(1.0, again).start()
    time.sleep(every)
    end = time.monotonic()
    window = load.between(before, end)
    failed = [r for r in window if r.error is not None]
    after = [r for r in window if r.error is None and r.ended > dead]
    return {
        "in_flight": sum(r.began < before for r in window),
        "failed": len(failed),
        "failed_in_flight": sum(r.began < before for r in failed),
        "failed_begun_after": sum(r.began >= dead for r in failed),
        "failed_kinds": sorted({r.error for r in failed if r.error}),
        "next_answer_s": round(min(r.ended for r in after) - dead, 3) if after else None,
        "gap_s": round(longest_gap(load.between(before - 1, end), before - 1, end), 3),
        "back": find(pod) is not None,
        # w0's server: the same process at the end of the window (not stopped and started)
        "w0_server_kept": server is not None
        and agent_pid(pod, 0, "tpupod.serve.builtin") == server,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="tpupod-rk-"))
    pod = f"rk{os.getpid()}"
    env = {**os.environ, "TPUPOD_HOME": str(home)}
    if args.src:
        env["PYTHONPATH"] = str(Path(args.src).resolve())
    load: Load | None = None
    try:
        cli(env, "up", "--name", pod, "--local", "2")
        base = ["--base-port", str(free_base_port())]  # other fleets may serve on 31000
        up = ["serve", "up", "--pod", pod, "--model", str(MODEL), *base]
        cli(env, *up, timeout=600)
        ups: list[str] = []

        def serve_again() -> None:
            done = subprocess.run(
                [TPUPOD, *up], env=env, capture_output=True, text=True, check=False
            )
            ups.append(f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")

        again = serve_again if args.serve_again else None
        exports = cli(env, "serve", "endpoint", "--pod", pod).splitlines()
        values = dict(line.removeprefix("export ").split("=", 1) for line in exports)
        load = Load(values["OPENAI_BASE_URL"], values["OPENAI_API_KEY"], args.clients,
                    args.max_tokens, args.pause)  # fmt: skip
        load.start()
        time.sleep(args.warmup)
        anchor_start = time.monotonic()
        time.sleep(args.every * args.kills)
        anchor = phase(load, anchor_start, time.monotonic())
        print(f"anchor: {anchor}", file=sys.stderr, flush=True)
        kills_start = time.monotonic()
        kills = []
        for n in range(args.kills):
            kills.append(one_kill(load, pod, args.every, args.kill, again))
            print(f"kill {n + 1}: {kills[-1]}", file=sys.stderr, flush=True)
        under_kills = phase(load, kills_start, time.monotonic())
        load.stop()
        which = "--router" if args.kill == "router" else "--agent"
        log = subprocess.run(  # code before agents had a keeper has no --agent
            [TPUPOD, "serve", "logs", "--pod", pod, which, "-n", "40"],
            env=env, capture_output=True, text=True, check=False,
        ).stdout.splitlines()  # fmt: skip
        restarts = [line for line in log if "respawn" in line]
        status = cli(env, "serve", "status", "--pod", pod)
    finally:
        if load is not None:
            load.stop()
        for stop in (["serve", "down"], ["down"]):
            subprocess.run([TPUPOD, *stop, "--pod", pod], env=env, capture_output=True, check=False)
    return {
        "src": args.src or str(ROOT / "src"),
        "clients": args.clients,
        "anchor": anchor,
        "kills": kills,
        "under_kills": under_kills,
        "killed": args.kill,
        "router_log": restarts,
        "serve_again": ups,
        "status": status,
    }


def median(values: list[float | int | None]) -> str:
    found = [v for v in values if v is not None]
    return f"{statistics.median(found):g}" if found else "-"


def report(r: dict[str, Any]) -> None:
    print(f"code: {r['src']}; {r['clients']} clients (half streaming), openai, no retries")
    print()
    print(f"{'phase':<24}{'requests':>9}{'ok':>7}{'failed':>8}{'longest gap s':>15}")
    for name, p in (("anchor (no kill)", r["anchor"]), (f"{len(r['kills'])} {r['killed']} kills",
                                                         r["under_kills"])):  # fmt: skip
        print(f"{name:<24}{p['requests']:>9}{p['ok']:>7}{p['failed']:>8}{p['longest_gap_s']:>15}")
    print()
    fields = [
        ("in flight at the kill", "in_flight"),
        ("failed", "failed"),
        ("  of those in flight", "failed_in_flight"),
        ("  begun after it died", "failed_begun_after"),
        ("gap without an answer s", "gap_s"),
        ("next answer after s", "next_answer_s"),
    ]
    print(f"{'per kill':<26}{'median':>8}{'worst':>8}   each")
    for label, key in fields:
        values = [k[key] for k in r["kills"]]
        known = [v for v in values if v is not None]
        worst = f"{max(known):g}" if known else "-"
        each = " ".join("-" if v is None else f"{v:g}" for v in values)
        print(f"{label:<26}{median(values):>8}{worst:>8}   {each}")
    kept = sum(bool(k.get("w0_server_kept")) for k in r["kills"])
    print(f"w0's server the same process after the kill: {kept} of {len(r['kills'])} kills")
    print()
    kinds = sorted({k for kill in r["kills"] for k in kill["failed_kinds"]})
    for k in kinds:
        print(f"failure: {k}")
    for line in r["router_log"][-3:]:
        print(f"{r['killed']} log: {line}")
    for line in r["serve_again"]:
        print(f"serve up again: {line}")
    print(r["status"].rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--every", type=float, default=6.0, help="seconds between kills")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--pause", type=float, default=0.1, help="a client's wait after a failed request"
    )
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--kill", choices=("router", "agent"), default="router")
    parser.add_argument(
        "--serve-again", action="store_true", help="the user's serve up 1 s after each kill"
    )
    parser.add_argument("--src", default=None, help="run this code (its src folder)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    result = measure(args)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
