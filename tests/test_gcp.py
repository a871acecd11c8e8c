"""The Cloud TPU provider: requests, and (against a local stand-in of the API) the lifecycle."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.conftest import CliResult


def dry_run_body(out: str) -> dict[str, object]:
    body: dict[str, object] = json.loads(out[out.index("{") :])
    return body


@pytest.mark.parametrize(
    ("tpu_type", "workers", "runtime"),
    [("v4-16", 2, "tpu-ubuntu2204-base"), ("v5litepod-64", 16, "v2-alpha-tpuv5-lite")],
)
def test_dry_run_shows_the_request_and_the_workers(
    tpu_type: str, workers: int, runtime: str, cli: Callable[..., CliResult]
) -> None:
    result = cli(
        "up",
        "--name",
        "dry",
        "--gcp",
        "--tpu-type",
        tpu_type,
        "--zone",
        "us-central2-b",
        "--project",
        "my-proj",
        "--dry-run",
        env={"GOOGLE_APPLICATION_CREDENTIALS": "/nonexistent"},
    )
    assert result.code == 0, result.err
    assert f"{workers} workers" in result.out
    assert "API: Cloud TPU v2, TPU VM (nodes)" in result.out
    assert (
        "POST https://tpu.googleapis.com/v2/projects/my-proj/locations/us-central2-b/nodes?nodeId=dry"
        in result.out
    )
    body = dry_run_body(result.out)
    assert body["acceleratorType"] == tpu_type and body["runtimeVersion"] == runtime
    assert "ssh-keys" in body["metadata"]  # type: ignore[operator]
    assert cli("list").out == ""  # nothing was created


def test_multislice_and_spot_go_through_queued_resources(cli: Callable[..., CliResult]) -> None:
    result = cli(
        "up",
        "--name",
        "ms",
        "--tpu-type",
        "v6e-16",
        "--zone",
        "europe-west4-a",
        "--project",
        "p",
        "--node-count",
        "2",
        "--capacity",
        "spot",
        "--dry-run",
    )
    assert result.code == 0, result.err
    assert "8 workers" in result.out and "API: Cloud TPU v2, Queued Resources" in result.out
    body = dry_run_body(result.out)
    spec = body["tpu"]["nodeSpec"][0]  # type: ignore[index]
    assert spec["multisliceParams"] == {"nodeCount": 2, "nodeIdPrefix": "ms"}
    assert body["spot"] == {}


def test_best_effort_uses_v2alpha1(cli: Callable[..., CliResult]) -> None:
    result = cli(
        "up",
        "--name",
        "be",
        "--tpu-type",
        "v5litepod-8",
        "--zone",
        "us-west4-a",
        "--capacity",
        "best-effort",
        "--dry-run",
    )
    assert "API: Cloud TPU v2alpha1, Queued Resources" in result.out
    assert "/v2alpha1/projects/" in result.out


def test_a_wrong_type_names_the_right_one(cli: Callable[..., CliResult]) -> None:
    result = cli("up", "--name", "x", "--tpu-type", "v5e-256", "--zone", "us-west4-a", "--dry-run")
    assert result.code == 2
    assert "the API calls it v5litepod-256" in result.err
