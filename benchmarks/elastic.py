"""Elastic slices (issue 42): goodput with ``--elastic`` beside plain ``--retries``.

Run as root (it builds a simulated pod of network namespaces with real sshd)::

    .venv/bin/python benchmarks/elastic.py                      # delays 60 s and 300 s
    .venv/bin/python benchmarks/elastic.py --delays 10,30 --steps 200   # a short one

Two pods of 3 separate spot v4-8 slices (one simulated host each) on one Cloud TPU API
stand-in (tests/fakes), side by side in the same minutes: ``tpupod run --retries 3
--elastic`` on one, ``tpupod run --retries 3`` (the anchor) on the other, each of
tests/programs/steps.py (a step every 0.5 s, a checkpoint every 10 steps and one at
SIGTERM, a heartbeat a step: the goodput's steps). Slice 2 of both is preempted at the
same moment with the stand-in's provisioning delay at the first delay; once both run
again, slice 1 of both with the second delay. Reported per run: its goodput (productive
step time over wall time, from its record), wall time, steps redone, and the time from
the first confirmed preemption to the first step after it (on fewer slices for the
elastic run). Target: elastic goodput >= 1.5x plain at the 300 s delay.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import TPUPOD  # noqa: E402
from tests.fakes.tpu_api import on_sim_hosts  # noqa: E402

from tpupod.sim import SimPod  # noqa: E402

PROGRAM = REPO / "tests" / "programs" / "steps.py"
STEP_S, SAVE_EVERY = 0.5, 10
NOTICE_S = 10.0  # the stand-in's notice: TERM, then the hosts go this much later
RUNS = {"elastic": ("--elastic",), "anchor: plain --retries": ()}


def steps_done(ckpt: Path) -> list[tuple[int, float]]:
    """Worker 0's steps, in order: (step, when it ended)."""
    log = ckpt / "steps-w0.log"
    if not log.exists():
        return []
    rows = [line.split() for line in log.read_text().splitlines()]
    return [(int(step), float(at)) for step, at in rows]


def running_again(ckpt: Path, attempt: int) -> bool:
    """Has attempt ``attempt`` (or a later one) begun its steps?"""
    return any((ckpt / f"started-{n}").exists() for n in range(attempt, attempt + 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", default="60,300", help="provisioning delays, s (two)")
    parser.add_argument("--steps", type=int, default=900, help="training steps (0.5 s each)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    first, second = (float(x) for x in args.delays.split(","))
    results: dict[str, dict[str, Any]] = {}
    with SimPod(8) as sim, tempfile.TemporaryDirectory() as home:
        api = on_sim_hosts(sim, NOTICE_S, steps=1)
        env = {
            **os.environ,
            "TPUPOD_HOME": home,
            "TPUPOD_TPU_API_ENDPOINT": api.start("0.0.0.0"),
            "TPUPOD_GCP_POLL_S": "0.5",
            "TPUPOD_RECOVERY_WATCH_S": "1",
            "TPUPOD_METADATA_URL": f"http://{sim.gateway}:{api.port}/computeMetadata/v1",
        }
        runs: dict[str, tuple[str, Path, subprocess.Popen[str], list[str]]] = {}
        try:
            for n, (label, options) in enumerate(RUNS.items()):
                name = f"eb{n}"
                up = [TPUPOD, "up", "--gcp", "--zone", "us-central2-b", "--project", "p",
                      "--user", "root", "--name", name, "--tpu-type", "v4-8", "--spot",
                      "--slices", "3"]  # fmt: skip
                subprocess.run(up, env=env, check=True, capture_output=True)
                ckpt = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tpupod-elastic-"))
                run = subprocess.Popen(
                    [TPUPOD, "run", "--pod", name, "--retries", "3", *options, "--",
                     sys.executable, str(PROGRAM), str(ckpt), str(args.steps), str(STEP_S),
                     str(SAVE_EVERY)],
                    env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                )  # fmt: skip
                said: list[str] = []
                assert run.stderr is not None
                threading.Thread(
                    target=lambda r=run, s=said: s.extend(r.stderr), daemon=True
                ).start()  # type: ignore[misc]
                runs[label] = (name, ckpt, run, said)
            ckpts = [ckpt for _, ckpt, _, _ in runs.values()]  # elastic's first
            while not all(any(s == 20 for s, _ in steps_done(c)) for c in ckpts):
                time.sleep(0.1)
            api.provision_s = first
            preempted_at = time.time()
            for name, *_ in runs.values():
                api.preempt_with_notice(f"{name}-2")
            print(f"slice 2 preempted ({first:.0f} s to provision)", flush=True)
            # the second preemption once both run again on every slice they will have
            again = {ckpt: 3 if RUNS[label] else 2 for label, (_, ckpt, _, _) in runs.items()}
            while not all(running_again(c, n) for c, n in again.items()) and not runs_ended(runs):
                time.sleep(0.5)
            time.sleep(20)
            api.provision_s = second
            for name, _, run, _ in runs.values():
                if run.poll() is None:
                    api.preempt_with_notice(f"{name}-1")
            print(f"slice 1 preempted ({second:.0f} s to provision)", flush=True)
            for label, (name, ckpt, run, said) in runs.items():
                run.wait(timeout=3600)
                results[label] = measure(Path(home), name, ckpt, run.returncode, preempted_at)
                if run.returncode != 0:
                    print("".join(said[-30:]), file=sys.stderr)
        finally:
            for name, ckpt, run, _ in runs.values():
                if run.poll() is None:
                    run.kill()
                subprocess.run(
                    [TPUPOD, "down", "--pod", name], env=env, capture_output=True, check=False
                )
                subprocess.run(["rm", "-rf", str(ckpt)], check=False)
            api.stop()
    report(results, first, second, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def runs_ended(runs: dict[str, tuple[str, Path, subprocess.Popen[str], list[str]]]) -> bool:
    return any(run.poll() is not None for _, _, run, _ in runs.values())


def measure(home: Path, name: str, ckpt: Path, code: int, preempted_at: float) -> dict[str, Any]:
    [path] = (home / "pods" / name / "runs").glob("*/recovery.json")
    record = json.loads(path.read_text())
    done = steps_done(ckpt)
    steps = [step for step, _ in done]
    first_after = next((at for _, at in done if at > preempted_at + NOTICE_S), float("nan"))
    confirmed = record["attempts"][0]["ended"]
    goodput = record.get("goodput") or {}
    return {
        "exit code": code,
        "goodput": goodput.get("goodput", float("nan")),
        "wall s": goodput.get("wall_s", float("nan")),
        "badput s": goodput.get("badput_s", {}),
        "steps redone": len(steps) - len(set(steps)),
        "confirmed -> first step after, s": first_after - confirmed,
        "attempts": [(a["cause"], a.get("slices")) for a in record["attempts"]],
    }


def report(results: dict[str, dict[str, Any]], first: float, second: float, steps: int) -> None:
    cpus, load = os.cpu_count(), os.getloadavg()[0]
    print(f"\nmachine: {platform.processor() or platform.machine()}, {cpus} CPUs, load {load:.1f}")
    print(f"{steps} steps of {STEP_S} s; slice 2 preempted ({first:.0f} s to provision), "
          f"then slice 1 ({second:.0f} s)")  # fmt: skip
    labels = list(results)
    print(f"| measure | {' | '.join(labels)} | elastic / plain |")
    print("| --- |" + " ---: |" * (len(labels) + 1))
    for key in ("goodput", "wall s", "steps redone", "confirmed -> first step after, s"):
        values = [float(results[label][key]) for label in labels]
        ratio = f"{values[0] / values[1]:.2f}x" if values[1] else "-"
        print(f"| {key} | {' | '.join(f'{v:.2f}' for v in values)} | {ratio} |")
    for label in labels:
        spent = ", ".join(f"{k} {v:.0f} s" for k, v in results[label]["badput s"].items() if v)
        print(f"{label}: exit {results[label]['exit code']}; attempts "
              f"{results[label]['attempts']}; badput: {spent}")  # fmt: skip


if __name__ == "__main__":
    main()
