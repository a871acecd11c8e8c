"""``cli_in_process`` (tests/conftest.py) stands in for ``cli`` in checks of what a command
prints or refuses: here both run the same lines and must agree, exit code, stdout and
stderr, so a test that moved to it still checks what a user sees."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult
from tpupod.pod.record import Pod

LINES = [
    # a dry run's request, printed
    ("up", "--name", "d", "--tpu-type", "v5litepod-16", "--zone", "us-west4-a", "--dry-run"),
    # a usage error (click's) and a tpupod error (error: + hint:)
    ("up", "--name", "d", "--local", "x"),
    ("up", "--name", "d", "--tpu-type", "v5e-256", "--zone", "us-west4-a", "--dry-run"),
    ("status", "--pod", "nope"),
    ("list",),
]


@pytest.mark.parametrize("line", LINES, ids=lambda line: " ".join(line[:3]))
def test_in_process_and_a_process_print_the_same(
    line: tuple[str, ...],
    cli: Callable[..., CliResult],
    cli_in_process: Callable[..., CliResult],
    state_home: Path,
) -> None:
    real, here = cli(*line), cli_in_process(*line)
    assert (here.code, here.out, here.err) == (real.code, real.out, real.err)


def test_a_fast_path_is_refused(cli_in_process: Callable[..., CliResult]) -> None:
    # `exec`, `run` and `jobs submit` start in tpupod.cli.entry's fast paths, not the typer app
    with pytest.raises(AssertionError, match="fast path"):
        cli_in_process("exec", "--", "true")


def test_logs_in_process_print_where_the_caller_reads(
    make_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    cli_in_process: Callable[..., CliResult],
) -> None:
    # logview once took sys.stdout as a default argument, fixed at import: in process its
    # lines went to a stream the runner had already closed ("I/O operation on closed file")
    pod = make_pod(2)
    assert cli("run", "--pod", pod.name, "--", "echo hello from $TPUPOD_WORKER_ID").code == 0
    for line in (("logs", "--pod", pod.name), ("logs", "--pod", pod.name, "--list")):
        cli_in_process(*line)  # a first call, as the test that found it made
        real, here = cli(*line), cli_in_process(*line)
        assert (here.code, here.out, here.err) == (real.code, real.out, real.err)
        assert "hello from" in here.out
