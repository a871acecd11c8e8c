"""`--baseline` calls a regression only beyond the repeats' noise (issue 36, fault 1): a
metric's median must be worse than the baseline's by more than the threshold and the noise
band of the ratio (the Mann-Whitney test's interval) must lie wholly on the worse side; with
too few repeats for a band the change is inconclusive. Old results files stay baselines."""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import mannwhitneyu

from tests.test_bench_checkpoint_faults import small
from tpupod.bench import baseline
from tpupod.bench.config import parse_config
from tpupod.bench.results import (
    Band,
    CombinationResult,
    RepeatStats,
    Results,
    Status,
    noise_band,
    pod_value,
    repeats_needed,
)

FIXTURES = Path(__file__).parent / "fixtures" / "bench"
# Two runs of SMALL (2 workers x 2 devices, 2 repeats) one after the other, written by the
# code before this change (results schema 1): the old 10 % rule found 3 regressions here.
IDENTICAL = (FIXTURES / "identical-run-1.json", FIXTURES / "identical-run-2.json")

pytestmark = pytest.mark.unit


def one_metric(values: dict[str, list[float]], config: dict[str, Any] | None = None) -> Results:
    """Results of a config, one combination, each metric's repeats as given."""
    plan = parse_config(config or small(benchmarks__0__options={"use_zarr3": True}))
    (combo,) = plan.combinations
    result = CombinationResult(
        index=0, label=combo.label, generator=combo.generator, options=combo.options,
        swept=combo.swept, mesh=combo.mesh, checkpoint=combo.checkpoint, status=Status.OK,
        repeats={metric: RepeatStats.of(v) for metric, v in values.items()},
    )  # fmt: skip
    return Results(
        suite_name=plan.suite_name, launch_id="x", started="", seconds=1.0, commit="c",
        pod="p", workers=2, machine={}, versions={}, config=plan.raw, combinations=[result],
    )  # fmt: skip


def verdicts(before: dict[str, list[float]], now: dict[str, list[float]]) -> dict[str, str]:
    comparison = baseline.compare(one_metric(now), one_metric(before), "b.json")
    return {c.metric: c.verdict.value for c in comparison.changes}


# -- the decision --------------------------------------------------------------------------


def test_identical_runs_recorded_before_are_no_regression() -> None:
    first, second = (baseline.load(str(path)) for path in IDENTICAL)
    comparison = baseline.compare(second, first, str(IDENTICAL[0]))
    assert comparison.regressions == []
    # the medians differ by more than 10 % (what the old rule flagged), but 2 + 2 repeats
    # cannot tell that from noise: inconclusive, never a regression
    assert {c.metric for c in comparison.inconclusive} >= {"restore_s", "restore_gbps"}
    assert all(c.band is None for c in comparison.changes)


def test_a_change_inside_the_repeats_spread_is_noise() -> None:
    before = [0.8, 1.0, 1.3, 0.9, 1.2]  # median 1.0
    now = [1.3, 0.9, 1.4, 1.15, 1.2]  # median 1.2: 20 % slower, but inside the spread
    assert verdicts({"save_total_s": before}, {"save_total_s": now}) == {
        "save_total_s": "ok, within noise"
    }


def test_a_change_beyond_the_spread_and_the_threshold_regresses() -> None:
    before = {
        "save_total_s": [1.0, 1.01, 0.99, 1.0, 1.02],
        "save_gbps": [2.0, 1.98, 2.02, 2.0, 1.96],
    }
    now = {"save_total_s": [2.0, 2.1, 1.95, 2.05, 2.0], "save_gbps": [1.0, 0.95, 1.02, 0.98, 1.0]}
    comparison = baseline.compare(one_metric(now), one_metric(before), "b.json")
    assert [(c.metric, c.verdict.value) for c in comparison.changes] == [
        ("save_total_s", "REGRESSION"),
        ("save_gbps", "REGRESSION"),  # fewer GB/s is worse
    ]
    total = comparison.changes[0]
    assert (total.baseline, total.current, total.ratio) == (1.0, 2.0, 2.0)
    # 5 + 5 repeats, one test at 5 %: P(U >= 21) = 12/252, so the band leaves out the 4
    # lowest and the 4 highest of the 25 ratios
    ratios = sorted(b / a for a in before["save_total_s"] for b in now["save_total_s"])
    assert total.band == Band(low=ratios[4], high=ratios[20])
    assert total.band.low > 1.8
    assert comparison.tests == 1  # a GB/s is its time's repeats upside down: one test


def test_a_real_change_under_the_threshold_is_ok_and_a_large_gain_is_named() -> None:
    before = {
        "restore_s": [1.0, 1.01, 0.99, 1.0, 1.0],
        "save_total_s": [2.0, 2.02, 1.99, 2.0, 2.01],
    }
    now = {"restore_s": [1.05, 1.06, 1.04, 1.05, 1.05], "save_total_s": [1.0, 1.01, 0.99, 1.0, 1.0]}
    assert verdicts(before, now) == {"save_total_s": "improved", "restore_s": "ok"}


def test_too_few_repeats_are_inconclusive_not_a_regression() -> None:
    # ten times slower, but 2 + 2 repeats: the most extreme ordering has a chance of 1 in 6
    assert verdicts({"save_total_s": [1.0, 1.01]}, {"save_total_s": [10.0, 10.1]}) == {
        "save_total_s": "inconclusive"
    }


def test_the_test_is_split_among_the_metrics_compared() -> None:
    # 3 + 3 repeats, ranges apart: decisive for one metric (1 in 20 = 5 %), not for two
    before, now = [1.0, 1.01, 0.99], [2.0, 2.02, 1.98]
    assert verdicts({"restore_s": before}, {"restore_s": now}) == {"restore_s": "REGRESSION"}
    both = verdicts(
        {"restore_s": before, "save_total_s": before}, {"restore_s": now, "save_total_s": now}
    )
    assert both == {"restore_s": "inconclusive", "save_total_s": "inconclusive"}


# -- the band ------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "m"), [(3, 3), (2, 9), (4, 6), (5, 5), (8, 8), (12, 10)])
def test_the_band_agrees_with_scipy_s_exact_mann_whitney_test(n: int, m: int) -> None:
    rng = random.Random(n * 100 + m)
    for _ in range(100):
        before = [rng.lognormvariate(0, 0.2) for _ in range(n)]
        now = [rng.choice([0.8, 1.0, 1.3]) * rng.lognormvariate(0, 0.2) for _ in range(m)]
        band = noise_band(before, now, 0.05)
        assert band is not None
        slower = mannwhitneyu(now, before, alternative="greater", method="exact").pvalue
        faster = mannwhitneyu(now, before, alternative="less", method="exact").pvalue
        assert (band.low > 1) == (slower <= 0.05)
        assert (band.high < 1) == (faster <= 0.05)


def test_the_band_of_three_and_three_is_the_ranges_ratio() -> None:
    before, now = [1.0, 1.1, 1.05], [5.0, 5.2, 5.1]
    assert noise_band(before, now, 0.05) == Band(low=5.0 / 1.1, high=5.2 / 1.0)
    assert noise_band(before[:2], now[:2], 0.05) is None  # 1 in 6
    assert repeats_needed(0.05) == 3
    assert repeats_needed(0.05 / 6) == 5  # SMALL: 2 combinations x 3 timed metrics


# -- old results files -----------------------------------------------------------------------


def test_a_results_file_of_schema_1_is_a_baseline_of_its_samples() -> None:
    old = baseline.load(str(IDENTICAL[0]))
    assert old.schema_version == 1
    combo = old.combinations[0]
    assert combo.repeats["save_total_s"].values == []  # schema 1 kept mean and std only
    # the values come from the samples: each repeat's slowest host
    by_repeat = [[s for s in combo.samples if s.repeat == r] for r in (0, 1)]
    expected = [pod_value(group, "save_total_s") for group in by_repeat]
    assert combo.values("save_total_s") == expected
    assert statistics.fmean(expected) == pytest.approx(combo.repeats["save_total_s"].mean)

    # a run written now (its values kept), against the old file: the same comparison
    now = baseline.load(str(IDENTICAL[1]))
    for c in now.combinations:
        c.aggregate()
    assert now.combinations[0].repeats["save_total_s"].values
    fresh = baseline.compare(now, old, "old.json")
    again = baseline.compare(baseline.load(str(IDENTICAL[1])), old, "old.json")
    assert [(c.metric, c.before, c.now, c.verdict) for c in fresh.changes] == [
        (c.metric, c.before, c.now, c.verdict) for c in again.changes
    ]
    assert len(fresh.changes) == 10 and fresh.skipped == []
