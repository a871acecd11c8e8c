"""Containers on every worker, with real podman: ``run --image``, ``exec --image``, cleanup.

Podman runs with its stock configuration (no containers.conf: this machine's hard limits,
nofile 20,000, are below podman's defaults, and tpupod fits them); only the storage is the
tests' own. No image registry is reachable, so the base image is a busybox-static rootfs
(``podman import``).
Programs that need Python mount the host's /usr and the venv's interpreter read-only; the
run's directory (this repository, with its .venv) is mounted by ``run`` itself.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CliResult, end_run, require, sim_leftovers, tpupod_argv
from tpupod.errors import UsageError
from tpupod.fanout.report import print_summary
from tpupod.fanout.results import FanoutResult, Outcome, WorkerResult
from tpupod.image.containerize import PODMAN_DEFAULT_LIMIT, Container, Mount, explain, wrap
from tpupod.pod.record import Pod, Worker
from tpupod.sim import SimPod
from tpupod.transport import ExitStatus

REPO = Path(__file__).resolve().parent.parent
CACHE = Path("/var/tmp/tpupod-test-podman")
BUSYBOX = Path("/bin/busybox")
APPLETS = ("sh", "echo", "cat", "sleep", "true", "false", "env", "ls", "kill", "trap")
# The venv's python is a symlink to an interpreter outside the repository (pyenv's, or
# /usr/bin/python3.x): the container needs that interpreter's folder and the host's /usr.
PYTHON_HOME = Path(os.path.realpath(REPO / ".venv/bin/python")).parent.parent
PYTHON_MOUNTS = ["--mount", "/usr:/usr:ro"]
if not str(PYTHON_HOME).startswith("/usr/"):
    PYTHON_MOUNTS += ["--mount", f"{PYTHON_HOME}:{PYTHON_HOME}:ro"]


def storage_conf(root: Path) -> str:
    return f'[storage]\ndriver = "overlay"\ngraphroot = "{root}/graph"\nrunroot = "{root}/run"\n'


def cgroup_mounts() -> str:
    """Shell that mounts this machine's cgroup hierarchies where they are missing."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")
        fstype, _, options = fields[1].split(" ", 2)
        if fstype in ("cgroup", "cgroup2"):
            point = fields[0].split()[4]
            flag = options.split()[-1] if fstype == "cgroup" else ""
            opts = f"-o {flag} " if flag else ""
            mounts.append(f"mkdir -p {point} && mount -t {fstype} {opts}{fstype} {point}")
    top = "mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup && " if len(mounts) > 1 else ""
    return f"grep -q ' - cgroup' /proc/self/mountinfo || {{ {top}{' && '.join(mounts)}; }}"


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check)


def import_base_image(tag: str, work: Path) -> None:
    """A busybox-static rootfs whose /lib and /lib64 lead into /usr (mounted from the host)."""
    root = work / "rootfs"
    (root / "bin").mkdir(parents=True)
    for folder in ("tmp", "etc", "usr"):
        (root / folder).mkdir()
    shutil.copy2(BUSYBOX, root / "bin/busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "lib").symlink_to("usr/lib")
    (root / "lib64").symlink_to("usr/lib64")
    archive = work / "rootfs.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(root, arcname=".")
    podman("import", "-q", str(archive), tag)


@pytest.fixture(scope="session")
def podman_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Podman as installed (no containers.conf), in a storage of the tests' own, and the tag
    of a busybox base image, cached between runs under a name keyed by what went into it."""
    require(shutil.which("podman") is not None, "podman is not installed (Debian's podman)")
    require(BUSYBOX.exists(), "busybox is not installed (Debian's busybox-static)")
    require(os.geteuid() == 0, "the container tests run podman as root")
    CACHE.mkdir(parents=True, exist_ok=True)
    storage = CACHE / "storage.conf"
    storage.write_text(storage_conf(CACHE / "storage"))
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("CONTAINERS_CONF", raising=False)
        patch.setenv("CONTAINERS_STORAGE_CONF", str(storage))
        key = hashlib.sha256(BUSYBOX.read_bytes() + repr(APPLETS).encode()).hexdigest()[:12]
        tag = f"tpupod-test-base:{key}"
        if podman("image", "exists", tag, check=False).returncode != 0:
            import_base_image(tag, tmp_path_factory.mktemp("base"))
        yield tag


def containers() -> list[str]:
    """Names of every tpupod container in the tests' storage, running or not."""
    out = podman("ps", "-a", "--filter", "name=^tpupod-", "--format", "{{.Names}}").stdout
    return out.split()


def wait_no_containers(timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := containers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


# -- unit: the command line -----------------------------------------------------------------


def test_a_mount_is_src_dst_and_an_optional_mode() -> None:
    assert Mount.parse("/data:/data:ro") == Mount("/data", "/data", "ro")
    assert Mount.parse("~/my data:/x").volume() == "\"$HOME\"/'my data:/x'"
    for bad in ("/data", "/a:b", ":/b", "/a:/b:rx:y"):
        with pytest.raises(UsageError):
            Mount.parse(bad)


def test_the_wrapped_command_names_the_container_and_passes_identity() -> None:
    container = Container("app:1", engine="podman", env_names=("FOO",), mounts=(Mount("/d", "/d"),))
    script = wrap("python train.py 'a b'", container, "L1")
    assert '--name "tpupod-L1-w${TPUPOD_WORKER_ID:-0}"' in script
    assert "--network=host" in script and "--rm" in script and "-e FOO" in script
    assert "TPUPOD_*|TPU_*|JAX_*" in script and "/dev/accel* /dev/vfio/*" in script
    assert "app:1 /bin/sh -c 'python train.py '\"'\"'a b'\"'\"''" in script
    assert "--privileged" not in script
    assert "--privileged" in wrap("x", Container("app:1", privileged=True), "L1")


def refused(kind: int, engine: str = "Error: runc: runc create failed") -> str:
    """What Debian's podman (or Docker's daemon) prints when a container's limit is refused."""
    return (
        f"{engine}: unable to start container process: error during container init: error "
        f"setting rlimits for ready process: error setting rlimit type {kind}: operation not "
        "permitted: OCI permission denied"
    )


def test_a_limit_the_engine_cannot_give_gets_a_hint_naming_it() -> None:
    """The summary's first failure says which limit of default_ulimits to change and how
    (each followed for real in the test below); Docker's daemon has no containers.conf."""
    workers = [Worker(id=i, hostname="vm", internal_address="127.0.0.1") for i in range(4)]
    results = [
        WorkerResult(workers[0], Outcome.FAILED, 0.2, ExitStatus(126), tail=(refused(6),)),
        WorkerResult(workers[1], Outcome.FAILED, 0.2, ExitStatus(126), tail=(refused(8),)),
        WorkerResult(workers[2], Outcome.FAILED, 0.2, ExitStatus(1), tail=("boom",)),
        WorkerResult(
            workers[3],
            Outcome.FAILED,
            0.2,
            ExitStatus(126),
            tail=(refused(7, "docker: Error response from daemon: failed to create task"),),
        ),
    ]
    explained = explain(FanoutResult("x", results, 0.3, failure_order=[0, 1, 2, 3]))
    hints = [w.hint for w in explained.workers]
    assert hints[0] is not None and "more nproc than this worker allows" in hints[0]
    assert "the lower of the worker's 'ulimit -Hu' and /proc/sys/kernel/pid_max" in hints[0]
    assert hints[1] is not None and "remove memlock (the container then gets" in hints[1]
    assert hints[2] is None and hints[3] is None
    out = io.StringIO()
    print_summary(explained, out, "run", color=False)
    assert out.getvalue().splitlines()[-1].startswith("hint: the engine asks for more nproc")


def engine_limits() -> tuple[int, int]:
    """The most nofile and nproc podman can give a container here: the hard limits, nproc
    also within kernel.pid_max (podman lowers its own nproc to pid_max as it starts)."""
    nofile, nproc = (
        resource.getrlimit(r)[1] for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC)
    )
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return nofile, pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)


def limited_cli(nofile: int, *args: str, timeout: float = 50) -> CliResult:
    """``tpupod ARGS`` started from a shell whose hard nofile limit is ``nofile``."""
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", "-c", f'ulimit -n {nofile} && exec "$@"', "bash", *tpupod_argv(*args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


# -- local pods: run and exec in containers -------------------------------------------------


@pytest.mark.timeout(60)
def test_exec_in_a_container_on_every_worker(
    podman_env: str, make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(2)
    (tmp_path / "data.txt").write_text("shared data\n")
    result = cli(
        "exec", "--pod", pod.name, "--image", podman_env, "--mount", f"{tmp_path}:/data:ro",
        "-e", "GREETING=hello", "--",
        'echo "$GREETING from $TPUPOD_WORKER_ID of $TPUPOD_NUM_WORKERS"; cat /data/data.txt; '
        "cat /proc/1/cmdline | tr '\\0' ' '",
    )  # fmt: skip
    assert result.code == 0, result.err
    for i in range(2):
        assert f"[w{i}] hello from {i} of 2" in result.out
        assert f"[w{i}] shared data" in result.out
    assert result.out.count("/run/podman-init -- /bin/sh") == 2  # --init: passes signals on
    assert containers() == []


@pytest.mark.timeout(60)
def test_exec_image_on_the_engines_stock_configuration_fits_the_workers_limits(
    podman_env: str, make_pod: Callable[..., Pod], state_home: Path
) -> None:
    """No containers.conf (the fixture's podman is as installed). Where the host's hard
    limits are below podman's defaults (here nofile 20,000), plain ``podman run`` is refused;
    tpupod's container gets the limits of the shell that runs the engine on the worker
    (on a local pod the launcher's, lowered here to tell them from the machine's)."""
    system = Path("/etc/containers/containers.conf")
    assert not system.exists() or "default_ulimits" not in system.read_text()
    nofile, nproc = engine_limits()
    if min(nofile, nproc) < PODMAN_DEFAULT_LIMIT:
        plain = podman("run", "--rm", podman_env, "true", check=False)
        assert plain.returncode == 126 and "error setting rlimit type" in plain.stderr
    pod = make_pod(2)
    lowered = nofile // 2
    script = "ulimit -Hn; ulimit -Hu; ulimit -Sn"
    result = limited_cli(lowered, "exec", "--pod", pod.name, "--image", podman_env, "--", script)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    for i in range(2):
        assert lines.count(f"[w{i}] {lowered}") == 2 and f"[w{i}] {nproc}" in lines
    assert containers() == []


@pytest.mark.timeout(90)
def test_the_hint_for_a_limit_of_containers_conf_works_as_written(
    podman_env: str, make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """A containers.conf that names default_ulimits governs (a --ulimit would make podman drop
    them all, so tpupod passes none). A limit it sets above what the worker allows gets a
    hint, and doing what the hint says starts the container: the host's own hard nproc (what
    tpupod once advised) is refused here, the lower of it and pid_max is not; a memlock above
    the host's is removed, and the container has the host's own."""
    nofile, nproc = engine_limits()
    hard_nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    pod = make_pod(1)
    conf = tmp_path / "containers.conf"

    def attempt(*ulimits: str) -> CliResult:
        listed = ", ".join(f'"{u}"' for u in ulimits)
        conf.write_text(f"[containers]\ndefault_ulimits = [{listed}]\n")
        argv = ["exec", "--pod", pod.name, "--image", podman_env, "--", "ulimit -Hu; ulimit -Hl"]
        return cli(*argv, env={"CONTAINERS_CONF": str(conf)})

    fits = [f"nofile={nofile}:{nofile}", f"nproc={nproc}:{nproc}"]
    wrongs = [f"nofile={nofile + 1}:{nofile + 1}"]
    if hard_nproc != resource.RLIM_INFINITY and hard_nproc > nproc:  # here 96,365 > 32,768
        wrongs += [f"nproc={hard_nproc}:{hard_nproc}"]
    if memlock != resource.RLIM_INFINITY:
        wrongs += [f"memlock={2 * memlock}:{2 * memlock}"]
    expected = {
        "nofile": "lower nofile to at most the worker's 'ulimit -Hn'",
        "nproc": "lower nproc to at most the lower of the worker's 'ulimit -Hu' and",
        "memlock": "remove memlock (the container then gets the worker's own)",
    }
    for wrong in wrongs:
        name = wrong.split("=")[0]
        result = attempt(*[u for u in fits if not u.startswith(f"{name}=")], wrong)
        assert result.code == 126, result.err
        assert f"hint: the engine asks for more {name} than this worker allows" in result.err
        assert expected[name] in result.err
    fitted = attempt(*fits)  # what the hints say: the lowered limits, no memlock
    assert fitted.code == 0, fitted.err
    assert f"[w0] {nproc}" in fitted.out
    if memlock != resource.RLIM_INFINITY:
        assert f"[w0] {memlock // 1024}" in fitted.out  # the host's own (ulimit -l is in KiB)
    assert containers() == []


@pytest.mark.timeout(90)
def test_run_image_lockstep_jax_across_two_workers(
    podman_env: str, make_pod: Callable[..., Pod], cli: Callable[..., CliResult]
) -> None:
    pod = make_pod(2, devices=2)
    result = cli(
        "run", "--pod", pod.name, "--image", podman_env, *PYTHON_MOUNTS, "--",
        ".venv/bin/python", "examples/lockstep_sum.py",
        timeout=80,
    )  # fmt: skip
    assert result.code == 0, result.err[-3000:]
    for i in range(2):
        assert (
            f"[w{i}] worker {i} of 2: 4 devices in the mesh, cross-host sum 10 (expected 10)"
            in (result.out)
        )
    assert containers() == []


@pytest.mark.timeout(120)
def test_stacks_of_a_hung_program_in_containers(
    podman_env: str, make_pod: Callable[..., Pod], cli: Callable[..., CliResult], state_home: Path
) -> None:
    """Issue 40: `tpupod stacks` reads a program inside its container (py-spy on the host
    finds it by the environment the container passes through) and names the odd worker."""
    require(shutil.which("py-spy", path=str(Path(".venv/bin").resolve())) is not None, "py-spy")
    pod = make_pod(2)
    run = subprocess.Popen(
        tpupod_argv("run", "--pod", pod.name, "--image", podman_env, *PYTHON_MOUNTS, "--",
                    ".venv/bin/python", "tests/programs/hang_plain.py", "hang"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        logs = state_home / "pods" / pod.name / "runs"
        deadline = time.monotonic() + 90
        # w0 waits for its peer (it logged step 5), w1 is stuck loading step 3, and the
        # launcher's progress.json has w0 ahead: what orders two groups of one worker each
        while not (waiting(logs) and ahead(logs)):
            assert run.poll() is None and time.monotonic() < deadline, "never blocked"
            time.sleep(0.2)
        taken = cli("stacks", "--pod", pod.name, timeout=60)
        assert taken.code == 0, taken.err
        lines = taken.out.splitlines()
        assert lines[0].startswith("w1 (1 of 2): next_batch hang_plain.py:"), taken.out
        assert lines[1].startswith("w0 (1 of 2): wait_for_peers hang_plain.py:"), taken.out
    finally:
        end_run(run)
    assert wait_no_containers() == []


def waiting(runs: Path) -> bool:
    """w0 logged step 5 (then it waits for its peer) and w1 is loading step 3."""
    w0, w1 = (list(runs.glob(f"*/w{i}.log")) for i in (0, 1))
    return bool(w0 and w1) and "step 5" in w0[0].read_text() and "loading" in w1[0].read_text()


def ahead(runs: Path) -> bool:
    """The launcher's progress.json has w0's step past w1's."""
    for path in runs.glob("*/progress.json"):
        steps = {w: v.get("step") for w, v in json.loads(path.read_text())["workers"].items()}
        if steps.get("0") is not None and (steps.get("1") or 0) < steps["0"]:
            return True
    return False


@pytest.mark.timeout(60)
def test_a_failing_container_stops_the_others_and_none_is_left(
    podman_env: str,
    make_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
    leftovers: Callable[[Pod], list[str]],
) -> None:
    pod = make_pod(3)
    program = (
        'if [ "$TPUPOD_WORKER_ID" = 1 ]; then sleep 1; echo failing; exit 3; fi; '
        'trap "" TERM; echo waiting; sleep 60'  # deaf to TERM, as JAX is: KILL after the grace
    )
    result = cli("run", "--pod", pod.name, "--grace", "1", "--image", podman_env, "--", program)
    assert result.code == 3, result.err
    assert "first failure: w1" in result.err
    assert result.err.count("stopped after w1 failed") == 2
    assert result.seconds < 15
    assert containers() == []
    assert leftovers(pod) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["ctrl-c", "timeout", "launcher killed", "exec timeout"])
def test_an_interrupted_run_leaves_no_container(
    podman_env: str, make_pod: Callable[..., Pod], state_home: Path, how: str
) -> None:
    pod = make_pod(2)
    argv = ["exec" if how == "exec timeout" else "run", "--pod", pod.name, "--grace", "1"]
    argv += ["--image", podman_env, *(["--timeout", "2"] if "timeout" in how else [])]
    launcher = subprocess.Popen(
        tpupod_argv(*argv, "--", "echo started; sleep 60"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None
    assert all("started" in launcher.stdout.readline() for _ in range(2))
    assert len(containers()) == 2
    if "timeout" not in how:
        launcher.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
    _, err = launcher.communicate(timeout=30)
    expected = {"ctrl-c": 130, "launcher killed": -signal.SIGKILL}.get(how, 124)
    assert launcher.returncode == expected, err
    if how == "launcher killed":  # the orphan guard ends the clients, the reapers the rest
        assert wait_no_containers() == []
    else:
        assert containers() == []


@pytest.mark.timeout(60)
def test_a_missing_image_or_engine_is_an_error_with_a_hint(
    podman_env: str, make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(2)
    missing = cli("run", "--pod", pod.name, "--image", "nosuch:1", "--", "true")
    assert missing.code != 0
    assert "error: image nosuch:1 is not on w0, w1" in missing.err
    assert "hint: 'tpupod image build" in missing.err
    # A PATH with every program but the engines: the workers have no engine.
    bare = tmp_path / "bin"
    bare.mkdir()
    for folder in ("/usr/local/bin", "/usr/bin"):
        for program in Path(folder).iterdir():
            if program.name not in ("podman", "docker") and not (bare / program.name).exists():
                (bare / program.name).symlink_to(program)
    result = cli(
        "exec", "--pod", pod.name, "--image", podman_env, "--", "true", env={"PATH": str(bare)}
    )
    assert result.code != 0
    assert "error: no container engine on w0" in result.err
    assert "hint: 'tpupod setup --docker' installs one on every worker" in result.err
    assert "Traceback" not in result.err


@pytest.mark.timeout(60)
def test_docker_without_its_daemon_says_so(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """The real docker CLI, pointed at a socket nobody listens on (no daemon runs here): every
    command that asks the engine says the daemon does not answer, in Docker's own words."""
    require(shutil.which("docker") is not None, "the docker CLI is not installed")
    pod = make_pod(2)
    nowhere = f"unix://{tmp_path}/docker.sock"
    context = busybox_context(tmp_path / "context", "")
    for argv in (
        ["image", "ls", "-p", pod.name, "--engine", "docker"],
        ["exec", "-p", pod.name, "--engine", "docker", "--image", "app:1", "--", "true"],
        ["run", "-p", pod.name, "--image", "app:1", "--", "true"],  # DOCKER_HOST picks docker
        ["image", "build", "-p", pod.name, "--engine", "docker", "-t", "app:1", str(context)],
    ):
        result = cli(*argv, env={"DOCKER_HOST": nowhere})
        assert result.code == 1, result.err
        assert result.err.splitlines() == [
            "error: cannot reach the docker daemon on w0 (vm): Cannot connect to the Docker "
            f"daemon at {nowhere}. Is the docker daemon running?",
            "hint: 'tpupod setup --docker --force' starts Docker on every worker (installs it "
            "where missing), or use --engine podman",
        ], argv


def test_container_options_need_an_image(cli: Callable[..., CliResult]) -> None:
    result = cli("exec", "--mount", "/a:/b", "--", "true")
    assert result.code == 2
    assert "--mount, --engine and --privileged go with --image" in result.err


# -- image build, distribution and ls -------------------------------------------------------


def busybox_context(folder: Path, dockerfile: str) -> Path:
    """A build context whose Dockerfile starts FROM scratch with a busybox rootfs: it builds
    in any storage, no base image needed (a simulated host's storage starts empty)."""
    root = folder / "rootfs"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin/busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "lib").symlink_to("usr/lib")  # into the host's /usr, where a test mounts it
    (root / "lib64").symlink_to("usr/lib64")
    (folder / "Dockerfile").write_text("FROM scratch\nCOPY rootfs/ /\n" + dockerfile)
    return folder


@pytest.mark.timeout(60)
def test_build_once_on_a_local_pod_and_list_it(
    podman_env: str, make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(3)
    tag = f"tpupod-test-app:{pod.name}"
    context = busybox_context(tmp_path, 'RUN echo "built at $(date +%s%N)" > /built\n')
    try:
        result = cli("image", "build", "--pod", pod.name, "-t", tag, str(context), timeout=50)
        assert result.code == 0, result.err
        assert "tpupod: w0 (vm): building" in result.err
        rows = result.out.splitlines()
        assert rows[0].startswith(f"{tag}: ") and rows[0].endswith("on 3 workers")
        assert "built in" in rows[1] and "shares w0's storage" in rows[2]  # one storage here
        image_id = rows[0].split()[1]
        listed = cli("image", "ls", "--pod", pod.name)
        assert listed.code == 0, listed.err
        assert listed.out.splitlines()[0].split() == ["TAG", "IMAGE", "ID", "ON", "MISSING", "ON"]
        assert [tag, image_id, "w0-2", "-"] in [line.split() for line in listed.out.splitlines()]
        ran = cli("exec", "--pod", pod.name, "--image", tag, "--", "cat /built")
        assert ran.code == 0 and ran.out.count("built at") == 3, ran.err
    finally:
        podman("rmi", "-f", tag, check=False)


@pytest.mark.timeout(60)
def test_a_bad_dockerfile_names_the_worker_and_the_step(
    podman_env: str, make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    pod = make_pod(2)
    context = busybox_context(tmp_path, "RUN echo fine\nRUN echo about to fail; exit 7\n")
    result = cli("image", "build", "--pod", pod.name, "-t", "tpupod-test-bad:1", str(context))
    assert result.code == 1
    assert "error: build of tpupod-test-bad:1 failed on w0 (vm) at step 4/4 (RUN echo about" in (
        result.err
    )
    assert "exit status 7" in result.err
    assert "hint: fix the Dockerfile" in result.err
    assert "Traceback" not in result.err
    missing = cli("image", "build", "--pod", pod.name, "-t", "x:1", str(tmp_path / "nothing"))
    assert missing.code == 2 and "is not a folder" in missing.err


@pytest.fixture
def ssh_pod_with_own_storages(
    podman_env: str, make_ssh_pod: Callable[..., Pod], sim: SimPod
) -> Iterator[Pod]:
    """An SSH pod whose hosts each have an engine storage of their own, as real hosts do.

    The simulated hosts share this machine's files, but each has its own home (an
    overlay): the same ~/.tpupod-test-storage.conf names a different folder on each.
    They also get this machine's cgroup mounts, which a real host has and runc needs
    (``ip netns exec`` mounts a fresh /sys without them).
    """
    for host in sim.hosts:
        root = CACHE / f"sim-{host.hostname}"
        conf = f"cat > ~/.tpupod-test-storage.conf <<'EOF'\n{storage_conf(root)}EOF\n"
        setup = f"{cgroup_mounts()}\n{conf}"
        done = sim.run_on(host.index, setup)
        assert done.returncode == 0, done.stderr
    yield make_ssh_pod(4, env={"CONTAINERS_STORAGE_CONF": "/root/.tpupod-test-storage.conf"})


@pytest.mark.timeout(120)
def test_build_once_and_load_on_every_host_of_an_ssh_pod(
    ssh_pod_with_own_storages: Pod, cli: Callable[..., CliResult], sim: SimPod, tmp_path: Path
) -> None:
    pod = ssh_pod_with_own_storages
    tag = f"tpupod-test-ssh:{pod.name}"
    context = busybox_context(tmp_path, 'RUN echo "built at $(date +%s%N)" > /built\n')
    try:
        result = cli("image", "build", "--pod", pod.name, "-t", tag, str(context), timeout=100)
        assert result.code == 0, result.err
        for i in range(1, 4):
            assert f"tpupod: w{i} (host-{i}): sending" in result.err
            assert f"tpupod: w{i}: loaded in" in result.err
        assert result.out.count("loaded in") == 3
        image_id = result.out.split()[1]
        for host in sim.hosts:  # in each host's own storage, at the same id
            own = sim.run_on(
                host.index,
                "CONTAINERS_STORAGE_CONF=~/.tpupod-test-storage.conf "
                f"podman image inspect --format '{{{{.Id}}}}' {tag}",
            )
            assert own.stdout.startswith(image_id), own.stderr
        listed = cli("image", "ls", "--pod", pod.name)
        assert [tag, image_id, "w0-3", "-"] in [line.split() for line in listed.out.splitlines()]
        # The limits are each host's own, read there: not the launcher's (lowered here).
        nofile = engine_limits()[0]
        script = "cat /built; hostname; echo nofile $(ulimit -Hn)"
        ran = limited_cli(nofile // 2, "exec", "-p", pod.name, "--image", tag, "--", script)
        assert ran.code == 0, ran.err
        built = {line.split(" ", 1)[1] for line in ran.out.splitlines() if "built at" in line}
        assert len(built) == 1 and ran.out.count("built at") == 4  # one build, on every host
        assert all(f"[w{i}] host-{i}" in ran.out for i in range(4))
        assert ran.out.count(f"] nofile {nofile}\n") == 4
        assert sim_leftovers(sim) == []
    finally:
        for host in sim.hosts:
            sim.run_on(
                host.index,
                f"CONTAINERS_STORAGE_CONF=~/.tpupod-test-storage.conf podman rmi -f {tag}",
            )


# -- setup --docker -------------------------------------------------------------------------

STUBS = {
    # apt-get install puts a docker client and daemon in place (as the package would)
    "apt-get": 'echo "apt-get $*" >> "$STUB_LOG"\n'
    'if [ "$*" != "${*%docker.io}" ]; then for p in docker dockerd; do\n'
    '  cp "$STUB_BIN/docker.later" "$STUB_BIN/$p"; done; fi',
    "systemctl": 'echo "systemctl $*" >> "$STUB_LOG"',
    "service": 'echo "service $*" >> "$STUB_LOG"',
    "docker.later": 'echo "docker $*" >> "$STUB_LOG"\n'
    'case "$*" in *ServerVersion*) echo "docker 26.1 ready";; esac',
}


@pytest.mark.timeout(60)
def test_setup_docker_installs_starts_and_is_idempotent(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """apt cannot install a daemon in this test machine: apt-get, systemctl, service and the
    docker it installs are stand-ins that record their calls, in front of the real PATH."""
    pod = make_pod(2)
    stubs, log = tmp_path / "bin", tmp_path / "calls.log"
    stubs.mkdir()
    for name, body in STUBS.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    path = os.pathsep.join([str(stubs), *os.environ["PATH"].split(os.pathsep)])
    path = os.pathsep.join(p for p in path.split(os.pathsep) if p != "/usr/local/bin")
    env = {"PATH": path, "STUB_LOG": str(log), "STUB_BIN": str(stubs)}
    first = cli("setup", "--pod", pod.name, "--worker", "0", "--docker", env=env)
    assert first.code == 0, first.err
    assert "[w0] installing docker.io" in first.out and "[w0] docker 26.1 ready" in first.out
    calls = log.read_text().splitlines()
    assert "apt-get install -y -q docker.io" in calls
    assert any(c in calls for c in ("systemctl enable --now docker", "service docker start"))
    again = cli("setup", "--pod", pod.name, "--worker", "0", "--docker", env=env)
    assert again.code == 0 and "already set up with this script" in again.out
    # What the hint for a daemon that does not answer says: --force starts it again.
    starts = ("systemctl enable --now docker", "service docker start")
    forced = cli("setup", "--pod", pod.name, "--worker", "0", "--docker", "--force", env=env)
    assert forced.code == 0 and "[w0] docker 26.1 ready" in forced.out, forced.err
    calls = log.read_text().splitlines()
    assert sum(c in starts for c in calls) == 2 and calls.count("apt-get update -q") == 1
    neither = cli("setup", "--pod", pod.name)
    assert neither.code == 2 and "one of --script FILE and --docker" in neither.err


@pytest.mark.timeout(120)
def test_build_on_each_host_gives_one_id_or_names_the_difference(
    ssh_pod_with_own_storages: Pod, cli: Callable[..., CliResult], sim: SimPod, tmp_path: Path
) -> None:
    pod = ssh_pod_with_own_storages
    tag = f"tpupod-test-each:{pod.name}"
    same = busybox_context(tmp_path / "same", "RUN echo same > /same\n")
    try:
        result = cli("image", "build", "--on-each", "-p", pod.name, "-t", tag, str(same))
        assert result.code == 0, result.err
        assert result.out.count("built in") == 4 and "MB" not in result.err  # no image sent
        differs = busybox_context(tmp_path / "differs", "RUN od -An -N8 -tx8 /dev/urandom > /r\n")
        odd = cli("image", "build", "--on-each", "-p", pod.name, "-t", tag, str(differs))
        assert odd.code == 1
        assert f"error: {tag} is not the same image on every worker (w0: " in odd.err
        assert "build once (without --on-each)" in odd.err
    finally:
        for host in sim.hosts:
            sim.run_on(
                host.index,
                f"CONTAINERS_STORAGE_CONF=~/.tpupod-test-storage.conf podman rmi -f {tag}",
            )


@pytest.mark.timeout(120)
def test_run_image_on_an_ssh_pod_lockstep_jax_then_a_failure_that_leaves_nothing(
    ssh_pod_with_own_storages: Pod, cli: Callable[..., CliResult], sim: SimPod, tmp_path: Path
) -> None:
    pod = ssh_pod_with_own_storages
    tag = f"tpupod-test-run:{pod.name}"
    context = busybox_context(tmp_path, "")
    program = (
        'if [ "$TPUPOD_WORKER_ID" = 2 ]; then sleep 1; echo failing; exit 5; fi; '
        'trap "" TERM; echo "waiting on $TPUPOD_WORKER_ID of $TPUPOD_NUM_WORKERS"; sleep 60'
    )
    own = "CONTAINERS_STORAGE_CONF=~/.tpupod-test-storage.conf podman"
    try:
        built = cli("image", "build", "-p", pod.name, "-t", tag, str(context), timeout=80)
        assert built.code == 0, built.err
        # JAX across two hosts (own addresses, gloo), each in a container; the repository
        # (this project and its venv) is mounted where it is on the host.
        jax = cli(
            "run", "-p", pod.name, "-w", "0,1", "--image", tag, *PYTHON_MOUNTS,
            "--mount", f"{REPO}:{REPO}:ro", "-e", "JAX_PLATFORMS=cpu", "--",
            f"cd {REPO} && .venv/bin/python examples/lockstep_sum.py",
            timeout=80,
        )  # fmt: skip
        assert jax.code == 0, jax.err[-3000:]
        for i in range(2):
            assert f"[w{i}] worker {i} of 2: 2 devices in the mesh, cross-host sum 3" in jax.out
        result = cli("run", "-p", pod.name, "--grace", "1", "--image", tag, "--", program)
        assert result.code == 5, result.err
        assert "first failure: w2" in result.err
        assert result.err.count("stopped after w2 failed") == 3
        assert all(f"waiting on {i} of 4" in result.out for i in (0, 1, 3))
        for host in sim.hosts:
            names = sim.run_on(host.index, f"{own} ps -a --format '{{{{.Names}}}}'").stdout
            assert names.split() == [], host.hostname
        assert sim_leftovers(sim) == []
    finally:
        for host in sim.hosts:
            sim.run_on(host.index, f"{own} rmi -f {tag}")
