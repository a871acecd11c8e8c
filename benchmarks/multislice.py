"""Multislice (issue 39): what slices cost a run.

Run as root (it builds simulated pods of network namespaces with real sshd):

    .venv/bin/python benchmarks/multislice.py launch                 # 2x2 and 4x4; 8 runs
    .venv/bin/python benchmarks/multislice.py launch --shapes 2x2 --runs 12

Sections, one subcommand each:

1. ``launch``: from starting ``tpupod run`` to the first step on every worker, on
   S x W simulated SSH hosts made into a pod of S slices of W hosts, beside the same
   hosts as a pod of one slice (the anchor), measured in the same run. The program is
   the same on both: ``tpupod.init_jax()``, then one jitted sum over a global array
   sharded over ``tpupod.mesh(ici={"fsdp": -1}, dcn={"data": -1})``, whose result
   every process reads (an all-reduce across every host); each worker then prints the
   wall clock. The hosts share this machine's clock, so the first step is the last
   worker's time less the time the command was started. The two pods take turns,
   run by run, the order swapped every round (A B, B A, ...), after one warm-up each.

2. ``recovery``: slice 1 of a spot pod of 2 slices of v4-16 (2 workers each) preempted as
   GCE does (TERM, the hosts taken 30 s later) on the TPU API stand-in over 8 simulated
   hosts, its provisioning delay set to 60 s for every new TPU: separate TPUs
   (``--slices 2``: slice 1 deleted and made again alone) beside one multislice queued
   resource (``--node-count 2``: GCP suspends it whole; the anchor, whole pod recreated),
   the two taking turns. ``tpupod run --retries 1`` of tests/programs/steps.py with a
   user's default options (a step every 0.5 s, a checkpoint every 10 steps and one at
   the notice); the notice comes 4 steps past a periodic save. Reported: notice ->
   attempt ended, confirmed -> first step after restore, its delete and create phases
   (the recovery's own timings), the TPUs deleted and created, the hosts provisioned
   afresh (booted with nothing from before), and the steps redone.

    .venv/bin/python benchmarks/multislice.py recovery --runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import TPUPOD, sim_pod

from tpupod.holder.client import stop_holder
from tpupod.pod.state import StateDir
from tpupod.sim import SimPod

DEVICES_PER_WORKER = 2
# The first step: the same program on a pod of one slice (where every dcn size is 1) and on
# one of several. Two clocks a worker: after init_jax, after the collective.
PROGRAM = """\
import time, numpy as np, tpupod
me = tpupod.init_jax()
joined = time.time()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = tpupod.mesh(ici={"fsdp": -1}, dcn={"data": -1})
sharding = NamedSharding(mesh, P(("data", "fsdp")))
ones = jax.make_array_from_callback((jax.device_count(),), sharding, lambda i: np.ones(1))
summed = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(ones)
total = float(summed.addressable_data(0))  # every process holds the reduced value
assert total == jax.device_count(), total
print(f"first-step {me.id} {mesh.shape['data']} {joined:.6f} {time.time():.6f}", flush=True)
"""
# worker id, the mesh's size across slices, the two clocks
STEP_LINE = re.compile(r"^\[w\d+\] +first-step (\d+) (\d+) ([0-9.]+) ([0-9.]+)$", re.M)


def first_step(pod: str, workers: int, slices: int) -> tuple[float, float]:
    """One ``tpupod run`` of the program: (seconds to the last worker's init_jax, seconds to
    the last worker's first step), both from the command's start. Every worker must have
    reported, its mesh ``slices`` across (the pod's slices reached the program)."""
    command = [TPUPOD, "run", "--pod", pod, "--", sys.executable, "-c", PROGRAM]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    found = STEP_LINE.findall(done.stdout)
    reported = {worker for worker, across, *_ in found if int(across) == slices}
    if done.returncode != 0 or len(reported) != workers:
        tail = "\n".join(done.stderr.splitlines()[-8:])
        raise RuntimeError(
            f"{pod}: exit {done.returncode}, {len(reported)} of {workers} workers reported "
            f"a first step on a mesh {slices} slices across:\n{tail}"
        )
    joined = max(float(j) for *_, j, _ in found) - started
    stepped = max(float(s) for *_, s in found) - started
    return joined, stepped


def interleaved(
    pods: dict[str, int], workers: int, runs: int
) -> dict[str, list[tuple[float, float]]]:
    """Each pod (name: its slices) ``runs`` times, in turn, after one warm-up each
    (discarded). The order swaps every round (A B, B A, A B, ...): on 2x2 hosts here, the
    pod that always ran second came out 5-9 % faster, whichever pod it was."""
    for pod, slices in pods.items():
        first_step(pod, workers, slices)
    samples: dict[str, list[tuple[float, float]]] = {pod: [] for pod in pods}
    order = list(pods)
    for _ in range(runs):
        for pod in order:
            samples[pod].append(first_step(pod, workers, pods[pod]))
        order.reverse()
    return samples


def parse_shape(text: str) -> tuple[int, int]:
    """``SxW``: S slices of W hosts."""
    slices, _, per_slice = text.partition("x")
    if not (slices.isdigit() and per_slice.isdigit() and int(slices) >= 2 and int(per_slice)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give SLICESxHOSTS, e.g. 2x2 (2 slices or more)"
        )
    return int(slices), int(per_slice)


def measure_launch(args: argparse.Namespace) -> None:
    print(f"\n{args.runs} runs each, in turn (A B, B A, ...), after one warm-up each; medians, s")
    print("\n| hosts | pod | to init_jax | to first step | vs one slice | pairs' ratio |")
    print("|--:|---|--:|--:|--:|--:|")
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(DEVICES_PER_WORKER)}
    for slices, per_slice in args.shapes:
        hosts = slices * per_slice
        with SimPod(hosts) as sim:
            one, sliced = f"one{hosts}", f"sliced{slices}x{per_slice}"
            sim_pod(sim, one, env=env)
            sim_pod(sim, sliced, env=env, slices=slices)
            try:
                samples = interleaved({one: 1, sliced: slices}, hosts, args.runs)
            finally:
                for pod in (one, sliced):
                    stop_holder(StateDir(), pod)
        print_row(hosts, samples[one], "one slice (the anchor)", samples[one])
        print_row(hosts, samples[sliced], f"{slices} slices of {per_slice}", samples[one])
        for pod, runs in samples.items():
            print(f"  {pod}, each run's first step, s: {' '.join(f'{s:.2f}' for _, s in runs)}")


def print_row(
    hosts: int, runs: list[tuple[float, float]], label: str, anchor: list[tuple[float, float]]
) -> None:
    """One table row: the medians, their ratio to the anchor's first step, and the median of
    the round-by-round ratios (each run beside the anchor's run of the same round)."""
    joined = statistics.median(j for j, _ in runs)
    stepped = statistics.median(s for _, s in runs)
    ratio = stepped / statistics.median(s for _, s in anchor)
    pairs = statistics.median(s / a for (_, s), (_, a) in zip(runs, anchor, strict=True))
    print(
        f"| {hosts} | {label} | {joined:.2f} | {stepped:.2f} | {ratio:.3f}x | {pairs:.3f}x |",
        flush=True,
    )


REPO = Path(__file__).resolve().parents[1]
STEPS_PROGRAM = REPO / "tests" / "programs" / "steps.py"
STEPS, STEP_S, SAVE_EVERY, NOTICE_AT = 40, 0.5, 10, 13  # the notice 4 steps past a save
NOTICE_S, PROVISION_S = 30.0, 60.0
RECOVERIES = {  # label: the pod's shape
    "separate TPUs, slice 1 replaced alone": ("--slices", "2"),
    "anchor: one queued resource, recreated whole": ("--node-count", "2"),
}


def one_recovery(sim: SimPod, n: int, shape: tuple[str, ...]) -> dict[str, float]:
    """One preempted run on a pod of ``shape``: its recovery's phases and costs."""
    sys.path.insert(0, str(REPO))
    from preemption import steps_done  # the preemption benchmark's reader: this section only
    from tests.fakes.tpu_api import on_sim_hosts  # the stand-in: this section only

    api = on_sim_hosts(sim, NOTICE_S, steps=1)
    env = {
        **os.environ,
        "TPUPOD_TPU_API_ENDPOINT": api.start("0.0.0.0"),
        "TPUPOD_GCP_POLL_S": "0.5",
        "TPUPOD_METADATA_URL": f"http://{sim.gateway}:{api.port}/computeMetadata/v1",
    }
    name = f"rec{n}"
    ckpt = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tpupod-bench-"))
    try:
        up = [TPUPOD, "up", "--gcp", "--zone", "us-central2-b", "--project", "p", "--user",
              "root", "--name", name, "--tpu-type", "v4-16", "--spot", *shape]  # fmt: skip
        subprocess.run(up, env=env, check=True, capture_output=True)
        api.provision_s = PROVISION_S  # a busy zone, for every TPU made from now on
        program = [sys.executable, str(STEPS_PROGRAM), str(ckpt), str(STEPS), str(STEP_S),
                   str(SAVE_EVERY)]  # fmt: skip
        run = subprocess.Popen(
            [TPUPOD, "run", "--pod", name, "--retries", "1", "--", *program],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        while not any(step == NOTICE_AT for step, _ in steps_done(ckpt)):
            if run.poll() is not None:
                raise SystemExit(f"the run ended early: {run.returncode}")
            time.sleep(0.05)
        notice = time.time()
        calls = len(api.calls)
        provisioned: list[str] = []
        boot = api.on_provision
        api.on_provision = lambda hosts: (provisioned.extend(hosts), boot(hosts))[-1]
        api.preempt_with_notice(f"{name}-1")
        _, err = run.communicate(timeout=900)
        if run.returncode != 0:
            raise SystemExit(err)
        [path] = (Path(os.environ["TPUPOD_HOME"]) / "pods" / name / "runs").glob("*/recovery.json")
        first, second = json.loads(path.read_text())["attempts"]
        resumed_at = int((ckpt / "started-2").read_text())
        done = steps_done(ckpt)
        first_step = [at for step, at in done if step == resumed_at][-1]
        steps = [step for step, _ in done]
        later = api.calls[calls:]
        return {
            "notice -> attempt ended": first["ended"] - notice,
            "confirmed -> first step after restore": first_step - first["ended"],
            "delete": second["phases"].get("delete", 0.0),
            "create": second["phases"].get("create", 0.0),
            "TPUs deleted": float(sum(method == "DELETE" for method, _ in later)),
            "TPUs created": float(sum(method == "POST" for method, _ in later)),
            "hosts provisioned": float(len(provisioned)),
            "steps redone": float(len(steps) - len(set(steps))),
        }
    finally:
        subprocess.run([TPUPOD, "down", "--pod", name], env=env, capture_output=True, check=False)
        api.stop()  # after the down: it deletes the TPUs through it
        subprocess.run(["rm", "-rf", str(ckpt)], check=False)


def measure_recovery(args: argparse.Namespace) -> None:
    results: dict[str, list[dict[str, float]]] = {label: [] for label in RECOVERIES}
    order = list(RECOVERIES)
    with SimPod(8) as sim:
        for n in range(args.runs):
            for label in order:
                number = len(results[label]) * 2 + list(RECOVERIES).index(label)
                found = one_recovery(sim, number, RECOVERIES[label])
                results[label].append(found)
                shown = ", ".join(f"{k} {v:.1f}" for k, v in found.items())
                print(f"run {n + 1}, {label}: {shown}", flush=True)
            order.reverse()
    keys = list(next(iter(results.values()))[0])
    print(f"\nmedians of {args.runs} run(s); provisioning delay {PROVISION_S:.0f} s for both")
    print("| pod | " + " | ".join(keys) + " | recovery vs the anchor |")
    print("|---|" + "--:|" * (len(keys) + 1))
    restored = "confirmed -> first step after restore"
    anchor = statistics.median(r[restored] for r in results[list(RECOVERIES)[1]])
    for label, runs in results.items():
        cells = [f"{statistics.median(r[k] for r in runs):.1f}" for k in keys]
        mine = statistics.median(r[restored] for r in runs)
        print(f"| {label} | " + " | ".join(cells) + f" | {mine / anchor:.2f}x |")


# One entry a section.
SECTIONS: dict[str, tuple[str, Callable[[argparse.Namespace], None]]] = {
    "launch": ("tpupod run to the first step, slices beside one slice", measure_launch),
    "recovery": ("one preempted slice replaced beside the whole pod", measure_recovery),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sections = parser.add_subparsers(dest="section", required=True)
    launch = sections.add_parser("launch", help=SECTIONS["launch"][0])
    launch.add_argument(
        "--shapes", type=parse_shape, nargs="+", default=[(2, 2), (4, 4)], metavar="SxW"
    )
    launch.add_argument("--runs", type=int, default=8, help="each pod's; even: each order as often")
    recovery = sections.add_parser("recovery", help=SECTIONS["recovery"][0])
    recovery.add_argument("--runs", type=int, default=1, help="each shape's (~2 minutes a run)")
    args = parser.parse_args()
    print(
        f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f} at the start, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    with tempfile.TemporaryDirectory(prefix="tpupod-bench-") as home:
        os.environ["TPUPOD_HOME"] = home
        SECTIONS[args.section][1](args)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
