"""put / get / sync / setup / free-tpu, on local pods and on SSH pods of simulated hosts."""

from __future__ import annotations

import asyncio
import filecmp
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CliResult
from tpupod.errors import UsageError
from tpupod.fanout.execute import execute
from tpupod.ops.free_tpu import free_tpu
from tpupod.ops.setup import setup
from tpupod.ops.sync import sync_local, sync_remote
from tpupod.ops.transfer import get, put
from tpupod.pod.record import Pod
from tpupod.sim import SimPod

GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **GIT_ENV},
    )
    return proc.stdout.strip()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder every simulated host sees (their /tmp is private; /var/tmp is not)."""
    path = Path(tempfile.mkdtemp(prefix="tpupod-test-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def repo(shared_dir: Path) -> Path:
    """A bare 'server' repository with main, a feature branch and a tag; the clone is returned."""
    server = shared_dir / "server.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(server)], check=True)
    work = shared_dir / "work"
    subprocess.run(["git", "clone", "-q", str(server), str(work)], check=True, capture_output=True)
    git(work, "checkout", "-q", "-b", "main")
    (work / "train.py").write_text("print('v1')\n")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "v1")
    git(work, "tag", "v1")
    git(work, "push", "-q", "origin", "main", "v1")
    git(work, "checkout", "-q", "-b", "feature")
    (work / "train.py").write_text("print('feature')\n")
    git(work, "commit", "-q", "-am", "feature")
    git(work, "push", "-q", "origin", "feature")
    git(work, "checkout", "-q", "main")
    return work


def make_tree(root: Path) -> Path:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.txt").write_text("alpha\n")
    (root / "sub" / "b.bin").write_bytes(os.urandom(300_000))
    (root / "sub" / "deeper" / "c.txt").write_text("gamma\n" * 1000)
    (root / "sub" / "empty").write_bytes(b"")
    return root


def trees_equal(left: Path, right: Path) -> bool:
    compared = filecmp.dircmp(left, right)
    if compared.left_only or compared.right_only or compared.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(left, right, compared.common_files, shallow=False)
    return (
        not mismatch
        and not errors
        and all(trees_equal(left / d, right / d) for d in compared.common_dirs)
    )


def test_put_get_round_trip_a_folder_byte_for_byte(
    any_pod: Callable[..., Pod], tmp_path: Path
) -> None:
    pod = any_pod(3)
    source = make_tree(tmp_path / "payload")
    assert asyncio.run(put(pod, source, "incoming/payload")).ok
    # Putting again replaces the folder whole; nothing staged is left beside it.
    (source / "a.txt").write_text("alpha 2\n")
    assert asyncio.run(put(pod, source, "incoming/payload")).ok
    listing = execute(pod, "ls -A incoming")
    assert [r.tail for r in listing.workers] == [("payload",)] * 3
    back = tmp_path / "back"
    result = asyncio.run(get(pod, "incoming/payload", back))
    assert result.ok, [r.error for r in result.workers]
    for worker in pod.workers:
        assert trees_equal(source, back / f"worker-{worker.id}" / "payload")


def test_put_into_a_folder_and_a_single_file(any_pod: Callable[..., Pod], tmp_path: Path) -> None:
    pod = any_pod(2)
    config = tmp_path / "bench.yaml"
    config.write_text("steps: 3\n")
    assert asyncio.run(put(pod, config, "configs/")).ok
    result = execute(pod, "cat configs/bench.yaml")
    assert [r.last_line for r in result.workers] == ["steps: 3"] * 2


def test_a_file_never_replaces_a_folder_and_its_contents_stay(
    any_pod: Callable[..., Pod], tmp_path: Path
) -> None:
    """A trial: `put train.py results` replaced the folder results (and its files) with the
    file, and said `2/2 ok`; a folder is replaced whole by a folder only."""
    pod = any_pod(2)
    assert execute(pod, "mkdir -p results && echo important > results/metrics.txt").ok
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    result = asyncio.run(put(pod, script, "results"))
    assert not result.ok and result.exit_code() == 1
    for outcome in result.workers:
        assert "results is a folder, and a file does not replace one" in str(outcome.error)
    kept = execute(pod, "cat results/metrics.txt; ls -A results")
    assert [r.tail for r in kept.workers] == [("important", "metrics.txt")] * 2
    assert asyncio.run(put(pod, script, "results/")).ok  # the way the refusal names
    inside = execute(pod, "ls -A results")
    assert [r.tail for r in inside.workers] == [("metrics.txt", "train.py")] * 2


@pytest.mark.parametrize("remote", ["", ".", "~", "a/..", "..", "../..", "  "])
def test_put_refuses_a_destination_that_is_a_workers_home_or_above(
    make_pod: Callable[..., Pod], tmp_path: Path, remote: str
) -> None:
    """A trial: `put train.py .` (and '') replaced each worker's whole home folder; every
    later command failed until the pod was made again."""
    pod = make_pod(1)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    for source in (script, make_tree(tmp_path / "tree")):
        with pytest.raises(UsageError) as refused:
            asyncio.run(put(pod, source, remote))
        assert f"put would replace {remote!r}" in refused.value.message
        assert f"to put {source.name} inside it: " in (refused.value.hint or "")
    assert execute(pod, "true").ok


def test_get_of_a_missing_file_names_the_worker(
    any_pod: Callable[..., Pod], tmp_path: Path
) -> None:
    pod = any_pod(2)
    result = asyncio.run(get(pod, "no/such/file", tmp_path / "out"))
    assert not result.ok and result.exit_code() == 1
    assert all(r.error for r in result.workers)
    assert not any((tmp_path / "out").glob("worker-*/*"))


def test_put_and_get_cli(
    make_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    cli_in_process: Callable[..., CliResult],
    tmp_path: Path,
) -> None:
    pod = make_pod(2)
    source = make_tree(tmp_path / "data")
    assert cli("put", "--pod", pod.name, str(source), "data").code == 0
    result = cli("get", "--pod", pod.name, "data", str(tmp_path / "out"))
    assert result.code == 0, result.err
    assert trees_equal(source, tmp_path / "out" / "worker-1" / "data")
    missing = cli_in_process("put", "--pod", pod.name, str(tmp_path / "nope"), "x")
    assert missing.code == 2 and "no such file or folder" in missing.err


def test_sync_branch_and_ref(make_ssh_pod: Callable[..., Pod], repo: Path) -> None:
    pod = make_ssh_pod()
    url = f"file://{repo.parent / 'server.git'}"
    result = asyncio.run(sync_remote(pod, url, "feature", "code"))
    assert result.ok, [r.tail for r in result.fanout.workers]
    assert set(result.commits.values()) == {git(repo, "rev-parse", "feature")}
    assert len(result.commits) == 4
    tag = asyncio.run(sync_remote(pod, url, "refs/tags/v1", "code"))
    assert tag.ok and set(tag.commits.values()) == {git(repo, "rev-parse", "v1^{commit}")}
    shown = execute(pod, "cat code/train.py")
    assert {r.last_line for r in shown.workers} == {"print('v1')"}


def test_sync_from_local_ships_unpushed_commits(
    make_ssh_pod: Callable[..., Pod], repo: Path
) -> None:
    pod = make_ssh_pod()
    (repo / "train.py").write_text("print('local only')\n")
    git(repo, "commit", "-q", "-am", "not pushed")
    first = asyncio.run(sync_local(pod, repo, "code"))
    assert first.ok and first.expected == git(repo, "rev-parse", "HEAD")
    assert set(first.commits.values()) == {first.expected}
    # A second change ships only what the workers lack, and lands the same way.
    (repo / "train.py").write_text("print('local 2')\n")
    git(repo, "commit", "-q", "-am", "again")
    second = asyncio.run(sync_local(pod, repo, "code"))
    assert second.ok and set(second.commits.values()) == {git(repo, "rev-parse", "HEAD")}
    shown = execute(pod, "cat code/train.py; ls -A ~ | grep -c tpupod-sync || true")
    assert {r.tail for r in shown.workers} == {("print('local 2')", "0")}


def test_sync_cli_reports_the_commit(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], repo: Path
) -> None:
    pod = make_pod(2)
    url = f"file://{repo.parent / 'server.git'}"
    result = cli(
        "sync", "--pod", pod.name, "--repo-url", url, "--branch", "feature", "--dir", "code"
    )
    assert result.code == 0, result.err
    assert f"all 2 workers at {git(repo, 'rev-parse', 'feature')}" in result.out
    bad = cli("sync", "--pod", pod.name, "--repo-url", url, "--branch", "nope", "--dir", "code")
    assert bad.code != 0 and "first failure" in bad.err


def test_setup_waits_for_the_lock_and_runs_once(
    make_ssh_pod: Callable[..., Pod], sim: SimPod, tmp_path: Path
) -> None:
    pod = make_ssh_pod()
    script = tmp_path / "bootstrap.sh"
    script.write_text("echo bootstrapping on $(hostname)\necho ran >> ~/setup-runs\n")
    sim.run_on(0, "flock /tmp/test.lock sleep 2.5 >/dev/null 2>&1 &")
    lines: list[str] = []
    result = asyncio.run(
        setup(
            pod,
            script,
            locks=["/tmp/test.lock"],
            on_line=lambda w, line: lines.append(f"w{w.id}:{line.text}"),
        )
    )
    assert result.ok, [r.tail for r in result.workers]
    assert any(line.startswith("w0:waiting for /tmp/test.lock (locked by pid") for line in lines)
    assert result.workers[0].duration > 1.5 > result.workers[1].duration
    again = asyncio.run(setup(pod, script, locks=["/tmp/test.lock"]))
    assert all("skipping" in r.last_line for r in again.workers)
    forced = asyncio.run(setup(pod, script, locks=["/tmp/test.lock"], force=True))
    assert forced.ok
    runs = execute(pod, "wc -l < ~/setup-runs")
    assert [r.last_line for r in runs.workers] == ["2"] * 4


def test_setup_gives_up_on_a_lock_held_too_long(
    make_pod: Callable[..., Pod], tmp_path: Path
) -> None:
    pod = make_pod(1)
    script = tmp_path / "s.sh"
    script.write_text("echo should not run\n")
    lock = tmp_path / "held.lock"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "30"])
    try:
        result = asyncio.run(setup(pod, script, locks=[str(lock)], lock_wait=1))
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code() == 75
    assert "gave up after 1s" in result.workers[0].last_line


def test_free_tpu_kills_the_holder_then_removes_the_lockfile(
    make_ssh_pod: Callable[..., Pod], sim: SimPod
) -> None:
    pod = make_ssh_pod()
    sim.run_on(
        1,
        "sh -c 'exec 3>/tmp/fake-accel0 4>/tmp/fake_lockfile; trap \"\" TERM; sleep 60' "
        ">/dev/null 2>&1 &",
    )
    sim.run_on(2, "touch /tmp/fake_lockfile")  # a stale lockfile, nobody holds it
    options = {"devices": ["/tmp/fake-accel*"], "lockfile": "/tmp/fake_lockfile", "grace": 0.5}
    dry = asyncio.run(free_tpu(pod, dry_run=True, **options))  # type: ignore[arg-type]
    assert dry.ok
    assert "holder:" in " ".join(dry.workers[1].tail) and "sleep 60" in " ".join(
        dry.workers[1].tail
    )
    assert sim.run_on(1, "pgrep -f 'slee[p] 60'").stdout.strip()
    freed = asyncio.run(free_tpu(pod, **options))  # type: ignore[arg-type]
    assert freed.ok, [r.tail for r in freed.workers]
    assert "killed" in " ".join(freed.workers[1].tail) and "freed" in freed.workers[1].last_line
    assert sim.run_on(1, "pgrep -f 'slee[p] 60' || echo none").stdout.strip() == "none"
    assert sim.run_on(1, "ls /tmp/fake_lockfile 2>&1").returncode != 0
    assert "removed a stale" in " ".join(freed.workers[2].tail)
    assert freed.workers[0].last_line == "free: nothing holds the accelerator"
