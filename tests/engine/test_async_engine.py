"""The step thread and its asyncio face: concurrency, cancellation, failures, shutdown."""

import asyncio
import time

import pytest

from infero import LLM, SamplingParams
from infero.engine.async_engine import AsyncEngine, EngineStepError, EngineStoppedError

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[3 + i, 50 + 7 * i, 100 + i, 200 - i, 17] for i in range(8)]


@pytest.fixture()
def llm(tiny_model_path):
    return LLM(tiny_model_path)


async def collect(engine, request_id, ids, params):
    tokens, text = [], ""
    async for out in engine.generate(request_id, ids, params):
        tokens += out.new_token_ids
        text += out.new_text
    return tokens, text


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_concurrent_requests_get_their_solo_tokens(llm):
    solo = [o.completion_ids for o in (llm.generate([p], GREEDY)[0] for p in PROMPTS)]

    async def main():
        engine = AsyncEngine(llm.engine)
        await engine.start()
        results = await asyncio.gather(*(collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)))
        await engine.shutdown()
        return [tokens for tokens, _ in results]

    assert asyncio.run(main()) == solo


def test_closing_the_stream_aborts_and_frees_blocks(llm):
    async def main():
        engine = AsyncEngine(llm.engine)
        await engine.start()
        stream = engine.generate("x", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        freed = await asyncio.to_thread(
            wait_until, lambda: engine.stats().kv_usage == 0 and not llm.engine.has_unfinished()
        )
        await engine.shutdown()
        return freed

    assert asyncio.run(main())


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(llm, monkeypatch):
    real_forward = llm.backend.forward
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real_forward(*args)

    monkeypatch.setattr(llm.backend, "forward", flaky)

    async def main():
        engine = AsyncEngine(llm.engine)
        await engine.start()
        with pytest.raises(EngineStepError, match="injected"):
            await collect(engine, "a", PROMPTS[0], GREEDY)
        tokens, _ = await collect(engine, "b", PROMPTS[1], GREEDY)
        await engine.shutdown()
        return tokens

    assert len(asyncio.run(main())) == 16
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_shutdown_refuses_new_requests(llm):
    async def main():
        engine = AsyncEngine(llm.engine)
        await engine.start()
        await engine.shutdown(timeout=1)
        with pytest.raises(EngineStoppedError):
            await collect(engine, "late", PROMPTS[0], GREEDY)

    asyncio.run(main())
