"""The HTTP servers' event loop and parser (serve/eventloop.py): uvloop and httptools where
the serve extra installed them, asyncio's loop when ``TPUPOD_NO_UVLOOP`` says so."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import uvicorn

from tpupod.serve import eventloop


@pytest.fixture(autouse=True)
def _policy_restored() -> Iterator[None]:
    before = asyncio.get_event_loop_policy()
    yield
    asyncio.set_event_loop_policy(before)


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_the_servers_run_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TPUPOD_NO_UVLOOP", raising=False)
    eventloop.use_uvloop()
    assert asyncio.run(_loop_module()).startswith("uvloop")


def test_tpupod_no_uvloop_keeps_asyncio_s_own_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPUPOD_NO_UVLOOP", "1")
    eventloop.use_uvloop()
    assert asyncio.run(_loop_module()).startswith("asyncio")


def test_uvicorn_parses_http_with_httptools() -> None:
    """uvicorn picks its parser itself ("auto"); httptools when importable, else h11,
    whose pure-Python parser cost the builtin server's front end 14-20 % more CPU a token."""
    config = uvicorn.Config(app=lambda *_: None)
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
