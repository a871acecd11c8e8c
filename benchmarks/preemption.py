"""Preemption recovery: from the notice to the first training step after restore.

Run as root (it builds a simulated pod of network namespaces with real sshd):

    .venv/bin/python benchmarks/preemption.py            # 3 runs of each
    .venv/bin/python benchmarks/preemption.py --runs 1

A 4-worker spot TPU VM (v4-32) of the Cloud TPU API stand-in (tests/fakes), its
provisioning delay set to 0 (one read per state), over 8 simulated hosts (the
recreated TPU gets the other 4, booted fresh). ``tpupod run --retries 1 --setup
--sync`` runs a stand-in training program with a user's default options
(tests/programs/steps.py, with this interpreter, which has tpupod, as a user's python
does: a step every 0.5 s, connected to the rendezvous, a checkpoint every 10 steps and
one at SIGTERM, at the end of the step under way); the TPU is preempted as GCE does
(TERM to every process, the hosts taken away 30 s later) four steps past a periodic
save. With default options the rendezvous runs on worker 0 (``auto``, a Cloud TPU
reached at external addresses): the anchor, in the same run, is the same recovery with
``--rendezvous-on launcher``. Reported per run: notice -> attempt ended (the grace
included), and confirmed -> first step after restore, broken into delete, create,
setup, sync, launch and restore (program start -> its first step), with the steps
redone (lost at the notice). Targets (issues 23 and 37): <= 30 s, <= 60 s, 0 steps.

With ``--outages 0,15,60`` (issue 37) each run is ``--retries 2`` and the Cloud TPU API
answers every call with 503 for that many seconds from the preemption on; reported per
outage: notice -> first step after restore, the recoveries it cost, and how the run
ended. The 0 s row is the anchor, measured beside the others in the same run:

    .venv/bin/python benchmarks/preemption.py --outages 0,15,60 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import TPUPOD  # noqa: E402
from tests.fakes.tpu_api import on_sim_hosts  # noqa: E402

from tpupod.sim import SimPod  # noqa: E402

PROGRAM = REPO / "tests" / "programs" / "steps.py"
STEPS, STEP_S, SAVE_EVERY = 40, 0.5, 10
NOTICE_AT = 13  # the step after which the notice comes: 4 steps past the save of step 9
NOTICE_S = 30.0
PHASES = ("delete", "create", "setup")  # timed by the recovery itself (recovery.json)
VARIANTS = {
    "default options": (),
    "anchor: --rendezvous-on launcher": ("--rendezvous-on", "launcher"),
}


def code_repo(where: Path) -> Path:
    """A small repository to --sync, with the pod's setup script."""
    repo = where / "code"
    repo.mkdir()
    (repo / "setup.sh").write_text("echo setting up; mkdir -p ~/.cache/bench\n")
    (repo / "train.py").write_text(PROGRAM.read_text())
    git = ["git", "-C", str(repo), "-c", "user.name=b", "-c", "user.email=b@b"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "code"], check=True)
    return repo


def steps_done(ckpt: Path) -> list[tuple[int, float]]:
    """Worker 0's steps, in order: (step, when it ended)."""
    log = ckpt / "steps-w0.log"
    if not log.exists():
        return []
    rows = [line.split() for line in log.read_text().splitlines()]
    return [(int(step), float(at)) for step, at in rows]


def one_run(
    sim: SimPod, home: Path, n: int, options: tuple[str, ...], outage_s: float | None = None
) -> dict[str, float]:
    """One preempted run; with ``outage_s``, the API answers 503 that long from the notice."""
    api = on_sim_hosts(sim, NOTICE_S, steps=1)  # no provisioning delay
    env = {
        **os.environ,
        "TPUPOD_HOME": str(home),
        "TPUPOD_TPU_API_ENDPOINT": api.start("0.0.0.0"),
        "TPUPOD_GCP_POLL_S": "0.05",
        "TPUPOD_RECOVERY_WATCH_S": "0.5",
        "TPUPOD_METADATA_URL": f"http://{sim.gateway}:{api.port}/computeMetadata/v1",
    }
    name = f"pb{n}"
    ckpt = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tpupod-bench-"))
    try:
        up = [TPUPOD, "up", "--gcp", "--zone", "us-central2-b", "--project", "p",
              "--user", "root", "--name", name, "--tpu-type", "v4-32", "--spot",
              "--api", "tpu-vm"]  # fmt: skip
        subprocess.run(up, env=env, check=True, capture_output=True)
        repo = code_repo(Path(tempfile.mkdtemp()))
        run = subprocess.Popen(
            [TPUPOD, "run", "--pod", name, "--retries", "1" if outage_s is None else "2",
             "--setup", "setup.sh",
             "--sync", "~/code", *options, "--", sys.executable, "train.py", str(ckpt),
             str(STEPS), str(STEP_S), str(SAVE_EVERY)],
            cwd=repo, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        lines: list[tuple[float, str]] = []
        reader = threading.Thread(target=lambda: lines.extend((time.time(), x) for x in run.stderr))  # type: ignore[union-attr]
        reader.start()
        while not any(step == NOTICE_AT for step, _ in steps_done(ckpt)):
            if run.poll() is not None:
                raise SystemExit(f"the run ended early: {run.returncode}")
            time.sleep(0.05)
        notice = time.time()
        api.preempt_with_notice(name)
        if outage_s:
            api.unavailable(outage_s)
        run.wait(timeout=600)
        reader.join()
        if outage_s is not None:
            return outage_measure(home, name, ckpt, notice, run.returncode)
        if run.returncode != 0:
            raise SystemExit("".join(line for _, line in lines))
        return measure(home, name, ckpt, notice, lines)
    finally:
        api.stop()
        subprocess.run([TPUPOD, "down", "--pod", name], env=env, capture_output=True, check=False)
        subprocess.run(["rm", "-rf", str(ckpt)], check=False)


def measure(
    home: Path, name: str, ckpt: Path, notice: float, lines: list[tuple[float, str]]
) -> dict[str, float]:
    [path] = (home / "pods" / name / "runs").glob("*/recovery.json")
    first, second = json.loads(path.read_text())["attempts"]
    synced = next(t for t, line in lines if "every worker at" in line and t > first["ended"])
    started = ckpt / "started-2"
    resumed_at = int(started.read_text())
    done = steps_done(ckpt)
    first_step = [at for step, at in done if step == resumed_at][-1]  # attempt 2's
    set_up = second["started"] + sum(second["phases"].get(p, 0.0) for p in PHASES)
    steps = [step for step, _ in done]
    return {
        "notice -> attempt ended": first["ended"] - notice,
        "confirmed -> first step after restore": first_step - first["ended"],
        "delete": second["phases"].get("delete", 0.0),
        "create": second["phases"].get("create", 0.0),
        "setup": second["phases"].get("setup", 0.0),
        "sync": synced - set_up,
        "launch": started.stat().st_mtime - synced,
        "restore + first step (a 0.5 s step)": first_step - started.stat().st_mtime,
        "steps redone (lost at the notice)": float(len(steps) - len(set(steps))),
    }


def outage_measure(home: Path, name: str, ckpt: Path, notice: float, code: int) -> dict[str, float]:
    """What a preemption plus an outage cost: time to the first step after restore (NaN
    when the run failed), recoveries, the exit code."""
    [path] = (home / "pods" / name / "runs").glob("*/recovery.json")
    record = json.loads(path.read_text())
    last = len(record["attempts"])
    started = ckpt / f"started-{last}"
    restored = float("nan")
    if code == 0 and started.exists():
        resumed_at = int(started.read_text())
        first_step = [at for step, at in steps_done(ckpt) if step == resumed_at][-1]
        restored = first_step - notice
    return {
        "notice -> first step after restore": restored,
        "recoveries": float(record["counters"].get("recoveries", 0)),
        "exit code": float(code),
    }


def outages(sizes: list[float], runs: int) -> None:
    """Each outage size ``runs`` times, interleaved (a load change hits every size)."""
    results: dict[float, list[dict[str, float]]] = {size: [] for size in sizes}
    with SimPod(8) as sim, tempfile.TemporaryDirectory() as home:
        for n in range(runs):
            for size in sizes:
                found = one_run(sim, Path(home), n * len(sizes) + sizes.index(size), (), size)
                results[size].append(found)
                shown = ", ".join(f"{k} {v:.2f}" for k, v in found.items())
                print(f"run {n + 1}, outage {size:.0f}s: {shown}", flush=True)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(
        f"| API outage | notice -> first step after restore, s (median of {runs}) | "
        "recoveries | exit codes |\n| ---: | ---: | --- | --- |"
    )
    for size, found in results.items():
        done = [r["notice -> first step after restore"] for r in found if r["exit code"] == 0]
        seconds = f"{statistics.median(done):.1f}" if done else "- (never restored)"
        recoveries = " / ".join(f"{r['recoveries']:.0f}" for r in found)
        codes = " / ".join(f"{r['exit code']:.0f}" for r in found)
        print(f"| {size:.0f} s | {seconds} | {recoveries} | {codes} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--outages", help="seconds of API outage from the notice, e.g. 0,15,60")
    args = parser.parse_args()
    if args.outages:
        outages([float(x) for x in args.outages.split(",")], args.runs)
        return
    results: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    with SimPod(8) as sim, tempfile.TemporaryDirectory() as home:
        for n in range(args.runs):
            for v, (variant, options) in enumerate(VARIANTS.items()):  # side by side
                results[variant].append(one_run(sim, Path(home), 2 * n + v, options))
                shown = ", ".join(f"{k} {x:.2f}" for k, x in results[variant][-1].items())
                print(f"run {n + 1}, {variant}: {shown}", flush=True)
    cpus = os.cpu_count()
    load = os.getloadavg()[0]
    print(f"\nmachine: {platform.processor() or platform.machine()}, {cpus} CPUs, load {load:.1f}")
    names = list(VARIANTS)
    print(f"| measure (median of {args.runs}) | {' | '.join(names)} | default / anchor |")
    print("| --- |" + " ---: |" * (len(names) + 1))
    for key in results[names[0]][0]:
        medians = [statistics.median(r[key] for r in results[v]) for v in names]
        ratio = f"{medians[0] / medians[1]:.2f}" if medians[1] else "-"
        cells = [f"{m:.2f}" for m in medians]
        print(f"| {key} | {' | '.join(cells)} | {ratio} |")


if __name__ == "__main__":
    main()
