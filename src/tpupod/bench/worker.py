"""What ``tpupod bench checkpoint`` runs on every worker: ``python -m tpupod.bench.worker``.

One JAX process per worker (``tpupod.init_jax``). For every combination and
repeat, all workers meet, build the same pytree on the combination's mesh, and
run Orbax's own ``test_fn`` (save, wait, restore, measured by Orbax's metrics);
each worker then checks what it restored against a fresh copy of what it saved.
At the end every worker's samples go to worker 0 through the rendezvous, and
worker 0 aggregates them and prints the results for the launcher (``wire``).
Every worker prints a progress marker before each repeat (its runs done, what
runs now); worker 0 also prints, once per repeat, what it measured.
"""

from __future__ import annotations

import importlib
import os
import platform
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import jax

from tpupod import settings
from tpupod.bench import orbax_harness
from tpupod.bench.config import BenchConfig, Combination, check_fits, mesh_devices, parse_config
from tpupod.bench.results import CombinationResult, Results, Sample, Status
from tpupod.bench.verify import restore_problems
from tpupod.bench.wire import Plan, encode
from tpupod.errors import BenchError, TpupodError
from tpupod.fanout.progress import marker
from tpupod.launch.client import client, rendezvous
from tpupod.launch.identity import WorkerIdentity
from tpupod.launch.jaxinit import init_jax


def main() -> int:
    text = settings.bench_plan()
    if text is None:
        raise BenchError(
            "no benchmark plan in the environment", hint="start it with 'tpupod bench checkpoint'"
        )
    plan = Plan.model_validate_json(text)
    identity = init_jax()
    if identity.launch_id is None:
        raise BenchError("no launch id", hint="start it with 'tpupod bench checkpoint'")
    _quiet_absl()
    config = parse_config(plan.config, plan.source)
    # The launcher checks this where it knows the pod's devices (a local pod); here, everywhere.
    check_fits(config, _device_count(), plan.source)
    root = _folder(plan.checkpoint_dir) / identity.launch_id
    started, started_at = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%S%z")
    runner = _Runner(identity, config, root)
    done = runner.run_all()
    gathered = client().exchange("bench:samples", [c.model_dump(mode="json") for c in done])
    if identity.id == 0:
        _remove(root)
        results = _results(plan, identity, config, gathered, started_at)
        results.seconds = time.monotonic() - started
        for line in encode(results):
            print(line, flush=True)
    return 0


def _quiet_absl() -> None:
    """Orbax logs through absl at INFO and WARNING on every call; keep the output for results."""
    # absl comes with Orbax (the checkpoint-bench extra), which orbax_harness loads on first use
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)


class _Runner:
    def __init__(self, identity: WorkerIdentity, config: BenchConfig, root: Any) -> None:
        self.identity = identity
        self.config = config
        self.root = root
        self.meshes: dict[int | None, Any] = {}
        self.total = 0  # the runs of combinations whose mesh this pod holds (run_all counts)
        self.done = 0

    def run_all(self) -> list[CombinationResult]:
        # A skipped combination is no run: counted, it made a rate of thousands of runs/s.
        runs = [c for c in self.config.combinations if not self._mesh(c.mesh)[1]]
        self.total = len(runs) * self.config.num_repeats
        done = [self.run(combo) for combo in self.config.combinations]
        self._mark("done")
        return done

    def run(self, combo: Combination) -> CombinationResult:
        result = CombinationResult(
            index=combo.index,
            label=combo.label,
            generator=combo.generator,
            options=combo.options,
            swept=combo.swept,
            mesh=combo.mesh,
            checkpoint=combo.checkpoint,
            status=Status.OK,
        )
        mesh, why = self._mesh(combo.mesh)
        if why:  # said once, by worker 0, and not counted as runs
            result.status, result.reason = Status.SKIPPED, why
            self._progress(combo, f": skipped, {why}")
            return result
        for repeat in range(self.config.num_repeats):
            # What runs now, on every worker (worker 0's line names it and says how it went).
            # No label here: the launcher's line of it has to fit 100 columns.
            self._mark(
                f"combination {combo.index + 1}/{len(self.config.combinations)}, "
                f"repeat {repeat + 1}/{self.config.num_repeats}"
            )
            sample = self._sample(combo, mesh, repeat)
            result.samples.append(sample)
            self.done += 1
            self._report(combo, sample)
        return result

    def _mesh(self, index: int | None) -> tuple[Any, str]:
        if index is None:
            return None, ""
        if index not in self.meshes:
            self.meshes[index] = _mesh_or_why(self.config.meshes[index])
        mesh = self.meshes[index]
        return (None, mesh) if isinstance(mesh, str) else (mesh, "")

    def _sample(self, combo: Combination, mesh: Any, repeat: int) -> Sample:
        spec = self.config.checkpoints[combo.checkpoint]
        directory = self.root / f"c{combo.index}" / f"r{repeat}"
        directory.mkdir(parents=True, exist_ok=True)
        # Built asynchronously: finish it first, or save's blocking time would include it.
        pytree = jax.block_until_ready(orbax_harness.make_pytree(spec, mesh))  # type: ignore[no-untyped-call]
        nbytes = sum(x.nbytes for x in jax.tree.leaves(pytree) if isinstance(x, jax.Array))
        rendezvous(f"bench:c{combo.index}:r{repeat}")  # every host starts together
        started = time.perf_counter()
        measured = orbax_harness.measure(
            combo.generator, combo.options, pytree, directory, mesh=mesh, repeat=repeat
        )
        seconds = time.perf_counter() - started
        # Once every host has restored, the checkpoint goes: a sweep of large pytrees would
        # otherwise keep one on disk per combination and repeat.
        rendezvous(f"bench:c{combo.index}:r{repeat}:restored")
        if self.identity.id == 0:
            _remove(directory)
        problems = [measured.failed] if measured.failed else []
        if measured.restored is not None:
            problems = restore_problems(orbax_harness.make_pytree(spec, mesh), measured.restored)
        for tree in (pytree, measured.restored):  # a generator may have deleted either already
            jax.tree.map(_delete, tree)
        sample = _sample_of(
            measured,
            orbax_harness.GENERATORS[combo.generator],
            problems,
            nbytes,
            worker=self.identity.id,
            repeat=repeat,
        )
        sample.seconds = seconds
        return sample

    def _report(self, combo: Combination, sample: Sample) -> None:
        """Worker 0's line of what a repeat measured (the markers carry the rate and ETA)."""
        self._progress(
            combo,
            f" repeat {sample.repeat + 1}/{self.config.num_repeats}: {_figures(sample)}"
            f"{'' if not sample.problems else ' RESTORED VALUES DIFFER'}",
        )

    def _mark(self, doing: str) -> None:
        """Every worker's count, for the launcher's live view (per host done, ETA)."""
        print(marker(self.done, self.total, "runs", doing), flush=True)

    def _progress(self, combo: Combination, tail: str) -> None:
        """Worker 0's line about a combination (the launcher prefixes ``[w0] ``)."""
        if self.identity.id != 0:
            return
        head = f"bench {combo.index + 1}/{len(self.config.combinations)} "
        print(f"{head}{_fit(combo.label, WIDTH - len(head) - len(tail))}{tail}", flush=True)


WIDTH = 95  # worker 0's lines, so that "[w0] " and they fit 100 columns


def _fit(label: str, room: int) -> str:
    """A label cut to ``room`` characters, so its line fits 100 columns: the generator's
    name first (what the label sweeps tells combinations apart), then its end. The table
    and the results file have it whole."""
    if len(label) <= room:
        return label
    name, _, swept = label.partition(" ")
    keep = len(name) - (len(label) - room) - 1
    if swept and keep >= 6:
        return f"{name[:keep]}… {swept}"
    return label[: max(room, 12) - 1] + "…"


def _folder(location: str) -> Any:
    """The checkpoint folder as Orbax takes it (an ``etils.epath.Path``): a local folder, or a
    ``gs://`` URL (Orbax writes arrays there through tensorstore, metadata through epath)."""
    epath = importlib.import_module("etils.epath")  # untyped
    if "://" in location:
        return epath.Path(location)
    return epath.Path(Path(location).expanduser())


def _remove(folder: Any) -> None:
    if "://" in str(folder):
        if folder.exists():
            folder.rmtree()
    else:
        shutil.rmtree(str(folder), ignore_errors=True)


def _figures(sample: Sample) -> str:
    """A sample in a few words: save and restore seconds, else Orbax's slowest operations."""
    shown = [(n, getattr(sample, f"{n}_s")) for n in ("save_total", "restore")]
    parts = [f"{n.split('_')[0]} {v:.3f}s" for n, v in shown if v is not None]
    if not parts:
        slowest = sorted(sample.ops.items(), key=lambda kv: -kv[1])[:3]
        parts = [f"{n} {v:.3f}s" for n, v in slowest]
    return " ".join(parts) or "nothing timed"


def _delete(leaf: Any) -> None:
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
        leaf.delete()


def _sample_of(
    measured: orbax_harness.Measured,
    ops: orbax_harness.Ops,
    problems: list[str],
    nbytes: int,
    *,
    worker: int,
    repeat: int,
) -> Sample:
    """tpupod's figures from the operations Orbax timed: saves (and the waits that complete
    them) and restores, as the generator's entry in ``orbax_harness.GENERATORS`` names them."""
    found = measured.ops

    def total(pattern: str) -> tuple[float | None, int]:
        times = [v for k, v in found.items() if pattern and re.fullmatch(pattern, k)]
        return (sum(times) if times else None), len(times)

    blocking, saves = total(ops.save)
    waited, _ = total(ops.wait)
    restore, restores = total(ops.restore)
    saving = f"{ops.save}|{ops.wait}" if ops.wait else ops.save
    return Sample(
        worker=worker,
        hostname=socket.gethostname(),
        repeat=repeat,
        save_blocking_s=blocking,
        save_total_s=None if blocking is None else blocking + (waited or 0.0),
        restore_s=restore,
        rss_save_mb=None if blocking is None else measured.rss_mb(saving),
        rss_restore_mb=None if restore is None else measured.rss_mb(ops.restore),
        nbytes=nbytes,
        saves=max(saves, 1),
        restores=max(restores, 1),
        ops=found,
        problems=problems,
    )


def _mesh_or_why(mesh: dict[str, Any]) -> Any:
    """The mesh, or why this pod cannot have it (Orbax skips such meshes too)."""
    need = mesh_devices(mesh)
    if need != jax.device_count():
        return f"the mesh has {need} devices, the pod {jax.device_count()}"
    try:
        return orbax_harness.make_mesh(mesh)
    except ValueError as exc:
        return str(exc).splitlines()[0]


def _results(
    plan: Plan,
    identity: WorkerIdentity,
    config: BenchConfig,
    gathered: dict[int, Any],
    started: str,
) -> Results:
    combos = [CombinationResult.model_validate(c) for c in gathered[0]]
    for member, theirs in sorted(gathered.items()):
        if member == 0:
            continue
        for mine, other in zip(combos, theirs, strict=True):
            mine.samples += CombinationResult.model_validate(other).samples
    for combo in combos:
        combo.mismatch_check()
        combo.aggregate()
    return Results(
        suite_name=config.suite_name,
        launch_id=identity.launch_id or "",
        started=started,
        seconds=0.0,
        commit=plan.commit,
        pod=plan.pod,
        workers=identity.count,
        machine=_machine(),
        versions=orbax_harness.versions(),
        config=config.raw,
        combinations=combos,
    )


def _device_count() -> int:
    return int(jax.device_count())


def _machine() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
    }


def run() -> int:
    """``main``, with what a worker cannot do (a checkpoint folder it cannot write) in one line."""
    try:
        return main()
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except TpupodError as exc:
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr, flush=True)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(run())
