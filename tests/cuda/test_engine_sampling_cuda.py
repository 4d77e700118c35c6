"""The serving engine on the GPU samples on the GPU: the same tokens and logprobs as the numpy Sampler applied to
the same device logits, and the logits never come to the host unless logprobs are asked for."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from tiny_gguf import write_tiny_model

from infero import LLM, SamplingParams
from infero.engine.engine import EngineConfig
from infero.engine.sampling import Sampler

pytestmark = pytest.mark.gpu

PROMPTS = [[3 + i, 50 + 7 * i, 100 + i, 200 - i, 17, 3 * i + 1] for i in range(6)]


class HostSampler:
    """The numpy reference on the device logits' rows, copied to the host."""

    def __init__(self, backend, seed):
        self.backend, self.reference = backend, Sampler(seed)

    def sample(self, logits, rows, params, prompt_ids, output_ids, banned_token_ids=None, allowed_masks=None):
        host = np.stack([self.backend.to_host(logits, r, r + 1)[0] for r in rows])
        return self.reference.sample(host, params, prompt_ids, output_ids, banned_token_ids, allowed_masks)


@pytest.fixture(scope="module")
def llm(gpu, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("engine-sampling") / "m.gguf", Q.Q8_0, seed=5)
    return LLM(path, device="cuda", engine_config=EngineConfig(seed=1234))


def _params():
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.3, top_k=20, min_p=0.02, seed=8, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, seed=9, max_tokens=12, ignore_eos=True
        ),  # fmt: skip
        SamplingParams(temperature=1.0, logit_bias={5: 4.0, 6: -100.0}, seed=10, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, presence_penalty=0.8, max_tokens=12, ignore_eos=True, n=2, seed=11),
    ]


def test_engine_on_the_gpu_samples_what_the_numpy_sampler_samples(llm):
    gpu_out = [llm.generate([p], q) for p, q in zip(PROMPTS, _params(), strict=True)]
    real = llm.engine.sampler
    llm.engine.sampler = HostSampler(llm.backend, 1234)
    try:
        host_out = [llm.generate([p], q) for p, q in zip(PROMPTS, _params(), strict=True)]
    finally:
        llm.engine.sampler = real
    for g, h in zip(gpu_out, host_out, strict=True):
        assert [c.completion_ids for c in g] == [c.completion_ids for c in h]
        for gc, hc in zip(g, h, strict=True):
            assert (gc.logprobs is None) == (hc.logprobs is None)
            for a, b in zip(gc.logprobs or [], hc.logprobs or [], strict=True):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_logits_stay_on_the_device_without_logprobs(llm, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a logits row was copied to the host")

    monkeypatch.setattr(llm.backend, "to_host", refuse)
    params = SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert [len(o.completion_ids) for o in outputs] == [8] * len(PROMPTS)


def test_steps_queued_ahead_on_the_gpu_give_the_plain_engines_outputs(llm, tmp_path_factory):
    """Asynchronous scheduling (on by default with CUDA: step k + 1 queued before step k's tokens reach the host,
    its input tokens written on the device by feed_tokens) against the same engine stepping one at a time."""
    assert llm.engine.async_scheduling
    plain = LLM(llm.path, device="cuda", engine_config=EngineConfig(seed=1234, async_scheduling=False))
    fed = []
    forward = llm.backend.forward

    def counted(model, batch, cache, feed=None):
        fed.append(feed is not None and feed.sampled.device_tokens is not None)
        return forward(model, batch, cache, feed)

    llm.backend.forward = counted
    try:
        queued = [llm.generate(PROMPTS, q) for q in _params()]
    finally:
        del llm.backend.forward
    assert sum(fed) > len(fed) // 2, f"only {sum(fed)} of {len(fed)} steps took their tokens on the device"
    expected = [plain.generate(PROMPTS, q) for q in _params()]
    for got, want in zip(queued, expected, strict=True):
        assert [c.completion_ids for c in got] == [c.completion_ids for c in want]
        assert [c.text for c in got] == [c.text for c in want]
