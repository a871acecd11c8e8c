"""The builtin server's front end apart from its engine (``serve/builtin/split.py``): real
processes.

One server (qwen2-tiny, one port) for the module: ``kill -9`` of its front
end, then of its engine, each while streams are in flight, with the real
``openai`` client. The keeper restarts the killed child; the other keeps
running (the same pid): the engine keeps its warm programs, the front end
keeps its port and answers 503 with the reason meanwhile. Stop strings are
found by the front end (the engine sends token ids): the answers and their
usage are those of a ``--no-split`` server and of ``generate``.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.test_serve_builtin import FIXTURES, NAME, Server, free_ports
from tpupod.model import Tokenizer, load_model
from tpupod.serve.builtin import split

pytestmark = pytest.mark.local

NEW = 8
RESTART_S = 240  # an engine's restart loads and compiles the model: slow on a busy CPU


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from started()


def started(*extra: str) -> Iterator[Server]:
    srv = Server(FIXTURES / NAME, free_ports(1), "--max-batch", "4", "--max-length", "256", *extra)
    try:
        srv.wait_ready(timeout=RESTART_S)
        yield srv
    finally:
        srv.proc.terminate()  # the keeper's own stop (kill -9 would leave its socket folder)
        try:
            srv.proc.wait(30)
        finally:
            srv.stop()


def child(srv: Server, role: str) -> psutil.Process:
    """The keeper's child of this role (``engine`` or ``frontend``)."""
    for proc in psutil.Process(srv.proc.pid).children():
        if f"--role {role}" in " ".join(proc.cmdline()):
            return proc
    raise AssertionError(f"no {role} process")


def wait_healthy(srv: Server, timeout: float = RESTART_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(srv.url("/health"), timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not come back")


def complete(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.completions.create(
        model=NAME, **{"prompt": [5, 6, 7], "max_tokens": NEW, "temperature": 0, **kwargs}
    )


def streams_in_flight(
    client: openai.OpenAI, count: int
) -> tuple[list[str], list[threading.Thread]]:
    """``count`` long streams, each past its first chunk when this returns."""
    outcomes: list[str] = []
    first = threading.Barrier(count + 1)

    def stream() -> None:
        chunks = client.completions.create(
            model=NAME, prompt=[5, 6, 7], max_tokens=250, temperature=0, stream=True
        )
        try:
            for i, _ in enumerate(chunks):
                if i == 0:
                    first.wait(timeout=60)
            outcomes.append("finished")
        except openai.APIError as exc:
            outcomes.append(f"error: {exc.message}")
        except httpx.HTTPError as exc:
            outcomes.append(f"cut: {type(exc).__name__}")

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    first.wait(timeout=60)
    return outcomes, threads


@pytest.mark.timeout(RESTART_S + 120)
def test_front_end_killed_the_engine_keeps_its_state_and_a_new_front_end_serves(
    server: Server,
) -> None:
    client = server.client()
    want = complete(client).choices[0].text
    engine, front = child(server, "engine"), child(server, "frontend")
    compiled = engine.cpu_times()
    _, threads = streams_in_flight(client, 2)
    os.kill(front.pid, signal.SIGKILL)
    for t in threads:  # the clients' connections are cut: nothing hangs
        t.join(timeout=30)
        assert not t.is_alive()
    wait_healthy(server, timeout=120)  # a front end starts in seconds: no model, no compile
    assert complete(server.client()).choices[0].text == want
    assert child(server, "engine").pid == engine.pid  # the same engine, its programs warm
    assert child(server, "frontend").pid != front.pid
    # the dead front end's streams were cancelled: their slots are free again
    deadline = time.monotonic() + 30
    while httpx.get(server.url("/health"), timeout=5).json()["running"] and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert httpx.get(server.url("/health"), timeout=5).json()["running"] == 0
    # answering took far less engine CPU time than loading and compiling had
    spent = engine.cpu_times().user - compiled.user
    assert spent < compiled.user / 2, (spent, compiled.user)


@pytest.mark.timeout(RESTART_S + 120)
def test_engine_killed_streams_end_with_an_error_503_until_it_is_back(server: Server) -> None:
    wait_healthy(server)
    client = server.client()
    want = complete(client).choices[0].text
    engine, front = child(server, "engine"), child(server, "frontend")
    outcomes, threads = streams_in_flight(client, 3)
    os.kill(engine.pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    reason = "the engine process is not running (it exited); it is being restarted"
    assert len(outcomes) == 3 and all(o.startswith(f"error: {reason}") for o in outcomes)

    health = httpx.get(server.url("/health"), timeout=5)
    assert health.status_code == 503
    assert health.json()["error"]["message"].startswith(reason)
    assert health.json()["error"]["code"] == "service_unavailable"
    with pytest.raises(openai.APIStatusError) as refused:
        complete(client)
    assert refused.value.status_code == 503 and reason in refused.value.message

    wait_healthy(server)
    assert complete(client).choices[0].text == want
    assert child(server, "frontend").pid == front.pid  # the port never closed
    assert child(server, "engine").pid != engine.pid


STALL_S = 3


@pytest.mark.timeout(RESTART_S + 120)
def test_a_stalled_engine_is_restarted_and_its_streams_end_with_the_reason() -> None:
    """An engine that stops making progress (here SIGSTOP; a hung device call is the
    same to the front end) left every request hanging with /health saying ok."""
    for srv in started("--stall-timeout", str(STALL_S)):
        client = srv.client()
        want = complete(client).choices[0].text
        engine, front = child(srv, "engine"), child(srv, "frontend")
        outcomes, threads = streams_in_flight(client, 2)
        stopped = time.monotonic()
        os.kill(engine.pid, signal.SIGSTOP)
        for t in threads:
            t.join(timeout=STALL_S + 30)
            assert not t.is_alive()
        ended = time.monotonic() - stopped
        assert STALL_S - 0.5 < ended < STALL_S + 10, ended
        reason = f"the engine made no progress for {STALL_S}s"
        assert len(outcomes) == 2 and all(o.startswith(f"error: {reason}") for o in outcomes)
        _, alive = psutil.wait_procs([engine], timeout=10)  # killed, not left stopped
        assert not alive
        assert httpx.get(srv.url("/health"), timeout=5).status_code == 503  # until it is back
        wait_healthy(srv)
        assert complete(client).choices[0].text == want
        assert child(srv, "frontend").pid == front.pid
        assert child(srv, "engine").pid != engine.pid


@pytest.mark.timeout(RESTART_S + 120)
def test_a_hung_front_end_is_restarted_by_the_keeper() -> None:
    """A front end that stops answering (SIGSTOP; a wedged event loop is the same) kept
    its ports, and every connection waited in the backlog for good: the keeper only
    restarted a child that died. It now asks the front end's /health and restarts one
    that has answered before and then stays silent for --stall-timeout."""
    for srv in started("--stall-timeout", str(STALL_S)):
        client = srv.client()
        want = complete(client).choices[0].text
        engine, front = child(srv, "engine"), child(srv, "frontend")
        time.sleep(1.5)  # the keeper's probe has had its first answer (it asks every 0.25 s)
        stopped = time.monotonic()
        os.kill(front.pid, signal.SIGSTOP)
        _, alive = psutil.wait_procs([front], timeout=STALL_S + 30)
        assert not alive
        # silence counts from its last answer: up to a probe's interval before the stop
        assert time.monotonic() - stopped > STALL_S - split.PROBE_S - 0.5
        wait_healthy(srv, timeout=60)  # a front end starts in seconds: no model, no compile
        assert complete(client).choices[0].text == want
        assert child(srv, "frontend").pid != front.pid
        assert child(srv, "engine").pid == engine.pid  # the engine, warm, is the same


def test_the_stall_timeout_is_checked() -> None:
    from tpupod.errors import UsageError
    from tpupod.serve.builtin.server import check_args, parse_args

    with pytest.raises(UsageError, match="--stall-timeout -1"):
        check_args(parse_args(["--model", "m", "--ports", "31000", "--stall-timeout", "-1"]))
    given = parse_args(["--model", "m", "--ports", "31000", "--stall-timeout", "2.5"])
    assert parse_args(split._passed_on(given)).stall_timeout == 2.5  # to the front end
    assert parse_args(["--model", "m", "--ports", "31000"]).stall_timeout == 60
    from tpupod.serve.replica import member as replica

    member = ["--model", "m", "--port", "1", "--rank", "0", "--size", "2", "--leader", "h:2"]
    member += ["--coordinator-port", "3"]
    assert replica.parse_args(member).stall_timeout == 60
    with pytest.raises(UsageError, match="--stall-timeout -1"):
        replica.run(replica.parse_args([*member, "--stall-timeout", "-1"]))


def test_a_keeper_killed_with_9_leaves_no_socket_folder_behind_the_next_start() -> None:
    """A keeper's own cleanup does not run under ``kill -9``; the next keeper's start removes
    the folders of keepers that are gone, and only those."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    root = Path(tempfile.gettempdir())
    dead = Path(tempfile.mkdtemp(prefix=f"{split.FOLDER_PREFIX}{gone.pid}-", dir=root))
    (dead / "engine-1.sock").touch()
    alive = Path(tempfile.mkdtemp(prefix=f"{split.FOLDER_PREFIX}{os.getpid()}-", dir=root))
    try:
        split._sweep_folders()
        assert not dead.exists()
        assert alive.exists()
    finally:
        alive.rmdir()


# ---- stop strings, found by the front end --------------------------------------------

PROMPT = [5, 6, 7]
ANSWER = 40


@pytest.fixture(scope="module")
def unsplit() -> Iterator[Server]:
    yield from started("--no-split")


@pytest.fixture(scope="module")
def answer() -> list[int]:
    """Greedy tokens of ``generate`` for PROMPT."""
    return [
        int(t)
        for t in load_model(FIXTURES / NAME).generate([PROMPT], max_new_tokens=ANSWER).tokens[0]
    ]


def asked(srv: Server, stop: str, stream: bool) -> tuple[str, str, int]:
    """(text, finish reason, completion tokens) of a completion with this stop string."""
    client = srv.client()
    kwargs: dict[str, Any] = {"prompt": PROMPT, "max_tokens": ANSWER, "stop": [stop, "never"]}
    if not stream:
        out = complete(client, **kwargs)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens
    chunks = list(complete(client, **kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert chunks[-1].usage is not None
    return text, reason, chunks[-1].usage.completion_tokens


@pytest.mark.timeout(RESTART_S + 240)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings_found_by_the_front_end_equal_no_split_and_generate(
    server: Server, unsplit: Server, answer: list[int], stream: bool
) -> None:
    """The engine sends token ids; the front end finds the stop string one frame or more
    late and cancels the request: no text past the stop, usage counts the tokens up to
    it, as the --no-split server (and the engine that used to stop) reports."""
    wait_healthy(server)
    tokenizer = Tokenizer(FIXTURES / NAME)
    full = tokenizer.decode(answer)
    # the fixture's answer: '\x1a是是是��ededple�...'; each stop below spans two tokens,
    # "是是" two tokens of a character each, "ede" after a held-back tail ("ed")
    for stop in ("是是", "de", "ede", "dp"):
        k = next(k for k in range(1, ANSWER + 1) if stop in tokenizer.decode(answer[:k]))
        assert stop not in tokenizer.decode(answer[k - 1 : k]), stop  # spans tokens
        want = (full[: full.index(stop)], "stop", k)
        assert asked(server, stop, stream) == want, stop
        assert asked(unsplit, stop, stream) == want, stop
    # the cancelled requests left their slots
    for srv in (server, unsplit):
        deadline = time.monotonic() + 30
        while httpx.get(srv.url("/health"), timeout=5).json()["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_the_front_end_takes_the_tokenizer_without_loading_jax(tmp_path: Path) -> None:
    """The engine sends its tokenizer pickled; unpickling it must not import JAX and flax
    (about a second of CPU and 150 MB more at every front-end start)."""
    pickled = tmp_path / "tokenizer.pickle"
    pickled.write_bytes(pickle.dumps(Tokenizer(FIXTURES / NAME)))
    code = (
        "import pickle, sys; "
        f"t = pickle.loads(open({str(pickled)!r}, 'rb').read()); "
        "print(t.decode(t.encode('hello world')), sorted({'jax', 'flax'} & set(sys.modules)))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "hello world []"
