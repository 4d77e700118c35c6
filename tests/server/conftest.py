"""Fixtures: live infero servers over the tiny test model (helpers in live_server.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from live_server import TINY_ENGINE, LiveServer, start_server, tiny_loader

from infero.engine.engine import EngineConfig
from infero.llm import LLM
from infero.server.app import ServerSettings


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_path) -> LLM:
    """One loaded tiny model for token counting in tests (the servers load their own)."""
    return LLM(tiny_model_path, device="cpu", engine_config=EngineConfig(kv_cache_bytes=1 << 20))


@pytest.fixture(scope="session")
def server(tiny_model_path) -> Iterator[LiveServer]:
    """The tiny model served without an API key, shared by the tests that leave it as they found it."""
    live = start_server(tiny_loader(tiny_model_path), ServerSettings("tiny"))
    yield live
    live.stop()


@pytest.fixture
def fresh_server(tiny_model_path) -> Iterator[Callable[..., LiveServer]]:
    """Start servers with particular settings for one test; they stop when it ends."""
    started = []

    def start(engine_config=TINY_ENGINE, load=None, wait_ready=True, step_delay=0.0, **settings) -> LiveServer:
        live = start_server(load or tiny_loader(tiny_model_path, engine_config, step_delay),
                            ServerSettings(settings.pop("name", "tiny"), **settings), wait_ready)  # fmt: skip
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()
