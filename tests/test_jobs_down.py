"""'tpupod down' under a live 'tpupod jobs worker --pod P': down says the runner is using the
pod and refuses without --force; with --force (or when the pod goes some other way) the
runner gives its running job back to the queue, not failed, and stops leasing."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CliResult
from tests.test_jobs import command_job, runner_at_work
from tpupod.jobs.models import JobStatus
from tpupod.jobs.store import Store
from tpupod.pod import users as podusers
from tpupod.pod.record import Pod
from tpupod.pod.state import StateDir
from tpupod.providers import provider_for

pytestmark = pytest.mark.local  # runner processes on a local pod


@contextlib.contextmanager
def _runner_at_work(pod: Pod, tmp_path: Path) -> Iterator[tuple[Store, int, subprocess.Popen[str]]]:
    """A runner for ``pod`` (a process) running a slow job on it, in a fresh store."""
    store = Store.open(f"sqlite:///{tmp_path / 'jobs.db'}")
    with runner_at_work(store, pod) as (job, proc):
        yield store, job, proc


@pytest.mark.timeout(120)
def test_down_refuses_a_pod_a_runner_is_using_and_force_gives_its_job_back(
    make_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    leftovers: Callable[[Pod], list[str]],
    tmp_path: Path,
) -> None:
    pod = make_pod(2)
    with _runner_at_work(pod, tmp_path) as (store, job, proc):
        refused = cli("down", "--pod", pod.name)
        assert refused.code == 1, refused.err
        first, hint = refused.err.splitlines()[:2]
        assert first.startswith(f"error: pod {pod.name!r} is in use by a job runner ('tpupod ")
        assert f"(pid {proc.pid}, since " in first
        assert hint.startswith(f"hint: stop it first (kill -TERM {proc.pid}), or add --force")
        assert store.get(job).status is JobStatus.RUNNING  # nothing was touched
        assert StateDir().exists(pod.name)

        forced = cli("down", "--pod", pod.name, "--force", timeout=60)
        assert forced.code == 0, forced.err
        stopped = f"stopped a job runner ('tpupod jobs worker --pod {pod.name}') (pid {proc.pid}"
        assert forced.out.startswith(stopped), forced.out
        assert forced.out.splitlines()[-1] == f"pod {pod.name!r} is down"
        _, err = proc.communicate(timeout=30)  # it had exited before the pod went
        assert proc.returncode == 0, err
    back = store.get(job)
    assert (back.status, back.attempt, back.lease_owner) == (JobStatus.PENDING, 1, None), back
    assert back.error == "attempt 1: its runner stopped"
    assert leftovers(pod) == []
    store.close()


@pytest.mark.timeout(120)
def test_a_runner_whose_pod_goes_gives_its_job_back_and_stops_leasing(
    make_pod: Callable[..., Pod],
    leftovers: Callable[[Pod], list[str]],
    tmp_path: Path,
) -> None:
    """The pod goes without the runner being asked (as down does with a runner that did
    not let go in time): its workers are stopped under the running job, and the record
    removed. The job is given back, not failed, and the next job is not taken."""
    pod = make_pod(2)
    with _runner_at_work(pod, tmp_path) as (store, job, proc):
        later = store.submit(command_job("echo later", pod=pod.name))
        state = StateDir()
        podusers.mark_going_down(state, pod.name)
        asyncio.run(provider_for(pod.provider).destroy(pod, state))
        state.remove(pod.name)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    said = f"error: pod {pod.name!r} is being taken down: this runner stopped"
    assert said in err.splitlines(), err
    back = store.get(job)
    assert (back.status, back.lease_owner) == (JobStatus.PENDING, None), back
    assert store.get(later).status is JobStatus.PENDING
    assert store.get(later).attempt == 0  # never leased
    assert "Traceback" not in err
    assert leftovers(pod) == []
    store.close()


def test_a_dead_users_file_is_a_leftover_and_does_not_block_down(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(1)
    folder = StateDir().pod_dir(pod.name) / podusers.USERS_DIR
    folder.mkdir()
    (folder / "999999.json").write_text('{"pid": 999999, "what": "x", "since": 0}')  # unlocked
    assert podusers.users(StateDir(), pod.name) == []
    assert not (folder / "999999.json").exists()
    done = cli("down", "--pod", pod.name)
    assert done.code == 0, done.err
