"""A full disk under the state directory (a real tmpfs of a few MB): plain errors where
nothing can start, and a run already going on that goes on.

A full home is common on a shared development box; it was an 'internal error:
OSError', and a disk that filled during 'tpupod run' killed the launcher (and with
it the workers) over its own log files.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CliResult, require, tpupod_argv
from tpupod.pod.record import Pod

pytestmark = pytest.mark.local  # mounts a tmpfs: root


SIZE_MB = 4
DD = ["dd", "if=/dev/zero", "bs=1M", f"count={SIZE_MB}"]  # bounded: never past the tmpfs


@pytest.fixture
def small_home(state_home: Path) -> Iterator[Path]:
    """The state directory on a 4 MB tmpfs of its own."""
    require(os.geteuid() == 0, "mounting a tmpfs needs root")
    state_home.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m", "tmpfs", str(state_home)], check=True
    )
    try:
        yield state_home
    finally:
        subprocess.run(["umount", "-l", str(state_home)], check=False)


def fill(home: Path) -> Path:
    """Every free byte of ``home``'s disk taken by one file."""
    filler = home / "filler"
    subprocess.run([*DD, f"of={filler}"], capture_output=True)
    return filler


def test_nothing_starts_on_a_full_disk_and_it_is_said_plainly(
    small_home: Path, cli: Callable[..., CliResult], make_pod: Callable[..., Pod]
) -> None:
    pod = make_pod(2)
    fill(small_home)
    made = cli("up", "--name", "more", "--local", "1")
    assert made.code == 1, made.err
    assert "error: No space left on device: " in made.err and "internal error" not in made.err
    assert "df -h" in made.err
    ran = cli("run", "--pod", pod.name, "--", "echo hi")
    assert ran.code == 1 and "cannot keep the run's logs in " in ran.err, ran.err
    assert "internal error" not in ran.err and "[w0] hi" not in ran.out
    assert not list((small_home / "pods" / pod.name / "runs").iterdir())  # no half run left


def test_a_run_whose_disk_fills_goes_on_and_its_record_says_the_logs_stop(
    small_home: Path, make_pod: Callable[..., Pod]
) -> None:
    """Worker 0 fills the disk mid-run and prints 2,000 lines; once the launcher has said
    it cannot keep them, the test frees the disk and the worker ends."""
    pod = make_pod(2)
    filler = small_home / "filler"  # a run starts in the launcher's folder: name the disk
    program = (
        f'if [ "$TPUPOD_WORKER_ID" = 0 ]; then echo before; {" ".join(DD)} of={filler} '
        "2>/dev/null; for i in $(seq 2000); do echo line $i of a log that no longer fits; "
        f"done; for i in $(seq 300); do [ -e {filler} ] && sleep 0.1; done; fi; echo end"
    )
    proc = subprocess.Popen(
        tpupod_argv("run", "--pod", pod.name, "--", program),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:  # the launcher's notices, as they come
        said.append(line)
        if "cannot write the run's logs in " in line:
            filler.unlink()
            break
    out, err = proc.communicate(timeout=60)
    err = "".join(said) + err
    assert proc.returncode == 0, err
    assert "not kept" in err and "internal error" not in err and "Traceback" not in err
    shown = out.splitlines()
    assert "[w0] line 2000 of a log that no longer fits" in shown and "[w0] end" in shown
    assert "[w1] end" in shown
    logs = subprocess.run(
        tpupod_argv("logs", "--pod", pod.name), capture_output=True, text=True, timeout=30
    )
    assert "(its logs stop early: No space left on device)" in logs.stderr, logs.stderr
    assert "ended with exit code 0" in logs.stderr
    assert "[w0] before" in logs.stdout and "[w0] line 2000" not in logs.stdout


def test_a_job_submitted_to_a_full_disk_names_the_file_and_the_store_stays_whole(
    small_home: Path, cli: Callable[..., CliResult]
) -> None:
    """The SQLite store's error said 'check that the database is up and reachable', a
    server's hint, for a file on a full disk."""
    assert cli("jobs", "submit", "--", "echo first").code == 0
    filler = fill(small_home)
    refused = cli("jobs", "submit", "--", "echo " + "x" * 5000)
    assert refused.code == 1 and "internal error" not in refused.err, refused.err
    assert f"it is the file {small_home / 'jobs.db'}: check the disk it is on" in refused.err
    filler.unlink()
    listed = cli("jobs", "ls")
    assert listed.code == 0 and len(listed.out.splitlines()) == 2, listed.out  # header, first


def test_a_run_with_retries_waits_for_space_to_go_on(
    small_home: Path, make_pod: Callable[..., Pod]
) -> None:
    """The chaos harness (issue 41): a worker killed while the state directory's disk was
    full ended `run --retries` at once ('error: No space left on device: .../progress.json',
    exit 1) where it should wait for space and go on with the next attempt."""
    pod = make_pod(2)
    filler = small_home / "filler"
    program = (
        f'if [ "$TPUPOD_ATTEMPT" = 1 ] && [ "$TPUPOD_WORKER_ID" = 1 ]; then '
        f"{' '.join(DD)} of={filler} 2>/dev/null; kill -9 $$; fi; "
        'echo "attempt $TPUPOD_ATTEMPT done"'
    )
    proc = subprocess.Popen(
        tpupod_argv("run", "--pod", pod.name, "--retries", "2", "--", program),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:
        said.append(line)
        if "waiting for space" in line:
            filler.unlink()
            break
    out, err = proc.communicate(timeout=60)
    err = "".join(said) + err
    assert proc.returncode == 0, err
    assert "internal error" not in err and "Traceback" not in err
    assert f"{small_home}" in "".join(said[-1:]), said[-1:]  # the wait names the disk
    assert "[w0] attempt 2 done" in out and "[w1] attempt 2 done" in out, out


def test_a_disk_that_fills_under_a_run_is_said_at_once(
    small_home: Path, make_pod: Callable[..., Pod]
) -> None:
    """The chaos harness (issue 41): the log files' last pages have room for ~100 more
    short lines each, so a disk that filled was said only when they ran out, 10-20 s
    later; the run's logs now stop (and it is said) within a second or two."""
    pod = make_pod(1)
    program = "for i in $(seq 600); do echo step $i; sleep 0.1; done"
    proc = subprocess.Popen(
        tpupod_argv("run", "--pod", pod.name, "--", program),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None and proc.stdout is not None
    try:
        for line in proc.stdout:
            if "step 20" in line:
                break
        filled = time.monotonic()
        filler = fill(small_home)
        for line in proc.stderr:
            if "cannot write the run's logs" in line:
                break
        said_after = time.monotonic() - filled
        filler.unlink()
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert said_after < 3.0, said_after


def test_a_restart_count_on_a_full_disk_does_not_cost_the_restart(small_home: Path) -> None:
    """The chaos harness's 30-minute run (issue 41): the router's keeper died counting a
    restart on a full disk (ENOSPC from router.restarts), and no router ran for 34 s."""
    from tpupod.serve import services  # the serve extra; only this test needs it

    services.count_restarts(small_home, "router", 1)
    filler = fill(small_home)
    try:
        services.count_restarts(small_home, "router", 2)  # said nothing, raised nothing
    finally:
        filler.unlink()
    assert services.restarts(small_home, "router") in (1, 2)
