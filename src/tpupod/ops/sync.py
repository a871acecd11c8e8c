"""``sync``: put the same commit on every worker, from a git server or from the local repository.

From a server (seed 004's ``--update``): clone on first use, then
``git fetch --depth=1 origin REF`` and ``git checkout --detach FETCH_HEAD``.
From the local repository (``--from-local``): a git bundle of HEAD, holding
only the commits the workers lack, is copied to every worker over the
transport and fetched there, so unpushed commits ship without a server.
Either way every worker reports the commit it is at, and a worker that
differs fails the sync.
"""

from __future__ import annotations

import posixpath
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tpupod.errors import TpupodError, UsageError
from tpupod.fanout.context import Interrupt
from tpupod.fanout.execute import execute_async
from tpupod.fanout.results import FanoutResult, chain
from tpupod.fanout.worker import LineHandler
from tpupod.ops.transfer import put
from tpupod.pod.record import Pod, Worker
from tpupod.providers import Connector

COMMIT_MARKER = "tpupod-commit "

CHECKOUT = """set -e
{before}
dir={dir}
mkdir -p "$dir"
cd "$dir"
[ -d .git ] || git init -q .
{fetch}
git checkout -q -f --detach FETCH_HEAD
echo "{marker}$(git rev-parse HEAD)"
git log -1 --format='at %h %s'
"""

FETCH_REMOTE = """if git remote get-url origin >/dev/null 2>&1; then git remote set-url origin {url}
else git remote add origin {url}; fi
git fetch -q --depth=1 origin {ref}"""

# The bundle's path is taken absolute before the script changes into the repository.
BUNDLE_PATH = """bundle={bundle}
case $bundle in /*) ;; *) bundle=$PWD/$bundle ;; esac"""
FETCH_BUNDLE = 'git fetch -q "$bundle" HEAD\nrm -f "$bundle"'


@dataclass
class SyncResult:
    """How the sync went on each worker, and the commit each one is at."""

    fanout: FanoutResult
    commits: dict[int, str] = field(default_factory=dict)
    expected: str | None = None

    @property
    def differing(self) -> list[int]:
        """Workers that did not end at the same commit as the others (or as expected)."""
        target = self.expected or _most_common(list(self.commits.values()))
        return [r.worker.id for r in self.fanout.workers if self.commits.get(r.worker.id) != target]

    @property
    def ok(self) -> bool:
        return self.fanout.ok and not self.differing


def git_ref(branch: str | None = None, pr: int | None = None, ref: str | None = None) -> str:
    """The ref to fetch: ``--ref`` as given, ``--pr N`` as GitHub's pull head, else the branch."""
    given = [name for name, value in (("--branch", branch), ("--pr", pr), ("--ref", ref)) if value]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} name different refs", hint="pass only one of them")
    if ref:
        return ref
    if pr is not None:
        return f"refs/pull/{pr}/head"
    return branch or "main"


def origin_url(repo: Path) -> str:
    """The local repository's ``origin``, the default place workers fetch from."""
    proc = subprocess.run(
        ["git", "-C", str(repo), "remote", "get-url", "origin"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise UsageError(
            f"{repo} has no git remote 'origin' to fetch from",
            hint="pass --repo-url URL, or --from-local to ship this repository's HEAD",
        )
    return proc.stdout.strip()


def default_dir(repo_url: str) -> str:
    """``https://host/org/repo.git`` -> ``repo`` (relative: the worker's home or work folder)."""
    name = posixpath.basename(repo_url.rstrip("/")).removesuffix(".git")
    if not name:
        raise UsageError(f"cannot name a folder after {repo_url!r}", hint="pass --dir DIR")
    return name


async def sync_remote(
    pod: Pod,
    repo_url: str,
    ref: str,
    directory: str,
    *,
    workers: Sequence[Worker] | None = None,
    connector: Connector | None = None,
    on_line: LineHandler | None = None,
    interrupt: Interrupt | None = None,
    timeout: float | None = None,
) -> SyncResult:
    """Fetch ``ref`` from ``repo_url`` into ``directory`` on every worker and check it out."""
    fetch = FETCH_REMOTE.format(url=shlex.quote(repo_url), ref=shlex.quote(ref))
    script = CHECKOUT.format(
        before="", dir=shell_path(directory), fetch=fetch, marker=COMMIT_MARKER
    )
    result = await execute_async(
        pod,
        script,
        workers=workers,
        connector=connector,
        on_line=_hide_marker(on_line),
        interrupt=interrupt,
        timeout=timeout,
        on_fail="wait",
    )
    return SyncResult(result, _commits(result))


async def sync_local(
    pod: Pod,
    repo: Path,
    directory: str,
    *,
    workers: Sequence[Worker] | None = None,
    connector: Connector | None = None,
    on_line: LineHandler | None = None,
    interrupt: Interrupt | None = None,
    timeout: float | None = None,
) -> SyncResult:
    """Ship the local repository's HEAD (committed, pushed or not) to every worker."""
    head = _git(repo, "rev-parse", "HEAD")
    quoted_dir = shell_path(directory)
    probe = await execute_async(
        pod,
        f"git -C {quoted_dir} rev-parse HEAD 2>/dev/null || true",
        workers=workers,
        connector=connector,
        interrupt=interrupt,
        timeout=timeout,
    )
    selected = [pod.workers[r.worker.id] for r in probe.workers if r.ok]
    if not selected:
        return SyncResult(probe, {}, head)
    bases = {r.last_line for r in probe.workers if r.ok}
    if bases == {head}:
        return SyncResult(probe, {r.worker.id: head for r in probe.workers if r.ok}, head)
    with tempfile.TemporaryDirectory(prefix="tpupod-sync-") as tmp:
        bundle = Path(tmp) / "head.bundle"
        _bundle(repo, bundle, bases)
        remote_bundle = f"{directory.rstrip('/')}.tpupod-sync.bundle"
        sent = await put(pod, bundle, remote_bundle, workers=selected, connector=connector)
    if not sent.ok:
        return SyncResult(chain(probe, sent), {}, head)
    before = BUNDLE_PATH.format(bundle=shell_path(remote_bundle))
    script = CHECKOUT.format(
        before=before, dir=quoted_dir, fetch=FETCH_BUNDLE, marker=COMMIT_MARKER
    )
    result = await execute_async(
        pod,
        script,
        workers=selected,
        connector=connector,
        on_line=_hide_marker(on_line),
        interrupt=interrupt,
        timeout=timeout,
    )
    return SyncResult(chain(probe, result), _commits(result), head)


def _bundle(repo: Path, bundle: Path, bases: set[str]) -> None:
    """A bundle of HEAD less what every worker has (all of it, if one has nothing we know)."""
    known = [b for b in bases if b and _has_commit(repo, b)]
    exclude = [f"^{b}" for b in known] if len(known) == len(bases) else []
    _git(repo, "bundle", "create", "-q", str(bundle), "HEAD", *exclude)


def _has_commit(repo: Path, sha: str) -> bool:
    proc = subprocess.run(
        ["git", "-C", str(repo), "cat-file", "-e", f"{sha}^{{commit}}"],
        capture_output=True,
        check=False,
    )
    return proc.returncode == 0


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise TpupodError(
            f"git {args[0]} in {repo} failed: {proc.stderr.strip() or proc.stdout.strip()}",
            hint="--from-local ships the local repository's HEAD: run it inside a git repository "
            "with at least one commit",
        )
    return proc.stdout.strip()


def shell_path(path: str) -> str:
    """Quote a path for the shell, keeping a leading ``~/`` expandable."""
    return "~/" + shlex.quote(path[2:]) if path.startswith("~/") else shlex.quote(path)


def _commits(result: FanoutResult) -> dict[int, str]:
    commits = {}
    for r in result.workers:
        for line in reversed(r.tail):
            if line.startswith(COMMIT_MARKER):
                commits[r.worker.id] = line.removeprefix(COMMIT_MARKER).strip()
                break
    return commits


def _hide_marker(on_line: LineHandler | None) -> LineHandler | None:
    if on_line is None:
        return None
    handler = on_line
    return lambda worker, line: (
        None if line.text.startswith(COMMIT_MARKER) else handler(worker, line)
    )


def _most_common(values: list[str]) -> str | None:
    return max(set(values), key=values.count) if values else None
