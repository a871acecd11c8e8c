"""A TPU worker's HBM and duty cycle on the dashboard, read from libtpu's runtime metrics
service as tpu-info reads it (gRPC, local credentials), against a stand-in that speaks the
same protocol (tests/fakes/libtpu_metrics.py): no TPU here."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.dashboard_server import Dashboard, dashboard_fixture  # noqa: F401 (a fixture)
from tests.fakes.libtpu_metrics import LibtpuMetrics
from tpupod.dashboard import libtpu
from tpupod.pod.record import Pod

GIB = 2**30


def standin() -> LibtpuMetrics:
    return LibtpuMetrics(
        used={0: 3 * GIB, 1: 1 * GIB},
        total={0: 16 * GIB, 1: 16 * GIB},
        duty={0: 87.5, 1: 12.5},
    )


def test_the_metrics_are_read_as_tpu_info_reads_them() -> None:
    metrics = standin()
    server, port = metrics.serve()
    try:
        chips = libtpu.read(f"127.0.0.1:{port}")
    finally:
        server.stop(0)
    assert chips == [
        libtpu.Chip(0, 3 * GIB, 16 * GIB, 87.5),
        libtpu.Chip(1, 1 * GIB, 16 * GIB, 12.5),
    ]
    assert metrics.asked == [libtpu.USAGE, libtpu.TOTAL, libtpu.DUTY]
    assert libtpu.summary(libtpu.lines(chips)) == "HBM 4.0/32.0 GiB, duty 50 % (2 dev)"


def test_nothing_serving_the_metrics_is_idle() -> None:
    server, port = LibtpuMetrics().serve()
    server.stop(0)  # the port is free now: no program holds the chips
    assert libtpu.read(f"127.0.0.1:{port}") is None
    assert libtpu.summary(libtpu.lines(None)) == "idle"
    assert libtpu.summary(["load 0.1", "cores 2"]) is None  # no TPU devices: no tpu lines


def accelerators(board: Dashboard, pod: str) -> set[str]:
    found = board.get(f"/api/pods/{pod}").json()["data"]
    return {w["accelerator"] for w in found["workers"]} if found else set()


def wait_for(board: Dashboard, pod: str, wanted: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while (seen := accelerators(board, pod)) != {wanted}:
        assert time.monotonic() < deadline, f"the pod page shows {seen}, not {wanted!r}"
        time.sleep(0.2)


def test_a_tpu_worker_shows_hbm_and_duty_cycle_while_a_program_holds_the_chips(
    dashboard: Callable[..., Dashboard],
    make_pod: Callable[..., Pod],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real workers of a local pod run the probe; their "TPU device" is a file named by
    TPUPOD_ACCELERATOR_DEVICES, and libtpu's address points at the stand-in."""
    pod = make_pod(2)
    metrics = standin()
    server, port = metrics.serve()
    device = tmp_path / "accel0"
    device.touch()
    monkeypatch.setenv("TPUPOD_ACCELERATOR_DEVICES", str(tmp_path / "accel*"))
    monkeypatch.setenv("TPUPOD_LIBTPU_METRICS", f"127.0.0.1:{port}")
    board = dashboard(interval=1.0)
    try:
        wait_for(board, pod.name, "HBM 4.0/32.0 GiB, duty 50 % (2 dev)")
        assert set(metrics.asked) == {libtpu.USAGE, libtpu.TOTAL, libtpu.DUTY}
        page = board.get(f"/pods/{pod.name}").text
        assert "HBM 4.0/32.0 GiB, duty 50 % (2 dev)" in page
    finally:
        server.stop(0)
    wait_for(board, pod.name, "idle")  # the program let go of the chips
    device.unlink()
    wait_for(board, pod.name, "no TPU")


def test_a_host_without_grpcio_says_so_as_a_state_not_an_error() -> None:
    """The probe's Python on a TPU host that lacks grpcio (the ``tpu`` extra): one line the
    pod page shows as a state with the install hint, exit 0, no traceback."""
    hidden = "import sys; sys.modules['grpc'] = None; from tpupod.dashboard.libtpu import main; "
    done = subprocess.run(
        [sys.executable, "-c", hidden + "sys.exit(main(['127.0.0.1:1']))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "tpu missing grpcio\n", "")
    shown = libtpu.summary(["load 0.1", *done.stdout.splitlines()])
    assert shown == "no TPU metrics (grpcio missing: pip install 'tpupod[tpu]')"
