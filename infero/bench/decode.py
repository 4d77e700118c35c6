"""`infero bench decode`: prefill and single-stream decode speed, and how close decode runs to the memory roofline.

roofline fraction = (bytes a decode step must read / measured copy bandwidth) / measured step time
"""

from __future__ import annotations

import time

import numpy as np

from infero.engine.batch import SequenceStep, build_batch


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Host memory bandwidth in bytes/s, counting bytes read plus bytes written (median of repeats)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / float(np.median(times))


def decode_step_bytes(model, context_len: int) -> int:
    """Bytes one decode step reads: every weight except the embedding table (one row), plus the KV prefix."""
    total = 0
    for layer in model.layers:
        total += sum(getattr(layer, f).nbytes for f in vars(layer) if getattr(layer, f) is not None)
    total += model.output.nbytes + model.output_norm.nbytes + model.embedding[0].nbytes
    c = model.config
    total += 2 * c.num_layers * context_len * c.num_kv_heads * c.head_dim * 4
    return total


def run(llm, prompt_len: int = 512, decode_tokens: int = 64, seed: int = 0) -> dict:
    model, backend, block = llm.model, llm.backend, 16
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model.config.vocab_size, size=prompt_len).tolist()
    blocks = -(-(prompt_len + decode_tokens) // block)
    cache = backend.allocate_kv_cache(model.config, blocks, block)
    table = list(range(blocks))
    backend.forward(model, build_batch([SequenceStep(ids[:16], 0, table)], block), cache)  # warm-up
    t = time.perf_counter()
    logits = backend.forward(model, build_batch([SequenceStep(ids, 0, table)], block), cache)
    prefill_s = time.perf_counter() - t
    token, times = int(np.argmax(logits[-1])), []
    for i in range(decode_tokens):
        t = time.perf_counter()
        logits = backend.forward(model, build_batch([SequenceStep([token], prompt_len + i, table)], block), cache)
        token = int(np.argmax(logits[-1]))
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times))
    step_bytes = decode_step_bytes(model, prompt_len + decode_tokens // 2)
    bandwidth = copy_bandwidth()
    return {
        "prefill_tokens": prompt_len,
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": 1.0 / step_s,
        "step_ms": step_s * 1e3,
        "step_bytes": step_bytes,
        "bandwidth_gb_s": bandwidth / 1e9,
        "roofline_fraction": (step_bytes / bandwidth) / step_s,
    }


def format_table(name: str, device: str, r: dict) -> str:
    rows = [
        ("model", name),
        ("device", device),
        (f"prefill {r['prefill_tokens']} tokens", f"{r['prefill_tok_s']:,.1f} tok/s"),
        ("decode, batch 1", f"{r['decode_tok_s']:,.1f} tok/s ({r['step_ms']:.2f} ms/step, median)"),
        ("bytes per decode step", f"{r['step_bytes'] / 2**20:,.1f} MiB"),
        ("measured copy bandwidth", f"{r['bandwidth_gb_s']:,.1f} GB/s (read + write)"),
        ("roofline fraction", f"{r['roofline_fraction']:.0%}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
