"""Fan-out exec on local pods, through the real CLI: streaming, policies, and no orphans."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, require, tpupod_argv, wait_until_gone
from tpupod.pod.record import Pod

PREFIX = re.compile(r"^\[w(\d+)\]\s+(.*)$")
COUNTING = (
    'for i in $(seq 1 40); do echo "$TPUPOD_WORKER_ID:$i"; [ $((i % 10)) = 0 ] && sleep 0.01; done'
)


def lines_by_worker(out: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for line in out.splitlines():
        match = PREFIX.match(line)
        assert match, f"line without a worker prefix: {line!r}"
        found.setdefault(int(match[1]), []).append(match[2])
    return found


@pytest.mark.parametrize("workers", [3, 8])
def test_every_line_arrives_prefixed_and_in_order(
    workers: int, any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(workers)
    result = cli("exec", "--pod", pod.name, "--", COUNTING)
    assert result.code == 0, result.err
    seen = lines_by_worker(result.out)
    assert sorted(seen) == list(range(workers))
    for worker, lines in seen.items():
        assert lines == [f"{worker}:{i}" for i in range(1, 41)]
    assert f"{workers}/{workers} ok" in result.err


def test_stderr_lines_go_to_stderr_with_prefix(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(2)
    result = cli("exec", "--pod", pod.name, "--", "echo out; echo err >&2")
    assert sorted(result.out.splitlines()) == ["[w0] out", "[w1] out"]
    assert "[w0] err" in result.err and "[w1] err" in result.err


BAR = "for i in $(seq 0 12); do printf '\\r%d/12' $i; sleep 0.25; done; echo; echo after"


def test_a_progress_bar_streams_back_as_it_moves(
    any_pod: Callable[..., Pod], state_home: Path
) -> None:
    """A bar drawn with \\r (tqdm, pip, a download) showed nothing until its newline, then
    one line of every state whose \\r's wrote over the worker's label on a terminal. Now
    its state comes as it moves, about once a second, and its end as a line."""
    pod = any_pod(2)
    proc = subprocess.Popen(
        tpupod_argv("exec", "--pod", pod.name, "--", BAR), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    started, arrived = time.monotonic(), []
    with proc.stdout:
        for line in proc.stdout:
            arrived.append((time.monotonic() - started, line.rstrip("\n")))
    assert proc.wait(30) == 0
    assert not [line for _, line in arrived if "\r" in line], arrived
    for worker in range(2):
        mine = [(t, line) for t, line in arrived if line.startswith(f"[w{worker}] ")]
        states = [line.split(" ", 1)[1] for _, line in mine]
        assert states[-2:] == ["12/12", "after"], arrived
        assert 2 <= len(states) - 2 <= 6, arrived  # about one a second over 3 s, not 13
        assert mine[-1][0] - mine[0][0] > 1.5, arrived  # the first state came long before the end


STUCK = "printf '\\r1/3'; sleep 0.3; printf '\\r2/3'; sleep 3; echo; echo after"


@pytest.mark.parametrize("how", ["exec", "run"])
def test_a_bar_that_stops_moving_shows_where_it_stands(
    how: str, any_pod: Callable[..., Pod], state_home: Path
) -> None:
    """A bar that stops (a stuck download) showed the state a second before it stopped
    until its next output came: here 1/3 for 3 s while it stood at 2/3."""
    pod = any_pod(1)
    argv = tpupod_argv(how, "--pod", pod.name, "--", STUCK)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    started, arrived = time.monotonic(), dict[str, float]()
    with proc.stdout:
        for line in proc.stdout:
            arrived.setdefault(line.rstrip("\n"), time.monotonic() - started)
    assert proc.wait(30) == 0
    assert list(arrived)[:3] == ["[w0] 1/3", "[w0] 2/3", "[w0] after"], arrived
    assert arrived["[w0] after"] - arrived["[w0] 2/3"] > 1.2, arrived  # not at the end


def test_exit_codes_aggregate_to_the_first_failure(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(3)
    result = cli(
        "exec",
        "--pod",
        pod.name,
        "--",
        'if [ "$TPUPOD_WORKER_ID" = 2 ]; then exit 5; fi; sleep 0.3',
    )
    assert result.code == 5
    assert "2/3 ok" in result.err
    assert "first failure: w2" in result.err and "exit 5" in result.err


def test_worker_selection(any_pod: Callable[..., Pod], cli: Callable[..., CliResult]) -> None:
    pod = any_pod(4)
    result = cli("exec", "--pod", pod.name, "--worker", "0,2-3", "--", "echo $TPUPOD_WORKER_ID")
    assert result.code == 0, result.err
    assert sorted(result.out.split()) == ["0", "2", "3", "[w0]", "[w2]", "[w3]"]
    bad = cli("exec", "--pod", pod.name, "--worker", "4", "--", "true")
    assert bad.code == 2 and "worker 4 does not exist: the pod has workers 0-3" in bad.err


def test_several_arguments_are_quoted(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(1)
    result = cli("exec", "--pod", pod.name, "--", "printf", "%s|", "a b", "$HOME")
    assert result.out.strip() == "[w0] a b|$HOME|"


def test_on_fail_kill_stops_everyone_and_leaves_nothing(
    any_pod: Callable[..., Pod],
    leftovers: Callable[[Pod], list[str]],
    cli: Callable[..., CliResult],
) -> None:
    pod = any_pod(4)
    command = 'if [ "$TPUPOD_WORKER_ID" = 1 ]; then sleep 0.3; exit 3; fi; sleep 60'
    result = cli("exec", "--pod", pod.name, "--on-fail", "kill", "--", command)
    assert result.code == 3
    assert result.seconds < 5
    assert "first failure: w1" in result.err
    assert "stopped after w1 failed" in result.err
    assert leftovers(pod) == []


def test_on_fail_wait_lets_the_others_finish(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(3)
    command = 'if [ "$TPUPOD_WORKER_ID" = 0 ]; then exit 7; fi; sleep 0.5; echo finished'
    result = cli("exec", "--pod", pod.name, "--", command)
    assert result.code == 7
    assert result.out.count("finished") == 2


def test_timeout_kills_the_process_group(
    any_pod: Callable[..., Pod],
    leftovers: Callable[[Pod], list[str]],
    cli: Callable[..., CliResult],
) -> None:
    pod = any_pod(3)
    # A pipeline and a background child: all of it lives in the command's process group.
    result = cli(
        "exec", "--pod", pod.name, "--timeout", "1", "--", "sleep 60 & sleep 60 | cat; wait"
    )
    assert result.code == 124
    assert result.seconds < 20  # the commands sleep 60: a hang shows; the margin is CI load
    assert result.err.count("timed out") >= 3
    assert leftovers(pod) == []


def test_term_ignoring_command_is_killed_after_grace(
    any_pod: Callable[..., Pod],
    leftovers: Callable[[Pod], list[str]],
    cli: Callable[..., CliResult],
) -> None:
    pod = any_pod(2)
    result = cli(
        "exec",
        "--pod",
        pod.name,
        "--timeout",
        "0.5",
        "--grace",
        "1",
        "--",
        'trap "" TERM; sleep 60; sleep 60',
    )
    assert result.code == 124
    assert 1.4 < result.seconds < 20  # the commands sleep 60 twice: a hang shows
    assert "SIGKILL" in result.err
    assert leftovers(pod) == []


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_cli_stops_every_worker(
    sig: signal.Signals,
    code: int,
    any_pod: Callable[..., Pod],
    leftovers: Callable[[Pod], list[str]],
    state_home: object,
) -> None:
    pod = any_pod(3)
    proc = subprocess.Popen(
        tpupod_argv(
            "exec", "--pod", pod.name, "--grace", "1", "--", 'echo started; trap "" TERM; sleep 60'
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    started = [proc.stdout.readline() for _ in range(3)]
    assert all("started" in line for line in started), started
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == code, err
    assert f"stopped by {sig.name}" in err
    assert leftovers(pod) == []


def test_background_child_holding_output_does_not_hang(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(1)
    result = cli("exec", "--pod", pod.name, "--", "echo main; sleep 30 &")
    assert result.code == 0
    assert result.seconds < 20  # the commands sleep 60: a hang shows; the margin is CI load
    assert "[w0] main" in result.out


def test_quiet_prints_only_the_summary(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(2)
    result = cli("exec", "--pod", pod.name, "--quiet", "--", "echo hello")
    assert result.code == 0
    assert result.out == ""
    assert "hello" in result.err  # the summary's last-line column


def test_output_is_plain_when_piped_and_colored_when_forced(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(2)
    plain = cli("exec", "--pod", pod.name, "--", "echo x")
    assert "\x1b[" not in plain.out
    colored = cli("exec", "--pod", pod.name, "--", "echo x", env={"FORCE_COLOR": "1"})
    assert "\x1b[36m[w0]" in colored.out and "\x1b[33m[w1]" in colored.out


def test_extra_env_reaches_workers(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(2)
    result = cli("exec", "--pod", pod.name, "-e", "GREETING=hi there", "--", 'echo "$GREETING"')
    assert sorted(result.out.splitlines()) == ["[w0] hi there", "[w1] hi there"]


def test_no_command_is_a_usage_error(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(1)
    result = cli("exec", "--pod", pod.name, "--", " ")
    assert result.code == 2 and "no command given" in result.err


def test_elapsed_is_concurrent_not_serial(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(8)
    started = time.monotonic()
    result = cli("exec", "--pod", pod.name, "--", "sleep 1")
    assert result.code == 0
    assert time.monotonic() - started < 4  # serial would be 8 s


def test_a_missing_program_reads_plainly(
    any_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = any_pod(2)
    result = cli("exec", "--pod", pod.name, "--", "no-such-program --flag")
    assert result.code == 127
    lines = [line for line in result.err.splitlines() if line.startswith("[w")]
    assert sorted(lines) == [
        "[w0] no-such-program: command not found",
        "[w1] no-such-program: command not found",
    ]


def test_a_failed_worker_s_hint_reaches_the_summary(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(2)
    workdir = pod.workers[1].workdir
    assert workdir is not None
    shutil.rmtree(workdir)
    result = cli("exec", "--pod", pod.name, "--", "true")
    assert result.code == 255
    assert "w1 (vm) unreachable: cannot start the command" in result.err
    assert result.err.rstrip().endswith(
        "hint: the pod's working directory may be gone; 'tpupod down' then 'tpupod up' recreates it"
    )


# -- the local fast path (localexec) and the summary's shape ------------------------------------

TYPER_ONLY = "from tpupod.cli.app import main; main()"  # the console script without fast paths
DURATION = re.compile(r"\d+\.\d\ds|\d+m\d\ds")


def typer_cli(*args: str) -> CliResult:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", TYPER_ONLY, *args], capture_output=True, text=True, timeout=60
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


def shape(text: str) -> list[str]:
    """Output to compare: durations blanked, lines sorted (workers interleave freely)."""
    return sorted(DURATION.sub("T", line).rstrip() for line in text.splitlines())


@pytest.mark.parametrize(
    "line",
    [
        ["--", "true"],
        ["-v", "--", "true"],
        ["-e", "A=1", "--", "env | grep -E '^(TPU|JAX|A=)' | sort; pwd; echo oops >&2"],
        ["-w", "1,3", "--", "[ $TPUPOD_WORKER_ID = 3 ] && sleep 2; exit $TPUPOD_WORKER_ID"],
        ["-q", "--worker", "0-1", "--", "echo", "a b"],
        ["--", "kill -9 $$"],
        # SIGPIPE as Popen leaves it (Python ignores it; an ignoring worker's yes would complain)
        ["-w", "0", "--", "trap -p; yes | head -n 1"],
    ],
)
def test_the_local_fast_path_and_the_full_cli_agree(
    line: list[str], make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(4, devices=2)
    args = ["exec", "--pod", pod.name, *line]
    fast, full = cli(*args), typer_cli(*args)
    assert fast.code == full.code, (fast.err, full.err)
    assert shape(fast.out) == shape(full.out)
    if line[-1] == "kill -9 $$":
        # All four die at once, so which one ended first is a race in either path (a CI run
        # saw w1 in one and w0 in the other); the rows below it still say each was killed.
        assert shape(racing_first(fast.err)) == shape(racing_first(full.err))
    else:
        assert shape(fast.err) == shape(full.err)


def test_workers_get_none_of_the_descriptors_tpupod_inherited(make_pod: Callable[..., Pod]) -> None:
    """As subprocess's close_fds in the full path: a worker that kept the caller's pipe open
    (a background child) would hold up whoever reads it."""
    pod = make_pod(2)
    read, write = os.pipe()
    argv = [sys.executable, "-m", "tpupod", "exec", "--pod", pod.name, "--", "ls /proc/$$/fd"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, pass_fds=(write,))
    finally:
        os.close(read)
        os.close(write)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == sorted(["[w0]", "[w1]"] * 3 + ["0", "1", "2"] * 2)


def racing_first(text: str) -> str:
    return re.sub(r"first failure: w\d+", "first failure: w?", text)


def test_a_plain_local_exec_starts_neither_typer_nor_asyncio(
    make_pod: Callable[..., Pod],
) -> None:
    """Nor typing, dataclasses or pathlib: together they cost the fast path about two Python
    starts (measured: exec -- true on 4 workers, 94 -> 58 ms of CPU, python -c pass 16 ms)."""
    pod = make_pod(2)
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "tpupod",
            "exec",
            "--pod",
            pod.name,
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    heavy = {"typer", "asyncio", "pydantic", "typing", "dataclasses", "inspect", "pathlib"}
    assert heavy & imported == set()
    summary = [line for line in proc.stderr.splitlines() if not line.startswith("import time")]
    assert len(summary) == 1 and summary[0].startswith(f"exec on {pod.name}: 2/2 ok in ")


def test_a_large_pod_s_summary_groups_identical_results(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(20)
    failing = (
        "[ $((TPUPOD_WORKER_ID % 6)) = 1 ] && exit 2; [ $TPUPOD_WORKER_ID = 4 ] && exit 3; true"
    )
    result = cli("exec", "--pod", pod.name, "--", failing)
    assert result.code == 2, result.err
    lines = result.err.splitlines()
    assert lines[0].startswith(f"exec on {pod.name}: 15/20 ok in "), result.err
    assert lines[1] == "4 failed: w1, w7, w13, w19 (exit 2)", result.err
    assert lines[2] == "1 failed: w4 (exit 3)", result.err
    assert lines[3].startswith("first failure: w"), result.err
    assert len(lines) == 4, result.err
    every = cli("exec", "--verbose", "--pod", pod.name, "--", failing)
    assert sum(line.startswith("w") and "exit" in line for line in every.err.splitlines()) == 20


@pytest.mark.parametrize("fast", [True, False])
def test_a_pod_beyond_the_soft_open_files_limit_raises_it_itself(
    fast: bool, make_pod: Callable[..., Pod], state_home: Path
) -> None:
    """100 workers need about 400 open files: a soft limit of 256 is raised, not hit."""
    require(shutil.which("prlimit") is not None, "prlimit (util-linux) is missing")
    pod = make_pod(100)
    entry = ["-m", "tpupod"] if fast else ["-c", TYPER_ONLY]
    argv = [sys.executable, *entry, "exec", "--pod", pod.name, "--", "true"]
    proc = subprocess.run(
        ["prlimit", "--nofile=256:20000", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith(f"exec on {pod.name}: 100/100 ok in "), proc.stderr
    low = subprocess.run(
        ["prlimit", "--nofile=256:256", *argv], capture_output=True, text=True, timeout=120
    )
    assert "the hard limit on open files is 256" in low.stderr, low.stderr
    assert "Traceback" not in low.stderr


def test_workers_get_sigint_as_the_full_cli_gives_it_when_tpupod_ignores_it(
    make_pod: Callable[..., Pod],
) -> None:
    """A script's background job (`tpupod exec ... &`) starts with SIGINT ignored. The full
    CLI handles SIGINT before it starts the workers, so theirs is at its default; the fast
    path started them before its handler, so they ignored it (a CI run under xdist, whose
    workers ignore SIGINT, saw `trap -- '' SIGINT` from the fast path alone)."""
    pod = make_pod(1)
    ignoring = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", sys.executable]
    args = ["exec", "--pod", pod.name, "--", "trap -p"]
    fast, full = (
        subprocess.run([*ignoring, *how, *args], capture_output=True, text=True, timeout=60)
        for how in (["-m", "tpupod"], ["-c", TYPER_ONLY])
    )
    assert fast.returncode == full.returncode == 0, (fast.stderr, full.stderr)
    assert "SIGINT" not in full.stdout
    assert shape(fast.stdout) == shape(full.stdout)


@pytest.mark.parametrize("on_fail", ["wait", "kill"])
def test_a_reader_that_goes_away_stops_every_worker(
    make_pod: Callable[..., Pod], on_fail: str
) -> None:
    """``tpupod exec -- LOOP | head -1`` with default options (the local fast path) ran
    until something killed it after head had gone; the full path stopped at once."""
    pod = make_pod(2)
    loop = "while true; do echo x; sleep 0.1; done"
    argv = tpupod_argv("exec", "--pod", pod.name, "--on-fail", on_fail, "--", loop)
    started = time.monotonic()
    shell = subprocess.run(
        ["bash", "-c", f"{' '.join(map(shlex.quote, argv))} | head -1; echo ${{PIPESTATUS[0]}}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert time.monotonic() - started < 10, shell.stderr
    assert shell.stdout.splitlines() == ["[w0] x", "141"] or shell.stdout.splitlines() == [
        "[w1] x",
        "141",
    ], shell
    assert "stopped by SIGPIPE" in shell.stderr
    assert wait_until_gone(pod.name) == []
