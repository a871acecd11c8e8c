"""put / get on hosts without SFTP (a tar stream over an exec channel), and without tar.

Each kind of host is a small simulated pod of its own, shared by this module:
sshd with no SFTP subsystem (minimal images, hardened configs), sshd whose
sessions find no ``tar`` (so folders go over SFTP), and sshd with neither.
Hosts with both are test_ops.py's: there folders go by tar and files by SFTP.
"""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CliResult, require
from tests.test_ops import make_tree, trees_equal
from tpupod.ops.transfer import get, put
from tpupod.pod.lifecycle import up
from tpupod.pod.record import Pod
from tpupod.pod.spec import spec_from_mapping
from tpupod.pod.state import StateDir
from tpupod.providers import connect
from tpupod.sim import SimPod, missing_prerequisites
from tpupod.transport import tarstream
from tpupod.transport.sshlib import asyncssh

pytestmark = pytest.mark.ssh

NO_SFTP: dict[str, str | None] = {"Subsystem": None}
# sshd's sessions get this PATH: no tar (SHLVL=1 is the simulated pod's own SetEnv).
NO_TAR: dict[str, str | None] = {"SetEnv": "SHLVL=1 PATH=/var/empty"}
HOME = Path.home()  # root's home on a simulated host (a private overlay of this one's)


def _sim(options: dict[str, str | None], hosts: int = 1) -> Iterator[SimPod]:
    missing = missing_prerequisites()
    require(not missing, f"a simulated pod needs {', '.join(missing)}")
    with SimPod(hosts, sshd_options=options) as sim:
        yield sim


@pytest.fixture(scope="module")
def no_sftp() -> Iterator[SimPod]:
    yield from _sim(NO_SFTP, hosts=2)


@pytest.fixture(scope="module")
def no_tar() -> Iterator[SimPod]:
    yield from _sim(NO_TAR)


@pytest.fixture(scope="module")
def bare() -> Iterator[SimPod]:
    yield from _sim({**NO_SFTP, **NO_TAR})


@pytest.fixture
def pod_on(state_home: Path) -> Callable[[SimPod], Pod]:
    """An SSH pod over a simulated pod's hosts, recorded in this test's state directory."""

    def make(sim: SimPod) -> Pod:
        data = {
            "name": f"t{os.getpid()}-{time.monotonic_ns() % 10**8}",
            "provider": "ssh",
            "hosts": [h.address for h in sim.hosts],
            "user": "root",
            "key": str(sim.key),
        }
        return up(spec_from_mapping(data, "test"), StateDir()).pod

    return make


def on_host(sim: SimPod, command: str, index: int = 0) -> str:
    proc = sim.run_on(index, command)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def modes_and_times(root: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (permission bits, mtime in whole seconds)} of a local tree."""
    found = {".": (root.stat().st_mode & 0o7777, int(root.stat().st_mtime))}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        found[str(path.relative_to(root))] = (st.st_mode & 0o7777, int(st.st_mtime))
    return found


def remote_modes_and_times(sim: SimPod, root: str, index: int = 0) -> dict[str, tuple[int, int]]:
    out = on_host(sim, f"cd {root} && find . -printf '%P %m %T@\\n'", index)
    found = {}
    for line in out.splitlines():
        name, mode, mtime = line.rsplit(" ", 2)
        found[name or "."] = (int(mode, 8), int(float(mtime)))
    return found


def tree_with_modes(root: Path) -> Path:
    make_tree(root)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o750)
    (root / "sub" / "deeper").chmod(0o700)
    (root / "a.txt").chmod(0o600)
    (root / "link").symlink_to("a.txt")
    (root / "ünï cödé.txt").write_text("utf-8 names\n")
    long = root / ("l" * 90) / ("m" * 90)  # past ustar's 100-byte names
    long.mkdir(parents=True)
    (long / ("n" * 120 + ".txt")).write_text("long\n")
    for i, path in enumerate(sorted(root.rglob("*"), reverse=True)):
        os.utime(path, (1_000_000_000 + i, 1_000_000_000 + i), follow_symlinks=False)
    os.utime(root, (999_999_999, 999_999_999))
    return root


# -- hosts without SFTP: everything goes by tar ----------------------------------------------


def test_put_and_get_a_file_without_sftp(
    no_sftp: SimPod, pod_on: Callable[[SimPod], Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = pod_on(no_sftp)
    config = tmp_path / "bench.yaml"
    config.write_text("steps: 3\n")
    config.chmod(0o640)
    os.utime(config, (1_000_000_000, 1_000_000_000))
    result = cli("put", "--pod", pod.name, str(config), "nosftp-file/")
    assert result.code == 0, result.err
    for index in (0, 1):
        assert on_host(no_sftp, f"stat -c '%a %Y' {HOME}/nosftp-file/bench.yaml", index) == (
            "640 1000000000\n"
        )
    result = cli("get", "--pod", pod.name, "nosftp-file/bench.yaml", str(tmp_path / "back"))
    assert result.code == 0, result.err
    for worker in (0, 1):
        copy = tmp_path / "back" / f"worker-{worker}" / "bench.yaml"
        assert copy.read_text() == "steps: 3\n"
        assert (copy.stat().st_mode & 0o777, int(copy.stat().st_mtime)) == (0o640, 1_000_000_000)


def test_put_and_get_a_nested_folder_with_modes_without_sftp(
    no_sftp: SimPod, pod_on: Callable[[SimPod], Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = pod_on(no_sftp)
    source = tree_with_modes(tmp_path / "payload")
    result = cli("put", "--pod", pod.name, str(source), "nosftp-tree/payload")
    assert result.code == 0, result.err
    expected = modes_and_times(source)
    del expected["link"]  # Linux keeps no mode for a symlink, and Python's tarfile no mtime
    remote = remote_modes_and_times(no_sftp, f"{HOME}/nosftp-tree/payload")
    assert {k: v for k, v in remote.items() if k != "link"} == expected
    assert on_host(no_sftp, f"readlink {HOME}/nosftp-tree/payload/link") == "a.txt\n"
    assert on_host(no_sftp, f"ls -A {HOME}/nosftp-tree") == "payload\n"  # nothing staged left

    result = cli("get", "--pod", pod.name, "nosftp-tree/payload", str(tmp_path / "back"))
    assert result.code == 0, result.err
    for worker in (0, 1):
        copy = tmp_path / "back" / f"worker-{worker}" / "payload"
        assert trees_equal(source, copy)
        got = modes_and_times(copy)
        del got["link"]
        assert got == expected
        assert os.readlink(copy / "link") == "a.txt"
        assert sorted(p.name for p in copy.parent.iterdir()) == ["payload"]


def test_put_replaces_a_folder_whole_without_sftp(
    no_sftp: SimPod, pod_on: Callable[[SimPod], Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = pod_on(no_sftp)
    source = make_tree(tmp_path / "data")
    assert cli("put", "--pod", pod.name, str(source), "nosftp-replace/data").code == 0
    (source / "a.txt").unlink()
    (source / "new.txt").write_text("new\n")
    result = cli("put", "--pod", pod.name, str(source), "nosftp-replace/data")
    assert result.code == 0, result.err
    for index in (0, 1):
        assert on_host(no_sftp, f"ls -A {HOME}/nosftp-replace", index) == "data\n"
        listing = on_host(no_sftp, f"cd {HOME}/nosftp-replace/data && find . | sort", index)
        assert listing.split() == sorted(
            ["."] + [f"./{p.relative_to(source)}" for p in source.rglob("*")]
        )


def test_a_file_never_replaces_a_folder_without_sftp(
    no_sftp: SimPod, pod_on: Callable[[SimPod], Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = pod_on(no_sftp)
    for index in (0, 1):
        folder = f"{HOME}/nosftp-kept"
        on_host(no_sftp, f"mkdir -p {folder} && echo important > {folder}/m", index)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    result = cli("put", "--pod", pod.name, str(script), "nosftp-kept")
    assert result.code == 1, result.out + result.err
    assert "nosftp-kept is a folder, and a file does not replace one" in result.out + result.err
    assert "hint: end the destination in / to put train.py inside it" in result.err
    for index in (0, 1):
        assert on_host(no_sftp, f"ls -A {HOME}/nosftp-kept; cat {HOME}/nosftp-kept/m", index) == (
            "m\nimportant\n"
        )


def test_get_of_a_missing_path_without_sftp(
    no_sftp: SimPod, pod_on: Callable[[SimPod], Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = pod_on(no_sftp)
    result = cli("get", "--pod", pod.name, "no/such/thing", str(tmp_path / "out"))
    assert result.code == 1
    assert "no such file or folder" in result.out + result.err
    assert "Traceback" not in result.out + result.err
    assert not any((tmp_path / "out").glob("worker-*/*"))


def test_tilde_paths_without_sftp(
    no_sftp: SimPod, pod_on: Callable[[SimPod], Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = pod_on(no_sftp)
    source = make_tree(tmp_path / "tilde")
    assert cli("put", "--pod", pod.name, str(source), "~/nosftp-tilde/").code == 0
    assert on_host(no_sftp, f"cat {HOME}/nosftp-tilde/tilde/a.txt") == "alpha\n"
    result = cli("get", "--pod", pod.name, "~/nosftp-tilde/tilde", str(tmp_path / "back"))
    assert result.code == 0, result.err
    assert trees_equal(source, tmp_path / "back" / "worker-0" / "tilde")


def test_odd_names_are_quoted_not_run(
    no_sftp: SimPod, pod_on: Callable[[SimPod], Pod], tmp_path: Path
) -> None:
    pod = pod_on(no_sftp)
    odd = "we ird/-$(touch pwned)'q\"; x"
    source = tmp_path / "f"
    source.write_text("odd\n")
    assert asyncio.run(put(pod, source, f"nosftp-odd/{odd}")).ok
    result = asyncio.run(get(pod, f"nosftp-odd/{odd}", tmp_path / "back"))
    assert result.ok, [w.error for w in result.workers]
    assert (tmp_path / "back" / "worker-0" / odd.rsplit("/", 1)[1]).read_text() == "odd\n"
    assert on_host(no_sftp, f"[ ! -e {HOME}/pwned ] && echo none") == "none\n"


def test_sftp_is_asked_once_a_connection(
    no_sftp: SimPod,
    pod_on: Callable[[SimPod], Pod],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pod = pod_on(no_sftp)
    asked: list[object] = []
    start = asyncssh.SSHClientConnection.start_sftp_client

    def counting(self: asyncssh.SSHClientConnection, *args: object, **kwargs: object) -> object:
        asked.append(self)
        return start(self, *args, **kwargs)

    monkeypatch.setattr(asyncssh.SSHClientConnection, "start_sftp_client", counting)
    source = tmp_path / "f.txt"
    source.write_text("x\n")

    async def three_puts() -> None:
        connector = connect(pod)
        try:
            for _ in range(3):
                assert (await put(pod, source, "nosftp-once/f.txt", connector=connector)).ok
        finally:
            await connector.close()

    asyncio.run(three_puts())
    assert len(asked) == 2  # once per host's connection, not once per put


def test_an_upload_cut_short_leaves_the_target_alone(
    no_sftp: SimPod,
    pod_on: Callable[[SimPod], Pod],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pod = pod_on(no_sftp)
    source = make_tree(tmp_path / "data")
    assert asyncio.run(put(pod, source, "nosftp-cut/data")).ok
    before = on_host(no_sftp, f"cd {HOME}/nosftp-cut && find . | sort")

    def cut_short(local: Path, arcname: str, sink: tarstream._Sink) -> None:
        # A whole archive of the folder, but the packer fails before the done marker:
        # to the host's tar this looks complete.
        with tarfile.TarFile(fileobj=sink, mode="w") as archive:
            archive.add(str(tmp_path / "other"), arcname=arcname)
        sink.send()
        raise OSError(28, "No space left on device", str(local))

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("partial\n")
    monkeypatch.setattr(tarstream, "pack", cut_short)
    result = asyncio.run(put(pod, source, "nosftp-cut/data"))
    assert not result.ok
    assert all("no space left on device" in (w.error or "") for w in result.workers)
    assert on_host(no_sftp, f"cd {HOME}/nosftp-cut && find . | sort") == before


# -- hosts without tar: folders go over SFTP; without either: one line -----------------------


def test_folders_go_over_sftp_where_tar_is_missing(
    no_tar: SimPod, pod_on: Callable[[SimPod], Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = pod_on(no_tar)
    source = make_tree(tmp_path / "data")
    assert cli("put", "--pod", pod.name, str(source), "notar/data").code == 0
    assert cli("put", "--pod", pod.name, str(source), "notar/data").code == 0  # replaces
    assert on_host(no_tar, f"ls -A {HOME}/notar") == "data\n"
    result = cli("get", "--pod", pod.name, "notar/data", str(tmp_path / "back"))
    assert result.code == 0, result.err
    assert trees_equal(source, tmp_path / "back" / "worker-0" / "data")


def test_no_sftp_and_no_tar_is_one_line_with_a_hint(
    bare: SimPod, pod_on: Callable[[SimPod], Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = pod_on(bare)
    source = make_tree(tmp_path / "data")
    for args in (
        ("put", str(source), "bare/data"),
        ("put", str(source / "a.txt"), "bare/a.txt"),
        ("get", "bare/data", str(tmp_path / "back")),
    ):
        result = cli(args[0], "--pod", pod.name, *args[1:])
        text = result.out + result.err
        assert result.code == 1, text
        assert "neither SFTP nor tar" in text and "Subsystem sftp internal-sftp" in text
        assert "Traceback" not in text
    assert not any((tmp_path / "back").glob("worker-*/*"))


# -- the unpacker refuses what a well-behaved host never sends -------------------------------


def archive(*members: tuple[str, bytes | str | None]) -> io.BytesIO:
    """A tar stream: (name, bytes) is a file, (name, None) a folder, (name, "->x") a symlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content.removeprefix("->")
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    buf.seek(0)
    return buf


@pytest.mark.unit
@pytest.mark.parametrize(
    ("members", "error"),
    [
        ((("./top", None), ("./elsewhere", b"x")), "unexpected member"),
        ((("./top", None), ("./top/../../x", b"x")), "unexpected member"),
        ((("./top", None), ("./top/l", "->/etc"), ("./top/l/passwd", b"x")), "through a link"),
        ((("./top", None), ("./top/l", "->/tmp/x"), ("./top/l", b"x")), "through a link"),
    ],
)
def test_unpack_refuses_members_outside_the_folder(
    members: tuple[tuple[str, bytes | str | None], ...], error: str, tmp_path: Path
) -> None:
    with pytest.raises(tarstream.TarStreamError, match=error):
        tarstream.unpack(archive(*members), "top", tmp_path / "dest")  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


@pytest.mark.unit
def test_unpack_renames_the_top_and_keeps_symlinks(tmp_path: Path) -> None:
    stream = archive(("./top", None), ("./top/a", b"alpha"), ("./top/l", "->/somewhere/else"))
    tarstream.unpack(stream, "top", tmp_path / ".dest.staged")  # type: ignore[arg-type]
    assert (tmp_path / ".dest.staged" / "a").read_bytes() == b"alpha"
    assert os.readlink(tmp_path / ".dest.staged" / "l") == "/somewhere/else"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("status", "stderr", "local", "reason"),
    [
        (127, b"tpupod-no-tar\n", None, "no tar on the host"),
        (2, b"tpupod-missing\n", tarfile.ReadError("empty file"), "no such file or folder"),
        # the host's own words beat a broken stream that they explain
        (2, b"tar: ./x: Cannot open: Permission denied\n", tarfile.ReadError("bad"), "./x: Cannot"),
        # a local file's failure beats the host's complaint about the cut stream
        (
            1,
            b"tpupod-cut-short\n",
            OSError(13, "Permission denied", "/data/x"),
            "permission denied",
        ),
        (None, b"", None, "the connection closed"),
    ],
)
def test_a_failed_transfer_is_one_line_naming_the_cause(
    status: int | None, stderr: bytes, local: Exception | None, reason: str
) -> None:
    error = tarstream._why(status, stderr, local)
    assert error.reason.startswith(reason) and "\n" not in error.reason


@pytest.mark.unit
def test_a_file_that_changed_while_read_is_not_a_failed_get() -> None:
    assert tarstream._only_changed(b"tar: ./logs/run.log: file changed as we read it\n")
    assert not tarstream._only_changed(b"tar: ./x: Cannot open: Permission denied\n")
    assert not tarstream._only_changed(b"")
