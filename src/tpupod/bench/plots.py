"""One PNG per benchmark (generator): save and restore GB/s of every combination, or, for a
generator that does not save and restore the tree (a cancel or policy benchmark), the
seconds of each operation Orbax timed.

Bars are the pod's mean over repeats with the std as error bars; dots are each
host's mean, so a slow host shows. matplotlib's Agg backend: no display needed.

Deferred imports: matplotlib (the checkpoint-bench extra) is imported where a plot is drawn,
so the rest of the launcher imports without it.
"""

from __future__ import annotations

import io

from tpupod.base import storage
from tpupod.bench.results import OP, CombinationResult, Results

OPS = (("save_gbps", "save"), ("restore_gbps", "restore"))


def write_plots(results: Results, folder: str) -> list[str]:
    """Write the PNGs into ``folder`` (a local folder or a gs:// URL); their locations."""
    by_generator: dict[str, list[CombinationResult]] = {}
    for combo in results.combinations:
        if combo.repeats:
            by_generator.setdefault(combo.generator.rpartition(".")[2], []).append(combo)
    return [_plot(name, combos, results, folder) for name, combos in by_generator.items()]


def _plot(name: str, combos: list[CombinationResult], results: Results, folder: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(combos) + 2), 4.5))
    ops = [(m, o) for m, o in OPS if all(m in c.repeats for c in combos)]
    unit = "GB/s"
    if not ops:  # no save and restore of the tree: Orbax's timed operations (shared by all)
        shared = set.intersection(*(set(c.repeats) for c in combos))
        ops = [(m, m[len(OP) :]) for m in sorted(shared) if m.startswith(OP)][:6]
        unit = "s"
    width = 0.8 / max(len(ops), 1)
    for k, (metric, op) in enumerate(ops):
        xs = [i + (k - (len(ops) - 1) / 2) * width for i in range(len(combos))]
        means = [c.repeats[metric].mean for c in combos]
        stds = [c.repeats[metric].std for c in combos]
        ax.bar(xs, means, width, yerr=stds, capsize=3, label=f"{op} (pod, mean of repeats)")
        for x, combo in zip(xs, combos, strict=True):
            hosts = _host_means(combo, metric)
            ax.plot([x] * len(hosts), hosts, "k.", markersize=4)
    ax.set_xticks(range(len(combos)))
    ax.set_xticklabels([_short(c) for c in combos], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(
        f"{results.suite_name}: {name}\n{results.workers} workers, commit {results.commit[:12]}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    location = storage.join(folder, f"{name}.png")
    storage.write(location, png.getvalue())
    return location


def _host_means(combo: CombinationResult, metric: str) -> list[float]:
    per: dict[int, list[float]] = {}
    for s in combo.samples:
        value = s.value(metric)
        if value is not None:
            per.setdefault(s.worker, []).append(value)
    return [sum(v) / len(v) for v in per.values()]


def _short(combo: CombinationResult) -> str:
    parts = combo.label.split(" ")[1:]
    return "\n".join(parts) or f"#{combo.index}"
