"""Small helpers shared by test modules (conftest.py files hold fixtures only: several share that module name)."""

import numpy as np


def relative_error(a, b) -> float:
    """||a - b|| / ||b||, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def teacher_forced_logits(llm, ids, steps=None):
    """Logits at every position of ids on llm's backend, computed in the given (start, stop) chunks (default: one
    prefill) into a fresh cache of 8 blocks of 16."""
    from infero.engine.batch import SequenceStep, build_batch

    backend, model = llm.backend, llm.model
    cache = backend.allocate_kv_cache(model.config, 8, 16)
    out = []
    for a, b in steps or [(0, len(ids))]:
        batch = build_batch([SequenceStep(ids[a:b], a, list(range(8)), "all")], 16)
        result = backend.forward(model, batch, cache)
        out.append(result if isinstance(result, np.ndarray) else backend.to_host(result, 0, b - a))
    return np.concatenate(out)


def stand_in(shape, dtype=np.float32, ptr=1 << 20):
    """A device tensor as the launchers' checks see it (shape, dtype, numel, address), for tests without a GPU."""
    from types import SimpleNamespace

    return SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype), numel=int(np.prod(shape)), ptr=ptr)


def record_launches(monkeypatch, module) -> list:
    """driver.launch replaced by a record of (kernel expression, grid, block), module's kernel lookups by the
    expression itself: what a launcher would launch, without a GPU."""
    from infero.backends.cuda import driver

    calls = []
    monkeypatch.setattr(driver, "launch", lambda fn, grid, block, *rest, **kw: calls.append((fn, grid, block)))
    monkeypatch.setattr(module, "_kernel", lambda expression: expression)
    return calls


def assert_graph_replay_is_eager(path, prompts) -> None:
    """Greedy generations with logprobs on CUDA, decode steps replayed from graphs and all eager: the same tokens
    and logprobs."""
    from infero import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    graphs = LLM(path, device="cuda")
    eager = LLM(path, device="cuda", enforce_eager=True)
    a = graphs.generate(prompts, params)
    b = eager.generate(prompts, params)
    assert graphs.backend._graphs and not eager.backend._graphs, "graphs captured where asked, and only there"
    assert [o.completion_ids for o in a] == [o.completion_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
