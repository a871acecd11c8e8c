"""The builtin server: the real process on loopback ports, the real ``openai`` client.

One server process (qwen2-tiny, two ports, one engine per port on two CPU
devices) serves most tests; the SIGTERM test starts its own (qwen3-tiny).
Answers are compared with ``QwenModel.generate`` run here on the same
checkpoint (float32, greedy). The scheduler is also driven in-process:
slots reused, requests joining a running batch, per-row sampling.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI, start_router

if importlib.util.find_spec("flax") is None or importlib.util.find_spec("openai") is None:
    if IN_CI:
        raise RuntimeError("prerequisite missing in CI: flax, openai (pip install -e '.[test]')")
    pytest.skip("needs the model and serve extras and openai", allow_module_level=True)

import httpx
import openai

from tpupod.model import QwenModel, load_model
from tpupod.serve.builtin.engine import Engine
from tpupod.serve.builtin.events import (
    Delta,
    Event,
    Failed,
    Finished,
    RequestRejected,
    SamplingParams,
    deliver,
)
from tpupod.serve.builtin.text import TextStream, submit

# The module's first test also pays for its shared server or engines (loads and
# compiles: ~10 s on a quiet machine, 94-187 s at load 13-19), past the 60 s default.
pytestmark = [pytest.mark.local, pytest.mark.timeout(300)]

FIXTURES = Path(__file__).parent / "fixtures"
NAME = "qwen2-tiny"
MAX_BATCH, MAX_LENGTH = 8, 128
NEW = 24  # tokens per answer where answers are compared


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Server:
    """``python -m tpupod.serve.builtin`` as the agent starts it."""

    def __init__(self, model: Path, ports: list[int], *extra: str, devices: int = 1) -> None:
        self.ports = ports
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            # the tiny checkpoints compile 4x faster without LLVM optimisations
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} "
            "--xla_backend_optimization_level=0",
        }
        argv = [
            sys.executable,
            "-m",
            "tpupod.serve.builtin",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--ports",
            ",".join(map(str, ports)),
            *extra,
        ]
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self.clients: list[openai.OpenAI] = []

    def wait_ready(self, timeout: float = 240) -> None:
        # a quiet machine is ready in ~10 s; at load 13-19 a start took 94-187 s (split or not)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        want = {f"ready port={p}" for p in self.ports}
        while want - set(self.lines):
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"server exited: {self.proc.wait()} {self.stderr()}")
            self.lines.append(line.strip())
            assert time.monotonic() < deadline, "server not ready in time"

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read() if self.proc.poll() is not None else ""

    def client(self, port: int | None = None) -> openai.OpenAI:
        port = port or self.ports[0]
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30
        )
        self.clients.append(client)
        return client

    def url(self, path: str, port: int | None = None) -> str:
        return f"http://127.0.0.1:{port or self.ports[0]}{path}"

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server(
        FIXTURES / NAME,
        free_ports(2),
        "--max-batch",
        str(MAX_BATCH),
        "--max-length",
        str(MAX_LENGTH),
        devices=2,
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def model() -> QwenModel:
    return load_model(FIXTURES / NAME)


def reference(model: QwenModel, prompts: list[list[int]], new: int = NEW) -> list[str]:
    """Greedy answers of QwenModel.generate, all prompts as one batch (one compile)."""
    out = model.generate(prompts, max_new_tokens=new)
    assert out.texts is not None
    return out.texts


def chat_ids(model: QwenModel, content: str) -> list[int]:
    assert model.tokenizer is not None
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    return model.tokenizer.encode(text)


QUESTIONS = [
    "Who are you?",
    "def add(a, b):",
    "Tell me a story",
    "1 2 3 4",
    "hello world",
    "The quick brown fox",
    "What is a TPU pod?",
    "abc",
]


def ask(client: openai.OpenAI, content: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": content}],
        **{"max_tokens": NEW, "temperature": 0, **kwargs},
    )


# ---- through the real server ---------------------------------------------------------


def test_greedy_chat_equals_generate_on_both_ports_streamed_or_not(
    server: Server, model: QwenModel
) -> None:
    expected = reference(model, [chat_ids(model, q) for q in QUESTIONS[:2]])
    assert [m.id for m in server.client().models.list().data] == [NAME]
    assert httpx.get(server.url("/health")).status_code == 200
    for port in server.ports:
        client = server.client(port)
        for question, want in zip(QUESTIONS[:2], expected, strict=True):
            whole = ask(client, question)
            assert whole.choices[0].message.content == want
            assert whole.choices[0].finish_reason in ("stop", "length")
            assert whole.usage.prompt_tokens == len(chat_ids(model, question))
            assert whole.usage.total_tokens == whole.usage.prompt_tokens + (
                whole.usage.completion_tokens
            )
            chunks = list(
                ask(client, question, stream=True, stream_options={"include_usage": True})
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == want
            assert chunks[0].choices[0].delta.role == "assistant"
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finishes[-1] == whole.choices[0].finish_reason
            assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completions_streamed_or_not_equal_generate(server: Server, model: QwenModel) -> None:
    assert model.tokenizer is not None
    prompt = "The quick brown fox"
    (want,) = reference(model, [model.tokenizer.encode(prompt)])
    client = server.client(server.ports[1])
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0)
    assert out.choices[0].text == want
    assert out.usage is not None and out.usage.prompt_tokens == len(model.tokenizer.encode(prompt))
    stream = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=NEW, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == want


def test_eight_concurrent_requests_batch_and_each_equals_it_alone(server: Server) -> None:
    client = server.client()
    new = 64  # long answers: the decode steps dominate the time
    alone: dict[str, str] = {}
    times = []
    for question in QUESTIONS:
        started = time.perf_counter()
        alone[question] = ask(client, question, max_tokens=new).choices[0].message.content
        times.append(time.perf_counter() - started)
    one = sorted(times)[len(times) // 2]

    rounds = []  # the best of 3: one alone takes ~40 ms, and a loaded machine's stall of a
    for _ in range(3):  # few dozen ms in the one round there was put it at 4.75x (CI)
        with ThreadPoolExecutor(8) as pool:
            started = time.perf_counter()
            answers = list(pool.map(lambda q: ask(client, q, max_tokens=new), QUESTIONS))
            rounds.append(time.perf_counter() - started)
        for question, answer in zip(QUESTIONS, answers, strict=True):
            assert answer.choices[0].message.content == alone[question], question
    together = min(rounds)  # one after the other would be 8x
    assert together < 4 * one, f"8 at once took {rounds}s, one alone {one:.3f}s"


def test_stop_strings_are_cut_streamed_or_not(server: Server) -> None:
    client = server.client()
    full = ask(client, QUESTIONS[0]).choices[0].message.content
    stop = full[5:8]
    cut = full[: full.index(stop)]
    out = ask(client, QUESTIONS[0], stop=[stop, "never-appears"])
    capped = ask(client, QUESTIONS[0], max_tokens=None, max_completion_tokens=3)
    assert capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"
    assert out.choices[0].message.content == cut
    assert out.choices[0].finish_reason == "stop"
    chunks = list(ask(client, QUESTIONS[0], stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_kept_inside_a_shared_batch(server: Server) -> None:
    client = server.client()
    sampled = {"temperature": 1.5, "top_p": 0.9, "max_tokens": 32}
    alone = ask(client, QUESTIONS[2], seed=7, **sampled).choices[0].message.content
    other_seed = ask(client, QUESTIONS[2], seed=8, **sampled).choices[0].message.content
    assert alone != other_seed
    calls = [
        lambda: ask(client, QUESTIONS[2], seed=7, **sampled),
        lambda: ask(client, QUESTIONS[2], seed=8, **sampled),
        lambda: ask(client, QUESTIONS[3], max_tokens=64),
        lambda: ask(client, QUESTIONS[4], seed=1, temperature=1.0, max_tokens=64),
    ]
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(lambda call: call(), calls))
    assert answers[0].choices[0].message.content == alone
    assert answers[1].choices[0].message.content == other_seed


def test_any_64_bit_seed_is_taken_and_draws_with_its_low_32_bits(server: Server) -> None:
    """OpenAI and vLLM take any 64-bit seed; a seed past 32 bits (-1, 2**40 + 7) failed its
    request with 503 'generation failed: Python integer -1 out of bounds for uint32'."""
    client = server.client()
    sampled = {"temperature": 1.5, "max_tokens": 16}

    def text(seed: int) -> str | None:
        return ask(client, QUESTIONS[1], seed=seed, **sampled).choices[0].message.content

    assert text(-1) == text(2**32 - 1)
    assert text(2**40 + 7) == text(7)
    assert text(2**64 - 1) == text(-1)
    with pytest.raises(openai.BadRequestError, match="seed"):
        text(2**64)


def test_half_a_surrogate_pair_is_a_400_not_a_500(server: Server) -> None:
    """JSON may escape half a UTF-16 surrogate pair (\\ud800), which Python takes as a str
    no encoder can take: the tokenizer raised and the client got a bare 500 (chat,
    completions, a stop string, the model's name in the 404). Now a 400 that names it; a
    whole pair escaped (what ensure_ascii JSON sends for an emoji) is a character."""
    half = "\\ud800"
    for path, body in (
        (
            "/v1/chat/completions",
            f'{{"model": "{NAME}", "messages": [{{"role": "user", '
            f'"content": "x{half}"}}], "max_tokens": 2}}',
        ),
        ("/v1/completions", f'{{"model": "{NAME}", "prompt": "x{half}y", "max_tokens": 2}}'),
        ("/v1/completions", f'{{"model": "{NAME}", "prompt": "x", "stop": "{half}"}}'),
        ("/v1/completions", f'{{"model": "{NAME}{half}", "prompt": "x"}}'),
    ):
        response = post(server, path, body.encode())
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_json" and "\\ud800" in error["message"], error
    emoji = json.dumps({"model": NAME, "prompt": "x \U0001f600", "max_tokens": 2})
    assert "\\ud83d\\ude00" in emoji
    assert post(server, "/v1/completions", emoji.encode()).status_code == 200


def post(server: Server, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url(path), content=content, timeout=30)


HI = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": NAME}, "messages"),
        ({"model": NAME, "messages": []}, "messages"),
        ({"model": NAME, "messages": HI, "max_tokens": "9"}, "max_tokens"),
        ({"model": NAME, "messages": HI, "max_tokens": 0}, "max_tokens"),
        ({"model": NAME, "messages": HI, "temperature": -1}, "temperature"),
        ({"model": NAME, "messages": HI, "top_p": 0}, "top_p"),
        ({"model": NAME, "messages": HI, "n": 2}, "n"),
        ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, "messages.role"),
        ({"model": NAME, "messages": HI, "max_tokens": 10**6}, "max_tokens"),
        ({"model": NAME, "messages": [{"role": "user", "content": "x " * 300}]}, "messages"),
        (b"{not json", None),
        ([1, 2], None),
    ],
)
def test_malformed_bodies_get_openai_shaped_400s(server: Server, body: Any, param: str) -> None:
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_the_openai_client_sees_400_and_404(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        ask(client, "x", temperature=-0.5)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.code == "model_not_found"
    response = post(server, "/v1/completions", {"model": NAME, "prompt": [1] * 200})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_logprobs_are_refused_and_unknown_paths_get_openai_errors(server: Server) -> None:
    """logprobs were accepted and ignored; 404 and 405 answered FastAPI's {"detail": ...}."""
    for path, body, param in (
        ("/v1/chat/completions", {"model": NAME, "messages": HI, "logprobs": True}, "logprobs"),
        (
            "/v1/chat/completions",
            {"model": NAME, "messages": HI, "top_logprobs": 2},
            "top_logprobs",
        ),
        ("/v1/completions", {"model": NAME, "prompt": "x", "logprobs": 0}, "logprobs"),
    ):
        response = post(server, path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "logprobs" in error["message"], error
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        ask(server.client(), "x", max_tokens=1, logprobs=True)
    assert ask(server.client(), "x", max_tokens=1, logprobs=False).choices[0].logprobs is None
    for method, path, status in (
        ("GET", "/v1/nothing", 404),
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
    ):
        response = httpx.request(method, server.url(path))
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and path in error["message"], error


def scrape(server: Server, port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url("/metrics", port)).text
    return {
        sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_requests_tokens_and_latency(server: Server) -> None:
    port = server.ports[1]
    before = scrape(server, port)
    client = server.client(port)
    answers = [ask(client, q, max_tokens=10) for q in QUESTIONS[:3]]
    with pytest.raises(openai.BadRequestError):
        ask(client, "x", max_tokens=0)
    after = scrape(server, port)

    def grew(name: str, **labels: str) -> float:
        key = name + json.dumps(labels, sort_keys=True)
        return after.get(key, 0) - before.get(key, 0)

    finished = sum(
        grew("tpupod_serve_requests_total", endpoint="chat", outcome=o) for o in ("stop", "length")
    )
    assert finished == 3
    assert grew("tpupod_serve_requests_total", endpoint="chat", outcome="rejected") == 1
    generated = sum(a.usage.completion_tokens for a in answers)
    assert grew("tpupod_serve_generated_tokens_total") == generated
    assert grew("tpupod_serve_prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    assert grew("tpupod_serve_time_to_first_token_seconds_count") == 3
    assert grew("tpupod_serve_request_latency_seconds_count") == 3
    assert after["tpupod_serve_running_requests{}"] == 0
    assert after["tpupod_serve_waiting_requests{}"] == 0
    assert after["tpupod_serve_slots{}"] == MAX_BATCH


def _running(server: Server, port: int) -> int:
    return int(httpx.get(server.url("/health", port)).json()["running"])


def test_a_client_that_leaves_frees_its_slot_streamed_or_not(
    server: Server, tmp_path: Path
) -> None:
    """A client that hangs up (its timeout, a Ctrl-C) ends its request, on the server or
    through the router: the slot is free and the request is counted 'cancelled'. A whole
    (non-streamed) answer went on to its last token, a slot held for nothing (the openai
    client retries a timeout twice: three answers made for one asked); the router kept
    its own request to the server, and logged a traceback for a stream's client."""
    port = server.ports[0]
    body = {"model": NAME, "prompt": [7, 8, 9], "max_tokens": MAX_LENGTH - 3, "temperature": 0}
    whole = post(server, "/v1/completions", body).json()
    assert whole["choices"][0]["finish_reason"] == "length", whole  # runs to its end
    log = tmp_path / "router.log"
    with log.open("wb") as err:
        router, url = start_router(tmp_path, [f"127.0.0.1:{port}"], "--no-auth", stderr=err)
    try:
        for target, stream in itertools.product((port, int(url.rsplit(":", 1)[1])), (False, True)):
            for _ in range(5):  # an answer whole before the client could hang up: again
                before = scrape(server, port)
                data = json.dumps({**body, "stream": stream})
                if _hang_up_mid_answer(server, port, target, data):
                    break
            else:
                pytest.fail("every answer was whole before its client hung up")
            after = scrape(server, port)
            grew = [_outcomes(after, outcome) - _outcomes(before, outcome)
                    for outcome in ("cancelled", "length")]  # fmt: skip
            assert grew == [1, 0], (target, stream, after)
        listed = httpx.get(f"{url}/backends").json()
        assert [b["outstanding"] for b in listed["health"].values()] == [0], listed  # no leak
    finally:
        router.terminate()
        router.wait(timeout=30)
    assert "Traceback" not in log.read_text(), log.read_text()


def _outcomes(scraped: dict[str, float], outcome: str) -> float:
    key = json.dumps({"endpoint": "completions", "outcome": outcome}, sort_keys=True)
    return scraped.get("tpupod_serve_requests_total" + key, 0)


def _hang_up_mid_answer(server: Server, port: int, target: int, data: str) -> bool:
    """POST ``data`` to ``target`` on a raw connection, close it once the server on
    ``port`` runs the request, and wait for its slot to be free. False when the answer
    was whole before a poll saw it run (a loaded machine's polls are slow: the CI waited
    30 s for a request long done)."""
    whole = _outcomes(scrape(server, port), "length")
    with socket.create_connection(("127.0.0.1", target)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data.encode())
        )
        deadline = time.monotonic() + 30
        while not _running(server, port):
            if _outcomes(scrape(server, port), "length") > whole:
                return False
            assert time.monotonic() < deadline, "the request never ran"
    deadline = time.monotonic() + 30
    while _running(server, port):
        assert time.monotonic() < deadline, "the slot was never freed"
    return True


def test_one_engine_on_two_devices_then_sigterm_ends_streams_with_an_error() -> None:
    """Qwen3, one port on two devices (the model tensor-parallel over them): its greedy
    chat (Qwen3's template without thinking) equals generate's; then SIGTERM while
    four streams are in flight."""
    port = free_ports(1)[0]
    srv = Server(
        FIXTURES / "qwen3-tiny", [port], "--max-batch", "4", "--max-length", "256", devices=2
    )
    try:
        srv.wait_ready()
        client = srv.client()
        qwen3 = load_model(FIXTURES / "qwen3-tiny")
        assert qwen3.tokenizer is not None
        template = {"enable_thinking": False}
        question = [{"role": "user", "content": "你是谁"}]
        want = qwen3.chat(question, template_kwargs=template, max_new_tokens=NEW).texts
        answer = client.chat.completions.create(
            model="qwen3-tiny",
            messages=question,  # type: ignore[arg-type]
            max_tokens=NEW,
            temperature=0,
            extra_body={"chat_template_kwargs": template},
        )
        assert want is not None and want[0]  # 24 tokens of text, no early stop
        assert answer.choices[0].message.content == want[0]

        outcomes: list[str] = []
        first = threading.Barrier(5)

        def stream() -> None:
            chunks = client.completions.create(
                model="qwen3-tiny", prompt=[5, 6, 7], max_tokens=250, temperature=0, stream=True
            )
            try:
                for i, _ in enumerate(chunks):
                    if i == 0:
                        first.wait(timeout=20)
                outcomes.append("finished")
            except openai.APIError as exc:
                outcomes.append(f"error: {exc.message}")

        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        first.wait(timeout=20)  # every stream has its first chunk
        srv.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert srv.proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 5
        for t in threads:
            t.join(timeout=10)
            assert not t.is_alive()
        assert outcomes == ["error: the server is shutting down"] * 4
    finally:
        srv.stop()


def test_bad_command_lines_say_what_is_wrong() -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    base = [sys.executable, "-m", "tpupod.serve.builtin", "--model", str(FIXTURES / NAME)]
    ports = ",".join(map(str, free_ports(2)))
    run = subprocess.run([*base, "--ports", ports], env=env, capture_output=True, text=True)
    assert run.returncode == 2
    assert "2 ports need at least 2 devices; this host has 1" in run.stderr
    run = subprocess.run([*base, "--ports", "x"], env=env, capture_output=True, text=True)
    assert run.returncode == 2 and "hint:" in run.stderr


# ---- the scheduler in-process ----------------------------------------------------------


class Collect:
    def __init__(self) -> None:
        self.text = ""
        self.end: Event | None = None
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        if isinstance(event, Delta):
            self.text += event.text
        else:
            self.end = event
            self.done.set()


@pytest.fixture(scope="module")
def engine(model: QwenModel) -> Iterator[Engine]:
    # three decode steps a device call: the server covers one a call
    eng = Engine(model, max_batch=2, max_length=64, decode_steps=3)
    eng.warmup()
    eng.start()
    yield eng
    eng.shutdown()


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 38)), [40, 41, 42], [50, 51, 52, 53]]


def test_slots_are_reused_and_answers_equal_generate(engine: Engine, model: QwenModel) -> None:
    want = model.generate(PROMPTS, max_new_tokens=20).texts
    sinks = [Collect() for _ in PROMPTS]
    admitted = len(engine.slot_history)
    for prompt, sink in zip(PROMPTS, sinks, strict=True):
        submit(engine, prompt, SamplingParams(max_tokens=20), sink)
    for sink in sinks:
        assert sink.done.wait(20)
    assert [s.text for s in sinks] == want
    assert all(isinstance(s.end, Finished) and s.end.completion_tokens <= 20 for s in sinks)
    used = [slot for slot, _ in engine.slot_history[admitted:]]
    assert len(used) == 4 and set(used) == {0, 1}  # four requests through two slots
    assert engine.running == 0 and engine.waiting == 0


def test_a_seed_the_rows_cannot_hold_is_refused_at_submit(engine: Engine) -> None:
    """A library caller's seed past 32 bits is refused where it is given, not failed
    later on the engine's thread as 'generation failed'."""
    for seed in (-1, 2**32):
        with pytest.raises(RequestRejected, match=r"not in \[0, 2\*\*32\)") as caught:
            engine.submit(PROMPTS[2], SamplingParams(max_tokens=2, seed=seed), Collect())
        assert caught.value.param == "seed"
    assert engine.waiting == 0


class HeldAtFirstText(Collect):
    """Holds the engine's thread in the request's first text until released: the request
    is running and nothing moves while the test acts (a test thread polling the step count
    was starved on a loaded machine until the first request had ended)."""

    def __init__(self) -> None:
        super().__init__()
        self.running, self.release = threading.Event(), threading.Event()

    def __call__(self, event: Event) -> None:
        super().__call__(event)
        if isinstance(event, Delta) and not self.running.is_set():
            self.running.set()
            self.release.wait(20)


def test_a_newcomer_joins_a_running_batch(engine: Engine, model: QwenModel) -> None:
    want = model.generate(PROMPTS[:2], max_new_tokens=40).texts
    first, second = HeldAtFirstText(), Collect()
    steps = engine.steps
    submit(engine, PROMPTS[0], SamplingParams(max_tokens=40), first)
    assert first.running.wait(20)  # decoding alone, held
    submit(engine, PROMPTS[1], SamplingParams(max_tokens=40), second)
    first.release.set()
    assert first.done.wait(20) and second.done.wait(20)
    assert [first.text, second.text] == want
    # they overlapped: together they took fewer steps than one after the other
    assert engine.steps - steps < 2 * 40


def test_a_cancelled_request_frees_its_slot(engine: Engine) -> None:
    sink = Collect()
    request = submit(engine, PROMPTS[2], SamplingParams(max_tokens=60), sink)
    request.cancel()
    deadline = time.monotonic() + 10
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.running == 0 and not sink.done.is_set()
    after = Collect()
    submit(engine, PROMPTS[3], SamplingParams(max_tokens=3), after)
    assert after.done.wait(10) and isinstance(after.end, Finished)


def test_shutdown_fails_what_is_in_flight(model: QwenModel) -> None:
    eng = Engine(model, max_batch=1, max_length=64)
    sinks = [Collect() for _ in range(3)]
    for sink in sinks:  # not started: all three wait
        submit(eng, PROMPTS[0], SamplingParams(max_tokens=10), sink)
    eng.shutdown("going away")
    assert all(isinstance(s.end, Failed) and s.end.message == "going away" for s in sinks)


def test_text_stream_holds_back_what_may_become_a_stop_string(model: QwenModel) -> None:
    assert model.tokenizer is not None
    ids = model.tokenizer.encode("hello world, hello moon")
    stream = TextStream(model.tokenizer, ["lo m"])
    out = ""
    stopped = False
    for token in ids:
        delta, stopped = stream.push(token)
        out += delta
        assert not out.endswith("lo ")  # "lo " may grow into the stop string
        if stopped:
            break
    assert stopped and out == "hello world, hel"


def test_text_stream_never_sends_half_a_character(model: QwenModel) -> None:
    assert model.tokenizer is not None
    text = "你是谁? héllo"  # seed 000's prompt: bytes the tiny tokenizer splits up
    ids = model.tokenizer.encode(text)
    assert len(ids) > len(text)  # some characters take several tokens
    stream = TextStream(model.tokenizer, [])
    deltas = [stream.push(token)[0] for token in ids]
    deltas.append(stream.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_smallest_span_reaches_the_engines_of_every_server_kind() -> None:
    """``--smallest-span`` (the attention spans' first rung) goes from the command line to
    the engines, to the split server's engine process and to a replica's members (part
    of what they must agree on); at least ``--max-length``: one span, the whole slot."""
    from tpupod.serve.builtin import __main__ as builtin_main
    from tpupod.serve.builtin import server as builtin
    from tpupod.serve.builtin import split
    from tpupod.serve.replica import member as replica

    argv = ["--model", str(FIXTURES / NAME), "--ports", "1", "--max-length", "200"]
    argv += ["--smallest-span", "64"]
    args = builtin.parse_args(argv)
    (engine,) = builtin.build_engines(args, 1)
    assert engine.spans == [64, 128, 200]
    assert builtin.parse_args(split._passed_on(args)).smallest_span == 64
    one = builtin.build_engines(builtin.parse_args([*argv, "--smallest-span", "4096"]), 1)
    assert one[0].spans == [200]
    default = builtin.parse_args(argv[:6])
    assert default.smallest_span == 128
    member = ["--model", str(FIXTURES / NAME), "--host", "h", "--port", "1", "--rank", "0"]
    member += ["--size", "2", "--leader", "h:2", "--coordinator-port", "3"]
    digests = {
        replica.config_digest(replica.parse_args([*member, "--smallest-span", str(n)]))
        for n in (64, 128)
    }
    assert len(digests) == 2  # members that would run different programs do not meet
    from tpupod.errors import ModelError, UsageError

    with pytest.raises(UsageError, match="--smallest-span 0") as refused:
        builtin_main.run(builtin.parse_args([*argv, "--smallest-span", "0"]))
    assert refused.value.hint and "--max-length" in refused.value.hint
    with pytest.raises(ModelError, match="smallest_span"):
        Engine(engine.model, max_length=200, smallest_span=0)


def test_no_split_a_stalled_engine_ends_its_requests_and_the_server_exits_4(
    model: QwenModel,
) -> None:
    """A ``--no-split`` server whose engine thread stops making progress (here its read of
    a device result blocks: a hung device call) left every request hanging and /health
    said ok: only the split server watched its engine. The server now watches the
    engine thread: after ``stall_s`` with work owed, the requests end with the reason
    and the server stops with exit 4, for its agent to restart it. An idle time longer
    than ``stall_s`` before the request does not count."""
    from tpupod.serve.builtin import server as builtin

    stall_s = 2.0
    eng = Engine(model, max_batch=2, max_length=64)
    eng.warmup()
    hang, release = threading.Event(), threading.Event()
    fetch = eng._fetch

    def fetch_or_hang(array: Any) -> Any:
        if hang.is_set():
            release.wait()
        return fetch(array)

    eng._fetch = fetch_or_hang  # type: ignore[method-assign]
    port = free_ports(1)[0]
    sock = builtin.bind("127.0.0.1", port)
    seen: dict[str, Any] = {}

    def use() -> None:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=60
        )
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        first = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4)
        seen["first"] = first.choices[0].finish_reason
        time.sleep(stall_s + 1)  # idle: no work owed, so not a stall
        hang.set()
        asked = time.monotonic()
        try:
            for _ in client.completions.create(
                model=NAME, prompt=PROMPTS[1], max_tokens=20, stream=True
            ):
                pass
            seen["second"] = "finished"
        except openai.APIError as exc:
            seen["second"] = exc.message
        seen["after"] = time.monotonic() - asked

    user = threading.Thread(target=use, daemon=True)
    user.start()
    try:
        code = asyncio.run(
            builtin.serve_engines([eng], [sock], [port], "127.0.0.1", NAME, stall_s=stall_s)
        )
    finally:
        release.set()  # the engine's thread ends (it was told to stop)
        sock.close()
    user.join(timeout=30)
    assert eng._thread is not None
    eng._thread.join(timeout=30)
    assert not eng._thread.is_alive()
    assert code == builtin.STALLED_EXIT == 4
    assert seen["first"] == "length"
    reason = "the engine made no progress for 2s with 1 request in flight (stalled)"
    assert seen["second"].startswith(reason), seen
    assert stall_s - 0.1 < seen["after"] < stall_s + 10, seen  # from the request, not the idle


def test_a_turn_of_many_prefills_longer_than_the_stall_timeout_is_progress(
    model: QwenModel,
) -> None:
    """A turn admits every newcomer a slot is free for, a packed prefill after another:
    on a slow host with long prompts it can outlast --stall-timeout, and both watches
    (the in-process one and the split front end's, which hears frames) took a healthy
    engine for a stalled one. Each prefill is now progress: the stamp, and an empty frame
    (the counts) for a linked front end."""
    eng = Engine(model, max_batch=4, max_length=64, prefill_tokens=64)
    eng.warmup()
    prefill, before = eng._prefill, eng.prefills

    def slow_prefill(batch: Any) -> Any:
        time.sleep(0.5)  # as a long prompt's prefill on a slow host
        return prefill(batch)

    eng._prefill = slow_prefill  # type: ignore[method-assign]
    frames: list[int] = []

    def dispatch(events: list[Any]) -> None:
        frames.append(len(events))
        deliver(events)

    eng.dispatch = dispatch
    eng.start()
    try:
        sinks = [Collect() for _ in range(4)]
        prompt = list(range(10, 50))  # 40 tokens: one prompt a pack (packs hold 64)
        for sink in sinks:
            submit(eng, prompt, SamplingParams(max_tokens=2), sink)
        seen_stalled = False
        while not all(s.done.is_set() for s in sinks):
            seen_stalled |= eng.stalled(1.2)  # four prefills: 2 s in the first turn
            time.sleep(0.02)
        assert not seen_stalled
        assert all(isinstance(s.end, Finished) for s in sinks)
        assert eng.prefills - before == 4 and frames.count(0) >= 4  # an empty frame each
    finally:
        eng.shutdown()
