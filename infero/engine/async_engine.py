"""The engine's step loop in its own thread, and the asyncio face the HTTP server talks to.

Only the step thread touches the Engine. The event loop sends it commands (add, abort) through a queue and
gets each step's outputs back in one `call_soon_threadsafe`, so HTTP parsing, SSE writing and a slow client
never stall a step, and a step never waits on the network.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from infero.engine.engine import Engine, EngineStats
from infero.engine.request import RequestOutput
from infero.engine.sampling import SamplingParams
from infero.errors import InferoError

log = logging.getLogger("infero.engine")


class EngineStoppedError(InferoError):
    """The engine is shutting down and takes no new requests."""


class EngineStepError(RuntimeError):
    """A step failed inside the engine (a bug, not the client's fault); the request was aborted."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_config = engine.model.config
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._stats = engine.stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._closed = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="infero-engine", daemon=True)
        self._thread.start()

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        self.engine.validate(prompt_ids, params, priority)

    def check_priority(self, priority: int) -> None:
        self.engine.check_priority(priority)

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Each step's outputs for the request's n choices; closing the iterator early aborts the request."""
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down")
        if request_id in self._streams:
            raise InferoError(f"request id {request_id!r} is already running")
        self.validate(prompt_ids, params, priority)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt_ids, params, cache_salt, priority))
        running = params.n
        try:
            while running:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item  # the finally aborts the request's other choices (a no-op if none is left)
                running -= item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if running:
                self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting; let running requests finish for up to `timeout` seconds, abort the rest, stop."""
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + timeout
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self._send(("abort", request_id))
            self._deliver_error(request_id, EngineStoppedError("the server shut down before the request finished"))
        self._closed = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        while not self._closed:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._stats = self.engine.stats()
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug in a step must not take the server down with it
                log.exception("engine step failed; aborting the requests it held")
                self._fail_all(e)
                continue
            self._stats = self.engine.stats()
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt_ids, params, cache_salt, priority = command
                try:
                    self.engine.add_request(request_id, prompt_ids, params, cache_salt, priority)
                except InferoError as e:
                    self._loop.call_soon_threadsafe(self._deliver_error, request_id, e)
            else:
                self.engine.abort(command[1])

    def _fail_all(self, error: Exception) -> None:
        running = {r.request_id for r in self.engine.scheduler.running + list(self.engine.scheduler.waiting)}
        for request_id in running:
            self.engine.abort(request_id)
            failure = EngineStepError(f"internal error in the engine: {type(error).__name__}: {error}")
            self._loop.call_soon_threadsafe(self._deliver_error, request_id, failure)
        self._stats = self.engine.stats()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out if out.error is None else out.error)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(error)
