"""A second, deliberately plain forward pass for tests: tensors read by the `gguf` package's own reader and
dequantizers, dense causal attention over the whole sequence, no paging, no batching, float64 throughout.

It shares no code with infero's loader, cache or ops, so agreement checks the parser's offsets, the paged
cache, the rotary pairing and the GQA head grouping all at once.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def _value(field):
    if len(field.types) == 1 and field.types[0].name != "STRING":
        return field.parts[-1][0].item()
    return None


def reference_logits(path, token_ids: list[int]) -> np.ndarray:
    r = GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    meta = {k: _value(f) for k, f in r.fields.items()}
    t = {}
    for tensor in r.tensors:
        shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
        t[tensor.name] = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float64)
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta[f"{arch}.attention.head_count_kv"]
    hidden = meta[f"{arch}.embedding_length"]
    hd = meta.get(f"{arch}.attention.key_length") or hidden // heads
    eps = meta[f"{arch}.attention.layer_norm_rms_epsilon"]
    base = meta[f"{arch}.rope.freq_base"]
    n = len(token_ids)

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    inv = base ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(n)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # x [n, h, hd]
        y = x.copy()
        if arch == "llama":  # rows were permuted by the converter: rotate adjacent pairs
            a, b = x[..., 0::2], x[..., 1::2]
            y[..., 0::2], y[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        else:
            a, b = x[..., : hd // 2], x[..., hd // 2 :]
            y[..., : hd // 2], y[..., hd // 2 :] = a * cos - b * sin, a * sin + b * cos
        return y

    x = t["token_embd.weight"][token_ids]
    layer = 0
    while f"blk.{layer}.attn_q.weight" in t:
        p = f"blk.{layer}."
        h = norm(x, t[p + "attn_norm.weight"])
        q = (h @ t[p + "attn_q.weight"].T + t.get(p + "attn_q.bias", 0)).reshape(n, heads, hd)
        k = (h @ t[p + "attn_k.weight"].T + t.get(p + "attn_k.bias", 0)).reshape(n, kv_heads, hd)
        v = (h @ t[p + "attn_v.weight"].T + t.get(p + "attn_v.bias", 0)).reshape(n, kv_heads, hd)
        if p + "attn_q_norm.weight" in t:
            q, k = norm(q, t[p + "attn_q_norm.weight"]), norm(k, t[p + "attn_k_norm.weight"])
        q, k = rope(q), rope(k)
        out = np.zeros((n, heads, hd))
        for head in range(heads):
            kvh = head // (heads // kv_heads)
            s = q[:, head] @ k[:, kvh].T / np.sqrt(hd)
            s[np.triu_indices(n, 1)] = -np.inf
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kvh]
        x = x + out.reshape(n, heads * hd) @ t[p + "attn_output.weight"].T
        h = norm(x, t[p + "ffn_norm.weight"])
        if p + "ffn_gate_inp.weight" in t:
            x = x + _experts(h, t, p, meta[f"{arch}.expert_used_count"])
        else:
            g, u = h @ t[p + "ffn_gate.weight"].T, h @ t[p + "ffn_up.weight"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ t[p + "ffn_down.weight"].T
        layer += 1
    out_w = t.get("output.weight", t["token_embd.weight"])
    return norm(x, t["output_norm.weight"]) @ out_w.T


def _experts(h: np.ndarray, t: dict, p: str, k: int) -> np.ndarray:
    """Qwen3-MoE's feed-forward token by token: softmax router, the k most probable experts (equal probabilities:
    the lower id), their probabilities renormalized, each expert a SwiGLU."""
    out = np.zeros_like(h)
    for i, row in enumerate(h):
        logits = t[p + "ffn_gate_inp.weight"] @ row
        prob = np.exp(logits - logits.max())
        prob /= prob.sum()
        top = sorted(range(len(prob)), key=lambda e: (-prob[e], e))[:k]
        for e in top:
            g, u = t[p + "ffn_gate_exps.weight"][e] @ row, t[p + "ffn_up_exps.weight"][e] @ row
            out[i] += prob[e] / prob[top].sum() * (t[p + "ffn_down_exps.weight"][e] @ (g / (1 + np.exp(-g)) * u))
    return out
