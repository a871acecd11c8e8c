"""Shared fixtures: a private state directory, local pods, the CLI run for real."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tpupod import settings
from tpupod.holder.client import stop_holder
from tpupod.pod.lifecycle import up
from tpupod.pod.record import Pod
from tpupod.pod.spec import LocalPodSpec, spec_from_mapping
from tpupod.pod.state import StateDir
from tpupod.sim import SimPod, missing_prerequisites

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Every process this test process starts inherits this mark (each xdist worker sets its own):
# what pod_processes() tells this process's pods by from same-named ones of anyone else.
TEST_RUN = "TPUPOD_TEST_RUN"
os.environ[TEST_RUN] = f"{os.getpid()}-{time.time_ns()}"
SIM_HOSTS = 4


def require(condition: bool, reason: str) -> None:
    """Skip on a developer's machine when a prerequisite is missing; fail in CI."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"prerequisite missing in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture
def state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "state"
    monkeypatch.setenv("TPUPOD_HOME", str(home))
    monkeypatch.setenv("TPUPOD_HOLDER_IDLE", "60")  # a holder a test forgot does not linger
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    return home


@pytest.fixture
def make_pod(state_home: Path) -> Iterator[Callable[..., Pod]]:
    """Create local pods with unique names; kill whatever they left running afterwards."""
    made: list[Pod] = []

    def make(workers: int = 3, devices: int = 1, name: str | None = None) -> Pod:
        name = name or _unique_name(made)
        pod = up(
            LocalPodSpec(name=name, workers=workers, devices_per_worker=devices), StateDir()
        ).pod
        made.append(pod)
        return pod

    yield make
    for pod in made:
        for proc in pod_processes(pod.name):
            with contextlib.suppress(psutil.NoSuchProcess):  # it ended since it was listed
                proc.kill()


def pod_processes(pod_name: str) -> list[psutil.Process]:
    """Live processes (zombies excluded) started on a local pod by this test process: they
    carry TPUPOD_POD=<name> and this process's TEST_RUN mark. A same-named pod of another
    test process, of another checkout's suite or of a user is not this one's to count or
    kill (a test beside them killed their 'dev' pods' servers)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            env = proc.environ()
            if env.get("TPUPOD_POD") == pod_name and env.get(TEST_RUN) == os.environ[TEST_RUN]:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def described(proc: psutil.Process) -> str:
    """A process's command line; "" when it ended between being listed and read (gone)."""
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, FileNotFoundError):
        return ""  # FileNotFoundError: psutil read /proc/PID/stat as the process went


def wait_until(check: Callable[[], bool], run: subprocess.Popen[str], timeout: float) -> None:
    """Poll ``check`` until true; fail the test with ``run``'s output (killed) when it ends
    first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not check():
        if run.poll() is not None or time.monotonic() > deadline:
            run.kill()
            out, err = run.communicate()
            pytest.fail(f"not reached:\n{out}\n{err}")
        time.sleep(0.05)


def wait_until_gone(pod_name: str, timeout: float = 3.0) -> list[psutil.Process]:
    """Processes of the pod still alive after ``timeout`` (the answer should be none)."""
    deadline = time.monotonic() + timeout
    while (left := pod_processes(pod_name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@dataclass
class CliResult:
    code: int
    out: str
    err: str
    seconds: float


def free_base_port(count: int = 8) -> int:
    """A base port whose next ``count`` ports are free, below the kernel's ephemeral range
    (the many connections of JAX, gloo and HTTP clients beside it take ports from that
    range at random, so a range inside it can be taken between this check and its use)."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        base = random.randrange(20000, min(low, 32768) - count, 10)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


_OPEN_CLIENTS: list[Any] = []


def openai_client(base_url: str, api_key: str, **options: Any) -> Any:
    """The real ``openai`` client (no retries), closed when the test ends: one left to the
    garbage collector warns of its socket in whichever test runs then, and warnings are
    errors here."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, **options)
    _OPEN_CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
def _close_openai_clients() -> Iterator[None]:
    yield
    while _OPEN_CLIENTS:
        _OPEN_CLIENTS.pop().close()


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage_per_file() -> Iterator[None]:
    """Collect garbage after each file, so that an object a file's tests left to die (a
    coroutine never awaited, a socket never closed) fails that file's last test. Left to
    the collector's own time, its warning failed whatever test ran when it came, in
    another file (CI at 9aa8fad: a connection attempt failed the dashboard's follow test)."""
    yield
    gc.collect()


def tpupod_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "tpupod", *args]


@pytest.fixture
def cli(state_home: Path) -> Callable[..., CliResult]:
    """Run the real ``tpupod`` command in a fresh process, as a user would."""

    def run(*args: str, timeout: float = 30, env: dict[str, str] | None = None) -> CliResult:
        started = time.monotonic()
        proc = subprocess.run(
            tpupod_argv(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
        return CliResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)

    return run


FAST_PATHS = (["exec"], ["run"], ["jobs", "submit"])  # tpupod.cli.entry's: not the typer app


@pytest.fixture
def cli_in_process(state_home: Path) -> Callable[..., CliResult]:
    """``cli``'s twin that calls the typer app in this process (what ``tpupod`` runs for
    every command but entry's fast paths): 20-30 ms a call instead of a process's ~1 s of
    imports, for checks of what a command prints or refuses. End-to-end checks use ``cli``."""
    from typer.testing import CliRunner

    from tpupod.cli.app import app_for, command_named, load_commands

    def run(*args: str, timeout: float = 30, env: dict[str, str] | None = None) -> CliResult:
        assert not any(list(args[: len(p)]) == p for p in FAST_PATHS), "use cli: a fast path"
        load_commands(list(args))
        started = time.monotonic()
        # the app as the console script has typer build it: the one command (the whole app,
        # every module loaded by earlier tests, cost typer about 100 ms a call to build)
        command = app_for(command_named(list(args)))
        result = CliRunner().invoke(command, list(args), env=env, prog_name="tpupod")
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception  # a bug, not an exit code: show its traceback
        seconds = time.monotonic() - started
        return CliResult(result.exit_code, result.stdout, result.stderr, seconds)

    return run


def _unique_name(made: list[Pod]) -> str:
    return f"t{os.getpid()}-{len(made)}-{time.monotonic_ns() % 100000}"


@pytest.fixture(scope="session")
def sim() -> Iterator[SimPod]:
    """A simulated pod of 4 hosts (namespaces with real sshd), shared by the session's tests."""
    missing = missing_prerequisites()
    require(not missing, f"a simulated pod needs {', '.join(missing)}")
    with SimPod(SIM_HOSTS) as pod:
        yield pod


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """One PostgreSQL cluster for the session (tests/postgres.py); a database per test."""
    from tests.postgres import postgres_cluster

    with postgres_cluster() as server:
        yield server


@pytest.fixture
def sim_hosts_up(sim: SimPod) -> Iterator[SimPod]:
    """The simulated pod, every host brought back up and emptied after the test."""
    yield sim
    reset_sim(sim)


def reset_sim(sim: SimPod) -> None:
    """Every host up again, and nothing running on any but its sshd."""
    down = [h.index for h in sim.hosts if h.sshd_pid is None]
    for index in down:
        sim.start_host(index)
    sim.wait_ready(down)
    with ThreadPoolExecutor(len(sim.hosts)) as pool:  # a process or two per host: at once
        list(pool.map(sim.kill_all, range(len(sim.hosts))))


@pytest.fixture
def make_ssh_pod(state_home: Path, sim_hosts_up: SimPod) -> Iterator[Callable[..., Pod]]:
    """Create SSH pods over the simulated hosts; worker i is host i % 4."""
    made: list[Pod] = []

    def make(workers: int = SIM_HOSTS, **options: object) -> Pod:
        hosts = [sim_hosts_up.hosts[i % SIM_HOSTS].address for i in range(workers)]
        data = {
            "name": _unique_name(made),
            "provider": "ssh",
            "hosts": hosts,
            "user": "root",
            "key": str(sim_hosts_up.key),
            **options,
        }
        pod = up(spec_from_mapping(data, "test"), StateDir()).pod
        made.append(pod)
        return pod

    yield make
    for pod in made:  # the CLI may have started a connection holder for it
        stop_holder(StateDir(), pod.name)


@pytest.fixture(params=["local", "ssh"])
def any_pod(request: pytest.FixtureRequest) -> Callable[..., Pod]:
    """A test that uses it runs on a local pod and on an SSH pod of simulated hosts."""
    name = "make_pod" if request.param == "local" else "make_ssh_pod"
    factory: Callable[..., Pod] = request.getfixturevalue(name)
    return factory


@pytest.fixture
def leftovers(request: pytest.FixtureRequest) -> Callable[[Pod], list[str]]:
    """``leftovers(pod)``: what the pod's commands left running (the answer should be nothing)."""

    def find(pod: Pod) -> list[str]:
        if pod.provider == "local":
            return [line for p in wait_until_gone(pod.name) if (line := described(p))]
        return sim_leftovers(request.getfixturevalue("sim"))

    return find


def sim_leftovers(sim: SimPod, timeout: float = 3.0) -> list[str]:
    """Processes on the simulated hosts other than sshd's, after up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(len(sim.hosts)) as pool:  # each host's ps at once
        while True:
            found = zip(sim.hosts, pool.map(sim.processes, range(len(sim.hosts))), strict=True)
            left = [f"{h.hostname}: {args}" for h, rows in found for _, args in rows]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)


# Test tiers. `make test-fast` runs the unit tier; `make test` runs them all (the ssh
# tier only as root). A test's tier follows from what it uses, so a new test lands in
# the right one by itself; a module can also name its own (`pytestmark = pytest.mark.local`).
TIERS = {
    "unit": "in-process tests: no root, no pods, no CLI process",
    "local": "processes on this machine: the CLI, local pods, multi-process JAX, the model",
    "ssh": "simulated hosts: network namespaces running real sshd (root)",
}
# Modules whose tests are slow for a reason no fixture shows: JAX compiles the model.
MODULE_TIERS = {"test_model.py": "local"}
# Tests that start processes themselves (JAX replicas), where no fixture shows it: without
# a tier they fell in the unit tier and made `make test-fast` take minutes. Better, such a
# test marks itself in place (`@pytest.mark.local`), as test_serve_multihost.py's do.
LOCAL_TESTS: set[str] = set()
# The long end-to-end tests (module::function, every parameter), marked `slow`: the
# slowest of the runs BENCHMARKS.md ("Tests") records. The one-tier targets leave them
# out for an answer in minutes (none is a unit test); `make test` runs them.
SLOW = {
    "test_bench_checkpoint.py::test_an_existing_checkpoint_with_orbax_sharding_config",
    "test_bench_checkpoint.py::test_results_to_gs_and_latest_from_there",
    "test_bench_checkpoint.py::test_sweep_runs_on_every_worker_and_the_same_again_is_no_regression",
    "test_extract.py::test_a_global_mesh_over_two_processes_matches_one_process",
    "test_extract.py::test_a_tokenizer_that_pads_and_truncates_gives_each_sample_its_own_tokens",
    "test_extract.py::test_gs_input_and_output_through_a_gcs_emulator_killed_mid_upload",
    "test_extract.py::test_kill_9_of_a_worker_and_of_the_launcher_then_resume_on_three_workers",
    "test_extract.py::test_resume_after_kill_9_at_several_points_is_identical",
    "test_gcp.py::test_status_shows_the_cloud_state_and_recreate_replaces_a_preempted_tpu",
    "test_jobs.py::test_1000_jobs_through_3_runner_processes_each_run_exactly_once",
    "test_jobs_outage.py::test_lines_printed_while_postgres_is_down_reach_the_log_in_order_once_it_is_back",
    "test_launch.py::test_a_4096_client_barrier_costs_at_most_6x_a_1024_client_one",
    "test_readme.py::test_make_demo",
    "test_recovery_faults.py::test_a_failing_api_and_a_silent_worker_are_not_a_preemption",
    "test_recovery_faults.py::test_a_launcher_killed_mid_recovery_is_resumed",
    "test_recovery_gcp.py::test_a_preempted_jax_run_ends_bit_for_bit_as_an_uninterrupted_one",
    "test_readme.py::test_serving",
    "test_serve_fleet.py::test_a_second_serve_up_changes_nothing_or_is_refused_and_replace_leaves_no_old_server",
    "test_serve_fleet.py::test_the_builtin_backend_serves_the_tiny_checkpoint",
    "test_serve_multihost.py::test_a_replica_across_two_simulated_ssh_hosts",
    "test_serve_multihost.py::test_a_stopped_follower_is_detected_within_the_lockstep_timeout",
    "test_serve_multihost.py::test_kill_9_of_a_follower_that_is_behind_is_a_member_that_went_away",
    "test_serve_multihost.py::test_kill_9_of_a_follower_restarts_its_group_and_no_request_fails",
    "test_serve_multihost.py::test_two_replicas_of_two_hosts_serve_behind_the_router",
}


def node_key(item: pytest.Item) -> str:
    """``module::function``, the same for every parameter, as SLOW and LOCAL_TESTS name it."""
    return f"{item.path.name}::{getattr(item, 'originalname', None) or item.name}"


def is_slow(item: pytest.Item) -> bool:
    return node_key(item) in SLOW


def tier_of(item: pytest.Item) -> str:
    """The tier of one collected test (see TIERS)."""
    own = [mark.name for mark in item.iter_markers() if mark.name in TIERS]
    if own:
        return own[0]
    fixtures = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    # any_pod and tests like it pick their pod's kind from a parameter, "local" or "ssh"
    kinds = {v for v in (callspec.params.values() if callspec else ()) if isinstance(v, str)}
    if "sim" in fixtures or "ssh" in kinds:
        return "ssh"
    if item.path.name in MODULE_TIERS:
        return MODULE_TIERS[item.path.name]
    if node_key(item) in LOCAL_TESTS or is_slow(item):
        return "local"  # processes no fixture shows; a slow test is an end-to-end one
    return "local" if fixtures & {"cli", "make_pod"} or "local" in kinds else "unit"


# One persistent JAX compilation cache for the run, shared by every process the tests
# start (servers, extraction workers, `tpupod run`'s JAX programs) and, under xdist, by
# every worker: they compile the same few tiny programs again and again, and on a CPU a
# compile costs seconds where a cache hit costs milliseconds. A cached executable is the
# one XLA would build, so no answer changes. The size limit turns on JAX's file lock,
# without which a process could read an entry another is still writing.
JAX_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": "",  # set per run in pytest_configure
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30),
}
# the same variables tpupod.sim hands on to simulated hosts (settings.jax_cache_env)
assert tuple(JAX_CACHE_ENV) == settings.JAX_CACHE_VARIABLES
JAX_CACHE_KEY = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    # The processes the tests start (hundreds of CLI runs) read and write bytecode: with
    # PYTHONDONTWRITEBYTECODE set, as some shells set it, each compiled every tpupod module
    # it imported (site-packages have theirs from pip).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    # A suite started in the background (`make test &`, nohup) inherits SIGINT ignored, and
    # so would every command the tests start: the tests that press Ctrl-C on one need it
    # handled, as a user's terminal has it (a handled signal is at its default after exec).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.environ.get("TPUPOD_TESTS_NO_JAX_CACHE"):
        return  # a worker under xdist (the controller set it), or a developer's own choice
    cache = Path(tempfile.mkdtemp(prefix="tpupod-tests-jax-cache-"))
    config.stash[JAX_CACHE_KEY] = cache
    os.environ.update({**JAX_CACHE_ENV, "JAX_COMPILATION_CACHE_DIR": str(cache)})


def pytest_unconfigure(config: pytest.Config) -> None:
    cache = config.stash.get(JAX_CACHE_KEY, None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier_of(item))
        if is_slow(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A local GCS emulator with bucket ``bkt``; gcsfs (here and in the CLI) talks to it."""
    import socket

    from gcp_storage_emulator.server import create_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="bkt")
    server.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # else ~60 s per call
    import fsspec

    fsspec.config.conf.pop("gcs", None)
    fs, _ = fsspec.core.url_to_fs("gs://bkt", skip_instance_cache=True)
    yield fs
    server.stop()


def start_router(
    state: Path, backends: list[str], *flags: str, timeout: float = 30, stderr: Any = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m tpupod.serve.router`` in front of ``backends`` (host:port), once each
    backend answers its ``/health`` and the router counts every one of them up; the process
    and its URL.

    The router counts a backend up until a check says otherwise: one started before its
    backends listen sees them refused, down until ``rise`` checks pass, while its own
    ``/health`` said "all up" at once (requests sent then got 503 no_backend)."""
    import httpx

    deadline = time.monotonic() + timeout
    for backend in backends:
        while not _answers_health(f"http://{backend}/health"):
            if time.monotonic() > deadline:
                raise AssertionError(f"backend {backend} did not answer /health in {timeout:g}s")
            time.sleep(0.05)
    port = free_base_port(1)
    router = subprocess.Popen(
        [sys.executable, "-m", "tpupod.serve.router", "--state-dir", str(state),
         "--port", str(port), "--backends", ",".join(backends), *flags],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if httpx.get(f"{url}/health").json().get("healthy") == len(backends):
                return router, url
        time.sleep(0.05)
    router.kill()
    raise AssertionError(f"the router did not count {backends} up in {timeout:g}s")


def _answers_health(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# -- the Cloud TPU API stand-in (tests/fakes/tpu_api.py), for every test of GCP pods ---------

NOTICE_S = 3.0  # the stand-in's notice window: TERM, then this long before the hosts go


@pytest.fixture
def tpu_api(sim_hosts_up: SimPod, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The stand-in Cloud TPU API, handing out the simulated hosts as TPU workers."""
    from tests.fakes.tpu_api import TpuApiStandIn  # the gcp extra: only tests of GCP pods

    api = TpuApiStandIn(
        [(h.address, h.address) for h in sim_hosts_up.hosts], on_ssh_keys=sim_hosts_up.authorize
    )
    monkeypatch.setenv("TPUPOD_TPU_API_ENDPOINT", api.start())
    monkeypatch.setenv("TPUPOD_GCP_POLL_S", "0.01")
    yield api
    api.stop()


@pytest.fixture
def bare_tpu_api() -> Iterator[tuple[Any, str]]:
    """The stand-in alone (addresses nobody answers on): for bodies, not for SSH."""
    from tests.fakes.tpu_api import TpuApiStandIn  # the gcp extra: only tests of GCP pods

    api = TpuApiStandIn([(f"10.9.0.{i}", f"34.9.0.{i}") for i in range(1, 9)])
    yield api, api.start()
    api.stop()


@pytest.fixture
def spot_api(sim_hosts_up: SimPod, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The stand-in, handing out the simulated hosts and preempting them as GCE does."""
    yield from spot_stand_in(sim_hosts_up, monkeypatch)


def spot_stand_in(sim: SimPod, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """spot_api's body, for a fixture over another simulated pod (tests/test_elastic.py)."""
    from tests.fakes.tpu_api import on_sim_hosts  # the gcp extra: only tests of GCP pods

    api = on_sim_hosts(sim, NOTICE_S)
    monkeypatch.setenv("TPUPOD_TPU_API_ENDPOINT", api.start("0.0.0.0"))
    monkeypatch.setenv("TPUPOD_GCP_POLL_S", "0.05")
    monkeypatch.setenv("TPUPOD_RECOVERY_WATCH_S", "0.3")
    metadata = f"http://{sim.gateway}:{api.port}/computeMetadata/v1"
    monkeypatch.setenv("TPUPOD_METADATA_URL", metadata)
    yield api
    api.stop()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder every simulated host sees and writes (their /tmp and home are their own):
    where a real run keeps checkpoints (a bucket)."""
    import uuid

    path = Path("/dev/shm") / f"tpupod-recovery-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def end_run(run: subprocess.Popen[str], wait_s: float = 30) -> tuple[str, str]:
    """Stop a `tpupod run` as Ctrl-C does (its workers with it) and wait for its launcher;
    killed when it does not end within ``wait_s``. Its output, as far as read."""
    if run.poll() is None:
        run.send_signal(signal.SIGINT)
    try:
        return run.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        run.kill()
        return run.communicate()
