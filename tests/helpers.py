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
