"""``tpupod bench checkpoint``: Orbax's checkpoint benchmarks on every worker, one report."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tpupod.cli.app import app, command
from tpupod.cli.flow.live import run_live
from tpupod.cli.options import PodOption, QuietOption, TimeoutOption
from tpupod.errors import BenchError
from tpupod.fanout.context import Sinks
from tpupod.fanout.report import print_summary
from tpupod.pod.spec import LocalPodSpec
from tpupod.pod.state import StateDir

if TYPE_CHECKING:
    from tpupod.bench.baseline import Change, Comparison
    from tpupod.bench.launcher import BenchRun
    from tpupod.bench.results import CombinationResult, RepeatStats, Results

PIPED_WIDTH = 100  # columns of the table where stdout is a pipe or a file
COLUMNS = (
    "save s\nblocking",
    "save s\ntotal",
    "restore\ns",
    "save\nGB/s",
    "restore\nGB/s",
    "RSS MB\nsave/\nrestore",
)

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks that run on every worker of a pod.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(bench_app, name="bench")


@command("checkpoint", group=bench_app, needs=("checkpoint-bench",))
def checkpoint(
    config: Annotated[
        Path,
        typer.Option(
            "--config",
            "-c",
            metavar="FILE.yaml",
            help="The suite, in Orbax's benchmark YAML format.",
            show_default=False,
        ),
    ],
    pod: PodOption = None,
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            metavar="DIR|gs://...",
            help="Results go to DIR/<suite>/<launch id>/ (results.json and a PNG per benchmark).",
        ),
    ] = "bench-results",
    baseline: Annotated[
        str | None,
        typer.Option(
            "--baseline",
            metavar="FILE|latest",
            help="Compare with an earlier results.json, or this suite's latest in --output.",
            show_default=False,
        ),
    ] = None,
    threshold: Annotated[
        float,
        typer.Option(
            "--threshold",
            min=0.0,
            help="The smallest change called: a metric regresses when its median is worse than "
            "the baseline's by more than this and the repeats tell it from noise.",
        ),
    ] = 0.10,
    ramfs_dir: Annotated[
        str | None,
        typer.Option(
            "--ramfs-dir",
            metavar="DIR",
            help="Write checkpoints to a memory-backed folder (such as /dev/shm).",
            show_default=False,
        ),
    ] = None,
    checkpoint_dir: Annotated[
        str | None,
        typer.Option(
            "--checkpoint-dir",
            metavar="DIR",
            help="Where workers write checkpoints: a folder every worker shares, or a gs:// "
            "URL (default: under --output on a local pod, ~/tpupod-bench/checkpoints on hosts).",
            show_default=False,
        ),
    ] = None,
    worker_python: Annotated[
        str | None,
        typer.Option(
            "--worker-python",
            help="The python with tpupod[checkpoint-bench] on the workers (default: this one on a "
            "local pod, python3 on hosts).",
            show_default=False,
        ),
    ] = None,
    timeout: TimeoutOption = None,
    quiet: QuietOption = False,
) -> None:
    """Save and restore a pytree with Orbax on every worker in lockstep; aggregate, plot, compare.

    Every combination of the config's swept options runs num_repeats times on
    all workers at once (Orbax's own benchmark code, through 'tpupod run');
    each worker checks that what it restored equals what it saved, sharding
    included. Worker 0 aggregates across hosts and repeats; the launcher
    writes results.json and plots, prints a table, and with --baseline
    compares every metric's median over the repeats: a regression (exit 1)
    is worse by more than --threshold and beyond the noise the two runs'
    repeats measure (Mann-Whitney); with too few repeats to tell, a change
    is called inconclusive. Only like is compared with like (generator,
    options, mesh, arrays, workers); what differs is named, and a
    comparison of nothing fails.

    Examples:

      tpupod bench checkpoint --config bench.yaml

      tpupod bench checkpoint -c bench.yaml --baseline latest --threshold 0.2

      tpupod bench checkpoint -c bench.yaml --ramfs-dir /dev/shm/ckpt

      tpupod bench checkpoint -c bench.yaml --checkpoint-dir gs://bucket/ckpt -o gs://bucket/runs
    """
    from tpupod.base import storage
    from tpupod.bench import baseline as baselines
    from tpupod.bench.config import check_fits, load_config
    from tpupod.bench.launcher import checkpoint_dir as where
    from tpupod.bench.launcher import raise_for_failures, run_bench

    suite = load_config(config)  # every problem before anything starts
    earlier = _baseline_path(baseline, output, suite.suite_name)
    target = StateDir().resolve(pod)
    workers = target.select(None)
    if isinstance(target.spec, LocalPodSpec):  # elsewhere the workers check it, before any run
        check_fits(suite, len(workers) * target.spec.devices_per_worker, str(config))
    before = None if earlier is None else baselines.load(earlier)
    if before is not None and earlier is not None:
        baselines.check_like(suite, len(workers), before, earlier)
    python = target.worker_python(worker_python)
    checkpoints = ramfs_dir or where(target, output, checkpoint_dir)
    if storage.is_remote(checkpoints):
        storage.check_writable(checkpoints, "--checkpoint-dir")

    async def body(live: Sinks) -> BenchRun:
        from tpupod.fanout.progress import PodProgress

        view = PodProgress(
            f"bench {suite.suite_name}",
            workers,
            live.on_line,
            tty=False if quiet else None,
        )
        with view:
            return await run_bench(
                target,
                suite,
                str(config),
                output=output,
                checkpoints=checkpoints,
                worker_python=python,
                timeout=timeout,
                sinks=Sinks(view, live.on_notice, live.interrupt),
            )

    done = run_live(workers, quiet, body)
    if done.results is None:
        print_summary(done.run.fanout, sys.stderr, title=f"bench {done.run.launch.launch_id}")
        code = done.run.fanout.exit_code()
        if code:
            raise typer.Exit(code)
        raise BenchError("worker 0 sent no results", hint="see 'tpupod logs -w 0'")
    _print_results(done.results)
    if done.folder is not None:
        print(f"results: {storage.join(done.folder, baselines.RESULTS_FILE)}", file=sys.stderr)
    for plot in done.plots:
        print(f"plot: {plot}", file=sys.stderr)
    raise_for_failures(done.results)
    if before is not None and earlier is not None:
        _check_baseline(baselines.compare(done.results, before, earlier, threshold))


def _baseline_path(baseline: str | None, output: str, suite: str) -> str | None:
    from tpupod.bench import baseline as baselines

    if baseline is None:
        return None
    if baseline == "latest":
        return baselines.latest(output, suite)
    return baseline


def _print_results(results: Results) -> None:
    """The results as a table that fits 100 columns where it is piped (a terminal: its width).

    Where every combination runs one generator, the title names it and the rows name only
    what they sweep; a wide cell wraps within its column. A generator that neither saves
    nor restores the tree (cancel, policy) gets a line below it: its slowest operations.
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    generators = {c.generator.rpartition(".")[2] for c in results.combinations}
    one = generators.pop() if len(generators) == 1 else None
    table = Table(
        title=f"{results.suite_name}: {one + ', ' if one else ''}{results.workers} workers, "
        f"commit {results.commit[:12]}, {results.seconds:.1f}s",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
    )
    table.add_column("combination" if one is None else "options", min_width=16, overflow="fold")
    for column in COLUMNS:
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("status", min_width=8)
    timed: list[str] = []  # what a generator that neither saves nor restores timed
    for c in results.combinations:
        label = c.label if one is None else c.label.partition(" ")[2] or "defaults"
        if not c.repeats:
            table.add_row(label, *[""] * len(COLUMNS), f"{c.status.value}: {c.reason}")
            continue
        r, h = c.repeats, c.hosts
        table.add_row(
            label,
            _cell(r, "save_blocking_s", "{:.3f}"),
            *(_cell(r, m, "{:.3f}±{:.3f}") for m in ("save_total_s", "restore_s")),
            *(_cell(r, m, "{:.3g}") for m in ("save_gbps", "restore_gbps")),
            "/".join(
                f"{h[m].max:.0f}" if m in h else "-" for m in ("rss_save_mb", "rss_restore_mb")
            ),
            c.status.value,
        )
        if "save_total_s" not in r and "restore_s" not in r:
            timed.append(f"{c.label}: {_ops(c)}")
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else PIPED_WIDTH)
    console.print(table)
    for line in _statistic(results):
        print(line)
    for line in timed:  # below the table: a row has no room for them
        print(line)


def _statistic(results: Results) -> list[str]:
    """What the cells are: means (the comparison with a baseline shows medians)."""
    counts = {len(r.values) for c in results.combinations for r in c.repeats.values() if r.values}
    repeats = f"{counts.pop()} repeats" if len(counts) == 1 else "the repeats"
    return [
        f"each cell: the mean (±std) over {repeats} of the pod's value (its slowest host's time);",
        "  --baseline compares medians",
    ]


def _cell(repeats: dict[str, RepeatStats], metric: str, form: str) -> str:
    if metric not in repeats:
        return ""
    return form.format(repeats[metric].mean, repeats[metric].std)


def _ops(combo: CombinationResult) -> str:
    """A generator that neither saves nor restores the tree: its slowest operations."""
    from tpupod.bench.results import OP

    ops = sorted(
        ((m, s.mean) for m, s in combo.repeats.items() if m.startswith(OP)), key=lambda x: -x[1]
    )
    return ", ".join(f"{m[len(OP) :]} {v:.3f}s" for m, v in ops[:3])


def _check_baseline(comparison: Comparison) -> None:
    """Print the comparison; exit 1 on a regression, or where nothing was compared."""
    threshold = f"{comparison.threshold * 100:g}%"
    _print_comparison(comparison, threshold)
    if not comparison.changes:
        label, why = comparison.skipped[0] if comparison.skipped else ("every one", "none ran")
        raise BenchError(
            f"nothing compared with the baseline: {label}: {why}",
            hint="compare with a run of the same config on as many workers",
        )
    worse = comparison.regressions
    if worse:
        first = worse[0]
        raise BenchError(
            f"{len(worse)} regression{'s' if len(worse) > 1 else ''} beyond {threshold} and the "
            f"repeats' noise against commit {comparison.baseline_commit[:12]}: "
            f"{first.label} {_change_line(first, threshold)}",
            hint="the lines above give every metric's medians, ratio and noise band",
        )


def _print_comparison(comparison: Comparison, threshold: str) -> None:
    """Per metric: the two medians, their ratio, the noise band, the verdict, under a header
    that says how it is decided. Every line but the paths' fits 100 columns."""
    from tpupod.bench.results import ALPHA, repeats_needed

    print(
        f"baseline: {comparison.baseline_path} (commit {comparison.baseline_commit[:12]}) "
        f"-> now (commit {comparison.current_commit[:12]})\n"
        "  per metric: medians of the repeats (the table's cells are means), before -> now\n"
        "  (ratio, noise band: the ratios the repeats allow, Mann-Whitney, "
        f"{ALPHA:.0%} over {_tests(comparison)});\n"
        f"  a regression is worse by more than {threshold} and beyond the band"
    )
    for label, changes in itertools.groupby(comparison.changes, key=lambda c: c.label):
        print(f"  {label}")
        for change in changes:
            print(f"    {_change_line(change, threshold)}")
    for label, why in comparison.skipped:
        print(f"  not compared: {label}\n    {why}")
    unsure = comparison.inconclusive
    if unsure:
        print(
            f"note: {len(unsure)} change{'s' if len(unsure) > 1 else ''} beyond {threshold} "
            f"inconclusive: {_repeats(unsure[0])} repeats cannot tell them from noise\n"
            f"  (num_repeats: {repeats_needed(comparison.alpha)} in both runs can)"
        )


def _tests(comparison: Comparison) -> str:
    """How many tests the 5 % is split among, and of how many metrics: a GB/s is its time's
    repeats inverted, tested with it (``baseline._tests``)."""
    tests, metrics = comparison.tests, len(comparison.changes)
    if tests == metrics:
        return f"{tests} metric{'s' if tests > 1 else ''}"
    return f"{tests} tests of\n  the {metrics} metrics below: a GB/s is tested with its time"


def _change_line(change: Change, threshold: str) -> str:
    """``save_total_s: 0.1981 -> 0.3052 (1.54x, noise 1.31x-1.78x): REGRESSION``."""
    from tpupod.bench.baseline import Verdict

    band = change.band
    verdict = change.verdict.value
    if change.verdict == Verdict.SAME:
        verdict = f"ok, within {threshold}"
    noise = (
        f"noise {band.low:.2f}x-{band.high:.2f}x"
        if band is not None
        else f"{_repeats(change)} repeats: no band"
    )
    return (
        f"{change.metric}: {change.baseline:.4g} -> {change.current:.4g} "
        f"({change.ratio:.2f}x, {noise}): {verdict}"
    )


def _repeats(change: Change) -> str:
    return f"{len(change.before)}+{len(change.now)}"
