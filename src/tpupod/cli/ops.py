"""Commands that do things to every worker: put, get, sync, setup, free-tpu."""

from __future__ import annotations

import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Annotated

import typer

from tpupod import settings
from tpupod.cli.app import command
from tpupod.cli.flow.live import run_live
from tpupod.cli.options import PodOption, QuietOption, TimeoutOption, WorkerOption
from tpupod.errors import TpupodError, UsageError
from tpupod.fanout.context import Sinks
from tpupod.fanout.report import print_summary
from tpupod.fanout.results import FanoutResult
from tpupod.ops import defaults
from tpupod.pod.state import StateDir


def _finish(result: FanoutResult, title: str) -> None:
    print_summary(result, sys.stderr, title=title)
    raise typer.Exit(result.exit_code())


@command("put")
def put(
    local: Annotated[Path, typer.Argument(help="A local file or folder.", show_default=False)],
    remote: Annotated[
        str, typer.Argument(help="Where on each worker (ending in / : inside that folder).")
    ],
    pod: PodOption = None,
    worker: WorkerOption = None,
) -> None:
    """Copy a file or folder to every worker at once, atomically (never half-written).

    A folder replaces a folder of that name whole; a file never replaces a folder, and
    nothing replaces a worker's home (end REMOTE in / to put it inside).

    Examples:

      tpupod put configs/bench.yaml bench.yaml

      tpupod put ./data/ /mnt/data/          # into /mnt/data/data
    """
    from tpupod.ops.transfer import put as put_op

    target = StateDir().resolve(pod)
    workers = target.select(worker)
    result = run_live(workers, True, lambda live: put_op(target, local, remote, workers=workers))
    _finish(result, f"put on {target.name}")


@command("get")
def get(
    remote: Annotated[str, typer.Argument(help="A file or folder on each worker.")],
    local_dir: Annotated[
        Path, typer.Argument(help="Local folder; worker N's copy lands in LOCAL_DIR/worker-N/.")
    ],
    pod: PodOption = None,
    worker: WorkerOption = None,
) -> None:
    """Collect a file or folder from every worker into LOCAL_DIR/worker-N/.

    Examples:

      tpupod get results/ ./results          # ./results/worker-0/results, ...
    """
    from tpupod.ops.transfer import get as get_op

    target = StateDir().resolve(pod)
    workers = target.select(worker)
    result = run_live(
        workers, True, lambda live: get_op(target, remote, local_dir, workers=workers)
    )
    _finish(result, f"get on {target.name}")


@command("sync")
def sync(
    pod: PodOption = None,
    worker: WorkerOption = None,
    branch: Annotated[
        str | None,
        typer.Option("--branch", "-b", help="Branch to fetch (default: main).", show_default=False),
    ] = None,
    pr: Annotated[
        int | None,
        typer.Option("--pr", help="Pull request N (refs/pull/N/head).", show_default=False),
    ] = None,
    ref: Annotated[
        str | None, typer.Option("--ref", help="Any ref or commit to fetch.", show_default=False)
    ] = None,
    repo_url: Annotated[
        str | None,
        typer.Option(
            "--repo-url",
            help="Repository to fetch from (default: this repository's origin).",
            show_default=False,
        ),
    ] = None,
    from_local: Annotated[
        bool,
        typer.Option(
            "--from-local",
            help="Ship this repository's HEAD (committed, pushed or not); no git server needed.",
        ),
    ] = False,
    directory: Annotated[
        str | None,
        typer.Option(
            "--dir",
            help="Checkout folder on each worker (default: the repository's name, in its home).",
            show_default=False,
        ),
    ] = None,
    timeout: TimeoutOption = None,
    quiet: QuietOption = False,
) -> None:
    """Put the same commit on every worker and check that they all are at it.

    Examples:

      tpupod sync --repo-url https://github.com/google/orbax --pr 123

      tpupod sync --branch my-feature           # from this repository's origin

      tpupod sync --from-local --dir ~/code     # unpushed commits too
    """
    from tpupod.ops import sync as sync_ops

    target = StateDir().resolve(pod)
    workers = target.select(worker)
    repo = Path.cwd()
    if from_local and (branch or pr or ref or repo_url):
        raise UsageError(
            "--from-local ships HEAD: it takes no --branch, --pr, --ref or --repo-url",
            hint="commit or check out what you want to ship, then sync again",
        )
    url = None if from_local else repo_url or sync_ops.origin_url(repo)
    wanted = sync_ops.git_ref(branch, pr, ref)

    def body(live: Sinks) -> Awaitable[sync_ops.SyncResult]:
        options = {
            "workers": workers,
            "on_line": live.on_line,
            "interrupt": live.interrupt,
            "timeout": timeout,
        }
        if url is None:
            folder = directory or repo.resolve().name
            return sync_ops.sync_local(target, repo, folder, **options)  # type: ignore[arg-type]
        folder = directory or sync_ops.default_dir(url)
        return sync_ops.sync_remote(target, url, wanted, folder, **options)  # type: ignore[arg-type]

    result = run_live(workers, quiet, body)
    print_summary(result.fanout, sys.stderr, title=f"sync on {target.name}")
    if not result.fanout.ok:
        raise typer.Exit(result.fanout.exit_code())
    if result.differing:
        for worker_id, commit in sorted(result.commits.items()):
            print(f"w{worker_id}: {commit}", file=sys.stderr)
        expected = result.expected or "the commit most workers are at"
        raise TpupodError(
            f"workers {', '.join(f'w{w}' for w in result.differing)} are not at {expected}",
            hint="rerun the sync; if it persists, look at those workers' checkouts",
        )
    commit = next(iter(result.commits.values()), "?")
    print(f"all {len(result.commits)} workers at {commit}")


@command("setup")
def setup(
    script: Annotated[
        Path | None,
        typer.Option(
            "--script", "-s", help="Bootstrap script to run on every worker.", show_default=False
        ),
    ] = None,
    pod: PodOption = None,
    worker: WorkerOption = None,
    docker: Annotated[
        bool,
        typer.Option(
            "--docker",
            help="Install and start Docker on every worker (tpupod's own script; no re-login).",
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Run even if this script already ran.")
    ] = False,
    lock_wait: Annotated[
        float,
        typer.Option(
            "--lock-wait", metavar="S", help="Wait up to S seconds for the apt/dpkg locks."
        ),
    ] = defaults.LOCK_WAIT_S,
    lock_file: Annotated[
        list[str] | None,
        typer.Option(
            "--lock-file",
            help="Lock files to wait for (repeatable; default: dpkg's and apt's).",
            show_default=False,
        ),
    ] = None,
    timeout: TimeoutOption = None,
    quiet: QuietOption = False,
) -> None:
    """Run a bootstrap script on every worker, once per script content.

    Each worker first waits while the dpkg/apt locks are held (unattended
    upgrades on a fresh VM), then runs the script; a marker named after the
    script's hash makes the next run with the same script a no-op.

    Examples:

      tpupod setup --script setup_tpu.sh

      tpupod setup --script setup_tpu.sh --force --lock-wait 600

      tpupod setup --docker        # a container engine for 'run --image'
    """
    from tpupod.ops import setup as setup_ops

    if (script is None) == (not docker):
        raise UsageError(
            "setup needs one of --script FILE and --docker",
            hint="tpupod setup --script setup_tpu.sh, or tpupod setup --docker",
        )
    if docker:
        from tpupod.image.setup_docker import script_file

        script = script_file()
    assert script is not None

    target = StateDir().resolve(pod)
    workers = target.select(worker)
    locks = lock_file or list(defaults.APT_LOCKS)
    result = run_live(
        workers,
        quiet,
        lambda live: setup_ops.setup(
            target,
            script,
            force=force,
            lock_wait=lock_wait,
            locks=locks,
            workers=workers,
            on_line=live.on_line,
            interrupt=live.interrupt,
            timeout=timeout,
        ),
    )
    _finish(result, f"setup on {target.name}")


@command("free-tpu")
def free_tpu(
    pod: PodOption = None,
    worker: WorkerOption = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only show what holds the accelerator.")
    ] = False,
    device: Annotated[
        list[str] | None,
        typer.Option(
            "--device",
            help="Device path pattern (repeatable; default: /dev/accel*, /dev/vfio/*).",
            show_default=False,
        ),
    ] = None,
    lockfile: Annotated[
        str, typer.Option("--lockfile", help="libtpu's lockfile.")
    ] = defaults.LIBTPU_LOCKFILE,
    grace: Annotated[
        float, typer.Option("--grace", metavar="S", help="Seconds between TERM and KILL.")
    ] = defaults.FREE_GRACE_S,
    quiet: QuietOption = False,
) -> None:
    """Kill whatever holds the accelerator on every worker and remove a stale libtpu lock.

    Examples:

      tpupod free-tpu --dry-run

      tpupod free-tpu -w 3
    """
    from tpupod.ops import free_tpu as free_tpu_ops

    target = StateDir().resolve(pod)
    workers = target.select(worker)
    devices = device or list(settings.accelerator_devices(defaults.ACCELERATOR_DEVICES))
    result = run_live(
        workers,
        quiet,
        lambda live: free_tpu_ops.free_tpu(
            target,
            devices=devices,
            lockfile=lockfile,
            grace=grace,
            dry_run=dry_run,
            workers=workers,
            on_line=live.on_line,
            interrupt=live.interrupt,
        ),
    )
    _finish(result, f"free-tpu on {target.name}")
