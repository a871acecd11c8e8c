"""The serving fleet: agents, servers, registry, router and fanout, with real processes.

The servers are ``tests/serve_stub.py`` run by the ``command`` backend (real
processes: kill -9, restarts and streams are real); the client is the real
``openai`` package. One fleet (a local pod of 2 workers x 2 servers) is
shared by the local tests of this module; the SSH test makes its own on
simulated hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.conftest import (
    CliResult,
    described,
    free_base_port,
    openai_client,
    pod_processes,
    require,
    sim_leftovers,
    start_router,
    tpupod_argv,
    wait_until_gone,
)
from tpupod import settings
from tpupod.errors import UsageError
from tpupod.pod.record import Pod
from tpupod.serve.backends import (
    Backend,
    ServerSpec,
    check_model,
    compile_cache_env,
    device_slices,
    plan,
    render,
)
from tpupod.serve.router.server import StreamTally, check_body

STUB = Path(__file__).parent / "serve_stub.py"
STUB_COMMAND = f"{{python}} {STUB} --host {{host}} --port {{port}} --tokens 400 --token-delay 0.01"
HEALTH_INTERVAL = 0.5


def run_cli(
    home: Path, *args: str, timeout: float = 60, stock: bool = False
) -> subprocess.CompletedProcess[str]:
    """``tpupod ARGS`` on ``home``; ``stock``: without the suite's JAX compilation cache
    (conftest), as a user's shell has none."""
    env = {**os.environ, "TPUPOD_HOME": str(home)}
    for name in settings.JAX_CACHE_VARIABLES if stock else ():
        env.pop(name, None)
    return subprocess.run(
        tpupod_argv(*args), capture_output=True, text=True, timeout=timeout, env=env
    )


# -- unit: launch templates and request checks ------------------------------------------


@pytest.mark.unit
def test_each_backend_says_which_models_it_accepts(tmp_path: Path) -> None:
    """serve up's model check (run on each worker by ctl preflight): a path is a folder
    there; a Hugging Face id or a URL is left to the server that downloads it."""
    checkpoint = Path(__file__).parent / "fixtures" / "qwen2-tiny"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    accepted = {
        Backend.BUILTIN: [str(checkpoint), "gs://bucket/qwen", f"file://{checkpoint}"],
        Backend.SGLANG_JAX: [str(checkpoint), str(bare), "Qwen/Qwen2.5-7B-Instruct"],
        Backend.VLLM: [str(bare), "Qwen/Qwen2.5-7B-Instruct", "gpt2", "s3://b/m", "gs://b/m"],
        Backend.COMMAND: ["anything at all", "/no/such"],
    }
    for backend, models in accepted.items():
        for model in models:
            check_model(backend, model)
    refused = [
        (Backend.BUILTIN, "Qwen/Qwen2.5-7B-Instruct", "no such folder"),
        (Backend.BUILTIN, str(bare), "no *.safetensors weights in that folder"),
        (Backend.BUILTIN, str(checkpoint / "config.json"), "not a folder"),
        (Backend.BUILTIN, "gs://", "no path after gs://"),
        (Backend.SGLANG_JAX, "gs://b/m", "the sglang-jax backend does not load gs:// URLs"),
        (Backend.SGLANG_JAX, "./no/such", "no such folder, and not a Hugging Face id"),
        (Backend.VLLM, str(tmp_path), "no config.json in that folder"),
        (Backend.VLLM, "hf://x/y", "the vllm backend does not load hf:// URLs"),
    ]
    for backend, model, said in refused:
        with pytest.raises(UsageError) as refusal:
            check_model(backend, model)
        assert refusal.value.message == f"--model {model}: {said}"
        assert refusal.value.hint


def test_launch_templates_render_the_seeds_command_lines() -> None:
    common: dict[str, Any] = {"host": "10.0.0.2", "model": "/m", "devices": 4, "python": "py"}
    (builtin,) = plan(Backend.BUILTIN, ports=[31000, 31001], dtype="bfloat16", **common)
    assert render(builtin) == [
        "py", "-m", "tpupod.extras", "serve,model",  # the worker checks its extras first
        "tpupod.serve.builtin", "--model", "/m", "--host", "10.0.0.2",
        "--ports", "31000,31001", "--dtype", "bfloat16",
    ]  # fmt: skip
    assert builtin.device_ids == ((0, 1), (2, 3))
    sgl = plan(
        Backend.SGLANG_JAX, ports=[31000, 31001], extra_args=("--context-length", "4096"), **common
    )
    assert render(sgl[1]) == [
        "py", "-m", "sgl_jax.launch_server", "--model-path", "/m", "--host", "10.0.0.2",
        "--port", "31001", "--device-indexes", "2,3", "--tp-size", "2", "--context-length", "4096",
    ]  # fmt: skip
    (vllm,) = plan(Backend.VLLM, ports=[8000], **common)
    assert render(vllm)[:6] == ["vllm", "serve", "/m", "--host", "10.0.0.2", "--port"]
    (cmd,) = plan(
        Backend.COMMAND, ports=[7], command="run {model} --port {port} {device_ids}", **common
    )
    assert render(cmd) == ["/bin/bash", "-c", "exec run /m --port 7 0,1,2,3"]


def test_command_templates_quote_values_and_reject_unknown_fields() -> None:
    spec = ServerSpec(
        name="x", backend=Backend.COMMAND, host="h", ports=(1,), model="a b; rm -rf /",
        command="serve {model}",
    )  # fmt: skip
    assert render(spec)[2] == "exec serve 'a b; rm -rf /'"
    from tpupod.errors import UsageError

    with pytest.raises(UsageError, match="not valid"):
        render(spec.model_copy(update={"command": "serve {nope}"}))
    with pytest.raises(UsageError, match="split evenly"):
        device_slices(4, 3)


def test_the_builtin_engine_gets_a_compile_cache_unless_the_user_set_one() -> None:
    spec = ServerSpec(name="b", backend=Backend.BUILTIN, host="h", ports=(1,), model="/m")
    got = compile_cache_env(spec, Path("/s/compile-cache"), {})
    assert got["JAX_COMPILATION_CACHE_DIR"] == "/s/compile-cache"
    assert got["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"  # CPU programs: < 1 s
    assert int(got["JAX_COMPILATION_CACHE_MAX_SIZE"]) > 0  # bounded, and JAX's file lock on
    mine = {"JAX_COMPILATION_CACHE_DIR": "/mine"}
    for env, given in ((mine, spec), ({}, spec.model_copy(update={"env": mine}))):
        assert "JAX_COMPILATION_CACHE_DIR" not in compile_cache_env(given, Path("/s"), env)
    vllm = spec.model_copy(update={"backend": Backend.VLLM})
    assert compile_cache_env(vllm, Path("/s"), {}) == {}  # its own caches are its own


@pytest.mark.parametrize(
    ("body", "chat", "problem"),
    [
        (b"{", True, "not valid JSON"),
        (b"[1]", True, "JSON object"),
        (b'{"messages": []}', True, "non-empty list"),
        (b'{"messages": ["hi"]}', True, "'role'"),
        (b'{"prompt": 3}', False, "'prompt'"),
        (b'{"prompt": "x", "max_tokens": -1}', False, "'max_tokens'"),
        (b'{"prompt": "x", "stream": "yes"}', False, "'stream'"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', True, None),
    ],
)
def test_malformed_bodies_are_named(body: bytes, chat: bool, problem: str | None) -> None:
    found = check_body(body, chat)
    assert (found is None) if problem is None else (found is not None and problem in found)


def test_a_stream_is_counted_by_its_events_or_its_usage() -> None:
    events = [
        b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n',
        *(b'data: {"choices": [{"delta": {"content": "t%d"}}]}\n\n' % i for i in range(5)),
        b'data: {"choices": [{"text": "x"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    whole = b"".join(events)
    tally = StreamTally()
    for i in range(0, len(whole), 7):  # cut anywhere, as the network does
        tally.feed(whole[i : i + 7])
    assert tally.tokens == 6  # the empty first delta is no token
    with_usage = StreamTally()
    with_usage.feed(whole.replace(b"data: [DONE]", b'data: {"usage": {"completion_tokens": 9}}'))
    assert with_usage.tokens == 9


def test_status_records_say_each_servers_state_and_why_a_worker_did_not_answer() -> None:
    """Fleet.status()'s records (what serve status prints and the dashboard reads)."""
    from tpupod.serve.fleet.record import FleetRecord, ServerRecord
    from tpupod.serve.fleet.status import ServerStatus, fleet_status

    servers = [ServerRecord(worker=w, host=f"h{w}", port=1, name="a") for w in (0, 1)]
    record = FleetRecord(
        pod="p", model="m", backend=Backend.COMMAND, python="python3", servers=servers,
        router_host="h0", router_port=9, token="t", started=0.0,
    )  # fmt: skip
    silent = "w1 (h1): unreachable: cannot connect: no answer in 5s"
    agents: list[Any] = [
        {"servers": [{"name": "a", "ports": [1], "state": "ready", "pid": 5, "restarts": 2,
                      "child_restarts": {"front end": 0, "engine": 1}}]},
        silent,
    ]  # fmt: skip
    router = {"backends": ["h0:1"], "health": {"h0:1": {"requests": 3, "tokens_per_s": 1.5}}}
    found = fleet_status(record, agents, router)
    # every restart of any of its processes, and which (the agent's of the whole server)
    restarted = (("server", 2), ("engine", 1))
    assert found.servers[0] == ServerStatus(
        0, "h0:1", "command", "ready", 5, 3, 3, 1.5, restarted=restarted
    )
    assert found.servers[1] == ServerStatus(1, "h1:1", "command", silent, None, None, None, None)
    assert (found.healthy, found.router_error, found.replicated) == (1, None, False)
    assert fleet_status(record, agents, "w0: no router").router_error == "w0: no router"
    full = "its record (router.json) could not be written: the disk under /s is full"
    unrecorded = fleet_status(record, agents, {**router, "restarts": 1, "record": full})
    assert (unrecorded.router_error, unrecorded.router_record) == (None, full)
    assert unrecorded.router_restarts == 1 and unrecorded.servers[0].requests == 3
    # a server whose log's disk is full says so while it lasts (the log cannot)
    agents[0]["servers"][0]["disk_full"] = {"since": 1.0, "lines_lost": 40}
    state = fleet_status(record, agents, router).servers[0].state
    assert state == "ready, disk full: 40 log lines lost"


def test_restarts_wait_longer_each_time_and_a_router_keeps_its_port() -> None:
    from tpupod.serve.agent.respawn import with_port
    from tpupod.serve.backoff import Backoff

    backoff = Backoff(1.0)
    waits = [backoff.after(0.1) for _ in range(7)]
    assert waits == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.after(61) == 1  # a good run: the first wait again
    argv = ["python", "-m", "tpupod.serve.router", "--port", "0", "--policy", "p"]
    assert with_port(argv, 4321) == [*argv[:4], "4321", "--policy", "p"]
    assert with_port(argv, None) == argv
    assert with_port(["sgl", "--host", "h"], 4321) == ["sgl", "--host", "h"]


SERVICE = """
import os, signal, sys, time
from pathlib import Path
from tpupod.serve import services
state = Path(sys.argv[1])
runs = state / "runs"
run = len(runs.read_text()) if runs.exists() else 0
runs.write_text("x" * (run + 1))
services.write_info(state, "svc", "127.0.0.1", 1)
print(f"run {run} listens", flush=True)
if run == 0:
    os.kill(os.getpid(), signal.SIGKILL)  # served, then killed: started again at once
if run == 1:
    sys.exit(3)  # failed by itself: started again after a wait
time.sleep(60)
"""


@pytest.mark.local
@pytest.mark.timeout(30)
def test_respawn_starts_a_killed_service_at_once_and_a_failing_one_after_a_wait(
    tmp_path: Path,
) -> None:
    """The router's respawn parent waited 1, 2, 4 s (reset after 60 s of running) before
    each start, a kill -9 too: the endpoint refused requests meanwhile. A run that
    listened and was killed by a signal is now started again at once; one that exits by
    itself still waits (it may fail again). Each is said in one stamped line and counted."""
    service = tmp_path / "svc.py"
    service.write_text(SERVICE)
    log = tmp_path / "svc.log"
    with open(log, "wb") as out:
        keeper = subprocess.Popen(
            [sys.executable, "-m", "tpupod.serve.agent.respawn", "--state-dir", str(tmp_path),
             "svc", "--", sys.executable, str(service), str(tmp_path)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for(lambda: "run 2 listens" in log.read_text(), 20, "third run")
    finally:
        keeper.terminate()
        assert keeper.wait(15) == 0
    lines = log.read_text().splitlines()
    times = {}
    for line in lines:
        stamp, _, text = line.partition("Z ")
        times[text] = datetime.fromisoformat(stamp).timestamp()
    assert (tmp_path / "svc.restarts").read_text() == "2\n"
    killed = (
        r"the svc exited \(killed by SIGKILL\) after [\d.]+s; started again at once \(restart 1\)"
    )
    failed = r"the svc exited \(exit 3\) after [\d.]+s; starting it again in 1s \(restart 2\)"
    said = [text for text in times if text.startswith("[tpupod respawn]")]
    assert len(said) == 2 and re.search(killed, said[0]) and re.search(failed, said[1]), lines
    assert times["run 1 listens"] - times["run 0 listens"] < 0.9  # no wait
    assert times["run 2 listens"] - times[said[1]] >= 1.0  # the wait


DEAF_SERVICE = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as deaf as a stopped (SIGSTOP) process
print("deaf", flush=True)
time.sleep(60)
"""


@pytest.mark.local
@pytest.mark.timeout(30)
def test_a_stop_that_kills_the_keeper_kills_the_service_it_kept(tmp_path: Path) -> None:
    """ctl's stop TERMs a service's keeper and KILLs it after the grace; the keeper waits
    as long for its service before it KILLs it. Where the stop's grace ran out first (CI,
    under load: an agent pinned before it recorded itself), the keeper died and the
    service it kept ran on, stopped, after 'serve down' said 'w1 agent stopped'."""
    from tpupod.serve.agent import ctl

    service = tmp_path / "deaf.py"
    service.write_text(DEAF_SERVICE)
    argv = [sys.executable, "-m", "tpupod.serve.agent.ctl", "--state-dir", str(tmp_path)]
    argv += ["ensure", "agent", "--", sys.executable, str(service)]
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL) as ensure:  # never recorded
        log = tmp_path / "agent.log"
        wait_for(lambda: log.exists() and "deaf" in log.read_text(), 20, "the service")
        ensure.kill()  # a Ctrl-C'd serve up: nothing kills what it started
    found = psutil.process_iter(["cmdline"])  # a process gone meanwhile: cmdline None
    kept = [p for p in found if (p.info["cmdline"] or [])[1:] == [str(service)]]
    assert len(kept) == 1, kept
    assert ctl.stop(tmp_path, "agent", grace=0.5)["stopped"]
    assert psutil.wait_procs(kept, timeout=3)[1] == []


@pytest.mark.unit
def test_request_counts_outlive_the_router_and_begin_anew_for_other_backends(
    tmp_path: Path,
) -> None:
    """serve status' REQUESTS are the router's counts: they began at 0 again with each
    restart of the router. They are kept in a file the router maps (every count there
    the moment it is made), which the next router goes on from."""
    from tpupod.serve.router.registry import Counts, HealthPolicy, Registry

    path, addresses = tmp_path / "router.counts", ["h:1", "h:2"]
    killed = Registry(addresses, "m", HealthPolicy(), Counts(addresses, path))
    b = killed.backends["h:2"]
    for ok in (True, False):
        killed.begin(b)
        killed.end(b, ok=ok, error=None if ok else "HTTP 500", tokens=5 if ok else 0)
    again = Registry(addresses, "m", HealthPolicy(), Counts(addresses, path)).describe()
    counted = {k: again["health"]["h:2"][k] for k in ("requests", "failures", "completion_tokens")}
    assert counted == {"requests": 2, "failures": 1, "completion_tokens": 5}
    assert again["health"]["h:1"]["requests"] == 0
    other = Registry(addresses[:1], "m", HealthPolicy(), Counts(addresses[:1], path))
    assert other.backends["h:1"].requests == 0  # another fleet's counts are not taken
    other.begin(other.backends["h:1"])
    assert Counts(addresses[:1], path).of(0).tolist() == [1, 0, 0]


def test_policies_choose_among_available_backends() -> None:
    from tpupod.serve.router.registry import HealthPolicy, Registry
    from tpupod.serve.router.server import Policy, Router

    registry = Registry(["a:1", "b:1", "c:1"], "m", HealthPolicy())
    rr = Router(registry, None, Policy.ROUND_ROBIN)
    assert [rr.choose(set()).address for _ in range(4)] == ["a:1", "b:1", "c:1", "a:1"]  # type: ignore[union-attr]
    least = Router(registry, None, Policy.LEAST_OUTSTANDING)
    registry.backends["a:1"].outstanding = 2
    registry.backends["c:1"].outstanding = 1
    assert {least.choose(set()).address for _ in range(6)} == {"b:1"}  # type: ignore[union-attr]
    assert least.choose({"b:1"}).address == "c:1"  # type: ignore[union-attr]
    two = Router(registry, None, Policy.POWER_OF_TWO)
    assert all(two.choose(set()).address != "a:1" for _ in range(20))  # type: ignore[union-attr]
    assert least.choose({"a:1", "b:1", "c:1"}) is None


def test_the_circuit_opens_after_errors_in_a_row_and_half_opens_after_the_cooldown() -> None:
    from tpupod.serve.router.registry import Health, HealthPolicy, Registry

    registry = Registry(["a:1", "b:1"], "m", HealthPolicy(eject_after=3, cooldown=0.2))
    a = registry.backends["a:1"]
    for _ in range(2):
        registry.begin(a)
        registry.end(a, ok=False, error="HTTP 500")
    assert a in registry.available()  # two errors: still in
    registry.begin(a)
    registry.end(a, ok=False, error="HTTP 500")
    assert [b.address for b in registry.available()] == ["b:1"]  # three: ejected
    time.sleep(0.25)
    assert a in registry.available()  # half-open: one trial
    registry.begin(a)
    assert a not in registry.available()  # while the trial runs, no other request
    registry.end(a, ok=True)
    assert a in registry.available() and a.open_until == 0.0  # it worked: closed again
    registry.refused(a, "connection refused")
    assert a.health is Health.DOWN and a not in registry.available()


def test_a_caller_cancelled_while_the_registry_stops_stays_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router's shutdown waits for the health checks to end; a cancel of the router's
    own task meanwhile (a second Ctrl-C, the loop closing) is raised after, not swallowed
    with the checks' cancel (it was: the caller went on as if not cancelled)."""
    from tpupod.serve.router.registry import HealthPolicy, Registry

    async def checks_that_unwind_slowly(self: Registry, session: Any) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.3)  # connections closing

    monkeypatch.setattr(Registry, "run_checks", checks_that_unwind_slowly)

    async def main() -> None:
        registry = Registry(["a:1"], "m", HealthPolicy())
        registry.start(None)  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        stopping = asyncio.create_task(registry.stop())
        await asyncio.sleep(0.05)
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        assert registry._task is not None and registry._task.done()

    asyncio.run(main())


@pytest.mark.local
@pytest.mark.timeout(60)
def test_the_router_retries_5xx_elsewhere_and_passes_4xx_through(tmp_path: Path) -> None:
    ports = [free_base_port(), free_base_port()]
    procs = [
        subprocess.Popen([sys.executable, str(STUB), "--port", str(ports[0]), "--fail", "500"]),
        subprocess.Popen([sys.executable, str(STUB), "--port", str(ports[1])]),
    ]
    try:
        # both stubs counted up before the first request, so the failing one's 500 has a
        # live one to be retried on (a stub slower to start than the router's first health
        # check is down until it has answered enough checks)
        backends = [f"127.0.0.1:{p}" for p in ports]
        router, url = start_router(
            tmp_path, backends, "--policy", "round_robin", "--health-interval", "0.2", timeout=20
        )
        procs.append(router)
        token = (tmp_path / "router.token").read_text().strip()
        auth = {"Authorization": f"Bearer {token}"}
        client = openai_client(f"{url}/v1", token)
        messages: Any = [{"role": "user", "content": "hi"}]
        for _ in range(6):  # round robin sends some to the failing one: retried on the other
            answer = client.chat.completions.create(model="stub-model", messages=messages)
            assert (answer.choices[0].message.content or "").startswith(f"stub{ports[1]}")
        health = httpx.get(f"{url}/backends", headers=auth).json()
        failing = health["health"][f"127.0.0.1:{ports[0]}"]
        assert failing["circuit"] == "open" and failing["last_error"] == "HTTP 500"
        assert health["backends"] == [f"127.0.0.1:{ports[1]}"]
        with pytest.raises(openai.NotFoundError):  # a 4xx is the client's: passed through as is
            client.chat.completions.create(model="no-such-model", messages=messages)
        healthy = httpx.get(f"{url}/backends", headers=auth)
        assert healthy.json()["health"][f"127.0.0.1:{ports[1]}"]["failures"] == 0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


# -- a shared local fleet -----------------------------------------------------------------


@dataclass
class Fleet:
    home: Path
    pod: str
    base_url: str
    token: str
    router: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    home = tmp_path_factory.mktemp("serve") / "state"
    pod = f"sv{os.getpid()}"
    assert run_cli(home, "up", "--name", pod, "--local", "2").returncode == 0
    try:
        up = run_cli(
            home, "serve", "up", "--pod", pod, "--model", "stub-model", "--backend", "command",
            "--command", STUB_COMMAND, "--servers-per-worker", "2",
            "--base-port", str(free_base_port()), "--health-interval", str(HEALTH_INTERVAL),
            "--restart-backoff", "0.2", "--startup-timeout", "60",
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        assert up.stderr.count(" ready (") == 4
        exports = run_cli(home, "serve", "endpoint", "--pod", pod).stdout.splitlines()
        values = dict(line.removeprefix("export ").split("=", 1) for line in exports)
        base_url, token = values["OPENAI_BASE_URL"], values["OPENAI_API_KEY"]
        yield Fleet(home, pod, base_url, token, base_url.removesuffix("/v1"))
    finally:
        run_cli(home, "serve", "down", "--pod", pod)
        run_cli(home, "down", "--pod", pod)
        for proc in pod_processes(pod):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def backends(fleet: Fleet) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {fleet.token}"}
    answer: dict[str, Any] = httpx.get(f"{fleet.router}/backends", headers=auth).json()
    return answer


@pytest.mark.local
def test_the_openai_client_talks_to_the_router(fleet: Fleet) -> None:
    client = openai_client(fleet.base_url, fleet.token)
    assert [m.id for m in client.models.list()] == ["stub-model"]
    seen = set()
    for _ in range(8):
        answer = client.chat.completions.create(
            model="stub-model", messages=[{"role": "user", "content": "你是谁"}], max_tokens=3
        )
        text = answer.choices[0].message.content or ""
        assert text.endswith(" t1 t2") and answer.usage is not None
        seen.add(text.split()[0])
    assert len(seen) == 4  # least outstanding with rotation spreads requests over every server
    before = sum(b["completion_tokens"] for b in backends(fleet)["health"].values())
    stream = client.chat.completions.create(
        model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    pieces = [c.choices[0].delta.content for c in stream]
    assert "".join(p or "" for p in pieces).endswith(" t1 t2 t3 t4") and len(pieces) == 5

    def counted() -> int:  # the router ends its books on the stream just after [DONE]
        return sum(b["completion_tokens"] for b in backends(fleet)["health"].values()) - before

    deadline = time.monotonic() + 5
    while counted() < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counted() == 5  # a streamed answer counts in serve status' tokens/s too
    completion = client.completions.create(model="stub-model", prompt="x", max_tokens=2)
    assert completion.choices[0].text.endswith(" t1")


@pytest.mark.local
def test_requests_without_the_token_get_401(fleet: Fleet) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{fleet.base_url}/chat/completions", json={}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{fleet.router}/metrics").status_code == 401
    assert httpx.get(f"{fleet.router}/health").json()["ok"] is True
    bad = openai_client(fleet.base_url, "wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.local
def test_malformed_requests_get_openai_shaped_400s_and_mark_no_backend(fleet: Fleet) -> None:
    before = {a: h["failures"] for a, h in backends(fleet)["health"].items()}
    auth = {"Authorization": f"Bearer {fleet.token}", "Content-Type": "application/json"}
    for body in (
        b"{not json",
        b'"text"',
        b'{"messages": []}',
        b'{"messages": [{"role": 1}], "n": 0}',
    ):
        r = httpx.post(f"{fleet.base_url}/chat/completions", content=body, headers=auth)
        assert r.status_code == 400, body
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
    client = openai_client(fleet.base_url, fleet.token)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="stub-model", messages=[])
    after = backends(fleet)
    assert len(after["backends"]) == 4
    assert {a: h["failures"] for a, h in after["health"].items()} == before
    metrics = httpx.get(f"{fleet.router}/metrics", headers=auth).text
    assert "tpupod_router_requests_total" in metrics


@pytest.mark.local
def test_fanout_prints_a_line_per_backend(fleet: Fleet) -> None:
    result = run_cli(
        fleet.home, "fanout", "--pod", fleet.pod, "--prompt", "你是谁", "--max-tokens", "4"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    resp = sorted(line for line in lines if line.startswith("RESP "))
    assert len(resp) == 4 and all(" status=200 ms=" in line for line in resp)
    assert all('content="stub' in line for line in resp)
    assert lines[-1].startswith("DONE backends=4 ok=4 wall_sec=")


@pytest.mark.local
def test_fanout_exits_non_zero_when_a_backend_fails(fleet: Fleet) -> None:
    listed = [*backends(fleet)["backends"][:1], "127.0.0.1:9"]  # port 9: nothing listens

    class Registry(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"ok": True, "model": "stub-model", "backends": listed}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = run_cli(
            fleet.home, "fanout", "--registry-url", url, "--prompt", "hi", "--timeout", "5"
        )
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 1
    assert "RESP backend=127.0.0.1:9 status=error" in result.stdout
    assert result.stdout.splitlines()[-1].startswith("DONE backends=2 ok=1 ")


async def watch(
    http: httpx.AsyncClient, fleet: Fleet, address: str, killed: float
) -> tuple[float | None, float | None]:
    """Seconds after the kill until the registry marked ``address`` down, and until it was back."""
    down_after = None
    while time.monotonic() - killed < 20:
        health = (await http.get(f"{fleet.router}/backends")).json()
        if down_after is None and health["health"][address]["state"] == "down":
            down_after = time.monotonic() - killed
        if down_after is not None and address in health["backends"]:
            return down_after, time.monotonic() - killed
        await asyncio.sleep(0.05)
    return down_after, None


def stub_pid(port: int) -> int:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if str(STUB) in cmdline and str(port) in cmdline:
            return int(proc.pid)
    raise AssertionError(f"no stub on port {port}")


@pytest.mark.local
@pytest.mark.timeout(60)
def test_kill_minus_nine_of_a_backend_under_load(fleet: Fleet) -> None:
    """No non-streaming request fails; the stream on it ends with an error; it comes back."""
    auth = {"Authorization": f"Bearer {fleet.token}"}
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def scenario() -> dict[str, Any]:
        stop = asyncio.Event()
        failures: list[str] = []
        done = [0]

        async def load(http: httpx.AsyncClient) -> None:
            while not stop.is_set():
                try:
                    r = await http.post(f"{fleet.base_url}/chat/completions", json=body)
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text}")
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                done[0] += 1

        async with (
            openai.AsyncOpenAI(
                base_url=fleet.base_url, api_key=fleet.token, max_retries=0
            ) as client,
            httpx.AsyncClient(headers=auth, timeout=10) as http,
        ):
            loads = [asyncio.create_task(load(http)) for _ in range(4)]
            await asyncio.sleep(0.3)
            stream = await client.chat.completions.create(
                model="stub-model", messages=[{"role": "user", "content": "hi"}],
                max_tokens=400, stream=True,
            )  # fmt: skip
            first = await anext(aiter(stream))
            port = int((first.choices[0].delta.content or "").removeprefix("stub"))
            address = f"127.0.0.1:{port}"
            os.kill(stub_pid(port), 9)
            killed = time.monotonic()

            async def drain() -> None:
                async for _ in stream:
                    pass

            with pytest.raises(openai.APIError):
                await asyncio.wait_for(drain(), 5)
            stream_ended = time.monotonic() - killed
            down_after, back_after = await watch(http, fleet, address, killed)
            await asyncio.sleep(0.5)  # some load on the one that came back
            stop.set()
            await asyncio.gather(*loads)
        return {
            "failures": failures, "requests": done[0], "port": port, "stream_ended": stream_ended,
            "down_after": down_after, "back_after": back_after,
        }  # fmt: skip

    result = asyncio.run(scenario())
    assert result["failures"] == []
    assert result["requests"] > 20
    assert result["stream_ended"] < 2
    assert result["down_after"] is not None and result["down_after"] < 2 * HEALTH_INTERVAL
    assert result["back_after"] is not None
    status = run_cli(fleet.home, "serve", "status", "--pod", fleet.pod)
    assert status.returncode == 0, status.stderr
    row = next(line.split() for line in status.stdout.splitlines() if f":{result['port']} " in line)
    assert row[3] == "ready" and row[5] == "1", status.stdout  # one restart, counted
    assert "(4/4 backends healthy; 0 restarts)" in status.stdout


STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ")


@pytest.mark.local
def test_logs_and_restart_reach_the_servers(fleet: Fleet) -> None:
    listed = sorted(backends(fleet)["backends"])
    port = int(listed[0].split(":")[1])
    others = {p: stub_pid(p) for p in (int(a.split(":")[1]) for a in listed[1:])}
    before = stub_pid(port)
    result = run_cli(fleet.home, "serve", "restart", "--pod", fleet.pod, "--port", str(port))
    assert result.returncode == 0, result.stderr
    assert stub_pid(port) != before
    assert {p: stub_pid(p) for p in others} == others  # the other servers were not touched
    logs = run_cli(fleet.home, "serve", "logs", "--pod", fleet.pod)
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    assert len([line for line in lines if "stub pid" in line]) >= 4
    assert all(STAMP.search(line) for line in lines), lines  # every line says when


@pytest.mark.local
def test_router_404_and_405_are_openai_errors_and_a_refused_token_is_named(fleet: Fleet) -> None:
    auth = {"Authorization": f"Bearer {fleet.token}"}
    for method, path, status in (
        ("GET", "/v1/nothing", 404),
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
    ):
        r = httpx.request(method, f"{fleet.router}{path}", headers=auth)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and path in error["message"], error
    wrong = run_cli(fleet.home, "fanout", "--pod", fleet.pod, "--prompt", "hi", "--token", "x")
    assert wrong.returncode == 1
    assert "refused the token" in wrong.stderr and "does not answer" not in wrong.stderr
    assert "Traceback" not in wrong.stderr


@pytest.mark.local
def test_serve_down_leaves_nothing_running(tmp_path: Path) -> None:
    home = tmp_path / "state"
    pod = f"sd{os.getpid()}"
    assert run_cli(home, "up", "--name", pod, "--local", "2").returncode == 0
    try:
        up = run_cli(
            home, "serve", "up", "--pod", pod, "--model", "m", "--backend", "command",
            "--command", STUB_COMMAND, "--base-port", str(free_base_port()),
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        assert len(pod_processes(pod)) >= 5  # 2 agents, 2 servers, the router
        down = run_cli(home, "serve", "down", "--pod", pod)
        assert down.returncode == 0, down.stderr
        deadline = time.monotonic() + 3
        while pod_processes(pod) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p.cmdline() for p in pod_processes(pod)] == []
        gone = run_cli(home, "serve", "status", "--pod", pod)
        assert gone.returncode == 1 and "no fleet is serving" in gone.stderr
    finally:
        run_cli(home, "down", "--pod", pod)


@contextlib.contextmanager
def local_pod(tmp_path: Path, prefix: str, workers: int) -> Iterator[tuple[Path, str]]:
    """A local pod of its own (state folder, name); at the end nothing of it may run."""
    home = tmp_path / "state"
    pod = f"{prefix}{os.getpid()}"
    assert run_cli(home, "up", "--name", pod, "--local", str(workers)).returncode == 0
    try:
        yield home, pod
    finally:
        run_cli(home, "serve", "down", "--pod", pod)
        run_cli(home, "down", "--pod", pod)
        assert wait_until_gone(pod) == []


def stub_up(home: Path, pod: str, *extra: str, base: int | None = None) -> Any:
    """serve up of stub servers (the command backend) on the pod."""
    return run_cli(
        home, "serve", "up", "--pod", pod, "--model", "m", "--backend", "command",
        "--command", STUB_COMMAND, "--base-port", str(base or free_base_port()),
        "--health-interval", "0.5", *extra,
    )  # fmt: skip


@pytest.mark.local
def test_a_server_that_exits_at_start_fails_serve_up_with_its_last_lines(tmp_path: Path) -> None:
    with local_pod(tmp_path, "sf", 1) as (home, pod):
        up = run_cli(
            home, "serve", "up", "--pod", pod, "--model", "m", "--backend", "command",
            "--command", "{python} -c 'import sys; sys.exit(\"cannot load {model}\")'",
            "--base-port", str(free_base_port()),
        )  # fmt: skip
        assert up.returncode == 1
        assert "error: w0: the server on :" in up.stderr
        assert "exited before it answered (exit 1)" in up.stderr
        assert "hint: its last lines: cannot load m" in up.stderr
        assert "restart" not in up.stderr  # it failed at once: no restarts to wait out
        assert wait_until_gone(pod) == []  # and left nothing, before any serve down


@pytest.mark.local
def test_a_server_that_is_not_openai_compatible_is_named_so_at_the_timeout(
    tmp_path: Path,
) -> None:
    """A command that serves HTTP but not /v1/models (a wrong --command) waited out
    --startup-timeout as '(starting)', the same as a server still loading, and said
    nothing until then: the wait now says every so often (a quarter of the timeout, at
    most 30 s) what still starts and what it answers."""
    with local_pod(tmp_path, "s4", 1) as (home, pod):
        up = run_cli(
            home, "serve", "up", "--pod", pod, "--model", "m", "--backend", "command",
            "--command", "{python} -m http.server {port} --bind {host}",
            "--base-port", str(free_base_port()), "--startup-timeout", "4",
        )  # fmt: skip
        assert up.returncode == 1
        assert "(starting: GET /v1/models answers 404)" in up.stderr, up.stderr
        notices = re.findall(r"w0 :\d+ still starting after \d+s \((.*)\)", up.stderr)
        assert notices and set(notices) == {"GET /v1/models answers 404"}, up.stderr
        assert wait_until_gone(pod) == []


TINY = Path(__file__).parent / "fixtures" / "qwen2-tiny"


@pytest.mark.local
@pytest.mark.timeout(150)
def test_a_failed_serve_up_ends_at_once_and_leaves_nothing_running(tmp_path: Path) -> None:
    """A wrong model path took 17-23 s (three restarts) and left the agent running; a port
    in use got the hint 'choose other --ports', an option serve up does not have. Both are
    now found before anything starts (issue 36: the model first, the port's holder named)."""
    base = free_base_port()
    with local_pod(tmp_path, "sw", 1) as (home, pod):
        missing = tmp_path / "no-such-model"
        bad = run_cli(
            home, "serve", "up", "--pod", pod, "--model", str(missing), "--base-port", str(base),
            timeout=120,
        )  # fmt: skip
        assert bad.returncode == 2, bad.stderr  # checked before anything started
        assert f"error: --model {missing}: no such folder" in bad.stderr
        assert "agent" not in bad.stderr and "restart" not in bad.stderr
        assert wait_until_gone(pod) == []
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", base))
            busy.listen()
            taken = run_cli(
                home, "serve", "up", "--pod", pod, "--model", str(TINY),
                "--base-port", str(base), timeout=120,
            )  # fmt: skip
        assert taken.returncode == 1, taken.stderr
        assert f"w0 :{base} (--base-port) by pid {os.getpid()} (" in taken.stderr  # this test
        assert "in use" in taken.stderr and "agent" not in taken.stderr
        assert "--base-port" in taken.stderr and "--ports" not in taken.stderr
        assert "Traceback" not in taken.stderr
        assert wait_until_gone(pod) == []
        gone = run_cli(home, "serve", "status", "--pod", pod)
        assert gone.returncode == 1 and "no fleet is serving" in gone.stderr


@pytest.mark.local
@pytest.mark.timeout(120)
def test_ctrl_c_during_serve_up_leaves_nothing_running(tmp_path: Path) -> None:
    """Ctrl-C while the servers start left the agent, its server and ctl wait-ready running."""
    with local_pod(tmp_path, "sc", 1) as (home, pod):
        argv = tpupod_argv(
            "serve", "up", "--pod", pod, "--model", "m", "--backend", "command",
            "--command", "sleep 1000 # {port}", "--base-port", str(free_base_port()),
        )  # fmt: skip
        env = {**os.environ, "TPUPOD_HOME": str(home)}
        with subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True) as up:
            try:
                deadline = time.monotonic() + 60
                # described(): a process listed may end before its command line is read
                while not any("sleep" in described(p) for p in pod_processes(pod)):
                    assert time.monotonic() < deadline and up.poll() is None
                    time.sleep(0.2)
                up.send_signal(signal.SIGINT)
                assert up.wait(30) == 130
                assert up.stderr is not None and "Traceback" not in up.stderr.read()
            finally:  # a failure here left it running, and its collection failed a later test
                up.kill()
        assert wait_until_gone(pod, timeout=10) == []


NEVER_READY = "sleep 1000 # {port}"  # a server that runs and never answers


@contextlib.contextmanager
def starting_up(home: Path, pod: str, workers: int) -> Iterator[subprocess.Popen[str]]:
    """``serve up`` (a process) whose servers run and never get ready, once each of the
    ``workers`` runs its server; killed at the end if it still runs."""
    argv = tpupod_argv(
        "serve", "up", "--pod", pod, "--model", "m", "--backend", "command",
        "--command", NEVER_READY, "--base-port", str(free_base_port()),
    )  # fmt: skip
    env = {**os.environ, "TPUPOD_HOME": str(home)}
    with subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True) as up:
        try:
            deadline = time.monotonic() + 60
            while sum("sleep" in described(p) for p in pod_processes(pod)) < workers:
                assert time.monotonic() < deadline and up.poll() is None
                time.sleep(0.2)
            yield up
        finally:
            up.kill()


@pytest.mark.local
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_sigterm_or_sighup_during_serve_up_leaves_nothing_and_status_saw_it_start(
    tmp_path: Path, stop: signal.Signals
) -> None:
    """SIGTERM (a supervisor, kill) or SIGHUP (the terminal closed) while the servers
    started left the agents (reparented to init), their restarting servers and ctl
    wait-ready running, and 'serve status' said no fleet was serving. Now both stop the
    fleet as Ctrl-C does, the exit is 128+N, and status shows the fleet while it starts."""
    with local_pod(tmp_path, "st", 2) as (home, pod), starting_up(home, pod, 2) as up:
        status = run_cli(home, "serve", "status", "--pod", pod)
        assert status.returncode == 0, status.stderr
        rows = [line.split() for line in status.stdout.splitlines() if line.startswith("w")]
        assert [(r[0], r[3]) for r in rows] == [("w0", "starting"), ("w1", "starting")], rows
        assert f"serve up (pid {up.pid}) is starting this fleet" in status.stdout
        early = run_cli(home, "serve", "endpoint", "--pod", pod)
        assert early.returncode == 1 and "is still starting" in early.stderr
        up.send_signal(stop)
        assert up.wait(60) == 128 + stop
        assert up.stderr is not None
        said = up.stderr.read()
        assert f"error: serve up was stopped ({stop.name}); it stopped what it had started" in (
            said
        )
        assert "Traceback" not in said
        assert wait_until_gone(pod, timeout=10) == []
        gone = run_cli(home, "serve", "status", "--pod", pod)
        assert gone.returncode == 1 and "no fleet is serving" in gone.stderr


# The points of a default 'serve up' (the builtin backend, the tiny checkpoint) where a
# signal comes: its record written, the agents about to start; the agents' processes run
# but have not answered (pinned there with SIGSTOP: an agent's imports take about a second,
# and a stopped process cannot write its record); the servers load the checkpoint.
STOP_POINTS = ("record", "agents", "servers")


def tiny_up_argv(pod: str) -> list[str]:
    """The trial's 'serve up': default options, the tiny checkpoint, small slots."""
    return tpupod_argv(
        "serve", "up", "--pod", pod, "--model", str(TINY), "--dtype", "float32",
        "--base-port", str(free_base_port()), "--", "--max-batch", "4", "--max-length", "128",
    )  # fmt: skip


def processes_running(pod: str, module: str, count: int, up: subprocess.Popen[Any]) -> list[Any]:
    """The pod's ``count`` processes that run ``module`` (``python -m tpupod.extras EXTRAS
    MODULE ...``; not a command line that only names it, as ctl's), once that many run;
    serve up must still run meanwhile."""
    deadline = time.monotonic() + 60
    while True:
        found = [p for p in pod_processes(pod) if _runs(described(p).split(), module)]
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline and up.poll() is None, "serve up ended first"
        time.sleep(0.02)


def _runs(argv: list[str], module: str) -> bool:
    return argv[1:3] == ["-m", "tpupod.extras"] and argv[4:5] == [module]


def wait_for_path(path: Path, up: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline and up.poll() is None, "serve up ended first"
        time.sleep(0.01)


@pytest.mark.local
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("point", "stop"),
    [
        ("record", signal.SIGINT),
        ("agents", signal.SIGTERM),
        ("agents", signal.SIGINT),
        ("servers", signal.SIGINT),
    ],
    ids=["record-INT", "agents-TERM", "agents-INT", "servers-INT"],
)
def test_a_signal_at_any_point_of_a_default_serve_up_stops_every_agent_and_says_so(
    tmp_path: Path, point: str, stop: signal.Signals
) -> None:
    """A new-user trial: TERM or Ctrl-C 1.5 s into a default 'serve up' left both agents
    running (an agent whose 'ctl ensure' was cancelled before it wrote its record was not
    seen by the stop), while serve up said it had stopped what it started, and 'serve
    status' said no fleet was serving; Ctrl-C said nothing at all. The tests of issue 36
    signalled only once every server ran. Now every agent that may have started is
    stopped, whatever the point, and Ctrl-C says so as TERM does (exit 128+N)."""
    with local_pod(tmp_path, "sp", 2) as (home, pod):
        env = {**os.environ, "TPUPOD_HOME": str(home)}
        with subprocess.Popen(tiny_up_argv(pod), env=env, stderr=subprocess.PIPE, text=True) as up:
            pinned: list[Any] = []
            try:
                if point == "record":
                    wait_for_path(home / "pods" / pod / "serve.json", up)
                elif point == "agents":
                    pinned = processes_running(pod, "tpupod.serve.agent", 2, up)
                    for agent in pinned:
                        agent.suspend()
                    for w in (0, 1):  # they have not answered: no agent record yet
                        state = home / "pods" / pod / "workers" / f"w{w}" / ".tpupod" / "serve"
                        assert not (state / "agent.json").exists()
                else:
                    processes_running(pod, "tpupod.serve.builtin", 2, up)
                up.send_signal(stop)
                assert up.wait(60) == 128 + stop
                assert up.stderr is not None
                said = up.stderr.read()
            finally:
                up.kill()
                for agent in pinned:  # an agent left by the stop would go on from here
                    with contextlib.suppress(psutil.NoSuchProcess):
                        agent.resume()
        assert f"error: serve up was stopped ({stop.name}); it stopped what it had started" in (
            said
        ), said
        assert "Traceback" not in said
        left = wait_until_gone(pod, timeout=5)
        assert [described(p) for p in left] == []
        gone = run_cli(home, "serve", "status", "--pod", pod)
        assert gone.returncode == 1 and "no fleet is serving" in gone.stderr, gone.stderr


@pytest.mark.local
@pytest.mark.timeout(90)
def test_a_serve_up_started_with_hup_and_int_ignored_keeps_them_ignored(tmp_path: Path) -> None:
    """'nohup tpupod serve up &' (HUP ignored), or a script's background job (Ctrl-C
    ignored): serve up took HUP anyway and stopped the fleet when the terminal closed. A
    signal its starter ignores stays ignored; the fleet comes up."""
    with local_pod(tmp_path, "si", 1) as (home, pod):
        ignoring = ["/bin/sh", "-c", "trap '' HUP INT; exec \"$@\"", "sh"]  # as nohup, '&'
        argv = ignoring + tpupod_argv(
            "serve", "up", "--pod", pod, "--model", "m", "--backend", "command",
            "--command", STUB_COMMAND, "--base-port", str(free_base_port()),
        )  # fmt: skip
        env = {**os.environ, "TPUPOD_HOME": str(home)}
        with subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True) as up:
            try:
                deadline = time.monotonic() + 60
                while not any(str(STUB) in described(p) for p in pod_processes(pod)):
                    assert time.monotonic() < deadline and up.poll() is None
                    time.sleep(0.05)
                up.send_signal(signal.SIGHUP)
                up.send_signal(signal.SIGINT)
                assert up.wait(60) == 0
            finally:
                up.kill()
        status = run_cli(home, "serve", "status", "--pod", pod)
        assert status.returncode == 0, status.stderr
        assert " ready " in status.stdout


@pytest.mark.local
@pytest.mark.timeout(90)
def test_serve_status_names_agents_that_no_fleet_record_knows(tmp_path: Path) -> None:
    """With no fleet recorded, 'serve status' said 'no fleet is serving' without a look at
    the workers, so agents left running (by a serve up stopped before its agents answered,
    or started by hand) went unseen. It now names every agent that runs, one still
    starting too (w1's, pinned before it answered, its ctl ensure stopped), and 'serve
    down' stops them."""
    with local_pod(tmp_path, "sn", 2) as (home, pod):
        python = sys.executable
        ensure = (
            f"{python} -m tpupod.serve.agent.ctl ensure agent -- {python} -m tpupod.extras "
            "serve tpupod.serve.agent --host 127.0.0.1 --port 0"
        )
        started = run_cli(home, "exec", "--pod", pod, "-w", "0", "--", ensure)
        assert started.returncode == 0, started.stderr
        answering = json.loads(started.stdout.split("] ", 1)[1])["pid"]
        env = {**os.environ, "TPUPOD_HOME": str(home)}
        argv = tpupod_argv("exec", "--pod", pod, "-w", "1", "--", ensure)
        pinned: list[Any] = []
        try:
            with subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) as starting:  # fmt: skip
                try:
                    agents = processes_running(pod, "tpupod.serve.agent", 2, starting)
                    pinned = [a for a in agents if a.pid != answering]
                    pinned[0].suspend()
                    starting.send_signal(signal.SIGINT)  # its ctl ensure is stopped
                    assert starting.wait(30) == 130
                finally:
                    starting.kill()
            status = run_cli(home, "serve", "status", "--pod", pod)
            assert status.returncode == 1, status.stdout
            assert status.stderr.splitlines() == [
                f"error: no fleet is recorded on pod {pod!r}, yet w0's agent (pid {answering}, "
                f"0 servers) and w1's agent (pid {pinned[0].pid}, not answering yet) run",
                f"hint: 'tpupod serve down --pod {pod}' stops them",
            ], status.stderr
            down = run_cli(home, "serve", "down", "--pod", pod)
            assert down.returncode == 0, down.stderr
            # pinned, it cannot stop itself: killed after the grace, and said so
            assert "w1 agent did not stop within its grace" in down.stderr, down.stderr
            assert wait_until_gone(pod) == []
        finally:
            for agent in pinned:
                with contextlib.suppress(psutil.NoSuchProcess):
                    agent.resume()
        gone = run_cli(home, "serve", "status", "--pod", pod)
        assert gone.returncode == 1 and "no fleet is serving" in gone.stderr


@pytest.mark.local
@pytest.mark.timeout(120)
def test_a_serve_up_killed_hard_leaves_a_fleet_that_status_shows_and_down_stops(
    tmp_path: Path,
) -> None:
    """kill -9 cannot be caught: what serve up started runs on. Status said no fleet was
    serving; it now shows the servers and that their serve up is gone, and the next serve
    up or serve down takes them over."""
    with local_pod(tmp_path, "sk", 2) as (home, pod):
        with starting_up(home, pod, 2) as up:
            up.kill()
            up.wait(10)
        status = run_cli(home, "serve", "status", "--pod", pod)
        assert status.returncode == 0, status.stderr
        assert status.stdout.count(" starting ") == 2, status.stdout
        assert f"serve up (pid {up.pid}) ended before this fleet was ready" in status.stdout
        assert "'tpupod serve down' stops what it started" in status.stdout
        restart = run_cli(home, "serve", "restart", "--pod", pod)
        assert restart.returncode == 1 and "ended before the fleet" in restart.stderr
        down = run_cli(home, "serve", "down", "--pod", pod)
        assert down.returncode == 0, down.stderr
        assert wait_until_gone(pod) == []


@pytest.mark.local
@pytest.mark.timeout(120)
def test_serve_down_stops_a_serve_up_that_is_starting_and_a_second_serve_up_is_refused(
    tmp_path: Path,
) -> None:
    """Two serve ups of one pod at once stopped each other's servers; serve down during a
    serve up left that one going on to start the router and write its record."""
    with local_pod(tmp_path, "sd", 1) as (home, pod), starting_up(home, pod, 1) as up:
        second = run_cli(home, "serve", "up", "--pod", pod, "--model", "m", "--backend",
                         "command", "--command", NEVER_READY)  # fmt: skip
        assert second.returncode == 1
        assert f"tpupod serve up (pid {up.pid}, since" in second.stderr
        assert "is starting a fleet on pod" in second.stderr
        down = run_cli(home, "serve", "down", "--pod", pod)
        assert down.returncode == 0, down.stderr
        assert f"stopping tpupod serve up (pid {up.pid}" in down.stderr
        assert up.wait(10) == 128 + signal.SIGTERM
        assert wait_until_gone(pod) == []
        gone = run_cli(home, "serve", "status", "--pod", pod)
        assert gone.returncode == 1 and "no fleet is serving" in gone.stderr


@pytest.mark.local
@pytest.mark.timeout(120)
def test_serve_up_checks_the_model_on_the_workers_before_it_starts_anything(
    tmp_path: Path,
) -> None:
    """A wrong --model showed 3-10 s later, inside a hint of the server's last lines (or
    behind a port clash). serve up now asks each worker first what the backend accepts:
    the builtin backend a checkpoint folder or a gs:// URL, vllm and sglang-jax also a
    Hugging Face id; the default options, as a user types them."""
    notes = tmp_path / "notes"
    notes.mkdir()
    with local_pod(tmp_path, "sm", 2) as (home, pod):
        for model, said in [
            (tmp_path / "no-such", f"--model {tmp_path / 'no-such'}: no such folder"),
            (notes, f"--model {notes}: no config.json in that folder"),
        ]:
            began = time.monotonic()
            bad = run_cli(home, "serve", "up", "--pod", pod, "--model", str(model))
            assert bad.returncode == 2, bad.stderr
            assert bad.stderr.splitlines() == [
                f"error: {said}",
                "hint: give a checkpoint folder (config.json, *.safetensors) or a gs:// URL",
            ]
            assert time.monotonic() - began < 10  # a ctl call per worker: ~1-2 s here
            assert pod_processes(pod) == []  # no agent was ever started
        vllm = run_cli(home, "serve", "up", "--pod", pod, "--model", "/no/such/model",
                       "--backend", "vllm")  # fmt: skip
        assert vllm.returncode == 2
        assert "/no/such/model: no such folder, and not a Hugging Face id" in vllm.stderr
        assert "Qwen/Qwen2.5-7B-Instruct" in vllm.stderr


def listens(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.local
@pytest.mark.timeout(120)
def test_ports_in_use_are_named_with_their_holder_and_a_base_port_free_everywhere(
    tmp_path: Path,
) -> None:
    """A taken port showed as a server's exit (or hid a wrong model), naming no process.
    serve up now names the process holding it (as ss -ltnp would) and a --base-port free
    on every worker, which then serves. It holds the fleet to the ports it was given
    rather than move it by itself (docs/serving.md says why)."""
    base = free_base_port()
    holder = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(base + 1), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with local_pod(tmp_path, "sp", 2) as (home, pod):
            deadline = time.monotonic() + 30
            while not listens(base + 1):
                assert time.monotonic() < deadline and holder.poll() is None
                time.sleep(0.1)
            taken = stub_up(home, pod, base=base)
            assert taken.returncode == 1, taken.stderr
            first, hint = taken.stderr.splitlines()
            python = Path(sys.executable).name
            assert first == (
                f"error: port in use: w1 :{base + 1} (--base-port) by pid {holder.pid} "
                f"({python} -m http.server {base + 1} --bind 127.0.0.1)"
            )
            found = re.fullmatch(
                r"hint: stop it, or give --base-port (\d+) \(free on every worker\)", hint
            )
            assert found, hint
            assert pod_processes(pod) == []  # nothing started
            moved = stub_up(home, pod, base=int(found.group(1)))
            assert moved.returncode == 0, moved.stderr
    finally:
        holder.kill()
        holder.wait()


def test_a_port_holder_of_a_local_pod_names_its_state_directory(tmp_path: Path) -> None:
    """A trial: with a pod 'dev' in two state directories, a refusal said only `pod 'dev'`
    of the other's server; a local worker's process runs in its worker folder, which says."""
    from tpupod.serve.agent.ctl import holder

    home = tmp_path / "other home"
    folder = home / "pods" / "dev" / "workers" / "w0"
    folder.mkdir(parents=True)
    env = {**os.environ, "TPUPOD_POD": "dev"}
    proc = subprocess.Popen(["sleep", "30"], cwd=folder, env=env)
    try:
        deadline = time.monotonic() + 10
        while "TPUPOD_POD" not in Path(f"/proc/{proc.pid}/environ").read_text(errors="replace"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert holder(proc.pid) == f"pid {proc.pid} (sleep 30, pod 'dev' of {home})"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.local
def test_eval_of_serve_endpoint_fails_loudly_when_it_cannot_say_the_endpoint(
    tmp_path: Path,
) -> None:
    """With two pods, eval "$(tpupod serve endpoint)" evaluated nothing and succeeded:
    a script went on without OPENAI_BASE_URL (the openai client then calls api.openai.com
    with whatever key is set). Now the eval fails too ('set -e' stops, '&&' does not go
    on) and says the variables were left as they were, beside tpupod's error."""
    home = tmp_path / "state"
    pods = [f"ea{os.getpid()}", f"eb{os.getpid()}"]
    env = {**os.environ, "TPUPOD_HOME": str(home)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    try:
        for pod in pods:
            assert run_cli(home, "up", "--name", pod, "--local", "1").returncode == 0
        script = 'eval "$(tpupod serve endpoint)" && echo went on; echo "eval: $?"'
        shell = subprocess.run(
            ["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60
        )
        assert shell.stdout == "eval: 1\n"
        assert shell.stderr.splitlines() == [
            f"error: 2 pods exist ({', '.join(sorted(pods))}); say which one",
            f"hint: add --pod {sorted(pods)[0]}, for example",
            "tpupod serve endpoint failed (see its error above): OPENAI_BASE_URL and "
            "OPENAI_API_KEY are left as they were",
        ]
        strict = subprocess.run(
            ["bash", "-c", 'set -e; eval "$(tpupod serve endpoint)"; echo went on'],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert strict.returncode == 1 and "went on" not in strict.stdout
    finally:
        for pod in pods:
            run_cli(home, "down", "--pod", pod)


def stub_pids(pod: str) -> set[int]:
    return {p.pid for p in pod_processes(pod) if str(STUB) in p.cmdline()}


@pytest.mark.local
@pytest.mark.timeout(120)
def test_a_second_serve_up_changes_nothing_or_is_refused_and_replace_leaves_no_old_server(
    tmp_path: Path,
) -> None:
    """A second identical serve up restarted the whole fleet and moved the router's port;
    --replace with other --servers-per-worker left an old server running, unlisted."""
    base = free_base_port()
    with local_pod(tmp_path, "sr", 2) as (home, pod):
        first = stub_up(home, pod, "--servers-per-worker", "2", base=base)
        assert first.returncode == 0, first.stderr
        endpoint = run_cli(home, "serve", "endpoint", "--pod", pod).stdout
        pids = stub_pids(pod)
        assert len(pids) == 4
        again = stub_up(home, pod, "--servers-per-worker", "2", base=base)
        assert again.returncode == 0, again.stderr
        assert "already serving" in again.stderr
        assert run_cli(home, "serve", "endpoint", "--pod", pod).stdout == endpoint
        assert stub_pids(pod) == pids  # nothing restarted
        other = stub_up(home, pod, "--servers-per-worker", "1", base=base)
        assert other.returncode == 1
        assert "already serving" in other.stderr and "--servers-per-worker" in other.stderr
        assert "serve down" in other.stderr and "--replace" in other.stderr
        assert stub_pids(pod) == pids
        replaced = stub_up(home, pod, "--servers-per-worker", "1", "--replace", base=base)
        assert replaced.returncode == 0, replaced.stderr
        now = stub_pids(pod)
        assert len(now) == 2 and not now & pids, (pids, now)  # every old server stopped
        assert run_cli(home, "serve", "endpoint", "--pod", pod).stdout == endpoint
        status = run_cli(home, "serve", "status", "--pod", pod)
        rows = [line for line in status.stdout.splitlines() if line.startswith("w")]
        assert len(rows) == 2 and all(" ready " in row for row in rows), status.stdout
        logs = run_cli(home, "serve", "logs", "--pod", pod).stdout.splitlines()
        logged = {int(m.group(1)) for line in logs if (m := re.search(r"stub pid (\d+)", line))}
        assert logged == now  # the current fleet's lines only


def router_processes(pod: str) -> list[psutil.Process]:
    return [p for p in pod_processes(pod) if p.cmdline()[1:3] == ["-m", "tpupod.serve.router"]]


@pytest.mark.local
@pytest.mark.timeout(120)
def test_a_router_killed_with_9_is_started_again_on_its_port_and_no_server_restarts(
    tmp_path: Path,
) -> None:
    """The router is one process in front of every server: killed (kill -9, the OOM
    killer) it left the endpoint refusing every request until the next serve up, which
    restarted the whole fleet. Its respawn parent now starts it again at once on the same
    port (which it holds: --port 0 picked one once); serve down stops both (local_pod
    checks that nothing of the pod is left)."""
    with local_pod(tmp_path, "rk", 2) as (home, pod):
        assert stub_up(home, pod).returncode == 0
        exports = run_cli(home, "serve", "endpoint", "--pod", pod).stdout.splitlines()
        values = dict(line.removeprefix("export ").split("=", 1) for line in exports)
        client = openai_client(values["OPENAI_BASE_URL"], values["OPENAI_API_KEY"], timeout=5)
        assert client.models.list().data
        servers = stub_pids(pod)
        (router,) = router_processes(pod)
        router.kill()
        killed = time.monotonic()
        router.wait(10)
        # a connection meanwhile waits in the backlog of the socket its parent holds
        assert client.models.list().data
        assert time.monotonic() - killed < 10, "the router did not come back"
        (again,) = router_processes(pod)
        assert again.pid != router.pid
        assert stub_pids(pod) == servers  # the servers went on
        wait_for_healthy = time.monotonic() + 10
        while "2/2 backends healthy" not in (
            status := run_cli(home, "serve", "status", "--pod", pod).stdout
        ):
            assert time.monotonic() < wait_for_healthy, status
            time.sleep(0.2)
        assert "2/2 backends healthy; 1 restart)" in status  # counted (it was nowhere)
        log = run_cli(home, "serve", "logs", "--pod", pod, "--router").stdout.splitlines()
        said = re.compile(
            r"\[tpupod respawn\] the router exited \(killed by SIGKILL\) after [\d.]+s; "
            r"started again at once \(restart 1\)$"
        )
        assert [line for line in log if said.search(line)], log
        assert sum("ready port=" in line for line in log) == 2, log  # the first run, the next
        # each line after its UTC time, as the servers' logs (it had none)
        stamped = re.compile(r"\[w0\] \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \S")
        assert all(stamped.match(line) for line in log), log


def by_worker(procs: list[psutil.Process]) -> dict[str, int]:
    """Each process's worker (the local pod's worker folder it runs in): its pid."""
    return {Path(p.cwd()).name: p.pid for p in procs}


def kill_agent_and_keeper(pod: str, worker: str) -> None:
    """A worker's agent lost for good: its keeper (which would start it again) killed
    first, then the agent."""
    found: dict[str, psutil.Process] = {}
    for proc in pod_processes(pod):
        with contextlib.suppress(psutil.Error):  # a ctl call may end meanwhile
            argv = proc.cmdline()
            if Path(proc.cwd()).name == worker and "router" not in argv:
                for role in ("tpupod.serve.agent.respawn", "tpupod.serve.agent"):
                    if role in argv:
                        found[role] = proc
    assert sorted(found) == ["tpupod.serve.agent", "tpupod.serve.agent.respawn"], found
    for role in ("tpupod.serve.agent.respawn", "tpupod.serve.agent"):
        found[role].kill()
        found[role].wait(10)


@pytest.mark.local
@pytest.mark.timeout(120)
def test_serve_up_again_starts_only_what_is_lost(tmp_path: Path) -> None:
    """A worker's agent and server killed with -9 (and the agent's keeper, which would
    start it again): a second serve up with the same settings said only that worker was
    lost, then stopped and started every server of the fleet. It now starts that worker's
    agent and server again and touches nothing else: the other server, the router and
    the endpoint stay."""
    base = free_base_port()
    with local_pod(tmp_path, "rl", 2) as (home, pod):
        assert stub_up(home, pod, base=base).returncode == 0
        endpoint = run_cli(home, "serve", "endpoint", "--pod", pod).stdout
        servers = by_worker([p for p in pod_processes(pod) if p.pid in stub_pids(pod)])
        agents = by_worker([p for p in pod_processes(pod) if "tpupod.serve.agent" in p.cmdline()])
        (router,) = router_processes(pod)
        assert sorted(servers) == sorted(agents) == ["w0", "w1"]
        kill_agent_and_keeper(pod, "w1")
        lost = psutil.Process(servers["w1"])
        lost.kill()
        lost.wait(10)
        again = stub_up(home, pod, base=base)
        assert again.returncode == 0, again.stderr
        assert "already serving with these settings, but not w1's " in again.stderr
        assert "w0" not in again.stderr.split("starting it again", 1)[1], again.stderr
        now = by_worker([p for p in pod_processes(pod) if p.pid in stub_pids(pod)])
        assert now["w0"] == servers["w0"] and now["w1"] != servers["w1"], (servers, now)
        assert [p.pid for p in router_processes(pod)] == [router.pid]
        assert run_cli(home, "serve", "endpoint", "--pod", pod).stdout == endpoint
        # serve up returns once the router routes to w1's new server (it said ready while
        # the router's checks still had it down)
        status = run_cli(home, "serve", "status", "--pod", pod).stdout
        assert "2/2 backends healthy" in status and "router: down" not in status, status
        # the router and its respawn parent, both killed: status said "router: w0: no router
        # runs here" and exit 0, with no hint; it is down, and serve up brings it back
        for proc in pod_processes(pod):
            if "tpupod.serve.agent.respawn" in proc.cmdline():
                proc.kill()
        router.kill()
        router.wait(10)
        down = run_cli(home, "serve", "status", "--pod", pod)
        assert down.returncode == 1, down.stdout + down.stderr
        assert "router: down: w0: no router runs here\n" in down.stdout, down.stdout
        error, hint = down.stderr.strip().splitlines()
        assert error.startswith("error: the fleet's router on w0 is down: "), error
        assert hint.startswith("hint: run this fleet's 'tpupod serve up' again"), hint
        began = time.monotonic()
        again = stub_up(home, pod, base=base)
        assert again.returncode == 0, again.stderr
        print(f"serve up again, the router lost: {time.monotonic() - began:.1f}s")
        assert "but not the router: starting it again" in again.stderr, again.stderr
        back = run_cli(home, "serve", "status", "--pod", pod)
        assert back.returncode == 0 and "; 1 restart)" in back.stdout, back.stdout + back.stderr
        assert by_worker([p for p in pod_processes(pod) if p.pid in stub_pids(pod)]) == now
        assert len(router_processes(pod)) == 1
        assert run_cli(home, "serve", "endpoint", "--pod", pod).stdout == endpoint


@pytest.mark.local
@pytest.mark.timeout(120)
def test_status_says_what_runs_with_no_keeper_and_fails_for_an_agent_down(
    tmp_path: Path,
) -> None:
    """A trial: the router's keeper killed, status said '0 restarts' and nothing of it (a
    router that dies then is not started again); an agent killed with its keeper, status
    said 'w1: no agent runs here' in a row and exited 0, with no hint."""
    base = free_base_port()
    with local_pod(tmp_path, "nk", 2) as (home, pod):
        assert stub_up(home, pod, base=base).returncode == 0
        servers = by_worker([p for p in pod_processes(pod) if p.pid in stub_pids(pod)])
        for proc in pod_processes(pod):
            argv = proc.cmdline()
            if "tpupod.serve.agent.respawn" in argv and "router" in argv:
                proc.kill()
                proc.wait(10)
        unkept = run_cli(home, "serve", "status", "--pod", pod)
        assert unkept.returncode == 0, unkept.stdout + unkept.stderr
        assert "no keeper: the router (its keeper was killed)" in unkept.stdout, unkept.stdout
        # a trial: the agents' logs, empty while nothing happened to them, printed nothing
        quiet = run_cli(home, "serve", "logs", "--agent", "--pod", pod)
        assert (quiet.returncode, quiet.stdout) == (0, ""), quiet.stderr
        assert "tpupod: no lines: the agents' logs are empty" in quiet.stderr, quiet.stderr
        kill_agent_and_keeper(pod, "w1")
        agentless = run_cli(home, "serve", "status", "--pod", pod)
        assert agentless.returncode == 1, agentless.stdout + agentless.stderr
        error, hint = agentless.stderr.strip().splitlines()
        assert error.startswith("error: the agent of w1 is down: nothing runs it"), error
        assert hint.startswith("hint: run this fleet's 'tpupod serve up' again"), hint
        again = stub_up(home, pod, base=base)
        assert again.returncode == 0, again.stderr
        # it said "but not w1's builtin-...: starting it again"; it is the agent that is
        # started, and it takes the server (which served on) over
        assert "already serving with these settings, but not w1's agent: " in again.stderr
        now = by_worker([p for p in pod_processes(pod) if p.pid in stub_pids(pod)])
        assert now == servers, (servers, now)
        back = run_cli(home, "serve", "status", "--pod", pod)
        assert back.returncode == 0, back.stdout + back.stderr


@pytest.mark.local
@pytest.mark.timeout(120)
def test_fanout_reports_backends_that_are_down_and_exits_non_zero(tmp_path: Path) -> None:
    """With 2 of 4 servers down, fanout said DONE backends=2 ok=2 and exited 0."""
    with local_pod(tmp_path, "sx", 2) as (home, pod):
        up = stub_up(home, pod, "--servers-per-worker", "2")
        assert up.returncode == 0, up.stderr
        exports = run_cli(home, "serve", "endpoint", "--pod", pod).stdout.splitlines()
        values = dict(line.removeprefix("export ").split("=", 1) for line in exports)
        w1 = [p for p in pod_processes(pod) if p.environ().get("TPUPOD_WORKER_ID") == "1"]
        # its agent's keeper, its agent and its two servers: killed, nobody restarts them
        assert len(w1) == 4
        for proc in sorted(w1, key=lambda p: "tpupod.serve.agent.respawn" not in p.cmdline()):
            proc.kill()
        auth = {"Authorization": f"Bearer {values['OPENAI_API_KEY']}"}
        registry = values["OPENAI_BASE_URL"].removesuffix("/v1") + "/backends"
        deadline = time.monotonic() + 20
        while len(httpx.get(registry, headers=auth).json()["backends"]) > 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        fanout = run_cli(home, "fanout", "--pod", pod, "--prompt", "hi", "--max-tokens", "2")
        assert fanout.returncode == 1, fanout.stdout + fanout.stderr
        lines = fanout.stdout.splitlines()
        assert len([line for line in lines if " status=200 " in line]) == 2
        assert len([line for line in lines if " status=down " in line]) == 2, lines
        assert lines[-1].startswith("DONE backends=4 ok=2 ")


# -- an SSH pod of simulated hosts ----------------------------------------------------------


@pytest.mark.timeout(90)
def test_the_agent_outlives_the_ssh_session_that_started_it(
    make_ssh_pod: Any, state_home: Path, sim: Any
) -> None:
    pod = make_ssh_pod(workers=2)
    python = sys.executable
    up = run_cli(
        state_home, "serve", "up", "--pod", pod.name, "--model", "m", "--backend", "command",
        "--command", STUB_COMMAND, "--servers-per-worker", "2", "--worker-python", python,
        "--health-interval", "0.5", "--agent-port", "9321",
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    # serve up has ended: its SSH sessions are closed; the agents and servers live on
    for host in sim.hosts[:2]:
        running = " ".join(args for _, args in sim.processes(host.index))
        assert "tpupod.serve.agent" in running and "serve_stub.py" in running
        assert f"--host {host.address} --port 9321" in running  # the port asked for
    fanout = run_cli(state_home, "fanout", "--pod", pod.name, "--prompt", "你是谁")
    assert fanout.returncode == 0, fanout.stdout + fanout.stderr
    assert fanout.stdout.count(" status=200 ") == 4
    assert any(f"{sim.hosts[1].address}:31001" in line for line in fanout.stdout.splitlines())
    # The router listens inside the pod's network; the endpoint is a local port forwarded to
    # it over the pod's SSH connection, which the pod's connection holder keeps.
    endpoint = run_cli(state_home, "serve", "endpoint", "--pod", pod.name)
    assert endpoint.returncode == 0, endpoint.stderr
    exports = dict(
        line.removeprefix("export ").split("=", 1) for line in endpoint.stdout.splitlines()
    )
    url = exports["OPENAI_BASE_URL"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", url), url
    assert f"to the router at {sim.hosts[0].address}:9100 over w0's SSH" in endpoint.stderr
    client = openai_client(url, exports["OPENAI_API_KEY"])
    answer = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
    )
    assert answer.choices[0].message.content
    again = run_cli(state_home, "serve", "endpoint", "--pod", pod.name)
    assert again.stdout == endpoint.stdout  # asked again: the same forward
    direct = run_cli(state_home, "serve", "endpoint", "--pod", pod.name, "--direct")
    assert f"OPENAI_BASE_URL=http://{sim.hosts[0].address}:9100/v1" in direct.stdout
    down = run_cli(state_home, "serve", "down", "--pod", pod.name)
    assert down.returncode == 0, down.stderr
    assert sim_leftovers(sim) == []
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # serve down closed the forward


# -- the builtin server, on the tiny checkpoint ---------------------------------------------


def assert_compile_cache(pod: str, home: Path) -> None:
    """The engine compiled into JAX's persistent cache in the worker's serving state (an
    engine killed or restarted loads its programs instead of compiling them again)."""
    engines = [p for p in pod_processes(pod) if "engine" in p.cmdline()]
    assert engines, [p.cmdline() for p in pod_processes(pod)]
    cache = Path(engines[0].environ()["JAX_COMPILATION_CACHE_DIR"])
    assert cache.is_relative_to(home) and any(cache.iterdir()), cache


@pytest.mark.local
@pytest.mark.timeout(480)
def test_the_builtin_backend_serves_the_tiny_checkpoint(tmp_path: Path) -> None:
    """One worker, two engines in one process (two ports); the openai client and fanout;
    its agent killed and serve up again."""
    import importlib.util

    require(
        importlib.util.find_spec("tpupod.serve.builtin") is not None,
        "tpupod.serve.builtin (the builtin server) is not in this tree",
    )
    home = tmp_path / "state"
    pod = f"sb{os.getpid()}"
    tiny = Path(__file__).parent / "fixtures" / "qwen2-tiny"
    assert (
        run_cli(home, "up", "--name", pod, "--local", "1", "--devices-per-worker", "2").returncode
        == 0
    )
    try:
        up_args = (
            "serve", "up", "--pod", pod, "--model", str(tiny), "--servers-per-worker", "2",
            "--dtype", "float32", "--base-port", str(free_base_port()), "--startup-timeout", "200",
            "--", "--max-batch", "4", "--max-length", "128",
        )  # fmt: skip
        up = run_cli(home, *up_args, timeout=230, stock=True)
        assert up.returncode == 0, up.stderr
        exports = run_cli(home, "serve", "endpoint", "--pod", pod).stdout.splitlines()
        values = dict(line.removeprefix("export ").split("=", 1) for line in exports)
        client = openai_client(values["OPENAI_BASE_URL"], values["OPENAI_API_KEY"])
        model = client.models.list().data[0].id
        assert model == "qwen2-tiny"
        messages: Any = [{"role": "user", "content": "你是谁"}]
        whole = client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, temperature=0
        )
        assert whole.usage is not None and whole.usage.completion_tokens == 6
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == whole.choices[0].message.content  # greedy: the same answer
        assert_compile_cache(pod, home)
        fanout = run_cli(home, "fanout", "--pod", pod, "--prompt", "你是谁", "--max-tokens", "4")
        assert fanout.returncode == 0, fanout.stdout + fanout.stderr
        assert fanout.stdout.count(" status=200 ") == 2
        # --port named one port and restarted the process of both, saying 'builtin-<other>'
        second = max(int(a.rsplit(":", 1)[1]) for a in re.findall(r"backend=(\S+)", fanout.stdout))
        pids = {p.pid for p in pod_processes(pod) if "tpupod.serve.builtin" in p.cmdline()}
        one = run_cli(home, "serve", "restart", "--pod", pod, "--port", str(second))
        assert one.returncode == 2, one.stderr
        assert f"the server on :{second} runs in one process with :{second - 1}" in one.stderr
        assert "hint: restart them together: tpupod serve restart -w 0" in one.stderr
        assert {p.pid for p in pod_processes(pod) if "tpupod.serve.builtin" in p.cmdline()} == pids
        # its agent and the agent's keeper killed: serve up again named the lost process
        # once per port ('w0's builtin-P, w0's builtin-P'), then the server (a trial: it
        # served on), and said ready while the router still had it down; it names the
        # agent, and the new agent takes the server over (it had stopped it)
        kill_agent_and_keeper(pod, "w0")
        again = run_cli(home, *up_args, timeout=230, stock=True)
        assert again.returncode == 0, again.stderr
        assert "but not w0's agent: starting it again" in again.stderr, again.stderr
        assert {p.pid for p in pod_processes(pod) if "tpupod.serve.builtin" in p.cmdline()} == pids
        status = run_cli(home, "serve", "status", "--pod", pod)
        assert "router: down" not in status.stdout, status.stdout
        assert "(2/2 backends healthy; 0 restarts)" in status.stdout, status.stdout
        assert run_cli(home, "serve", "down", "--pod", pod).returncode == 0
        assert wait_until_gone(pod) == []
    finally:
        run_cli(home, "down", "--pod", pod)


@pytest.mark.local
@pytest.mark.timeout(180)
def test_two_one_worker_local_pods_serve_at_once(tmp_path: Path) -> None:
    """A one-worker local pod's agent took the fixed agent port (9010) on this machine's
    loopback, so a second one-worker local pod could not serve beside it (nor two test
    runs at once). A local pod's agents take any free port."""
    home = tmp_path / "state"
    pods = [f"one{os.getpid()}a", f"one{os.getpid()}b"]
    try:
        for pod in pods:
            assert run_cli(home, "up", "--name", pod, "--local", "1").returncode == 0
            up = run_cli(
                home, "serve", "up", "--pod", pod, "--model", "stub-model", "--backend",
                "command", "--command", STUB_COMMAND, "--base-port", str(free_base_port()),
                "--startup-timeout", "60", timeout=120,
            )  # fmt: skip
            assert up.returncode == 0, up.stderr
        for pod in pods:
            status = run_cli(home, "serve", "status", "--pod", pod)
            assert status.returncode == 0, status.stderr
        # down with its fleet up: the fleet goes with the pod, and down says so (a trial:
        # only "pod 'NAME' is down")
        gone = run_cli(home, "down", "--pod", pods[0])
        assert gone.returncode == 0, gone.stderr
        assert f"pod {pods[0]!r} has a serving fleet: it stops with the pod" in gone.stderr
        assert wait_until_gone(pods[0]) == []
    finally:
        for pod in pods:
            run_cli(home, "serve", "down", "--pod", pod)
            run_cli(home, "down", "--pod", pod)


@pytest.mark.local
def test_an_agent_whose_port_is_taken_says_so_in_one_line(tmp_path: Path) -> None:
    """`serve up` shows the agent's last lines when it does not start: a traceback's
    fragments before, one line and what to do now."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "tpupod.serve.agent", "--state-dir", str(tmp_path)]
        agent = subprocess.run(
            [*argv, "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert agent.returncode == 1
    assert agent.stderr.strip() == (
        f"the agent cannot listen on 127.0.0.1:{port}: Address already in use\n"
        f"hint: another process on this worker holds port {port}; stop it"
    )


def test_a_worker_python_that_answers_nothing_is_named_plainly(
    cli: Callable[..., CliResult], make_pod: Callable[..., Pod]
) -> None:
    """Its error showed a bound method's repr (a WorkerResult of 600 characters)."""
    pod = make_pod(workers=1)
    result = cli(
        "serve", "up", "--pod", pod.name, "--model", str(TINY), "--worker-python", "/bin/false"
    )
    assert result.code == 1, result
    assert (
        result.err.splitlines()[-2] == "error: w0: tpupod.serve.agent.ctl gave no answer (exit 1)"
    )


@pytest.mark.timeout(90)
def test_down_of_an_ssh_pod_stops_its_fleet_first(
    make_ssh_pod: Any, state_home: Path, sim: Any
) -> None:
    """'tpupod down' of an SSH pod forgets the hosts, which stay up: its serving fleet ran
    on with no record left to stop it ('serve down' then found no pod)."""
    pod = make_ssh_pod(workers=2)
    up = run_cli(
        state_home, "serve", "up", "--pod", pod.name, "--model", "m", "--backend", "command",
        "--command", STUB_COMMAND, "--worker-python", sys.executable,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    down = run_cli(state_home, "down", "--pod", pod.name)
    assert down.returncode == 0, down.stderr
    assert "stopping its serving fleet first" in down.stderr
    assert sim_leftovers(sim) == []


# -- a default builtin fleet under kills (issue 41) -----------------------------------------

TINY = Path(__file__).parent / "fixtures" / "qwen2-tiny"
STAMPED = re.compile(r"\[w(\d)\] (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z (.*)$")


@pytest.fixture(scope="module")
def builtin_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A fleet as the README starts one: ``up --local 2``, ``serve up --model`` of the tiny
    checkpoint (the builtin backend), every other option its default but the ports."""
    home = tmp_path_factory.mktemp("builtin") / "state"
    pod = f"bk{os.getpid()}"
    assert run_cli(home, "up", "--name", pod, "--local", "2").returncode == 0
    try:
        up = run_cli(
            home, "serve", "up", "--pod", pod, "--model", str(TINY),
            "--base-port", str(free_base_port()),  # other fleets may run on this machine
            "--", "--max-batch", "4", "--max-length", "128", timeout=240,
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        exports = run_cli(home, "serve", "endpoint", "--pod", pod).stdout.splitlines()
        values = dict(line.removeprefix("export ").split("=", 1) for line in exports)
        base_url, token = values["OPENAI_BASE_URL"], values["OPENAI_API_KEY"]
        yield Fleet(home, pod, base_url, token, base_url.removesuffix("/v1"))
    finally:
        run_cli(home, "serve", "down", "--pod", pod)
        run_cli(home, "down", "--pod", pod)
        assert wait_until_gone(pod) == []


@dataclass
class Asked:
    began: float
    ended: float
    error: str | None  # None: a whole answer


class Clients:
    """Threads asking the router again as soon as each has its answer (half streaming),
    with the real openai client and no retries (a retry would hide the fault)."""

    def __init__(self, fleet: Fleet, count: int) -> None:
        self.done: list[Asked] = []
        self.stop = threading.Event()
        self.model = openai_client(fleet.base_url, fleet.token).models.list().data[0].id
        clients = [openai_client(fleet.base_url, fleet.token, timeout=60) for _ in range(count)]
        self.threads = [
            threading.Thread(target=self.ask, args=(c, i % 2 == 1)) for i, c in enumerate(clients)
        ]

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def ask(self, client: Any, stream: bool) -> None:
        messages: Any = [{"role": "user", "content": "hello"}]
        while not self.stop.is_set():
            began, error = time.monotonic(), None
            try:
                answer = client.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=8, stream=stream
                )
                if stream:
                    ends = [c.choices[0].finish_reason for c in answer if c.choices]
                    error = None if ends and ends[-1] else "the stream ended unfinished"
            except Exception as exc:  # what the client saw is the result
                cause = exc.__cause__ or exc.__context__
                error = f"{type(exc).__name__} <- {type(cause).__name__}: {cause}"
            self.done.append(Asked(began, time.monotonic(), error))

    def answered_after(self, moment: float) -> int:
        return sum(a.error is None and a.ended > moment for a in self.done)


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} after {timeout:g}s"
        time.sleep(0.05)


def logged_after(lines: list[str], wall: float, text: str) -> float | None:
    """Seconds from ``wall`` (time.time()) to the first stamped line that contains ``text``."""
    for line in lines:
        m = STAMPED.match(line)
        if m and text in m.group(3):
            at = datetime.fromisoformat(m.group(2)).replace(tzinfo=UTC).timestamp()
            return at - wall
    return None


def requests_counted(fleet: Fleet) -> int:
    return sum(h["requests"] for h in backends(fleet)["health"].values())


@pytest.mark.local
@pytest.mark.timeout(180)
def test_a_router_killed_with_9_under_load_fails_only_the_requests_in_flight_in_it(
    builtin_fleet: Fleet,
) -> None:
    """A kill -9 of the router was a total outage: every request refused for 1.5-4.9 s
    until its respawn parent started it again after a backoff (1, 2, 4 s). The parent now
    holds the listening socket and hands it to each router, so new connections wait in
    the backlog, and a router that died by a signal is started again at once: only the
    requests in flight in the killed router fail (the client sees the connection close:
    APIConnectionError, or a stream cut short); the router's request counts go on; the
    router's log names the restart within a second or two."""
    fleet = builtin_fleet
    (router,) = router_processes(fleet.pod)
    with Clients(fleet, 8) as clients:
        wait_for(lambda: clients.answered_after(0) >= 16, 60, "answers before the kill")
        counted = requests_counted(fleet)
        wall = time.time()
        router.kill()
        router.wait(10)  # gone: every connection it had is closed
        dead = time.monotonic()
        wait_for(lambda: clients.answered_after(dead) >= 16, 30, "answers after the kill")
    failed = [a for a in clients.done if a.error is not None]
    begun_after = [a for a in failed if a.began >= dead]
    # before: refused until the respawn, 1.5-4.9 s
    assert begun_after == [], f"{len(begun_after)} failed, first: {begun_after[0]}"
    # each sent to the killed router (on a connection it had accepted): a client's next
    # request goes on a new connection, which waits in the backlog: one failure a client
    assert len(failed) <= 8, failed
    assert requests_counted(fleet) >= counted + 16  # kept: they began again at 0
    log = run_cli(fleet.home, "serve", "logs", "--pod", fleet.pod, "--router").stdout
    said = logged_after(log.splitlines(), wall, "the router exited (killed by SIGKILL)")
    assert said is not None and said < 2.0, log
    assert "started again at once (restart 1)" in log, log
    status = run_cli(fleet.home, "serve", "status", "--pod", fleet.pod).stdout
    assert "2/2 backends healthy; 1 restart)" in status, status


def builtin_child(pod: str, worker: int, role: str) -> psutil.Process:
    """The engine or the front end (``role``) of the builtin server on ``worker``."""
    found = [
        p
        for p in pod_processes(pod)
        if "tpupod.serve.builtin" in p.cmdline() and f"--role {role}" in " ".join(p.cmdline())
        and Path(p.cwd()).name == f"w{worker}"
    ]  # fmt: skip
    assert len(found) == 1, [p.cmdline() for p in found]
    return found[0]


def status_row(fleet: Fleet, worker: int) -> str:
    out = run_cli(fleet.home, "serve", "status", "--pod", fleet.pod).stdout
    return next(line for line in out.splitlines() if line.startswith(f"w{worker} "))


@pytest.mark.local
@pytest.mark.timeout(120)
def test_engine_and_front_end_kills_are_counted_in_serve_status_and_named_in_the_log(
    builtin_fleet: Fleet,
) -> None:
    """The builtin server restarts its own engine and front end: serve status showed
    RESTARTS 0 after any number of them. Each is counted now, with the process that
    restarted (``1 (front end 1)``), and the server's log names it within a second or
    two; the row's request count is not reset by them. The agent's restart of a whole
    server is named the same way (``server``)."""
    fleet = builtin_fleet
    assert re.search(r"\bready +\d+ +0 ", status_row(fleet, 0))
    before = backends(fleet)["health"]
    wall = time.time()
    builtin_child(fleet.pod, 0, "frontend").kill()
    wait_for(lambda: " 1 (front end 1) " in status_row(fleet, 0), 20, "front end restart")
    lines = run_cli(fleet.home, "serve", "logs", "--pod", fleet.pod, "-w", "0").stdout
    said = logged_after(lines.splitlines(), wall, "the front end process was killed (SIGKILL)")
    assert said is not None and said < 2.0, lines
    restarting = r"killed \(SIGKILL\) after [\d.]+s; starting it again in [\d.]+s \(restart 1\)$"
    assert re.search(restarting, lines, re.M), lines
    wall = time.time()
    builtin_child(fleet.pod, 0, "engine").kill()
    wait_for(lambda: " 2 (engine 1, front end 1) " in status_row(fleet, 0), 20, "engine restart")
    lines = run_cli(fleet.home, "serve", "logs", "--pod", fleet.pod, "-w", "0").stdout
    said = logged_after(lines.splitlines(), wall, "the engine process was killed (SIGKILL)")
    assert said is not None and said < 2.0, lines
    after = backends(fleet)["health"]
    assert all(after[a]["requests"] >= before[a]["requests"] for a in before)
    # the whole server (its keeper, and so its children) killed: its agent starts it again
    (keeper,) = [
        p for p in pod_processes(fleet.pod)
        if p.cmdline()[2:5:2] == ["tpupod.extras", "tpupod.serve.builtin"]
        and Path(p.cwd()).name == "w1"
    ]  # fmt: skip
    wall = time.time()
    keeper.kill()
    wait_for(lambda: " 1 (server 1) " in status_row(fleet, 1), 20, "the server's restart")
    lines = run_cli(fleet.home, "serve", "logs", "--pod", fleet.pod, "-w", "1").stdout
    said = logged_after(lines.splitlines(), wall, "[tpupod agent] the server exited (killed by")
    assert said is not None and said < 2.0, lines


@pytest.mark.local
@pytest.mark.timeout(300)
def test_a_server_whose_engine_restarts_is_restarting_until_it_serves_again(
    builtin_fleet: Fleet,
) -> None:
    """The new-user trial of issue 41: for the 2-3 minutes a killed engine took to come
    back (under load), serve status said 'ready' while the server answered 503 to every
    request, and the log said the kill but never the return."""
    fleet = builtin_fleet
    wait_for(lambda: re.search(r"\bready\b", status_row(fleet, 0)) is not None, 60, "ready")
    wall = time.time()
    builtin_child(fleet.pod, 0, "engine").kill()
    wait_for(lambda: "restarting (engine)" in status_row(fleet, 0), 10, "restarting shown")
    wait_for(lambda: "restarting" not in status_row(fleet, 0), 240, "serving again")
    assert re.search(r"\bready\b", status_row(fleet, 0))
    lines = run_cli(fleet.home, "serve", "logs", "--pod", fleet.pod, "-w", "0").stdout
    said = logged_after(lines.splitlines(), wall, "the engine is serving again after ")
    assert said is not None, lines


def worker_agent(pod: str, worker: int) -> psutil.Process:
    """The agent of ``worker`` (not its keeper, whose command line names the agent's)."""
    (found,) = [
        p for p in pod_processes(pod)
        if p.cmdline()[2:5:2] == ["tpupod.extras", "tpupod.serve.agent"]
        and Path(p.cwd()).name == f"w{worker}"
    ]  # fmt: skip
    return found


def engine_restarts(fleet: Fleet, worker: int) -> int:
    found = re.search(r"\bengine (\d+)", status_row(fleet, worker))
    return int(found.group(1)) if found else 0


def state_of(fleet: Fleet, worker: int) -> str:
    return status_row(fleet, worker).split()[3]


@pytest.mark.local
@pytest.mark.timeout(180)
def test_an_agent_killed_with_9_under_load_is_started_again_and_takes_over_its_servers(
    builtin_fleet: Fleet,
) -> None:
    """A kill -9 of a worker's agent left its servers writing into a pipe nobody read: the
    next line one wrote (an engine's restart said in its log) killed it, and no agent ran
    to start it again until the user's serve up, which stopped the servers the dead agent
    left and started them anew (30 s of loading on a loaded machine). The agent now runs
    under a keeper that starts it again at once, and the new agent takes over the servers
    still running (their output goes on into their logs): no request fails, the server
    keeps its pid, its later restarts are made and counted; the agent's log names the
    restart within a second or two and serve status counts it."""
    fleet = builtin_fleet
    # both routed to (a test before may have left one starting): w1 serves through it all
    wait_for(lambda: state_of(fleet, 0) == state_of(fleet, 1) == "ready", 90, "both ready")
    before = status_row(fleet, 0).split()[4]  # its pid
    engines = engine_restarts(fleet, 0)
    agent = worker_agent(fleet.pod, 0)
    with Clients(fleet, 4) as clients:
        wait_for(lambda: clients.answered_after(0) >= 8, 60, "answers before the kill")
        wall = time.time()
        agent.kill()
        agent.wait(10)
        dead = time.monotonic()
        wait_for(lambda: clients.answered_after(dead) >= 16, 30, "answers after the kill")
        # the server speaks after its agent died: its engine killed, its keeper says so
        builtin_child(fleet.pod, 0, "engine").kill()
        # the agent answers: 'restarting (engine)' until the engine loads again (minutes
        # under load), then 'ready'
        again = ("ready", "restarting")
        wait_for(lambda: state_of(fleet, 0).startswith(again), 20, "an agent on w0 again")
        wait_for(lambda: engine_restarts(fleet, 0) > engines, 30, "the engine's restart")
        assert f"  {before}  " in status_row(fleet, 0)  # the same server
        served = clients.answered_after(time.monotonic())
        wait_for(lambda: clients.answered_after(dead) >= served + 8, 30, "answers at the end")
    failed = [a for a in clients.done if a.error is not None]
    # the engine's kill fails what was in flight in it (up to --max-batch): not the agent's
    assert len(failed) <= 4, failed
    log = run_cli(fleet.home, "serve", "logs", "--pod", fleet.pod, "--agent", "-w", "0").stdout
    said = logged_after(log.splitlines(), wall, "the agent exited (killed by SIGKILL)")
    assert said is not None and said < 2.0, log
    assert "started again at once (restart 1)" in log, log
    server_log = run_cli(fleet.home, "serve", "logs", "--pod", fleet.pod, "-w", "0").stdout
    assert logged_after(server_log.splitlines(), wall, "took over this server") is not None
    assert logged_after(server_log.splitlines(), wall, "the engine process was killed") is not None
    status = run_cli(fleet.home, "serve", "status", "--pod", fleet.pod).stdout
    assert "agents: w0 restarted 1 time" in status, status


@pytest.mark.local
@pytest.mark.timeout(90)
def test_serve_down_says_an_agent_that_did_not_stop_in_its_grace_was_killed(
    tmp_path: Path,
) -> None:
    """The new-user trial: with w0's agent frozen (kill -STOP), 'serve down' paused about
    10 s without a word, then said 'w0 agent stopped' as if it had stopped by itself."""
    with local_pod(tmp_path, "sf", 1) as (home, pod):
        assert stub_up(home, pod).returncode == 0
        agents = [
            p for p in pod_processes(pod) if _runs(described(p).split(), "tpupod.serve.agent")
        ]
        assert len(agents) == 1, [described(p) for p in pod_processes(pod)]
        agents[0].suspend()
        down = run_cli(home, "serve", "down", "--pod", pod)
        assert down.returncode == 0, down.stderr
        said = down.stdout + down.stderr
        assert "w0 agent did not stop within its grace (8s) and was killed" in said, said
        assert "w0 agent stopped" not in said, said
        assert "w0 router stopped" in said, said
        assert wait_until_gone(pod) == []
