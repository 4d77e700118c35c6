"""A live infero server in a background thread (uvicorn on a free 127.0.0.1 port) for black-box API tests."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai
import uvicorn

from infero.engine.engine import EngineConfig
from infero.llm import LLM
from infero.server.app import ServerSettings, create_app

# The backend the served models run on: the suite runs on the CPU in CI and with INFERO_TEST_DEVICE=cuda on the GPU.
# Asynchronous scheduling is on as with CUDA (the CPU backend's default is off), so CI serves through it too.
TEST_DEVICE = os.environ.get("INFERO_TEST_DEVICE", "cpu")
TINY_ENGINE = EngineConfig(
    max_num_seqs=64, max_num_batched_tokens=512, kv_cache_bytes=16 << 20, seed=0, async_scheduling=True
)


@dataclass
class LiveServer:
    url: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def state(self):
        return self.app.state.infero

    @property
    def model(self) -> str:
        return self.state.settings.served_model_name

    def client(self, api_key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def stats(self):
        return self.state.engine.stats()

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until the engine holds no request and no KV block (what every test should leave behind)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.stats()
            if s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0 and self.state.num_queued == 0:
                return
            time.sleep(0.01)
        raise AssertionError(f"engine not idle after {timeout}s: {self.stats()}, queued {self.state.num_queued}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(load: Callable[[], LLM], settings: ServerSettings, wait_ready: bool = True) -> LiveServer:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # so asyncio sets TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(load, settings)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", app, server, thread)
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    if wait_ready:
        while live.state.status != "ready":
            if time.monotonic() > deadline or live.state.status == "failed":
                raise RuntimeError(f"the test server did not get ready: {live.state.load_error}")
            time.sleep(0.01)
    return live


def tiny_loader(path, engine_config: EngineConfig = TINY_ENGINE, step_delay: float = 0.0) -> Callable[[], LLM]:
    """Loads the tiny model; with `step_delay`, every engine step also sleeps that long (the tiny model decodes a
    token in well under a millisecond, too fast to catch a request mid-stream)."""

    def load() -> LLM:
        llm = LLM(path, device=TEST_DEVICE, engine_config=engine_config)
        if step_delay:
            step = llm.engine.step

            def slow_step():
                time.sleep(step_delay)
                return step()

            llm.engine.step = slow_step
        return llm

    return load
