"""``tpupod fanout``: one chat request to every backend of the fleet at once (seed 000's client).

The backends come from the registry (the router's ``/backends``). Each gets
the same prompt directly, not through the router, so every server is
checked. One line per backend as it answers::

    RESP backend=host:port status=200 ms=412 content=...

A backend the registry marks down (or ejected) is not asked: its line says
``status=down`` and why. Then ``DONE backends=N ok=N wall_sec=...``, N
counting every backend the registry knows. Any failure makes the exit
non-zero.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from tpupod.errors import ServeError


@dataclass(frozen=True)
class Answer:
    backend: str
    status: int | None
    ms: float
    content: str
    failure: str = "error"  # what the line says when there is no status: error or down

    @property
    def ok(self) -> bool:
        return self.status == 200

    def line(self) -> str:
        status = self.status if self.status is not None else self.failure
        content = json.dumps(self.content, ensure_ascii=False)
        return f"RESP backend={self.backend} status={status} ms={self.ms:.0f} content={content}"


@dataclass(frozen=True)
class Listed:
    """What the registry knows: its model, the backends it routes to, and those it does not."""

    model: str
    healthy: list[str]
    down: dict[str, str]  # address: why (its state and last error)

    def down_answers(self) -> list[Answer]:
        return [Answer(b, None, 0.0, why, "down") for b, why in sorted(self.down.items())]


async def registry_backends(url: str, token: str | None, timeout: float) -> Listed:
    """The registry's model, its healthy backends and the others (down, ejected)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=timeout) as client:
        r = await client.get(f"{url.rstrip('/')}/backends", headers=headers)
        r.raise_for_status()
        body = r.json()
    healthy = [str(b) for b in body.get("backends", [])]
    health = body.get("health", {})
    down = {
        str(address): f"the registry marks it {seen.get('state', 'down')}"
        + (f": {seen['last_error']}" if seen.get("last_error") else "")
        for address, seen in health.items()
        if address not in healthy
    }
    return Listed(str(body.get("model", "")), healthy, down)


async def ask(
    client: httpx.AsyncClient, backend: str, model: str, prompt: str, max_tokens: int
) -> Answer:
    began = time.monotonic()
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
    }
    try:
        r = await client.post(f"http://{backend}/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        text = f"{type(exc).__name__}: {exc}".strip()
        return Answer(backend, None, (time.monotonic() - began) * 1000, text)
    ms = (time.monotonic() - began) * 1000
    try:
        content = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
    except (ValueError, KeyError, IndexError, TypeError):
        content = r.text
    return Answer(backend, r.status_code, ms, str(content))


async def fanout(
    backends: list[str],
    model: str,
    prompt: str,
    *,
    max_tokens: int = 64,
    timeout: float = 600.0,
    concurrency: int | None = None,
    on_answer: Callable[[Answer], None] = lambda a: None,
) -> list[Answer]:
    """Ask every backend at once (at most ``concurrency`` at a time); answers as they come."""
    limit = asyncio.Semaphore(concurrency or max(1, len(backends)))
    answers: list[Answer] = []
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as c:

        async def one(backend: str) -> None:
            async with limit:
                answer = await ask(c, backend, model, prompt, max_tokens)
            answers.append(answer)
            on_answer(answer)

        await asyncio.gather(*(one(b) for b in backends))
    return answers


def broadcast(
    registry_url: str,
    token: str | None,
    prompt: str,
    *,
    model: str | None = None,
    max_tokens: int = 64,
    timeout: float = 600.0,
    concurrency: int | None = None,
    on_answer: Callable[[Answer], None] = lambda a: None,
) -> list[Answer]:
    """``tpupod fanout``: ask the registry for its backends, then every healthy one at once;
    a backend the registry marks down is answered for (``status=down``), not asked."""
    listed = asyncio.run(_listed(registry_url, token))
    down = listed.down_answers()
    for answer in down:
        on_answer(answer)
    answers = asyncio.run(
        fanout(
            listed.healthy,
            model or listed.model,
            prompt,
            max_tokens=max_tokens,
            timeout=timeout,
            concurrency=concurrency,
            on_answer=on_answer,
        )
    )
    return answers + down


async def _listed(registry_url: str, token: str | None) -> Listed:
    """The registry's backends; a refusal or silence is a ServeError that says which."""
    try:
        listed = await registry_backends(registry_url, token, 30.0)
    except httpx.HTTPStatusError as exc:
        status = exc.response.status_code
        if status in (401, 403):
            raise ServeError(
                f"the registry at {registry_url} refused the token (HTTP {status})",
                hint="leave --token out to use the fleet's ('tpupod serve endpoint' prints it)",
            ) from exc
        raise ServeError(
            f"the registry at {registry_url} answered HTTP {status}",
            hint="'tpupod serve status' shows the fleet",
        ) from exc
    except httpx.HTTPError as exc:
        raise ServeError(
            f"the registry at {registry_url} does not answer: {exc}",
            hint="'tpupod serve status' shows the fleet",
        ) from exc
    if not listed.healthy and not listed.down:
        raise ServeError("the registry lists no backend", hint="'tpupod serve status'")
    return listed
