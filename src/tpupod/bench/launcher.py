"""The launcher's side of ``tpupod bench checkpoint``: plan, ``tpupod run``, results on disk.

The config is checked here, before anything starts. The plan goes to every
worker in the environment, the workers run under ``tpupod run`` (preflight,
rendezvous, supervision, per-worker logs), and worker 0's results come back
as output lines. They are written to ``OUTPUT/<suite>/<launch id>/results.json``
(a local folder or a ``gs://`` URL) with one PNG per benchmark beside them.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tpupod.base import storage
from tpupod.bench.baseline import RESULTS_FILE, suite_dir
from tpupod.bench.config import BenchConfig
from tpupod.bench.plots import write_plots
from tpupod.bench.results import Results
from tpupod.bench.wire import Collector, Plan
from tpupod.errors import BenchError, UsageError
from tpupod.extras import worker_argv
from tpupod.fanout.context import Context, Sinks
from tpupod.fanout.execute import Policy, execute_async
from tpupod.fanout.results import OnFail
from tpupod.launch.records import runs
from tpupod.launch.run import RunResult
from tpupod.launch.run import run as launch_run
from tpupod.pod.record import Pod, Worker
from tpupod.transport import OutputLine

WORKER_MODULE = "tpupod.bench.worker"
# On hosts, checkpoints go here (relative to the home) unless --checkpoint-dir names a shared
# folder: a multi-host Orbax checkpoint is one folder that every host writes its part of.
HOST_CHECKPOINT_DIR = "tpupod-bench/checkpoints"
LOCAL_OUTPUT = "bench-results"
MAX_PLAN_BYTES = 96 * 1024


@dataclass(frozen=True)
class BenchRun:
    run: RunResult
    results: Results | None
    folder: str | None  # where results.json and the plots are (a folder or a gs:// URL)
    plots: list[str]


def checkpoint_dir(pod: Pod, output: str, chosen: str | None) -> str:
    """Where the workers write checkpoints (a launch id is added below it)."""
    if chosen:
        if storage.is_remote(chosen) or not pod.on_this_machine:
            return chosen  # a gs:// URL every worker writes its part to, or a host's folder
        return str(Path(chosen).expanduser().resolve())
    if not pod.on_this_machine:
        return HOST_CHECKPOINT_DIR
    # results may go to gs://; a local pod's checkpoints stay on this machine
    return str(Path(LOCAL_OUTPUT if storage.is_remote(output) else output, "checkpoints").resolve())


def commit() -> str:
    """The commit of the code being benchmarked (this repository's HEAD, '+dirty' if changed)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+dirty" if dirty else head


async def run_bench(
    pod: Pod,
    config: BenchConfig,
    source: str,
    *,
    output: str,
    checkpoints: str,
    worker_python: str,
    workers: list[Worker] | None = None,
    timeout: float | None = None,
    sinks: Sinks | None = None,
) -> BenchRun:
    plan = Plan(
        config=config.raw,
        source=os.path.basename(source),
        checkpoint_dir=checkpoints,
        commit=commit(),
        pod=pod.name,
    )
    text = plan.model_dump_json()
    # One environment string, and over SSH the whole command script, may hold 128 KiB
    # (MAX_ARG_STRLEN): leave room for the rest of the script.
    if len(text) > MAX_PLAN_BYTES:
        raise UsageError(
            f"{source}: the config is {len(text) // 1024} KiB as sent to the workers, "
            f"more than the {MAX_PLAN_BYTES // 1024} KiB a worker's environment takes",
            hint="describe the arrays more compactly, or split the suite into several configs",
        )
    collector = Collector()
    given = sinks or Sinks()
    shown = given.on_line

    def take(worker: Worker, line: OutputLine) -> None:
        if collector.feed(line.text) or shown is None:
            return
        shown(worker, line)

    await remove_scratch(pod, checkpoints, _ended_launches(pod))  # what a killed run left
    try:
        async with Context(pod, Sinks(take, given.on_notice, given.interrupt)) as ctx:
            result = await launch_run(
                ctx,
                shlex.join(worker_argv(worker_python, "checkpoint-bench", WORKER_MODULE)),
                workers=workers,
                env={"TPUPOD_BENCH_PLAN": text},
                policy=Policy(OnFail.KILL, timeout),
            )
    finally:  # stopped, failed or done: this launch's checkpoints are scratch
        await remove_scratch(pod, checkpoints, _ended_launches(pod))
    results = collector.results()
    if results is None or not any(c.samples for c in results.combinations):
        # nothing measured is no result: a later --baseline latest must not compare with it
        return BenchRun(result, results, None, [])
    folder = storage.join(suite_dir(output, results.suite_name), results.launch_id)
    storage.write(storage.join(folder, RESULTS_FILE), results.model_dump_json(indent=1) + "\n")
    return BenchRun(result, results, folder, write_plots(results, folder))


def _ended_launches(pod: Pod) -> list[str]:
    """This pod's benchmark launches that are over (ended, or their launcher is gone):
    their scratch checkpoints, where left, are nobody's."""
    return [
        r.launch_id
        for r in runs(pod.name)
        if WORKER_MODULE in r.command and (r.done or r.launcher_gone())
    ]


async def remove_scratch(pod: Pod, checkpoints: str, launches: list[str]) -> None:
    """Remove ``checkpoints/LAUNCH`` of each launch: here (a local pod, a gs:// URL) or on
    every worker (a host's folder). The workers remove their own when a run ends well; a
    run that was stopped or killed leaves them, gigabytes with real checkpoints."""
    if not launches:
        return
    if storage.is_remote(checkpoints) or pod.on_this_machine:
        for launch in set(launches) & set(storage.names(checkpoints)):
            storage.remove_tree(storage.join(checkpoints, launch))
        return
    folders = [f"{checkpoints}/{launch}" for launch in launches]
    await execute_async(pod, shlex.join(["rm", "-rf", "--", *folders]), timeout=60)


def raise_for_failures(results: Results) -> None:
    """Restored arrays that differ, or a run where no combination could run at all."""
    if not any(c.samples for c in results.combinations):
        first = results.combinations[0]
        raise BenchError(
            f"no combination ran, no results written: every mesh was skipped ({first.reason})",
            hint="give mesh_config parallelism whose product is the pod's device count",
        )
    problems = results.problems()
    if problems:
        raise BenchError(
            f"restored arrays differ from the saved ones ({len(problems)}): {problems[0]}",
            hint="the results file lists every one; the checkpoint storage lost or changed data",
        )
