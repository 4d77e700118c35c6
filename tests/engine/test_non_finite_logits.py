"""A model that computes NaN for one request fails that request with NonFiniteLogitsError; the others go on."""

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

from infero.backends.cpu import CpuBackend
from infero.checkpoint import load_checkpoint
from infero.engine.async_engine import AsyncEngine
from infero.engine.engine import Engine, EngineConfig
from infero.engine.sampling import NON_FINITE_LOGITS, Sampler, SamplingParams
from infero.errors import NonFiniteLogitsError
from infero.models import load_model
from infero.server.errors import from_infero_error
from infero.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gguf_fields  # noqa: E402

POISONED = 1000  # the token whose embedding row is NaN


@pytest.fixture(scope="module")
def poisoned_engine(tmp_path_factory):
    """The fuzzer's seed model (tests/checkpoint/conftest.py) with token POISONED's embedding scale set to NaN, and
    an untied output matrix (a tied one would give every request a NaN logit for POISONED)."""
    from infero.default_model import default_model_path

    f = gguf_fields.tiny_seed(default_model_path())
    gguf_fields.cut_vocabulary(f, 2048)
    embd = next(t for t in f.tensors if t.name == "token_embd.weight")
    f.tensors.append(gguf_fields.Tensor("output.weight", embd.dims, embd.ggml_type, embd.data))
    data = bytearray(embd.data)
    row = len(data) // 2048
    data[POISONED * row : POISONED * row + 2] = np.float16(np.nan).tobytes()  # the row's first Q8_0 block scale
    embd.data = bytes(data)
    path = gguf_fields.write(f, tmp_path_factory.mktemp("nan") / "poisoned.gguf")
    ckpt = load_checkpoint(path)
    backend = CpuBackend()
    model = load_model(ckpt, backend.ops)
    return lambda: Engine(model, backend, Tokenizer.from_gguf_metadata(ckpt.metadata), EngineConfig(seed=0))


def test_cpu_sampler_marks_a_row_with_nan_or_inf_and_samples_the_others():
    logits = np.zeros((3, 8), np.float32)
    logits[0, 3], logits[1, 5], logits[2, 1] = np.nan, 2.0, np.inf
    greedy = SamplingParams(temperature=0)
    out = Sampler(0).sample(logits, [greedy] * 3, [[1]] * 3, [[]] * 3)
    assert [r.token_id for r in out] == [NON_FINITE_LOGITS, 5, NON_FINITE_LOGITS]


def test_engine_fails_the_poisoned_request_alone(poisoned_engine):
    engine = poisoned_engine()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("bad", [5, POISONED, 6], params)
    engine.add_request("good", [5, 7, 6], params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    [bad] = outputs["bad"]
    assert bad.finished and bad.finish_reason == "error" and isinstance(bad.error, NonFiniteLogitsError)
    assert "non-finite logits" in str(bad.error)
    good = outputs["good"]
    assert len(good) == 4 and good[-1].finish_reason == "length" and all(o.error is None for o in good)


def test_async_engine_raises_for_the_poisoned_request_and_serves_the_next(poisoned_engine):
    async def scenario():
        engine = AsyncEngine(poisoned_engine())
        await engine.start()
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        with pytest.raises(NonFiniteLogitsError):
            async for _ in engine.generate("bad", [5, POISONED], params):
                pass
        tokens = [t async for out in engine.generate("good", [5, 7], params) for t in out.new_token_ids]
        await engine.shutdown(timeout=1)
        return tokens

    assert len(asyncio.run(scenario())) == 3


def test_server_answers_non_finite_logits_with_a_500_that_says_so():
    error = from_infero_error(NonFiniteLogitsError("the model produced non-finite logits"))
    assert error.status == 500 and error.code == "non_finite_logits" and "non-finite logits" in error.message


def test_a_stream_that_meets_non_finite_logits_ends_with_a_server_error_event_that_says_so():
    import json

    from infero.server.streaming import error_event

    event = error_event(NonFiniteLogitsError("the model produced non-finite logits"))
    body = json.loads(event.decode().removeprefix("data: ").strip())
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "non_finite_logits"
