"""`infero bench decode`: prefill and single-stream decode speed, and how close decode runs to the memory roofline.

roofline fraction = (bytes a decode step must read / measured copy bandwidth) / measured step time
A decode step is timed end to end as the engine runs it: upload the batch, the forward pass (a CUDA graph
replay on the GPU), and the next token back on the host.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from infero.engine.batch import SequenceStep, build_batch


def decode_step_bytes(model, backend, context_len: int) -> int:
    """Bytes one decode step reads: every weight except the embedding table (one row), plus the KV prefix."""
    total = 0
    for layer in model.layers:
        total += sum(w.nbytes for w in vars(layer).values() if w is not None)
    total += model.output.nbytes + model.output_norm.nbytes
    total += model.embedding.nbytes // model.config.vocab_size
    total += backend.kv_block_bytes(model.config, 16) // 16 * context_len
    return total


def run(llm, prompt_len: int = 512, decode_tokens: int = 64, seed: int = 0) -> dict:
    model, backend, block = llm.model, llm.backend, 16
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model.config.vocab_size, size=prompt_len).tolist()
    blocks = -(-(prompt_len + decode_tokens + 16) // block)
    cache = backend.allocate_kv_cache(model.config, blocks, block)
    table = list(range(blocks))

    def forward(tokens: list[int], start: int) -> int:
        logits = backend.forward(model, build_batch([SequenceStep(tokens, start, table)], block), cache)
        return int(np.argmax(backend.to_host(logits, 0, 1)[0]))

    forward(ids[:16], 0)  # warm-up: kernels compiled and loaded
    forward(ids, 0)
    t = time.perf_counter()
    token = forward(ids, 0)
    prefill_s = time.perf_counter() - t
    times = []
    for i in range(decode_tokens):
        t = time.perf_counter()
        token = forward([token], prompt_len + i)
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times[2:] or times))
    step_bytes = decode_step_bytes(model, backend, prompt_len + decode_tokens // 2)
    bandwidth = backend.copy_bandwidth()
    return {
        "prefill_tokens": prompt_len,
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": 1.0 / step_s,
        "step_ms": step_s * 1e3,
        "step_bytes": step_bytes,
        "bandwidth_gb_s": bandwidth / 1e9,
        "roofline_fraction": (step_bytes / bandwidth) / step_s,
    }


def profile(llm, prompt_len: int = 512, steps: int = 16) -> list[tuple[str, float, int]]:
    """Where a decode step's time goes: (op, microseconds per step, calls per step), eager, timed per op."""
    backend, model = llm.backend, llm.model
    if not hasattr(backend, "event_timer"):
        raise ValueError("--profile needs the CUDA backend")
    backend.use_graphs = False
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, size=prompt_len).tolist()
    blocks = -(-(prompt_len + steps + 16) // 16)
    cache = backend.allocate_kv_cache(model.config, blocks, 16)
    table = list(range(blocks))
    backend.forward(model, build_batch([SequenceStep(ids, 0, table)], 16), cache)
    totals, calls = defaultdict(float), defaultdict(int)
    real_ops = model.ops
    model.ops = _TimedOps(real_ops, backend.event_timer(), totals, calls)
    try:
        for i in range(steps):
            batch = build_batch([SequenceStep([ids[i]], prompt_len + i, table)], 16)
            backend.to_host(backend.forward(model, batch, cache), 0, 1)
            model.ops.flush()
    finally:
        model.ops = real_ops
        backend.use_graphs = True
    return sorted(((k, v / steps, calls[k] // steps) for k, v in totals.items()), key=lambda r: -r[1])


class _TimedOps:
    """Wraps each op in a pair of CUDA events; labels linear layers by weight type and shape."""

    def __init__(self, ops, timer, totals, calls):
        self._ops, self._timer, self._totals, self._calls, self._pending = ops, timer, totals, calls, []

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn

        def timed(*args, **kwargs):
            label = name
            if name == "linear":
                w = args[1]
                label = f"linear {getattr(w, 'ggml_type', '?')} {getattr(w, 'rows', '')}x{getattr(w, 'cols', '')}"
            start = self._timer.mark()
            result = fn(*args, **kwargs)
            self._pending.append((label, start, self._timer.mark()))
            return result

        return timed

    def flush(self):
        for label, start, end in self._pending:
            self._totals[label] += self._timer.elapsed_us(start, end)
            self._calls[label] += 1
        self._pending.clear()


def format_table(name: str, device: str, r: dict) -> str:
    rows = [
        ("model", name),
        ("device", device),
        (f"prefill {r['prefill_tokens']} tokens", f"{r['prefill_tok_s']:,.1f} tok/s"),
        ("decode, batch 1", f"{r['decode_tok_s']:,.1f} tok/s ({r['step_ms']:.3f} ms/step, median)"),
        ("bytes per decode step", f"{r['step_bytes'] / 2**20:,.1f} MiB"),
        ("measured copy bandwidth", f"{r['bandwidth_gb_s']:,.1f} GB/s (read + write)"),
        ("roofline fraction", f"{r['roofline_fraction']:.0%}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_profile(rows: list[tuple[str, float, int]]) -> str:
    total = sum(us for _, us, _ in rows)
    lines = [f"{'op':<40} {'us/step':>10} {'calls':>6} {'share':>6}"]
    lines += [f"{label:<40} {us:>10.1f} {n:>6} {us / total:>6.1%}" for label, us, n in rows]
    lines.append(f"{'total (kernels, eager)':<40} {total:>10.1f}")
    return "\n".join(lines)
