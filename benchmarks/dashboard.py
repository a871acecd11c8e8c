"""`tpupod dashboard` under a big state directory: render times, browser navigation, live
updates, the process's CPU and memory, and whether history slows the first view.

    .venv/bin/python benchmarks/dashboard.py                # 256 workers, 1,000 runs, 10,000 jobs
    .venv/bin/python benchmarks/dashboard.py --watch-s 600  # the issue's 10 minutes of 3 browsers

Everything runs on this machine: a local pod of 256 workers (each sample runs a probe on
every worker), 1,000 finished runs and one running run written as `tpupod run` writes
them (run.json, wN.log), 10,000 jobs in a SQLite store, and the dashboard as its own
process (`tpupod dashboard --interval 5`). Chromium is Debian's, driven by playwright.

* render: server time per page, p50 and p95 of ``--requests`` GETs each (httpx, keep-alive),
  beside the anchor: an empty answer of the same process (``/favicon.ico``, 204), the HTTP
  floor on this machine at this moment;
* navigation: ``goto`` until the page's heading is visible, in Chromium, median of 5;
* event: a job cancelled in the store until the jobs page shows it;
* log line: a line appended to a running worker's log until the run page shows it;
* process: CPU (share of one core) and RSS of the dashboard with 3 browser pages open: the
  dashboard is the web process and the sampling process it starts, counted together; apart
  from them the sampler's probes (a local pod's workers are processes here, on a real pod
  that work is on the hosts);
* history: the overview and the runs page with 10 and with 1,000 finished runs, two
  dashboards at once with their requests interleaved (medians of ``--history-requests``),
  served from memory and made each time.

``--big-log LINES`` measures one thing instead: a finished run of 4 workers whose logs hold
LINES lines each (100,000: 21 MB), opened in Chromium until every worker's last line is
shown (the page keeps 500 a worker), 5 times (the first bounded by ``--big-log-timeout``),
with the web process's CPU per open; ``--before SRC`` runs the same against another
checkout's ``src/`` (PYTHONPATH) in the same run, the anchor.

``--backends N`` also starts a serving fleet of N backends (the fleet tests' stub OpenAI
server, 4 a worker, behind the router) for the serving page; without it the page is empty.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from tpupod.jobs.models import JobRequest
from tpupod.jobs.store import Store
from tpupod.pod.lifecycle import up
from tpupod.pod.spec import LocalPodSpec
from tpupod.pod.state import StateDir

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.fakes.runs import write_runs  # noqa: E402

TPUPOD = str(Path(sys.executable).with_name("tpupod"))
PORT = 8761


def start(
    home: Path, interval: float, port: int = PORT, src: str | None = None
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TPUPOD_HOME": str(home)}
    if src is not None:  # another checkout's code (the sampler inherits it)
        env["PYTHONPATH"] = src
    argv = [TPUPOD, "dashboard", "--port", str(port), "--interval", str(interval), "--token", "t"]
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300  # a first sample of 256 workers on a busy machine
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/pods").json()["state"] == "ok":
                time.sleep(2 * interval)  # settled: its first rounds and imports are over
                return proc
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the dashboard did not sample within 300 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=20)


def render_times(paths: list[str], requests: int) -> dict[str, tuple[float, float]]:
    """Per path: (p50, p95) of the server's answer time, in ms."""
    found = {}
    with httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=120) as client:
        for path in paths:
            client.get(path).raise_for_status()  # its first making (templates compile) aside
            times = []
            for _ in range(requests):
                began = time.perf_counter()
                client.get(path).raise_for_status()
                times.append((time.perf_counter() - began) * 1000)
            times.sort()
            found[path] = (statistics.median(times), times[int(len(times) * 0.95) - 1])
    return found


def browse(
    paths: list[str],
    running: str,
    home: Path,
    store: Store,
    *,
    proc: subprocess.Popen[bytes],
    watch_s: float,
) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    base = f"http://127.0.0.1:{PORT}"
    out: dict[str, Any] = {}
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=shutil.which("chromium"), args=["--no-sandbox"]
        )
        page = chromium.new_page()
        for path in paths:
            times = []
            for _ in range(5):
                began = time.perf_counter()
                page.goto(base + path)
                page.locator("main h1").wait_for()
                times.append((time.perf_counter() - began) * 1000)
            out[path] = statistics.median(times)
        # an event: a job cancelled in the store, until the jobs page shows it
        page.goto(base + "/jobs")
        newest = page.locator("#job-list tbody tr").first
        job = int(newest.get_attribute("data-job") or 0)
        began = time.perf_counter()
        store.cancel(job)
        newest.locator("td.status", has_text="cancelled").wait_for(timeout=30_000)
        out["event"] = time.perf_counter() - began
        # a log line of a running worker, until the run page shows it
        page.goto(f"{base}/runs/{running}")
        page.locator('#logs pre[data-worker="0"]', has_text="line 19").wait_for()
        log = home / "state" / "pods" / "big" / "runs" / running / "w0.log"
        began = time.perf_counter()
        with log.open("a") as f:
            f.write("a new line\n")
        page.locator('#logs pre[data-worker="0"]', has_text="a new line").wait_for()
        out["log"] = time.perf_counter() - began
        # three viewers for watch_s: the dashboard's CPU and RSS (the page above closed:
        # three pages open, not four)
        page.close()
        pages = [chromium.new_page() for _ in range(3)]
        for viewer, path in zip(pages, ["/", "/pods/big", f"/runs/{running}"], strict=True):
            viewer.goto(base + path)
        out["process"] = watch(proc, watch_s)
        chromium.close()
    return out


def watch(proc: subprocess.Popen[bytes], seconds: float) -> dict[str, float]:
    """Over ``seconds``, in shares of one core: the web process, the sampling process, and
    the sampler's reaped children (the probes); RSS MiB of the first two."""
    web = psutil.Process(proc.pid)
    sampler = next(c for c in web.children() if "tpupod.dashboard.sampler" in c.cmdline())
    before = [web.cpu_times(), sampler.cpu_times()]
    time.sleep(seconds)
    after = [web.cpu_times(), sampler.cpu_times()]
    (w0, s0), (w1, s1) = before, after
    return {
        "web": (w1.user + w1.system - w0.user - w0.system) / seconds,
        "sampler": (s1.user + s1.system - s0.user - s0.system) / seconds,
        "probes": (s1.children_user + s1.children_system - s0.children_user - s0.children_system)
        / seconds,
        "web_rss": web.memory_info().rss / 2**20,
        "sampler_rss": sampler.memory_info().rss / 2**20,
    }


def start_fleet(backends: int) -> None:
    """A local pod of ``backends / 4`` workers serving 4 stub servers each, behind the router."""
    stub = Path(__file__).parents[1] / "tests" / "serve_stub.py"
    command = f"{{python}} {stub} --host {{host}} --port {{port}} --tokens 4 --token-delay 0"
    workers = max(1, backends // 4)
    run_cli("up", "--name", "serve", "--local", str(workers))
    run_cli(
        "serve", "up", "--pod", "serve", "--model", "stub-model", "--backend", "command",
        "--command", command, "--servers-per-worker", str(backends // workers),
        "--base-port", "18200", "--startup-timeout", "120",
    )  # fmt: skip


def run_cli(*args: str) -> None:
    done = subprocess.run([TPUPOD, *args], check=False, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise SystemExit(f"tpupod {' '.join(args[:2])} failed: {done.stderr.strip()}")


def history(few: Path, many: Path, args: argparse.Namespace) -> None:
    """The overview and the runs page with 10 and with ``args.runs`` finished runs: both
    dashboards running at once, their requests interleaved one by one (each the other's
    anchor at the same moment), medians of ``args.history_requests``. Served from memory
    (quiet data: nothing changed since the page was made), and made each time (a query of
    its own per request: what every request costs while the data changes)."""
    boards = {10: start(few, args.interval, PORT + 1), args.runs: start(many, args.interval)}
    ports = {10: PORT + 1, args.runs: PORT}
    try:
        clients = {n: httpx.Client(base_url=f"http://127.0.0.1:{ports[n]}") for n in boards}
        for path in ("/", "/runs"):
            for how in ("from memory", "made each time"):
                times: dict[int, list[float]] = {n: [] for n in boards}
                for i in range(args.history_requests):
                    for n, client in clients.items():
                        url = path if how == "from memory" else f"{path}?n={i}"
                        began = time.perf_counter()
                        client.get(url).raise_for_status()
                        times[n].append((time.perf_counter() - began) * 1000)
                few_ms, many_ms = (statistics.median(times[n]) for n in boards)
                print(
                    f"history: `{path}` {how}, p50 {few_ms:.2f} ms with 10 runs, "
                    f"{many_ms:.2f} ms with {args.runs}: {many_ms / few_ms:.2f}x "
                    f"({args.history_requests} interleaved requests each)"
                )
        for client in clients.values():
            client.close()
    finally:
        for proc in boards.values():
            stop(proc)


BIG_WORKERS = 4


def write_big_run(state: StateDir, lines: int) -> str:
    """A finished run of ``BIG_WORKERS`` workers, each log ``lines`` lines of about 52 bytes
    (100,000 lines: 21 MB in all); its launch id."""
    launch = "20260101-000000-biglog"
    folder = state.pod_dir("big") / "runs" / launch
    folder.mkdir(parents=True)
    workers = [{"id": w, "hostname": f"vm{w}"} for w in range(BIG_WORKERS)]
    now = time.time()
    record = {
        "launch_id": launch, "command": "python train.py", "workers": workers,
        "coordinator": "127.0.0.1:8476", "started": now - 600, "finished": now, "exit_code": 0,
        "results": [{"worker": w, "outcome": "exit 0", "last_line": "done"} for w in range(4)],
    }  # fmt: skip
    (folder / "run.json").write_text(json.dumps(record))
    for w in range(BIG_WORKERS):
        line = "w{w} step {i:07d} loss {loss:.9f} lr 3.0e-04 gn 0.25\n"
        body = "".join(line.format(w=w, i=i, loss=1 / (i + 1)) for i in range(lines))
        (folder / f"w{w}.log").write_text(body)
    return launch


def big_log(args: argparse.Namespace) -> None:
    """How long a run page with big logs takes to show every worker's last line."""
    from playwright.sync_api import sync_playwright

    home = Path(tempfile.mkdtemp(prefix="tpupod-dash-biglog-"))
    os.environ["TPUPOD_HOME"] = str(home / "state")
    state = StateDir()
    up(LocalPodSpec(name="big", workers=BIG_WORKERS), state)
    launch = write_big_run(state, args.big_log)
    size = sum(f.stat().st_size for f in (state.pod_dir("big") / "runs" / launch).glob("*.log"))
    print(f"run {launch}: {BIG_WORKERS} workers x {args.big_log} lines, {size / 1e6:.1f} MB")
    last = [f"w{w} step {args.big_log - 1:07d}" for w in range(BIG_WORKERS)]
    shown = (
        "(lines) => [...document.querySelectorAll('#logs pre')].filter((p, i) => "
        "p.textContent.includes(lines[i])).length === lines.length"
    )
    codes = {"after": None, "before": args.before} if args.before else {"after": None}
    try:
        with sync_playwright() as pw:
            chromium = pw.chromium.launch(
                executable_path=shutil.which("chromium"), args=["--no-sandbox"]
            )
            for name, src in codes.items():
                proc = start(home / "state", args.interval, src=src)
                web = psutil.Process(proc.pid)
                try:
                    times, cpus = [], []
                    for _ in range(5):
                        page = chromium.new_page()
                        cpu0 = sum(web.cpu_times()[:2])
                        began = time.perf_counter()
                        page.goto(f"http://127.0.0.1:{PORT}/runs/{launch}")
                        try:
                            page.wait_for_function(
                                shown,
                                arg=last,
                                timeout=args.big_log_timeout * 1000,
                                polling=100,
                            )
                        except Exception:  # playwright's TimeoutError
                            times.append(None)
                        else:
                            times.append((time.perf_counter() - began) * 1000)
                        cpus.append(sum(web.cpu_times()[:2]) - cpu0)
                        page.close()
                        if times[-1] is None:
                            break  # one that never finished says enough
                    done = [t for t in times if t is not None]
                    text = (
                        f"median {statistics.median(done):.0f} ms of {len(done)}"
                        if done
                        else f"incomplete after {args.big_log_timeout:.0f} s"
                    )
                    print(
                        f"{name}: every worker's last line shown: {text} "
                        f"(each: {', '.join('-' if t is None else f'{t:.0f}' for t in times)} ms); "
                        f"web process CPU per open: "
                        f"{', '.join(f'{c:.2f}' for c in cpus)} s"
                    )
                finally:
                    stop_killing(proc)
            chromium.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def stop_killing(proc: subprocess.Popen[bytes]) -> None:
    """Stop a dashboard that may not end on SIGTERM (the code before the shutdown fix)."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--watch-s", type=float, default=60.0)
    parser.add_argument("--backends", type=int, default=0)
    parser.add_argument("--history-requests", type=int, default=200)
    parser.add_argument("--big-log", type=int, default=0, metavar="LINES")
    parser.add_argument("--big-log-timeout", type=float, default=120.0)
    parser.add_argument("--before", metavar="SRC", default=None)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    if args.big_log:
        big_log(args)
        return
    home = Path(tempfile.mkdtemp(prefix="tpupod-dash-bench-"))
    os.environ["TPUPOD_HOME"] = str(home / "state")
    state = StateDir()
    up(LocalPodSpec(name="big", workers=args.workers), state)
    few = home / "few"
    shutil.copytree(home / "state", few / "state")
    running = write_runs(state, "big", args.workers, args.runs)
    write_runs(StateDir(few / "state"), "big", args.workers, 10)
    store = Store.open()
    store.submit_many([JobRequest(command=f"echo {i}", name=f"job-{i}") for i in range(args.jobs)])
    paths = [
        "/",
        "/pods",
        "/pods/big",
        "/runs",
        f"/runs/{running}",
        "/jobs",
        "/jobs?status=pending",
        "/jobs/1",
        "/serving",
        "/charts",
        "/api/pods",
        "/metrics",
    ]
    if args.backends:
        start_fleet(args.backends)
    proc = start(home / "state", args.interval)
    try:
        rendered = render_times(["/favicon.ico", *paths], args.requests)
        print("\n| page | p50 ms | p95 ms |\n| --- | ---: | ---: |")
        for path, (p50, p95) in rendered.items():
            print(f"| `{path}` | {p50:.1f} | {p95:.1f} |")
        browsed = browse(paths[:6], running, home, store, proc=proc, watch_s=args.watch_s)
        print("\n| page | navigation to visible, ms (median of 5) |\n| --- | ---: |")
        for path in paths[:6]:
            print(f"| `{path}` | {browsed[path]:.0f} |")
        print(f"\nevent (job cancelled) -> on screen: {browsed['event']:.2f} s")
        print(f"log line -> on screen: {browsed['log']:.2f} s")
        seen = browsed["process"]
        print(
            f"dashboard, 3 pages open {args.watch_s:.0f} s, % of one core: "
            f"{(seen['web'] + seen['sampler']) * 100:.2f} (web process {seen['web'] * 100:.2f},"
            f" sampling process {seen['sampler'] * 100:.2f})"
            f" (+ its probes {seen['probes'] * 100:.1f}); RSS web {seen['web_rss']:.0f} MiB,"
            f" sampler {seen['sampler_rss']:.0f} MiB"
        )
        stop(proc)
        history(few / "state", home / "state", args)
    finally:
        stop(proc)
        if args.backends:
            down = [TPUPOD, "serve", "down", "--pod", "serve"]
            subprocess.run(down, check=False, capture_output=True)
        store.close()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
