"""Checkpoint save and restore GB/s: `tpupod bench checkpoint` beside Orbax called directly
and a raw write and read of the same bytes, interleaved in one run.

    .venv/bin/python benchmarks/checkpoint.py --gb 2 --runs 3

The pytree is N float32 arrays of 256 MiB (``--gb`` in all), unsharded on one
device. Each contender runs in a fresh process, one after the other, in every run:

- raw (fsync): numpy writes each array's bytes to its own file and fsyncs it
  (``dd conv=fsync``'s sequential write), then reads them back with ``np.fromfile``;
- raw (no fsync): the same without the fsync (what lands in the page cache);
- orbax: a plain script calls ``ocp.AsyncCheckpointer(PyTreeCheckpointHandler)``
  save, ``wait_until_finished``, restore, as a user would without tpupod;
- tpupod: ``tpupod bench checkpoint`` on a 1-worker local pod (Orbax's
  generator's own test_fn, plus tpupod's launch, check and report).

Orbax options for both: OCDBT on, compression off (random floats do not
compress; zstd would measure the CPU), async save. Restores read what was just
written (the page cache), as Orbax's harness does: it restores right after it saves.

    .venv/bin/python benchmarks/checkpoint.py --generators --mb 64 --repeats 3

times every Orbax generator tpupod runs, on a 2-worker local pod of 2 devices each
(one array of ``--mb`` MiB sharded data x model), beside PyTreeCheckpointBenchmark on
the same tree in the same run (the anchor): the slowest host's test_fn seconds, median
over repeats, and the ratio to the anchor.
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
from pathlib import Path

import yaml
from common import TPUPOD

ARRAY_SHAPE = (8192, 8192)  # float32: 256 MiB
ARRAY_BYTES = 8192 * 8192 * 4

RAW = """
import os, sys, time, json, numpy as np
folder, n, sync = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "fsync"
rngs = [np.random.default_rng(i) for i in range(n)]
arrays = [r.standard_normal((8192, 8192), dtype=np.float32) for r in rngs]
t = time.perf_counter()
for i, a in enumerate(arrays):
    with open(f"{folder}/a{i}", "wb") as f:
        f.write(a.data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
save = time.perf_counter() - t
del arrays
t = time.perf_counter()
back = [np.fromfile(f"{folder}/a{i}", dtype=np.float32) for i in range(n)]
restore = time.perf_counter() - t
print(json.dumps({"save": save, "restore": restore}))
"""

ORBAX = """
import sys, time, json, jax, numpy as np
import orbax.checkpoint as ocp
folder, n = sys.argv[1], int(sys.argv[2])
tree = {f"a{i}": jax.numpy.asarray(np.random.default_rng(i).standard_normal((8192, 8192),
        dtype=np.float32)) for i in range(n)}
jax.block_until_ready(tree)
handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_compression=False)
ckptr = ocp.AsyncCheckpointer(handler)
t = time.perf_counter()
ckptr.save(f"{folder}/pytree", args=ocp.args.PyTreeSave(tree))
blocking = time.perf_counter() - t
ckptr.wait_until_finished()
save = time.perf_counter() - t
restore_args = ocp.checkpoint_utils.construct_restore_args(tree)
item = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
jax.tree.map(lambda a: a.delete(), tree)  # as Orbax's harness does: restore into free memory
args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
t = time.perf_counter()
back = ckptr.restore(f"{folder}/pytree", args=args)
jax.block_until_ready(back)
restore = time.perf_counter() - t
ckptr.close()
print(json.dumps({"save": save, "blocking": blocking, "restore": restore}))
"""


def config(n: int) -> dict[str, object]:
    spec = {f"a{i}": {"dtype": "float32", "shape": list(ARRAY_SHAPE)} for i in range(n)}
    return {
        "suite_name": "checkpoint benchmark vs raw",
        "num_repeats": 1,
        "checkpoint_config": {"spec": spec},
        "benchmarks": [
            {
                "generator": "pytree",
                "options": {"use_ocdbt": True, "use_compression": False, "async_enabled": True},
            }
        ],
    }


def run_script(script: str, folder: Path, n: int, *extra: str) -> dict[str, float]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", script, str(folder), str(n), *extra],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def run_tpupod(work: Path, n: int, env: dict[str, str]) -> dict[str, float]:
    cfg = work / "bench.yaml"
    cfg.write_text(yaml.safe_dump(config(n)))
    out = work / "results"
    subprocess.run(
        [TPUPOD, "bench", "checkpoint", "--pod", "ckpt", "-c", str(cfg), "-o", str(out), "-q",
         "--checkpoint-dir", str(work / "ckpt")],
        check=True, env=env, capture_output=True, text=True,
    )  # fmt: skip
    (path,) = out.glob("*/*/results.json")
    combo = json.loads(path.read_text())["combinations"][0]
    shutil.rmtree(out)
    (sample,) = combo["samples"]
    assert not sample["problems"], sample["problems"]
    return {
        "save": sample["save_total_s"],
        "blocking": sample["save_blocking_s"],
        "restore": sample["restore_s"],
    }


GENERATOR_STEPS = 3  # saves of the manager, perf, deleter and policy generators


def generators_config(mb: int, repeats: int) -> dict[str, object]:
    """Every generator tpupod runs, on one array of ``mb`` MiB; PyTree first (the anchor)."""
    rows = mb * 1024 * 1024 // 4 // 4096
    policy = {
        "preservation_policies": [{"policy_type": "LatestN", "n": 2}],
        "save_decision_policies": [{"policy_type": "FixedIntervalPolicy", "interval_steps": 1}],
    }
    steps = GENERATOR_STEPS
    return {
        "suite_name": "every generator",
        "num_repeats": repeats,
        "mesh_config": {"mesh_axes": ["data", "model"], "ici_parallelism": {"data": 2, "model": 2}},
        "checkpoint_config": {
            "spec": {
                "array": {"dtype": "float32", "shape": [rows, 4096], "sharding": ["data", "model"]}
            }
        },
        "benchmarks": [
            {"generator": "pytree", "options": {"use_ocdbt": True, "async_enabled": True}},
            {"generator": "CheckpointManagerBenchmark", "options": {"train_steps": steps}},
            {"generator": "CheckpointManagerPerfBenchmark", "options": {"train_steps": steps}},
            {"generator": "DeleterBenchmark", "options": {"train_steps": steps}},
            {"generator": "ArrayHandlerBenchmark", "options": {"use_ocdbt": True}},
            {"generator": "orbax.checkpoint._src.testing.benchmarks.v1.benchmark.Benchmark"},
            {"generator": "V1CheckpointerCancelBenchmark", "options": {"cancel_delay_secs": 0.0}},
            {
                "generator": "CheckpointPolicyBenchmark",
                "options": {"num_checkpoints": steps, "checkpoint_policies_options": [policy]},
            },
        ],
    }


def run_generators(args: argparse.Namespace) -> None:
    base = Path(tempfile.mkdtemp(prefix="tpupod-ckpt-gens-", dir=args.dir))
    env = {**os.environ, "TPUPOD_HOME": str(base / "state")}
    up = [TPUPOD, "up", "--name", "gens", "--local", "2", "--devices-per-worker", "2"]
    subprocess.run(up, check=True, env=env, capture_output=True)
    cfg = base / "gens.yaml"
    cfg.write_text(yaml.safe_dump(generators_config(args.mb, args.repeats)))
    try:
        subprocess.run(
            [TPUPOD, "bench", "checkpoint", "--pod", "gens", "-c", str(cfg), "-o",
             str(base / "out"), "-q", "--checkpoint-dir", str(base / "ckpt")],
            check=True, env=env, capture_output=True, text=True,
        )  # fmt: skip
        (path,) = (base / "out").glob("*/*/results.json")
        results = json.loads(path.read_text())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(
        f"one float32 array of {args.mb} MiB, data=2 x model=2 over 2 workers x 2 devices, "
        f"{args.repeats} repeats; {GENERATOR_STEPS} steps where a generator saves per step"
    )
    print("| generator | test_fn s (slowest host, median) | vs PyTree | slowest ops (mean s) |")
    print("| --- | ---: | ---: | --- |")
    anchor = None
    for combo in results["combinations"]:
        per_repeat: dict[int, float] = {}
        for sample in combo["samples"]:
            per_repeat[sample["repeat"]] = max(
                per_repeat.get(sample["repeat"], 0.0), sample["seconds"]
            )
        seconds = statistics.median(per_repeat.values())
        anchor = anchor or seconds
        ops = sorted(
            ((k[3:], v["mean"]) for k, v in combo["repeats"].items() if k.startswith("op:")),
            key=lambda kv: -kv[1],
        )[:3]
        shown = ", ".join(f"{k} {v:.3f}" for k, v in ops)
        print(f"| {combo['label']} | {seconds:.3f} | {seconds / anchor:.2f}x | {shown} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="pytree size, GB (256 MiB arrays)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default="/var/tmp", help="where the files go (a real disk)")
    parser.add_argument("--generators", action="store_true", help="time every generator")
    parser.add_argument("--mb", type=int, default=64, help="--generators: the array, MiB")
    parser.add_argument("--repeats", type=int, default=3, help="--generators: repeats")
    args = parser.parse_args()
    if args.generators:
        run_generators(args)
        return
    n = max(1, round(args.gb * 1e9 / ARRAY_BYTES))
    nbytes = n * ARRAY_BYTES
    base = Path(tempfile.mkdtemp(prefix="tpupod-ckpt-bench-", dir=args.dir))
    env = {**os.environ, "TPUPOD_HOME": str(base / "state")}
    subprocess.run(
        [TPUPOD, "up", "--name", "ckpt", "--local", "1"], check=True, env=env, capture_output=True
    )
    times: dict[str, list[dict[str, float]]] = {
        "raw (fsync)": [],
        "raw (no fsync)": [],
        "orbax": [],
        "tpupod": [],
    }
    try:
        for run in range(args.runs):
            for name, done in times.items():
                work = base / f"{name.replace(' ', '_')}-{run}"
                work.mkdir()
                if name == "tpupod":
                    done.append(run_tpupod(work, n, env))
                elif name == "orbax":
                    done.append(run_script(ORBAX, work, n))
                else:
                    done.append(run_script(RAW, work, n, "fsync" if "(fsync)" in name else "-"))
                shutil.rmtree(work)
                print(f"run {run + 1} {name}: {done[-1]}", file=sys.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(times, nbytes, args)


def report(times: dict[str, list[dict[str, float]]], nbytes: int, args: argparse.Namespace) -> None:
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"pytree: {nbytes / 1e9:.2f} GB ({nbytes // ARRAY_BYTES} x 256 MiB float32), "
          f"{args.runs} runs interleaved, files in {args.dir}")  # fmt: skip
    raw = {op: statistics.median(t[op] for t in times["raw (fsync)"]) for op in ("save", "restore")}
    print("| contender | save GB/s | restore GB/s | save vs raw | restore vs raw |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, runs in times.items():
        save = statistics.median(t["save"] for t in runs)
        restore = statistics.median(t["restore"] for t in runs)
        print(
            f"| {name} | {nbytes / 1e9 / save:.2f} | {nbytes / 1e9 / restore:.2f} "
            f"| {raw['save'] / save:.0%} | {raw['restore'] / restore:.0%} |"
        )
    for name in ("orbax", "tpupod"):
        blocking = statistics.median(t["blocking"] for t in times[name])
        print(f"{name}: save blocking (until save() returns) median {blocking:.3f} s")
    print(json.dumps(times))


if __name__ == "__main__":
    main()
