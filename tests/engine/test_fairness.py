"""A long prompt on the CPU shares steps with running streams: its chunks stay within the backend's token budget,
every decode gets a token each step, and a disconnect during its prefill frees it before the next step."""

import asyncio
import threading
import time

import pytest
from tiny_gguf import TinyShape, write_tiny_model

from infero import LLM, SamplingParams
from infero.backends.cpu import CpuBackend
from infero.engine.async_engine import AsyncEngine

BUDGET = CpuBackend.default_max_num_batched_tokens
LONG_PROMPT = [3 + i % 200 for i in range(2000)]
STREAM = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)


@pytest.fixture()
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "tiny-4k.gguf"
    return LLM(write_tiny_model(path, shape=TinyShape(context=4096), seed=1), device="cpu")


def record_chunks(engine) -> list[list[tuple[str, int]]]:
    """Each step's scheduled (request id, tokens), appended as the engine schedules."""
    steps, schedule = [], engine.scheduler.schedule

    def recording():
        chunks = schedule()
        steps.append([(c.request.request_id, c.num_tokens) for c in chunks])
        return chunks

    engine.scheduler.schedule = recording
    return steps


def test_the_cpu_engine_takes_the_cpu_backends_default_budget(llm):
    assert llm.engine.config.max_num_batched_tokens == BUDGET < 2048


def test_a_long_prompt_is_chunked_within_the_budget_and_a_running_decode_gets_a_token_every_step(llm):
    engine = llm.engine
    engine.add_request("stream", [5, 6, 7], STREAM)
    assert [o.request_id for o in engine.step()] == ["stream"]
    engine.add_request("long", LONG_PROMPT, SamplingParams(temperature=0, max_tokens=1))
    steps = record_chunks(engine)
    long_done = False
    while not long_done:
        outputs = engine.step()
        assert "stream" in [o.request_id for o in outputs]  # no step passes without the stream's token
        long_done = any(o.request_id == "long" and o.finished for o in outputs)
    for chunks in steps:
        assert chunks[0] == ("stream", 1) and sum(n for _, n in chunks) <= BUDGET
    assert sum(n for chunks in steps for rid, n in chunks if rid == "long") == len(LONG_PROMPT)
    assert len(steps) == -(-len(LONG_PROMPT) // (BUDGET - 1))
    engine.abort("stream")


def test_a_disconnect_during_a_long_prefill_frees_it_before_the_next_step(llm):
    engine = llm.engine
    steps = record_chunks(engine)
    in_step, release = threading.Event(), threading.Event()
    forward = llm.backend.forward

    def held_forward(*args):
        in_step.set()
        assert release.wait(10)
        return forward(*args)

    llm.backend.forward = held_forward

    async def main():
        async_engine = AsyncEngine(engine)
        await async_engine.start()

        async def consume():
            async for _ in async_engine.generate("long", LONG_PROMPT, STREAM):
                pass

        client = asyncio.create_task(consume())
        assert await asyncio.to_thread(in_step.wait, 10)
        client.cancel()  # the client goes away while its first chunk runs
        await asyncio.gather(client, return_exceptions=True)
        release.set()
        freed = await asyncio.to_thread(wait_for_idle, engine)
        await async_engine.shutdown(timeout=1)
        return freed

    assert asyncio.run(main())
    assert steps == [[("long", BUDGET)]]  # one budgeted chunk ran; the abort came before a second was scheduled
    assert engine.pool.num_free == engine.pool.num_blocks


def wait_for_idle(engine, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
