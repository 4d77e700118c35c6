"""Synthetic models: GGUF files of a real model's shape with random weights, for benchmarks with no download.

K-quant and IQ tensors are random but valid blocks (random bits, finite fp16 scales chosen so the decoded
weights have a fixed spread); legacy 32-element types are quantized from random floats with the `gguf`
package. Decode speed does not depend on the values when end-of-generation is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from infero.errors import InferoError

# Byte offsets of the fp16 scale fields inside one block of each type (ggml's block structs).
FP16_FIELDS = {
    2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0],  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0
    10: [80, 82], 11: [108], 12: [0, 2], 13: [0, 2], 14: [208],  # Q2_K Q3_K Q4_K Q5_K Q6_K
    20: [0], 23: [0],  # IQ4_NL IQ4_XS
}  # fmt: skip


def random_blocks(qtype: int, rows: int, cols: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """uint8 [rows, bytes per row] of valid blocks of ggml type `qtype` whose decoded values have spread ~std."""
    import gguf
    from gguf.quants import dequantize

    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    nblocks = rows * cols // block_elems
    raw = rng.integers(0, 256, size=(nblocks, block_bytes), dtype=np.uint8)
    fields = FP16_FIELDS.get(qtype)
    if fields is None:  # a type infero does not run: its bytes only need the right size
        return raw.reshape(rows, -1)
    # One scale for every fp16 field, fitted on a sample so the decoded spread is `std`.
    sample = raw[: min(nblocks, 256)].copy()
    for off in fields:
        sample[:, off : off + 2] = np.array([1.0], np.float16).view(np.uint8)
    spread = float(dequantize(sample, gguf.GGMLQuantizationType(qtype)).std()) or 1.0
    scales = rng.uniform(0.5, 1.0, size=(nblocks, len(fields))) * (std / spread / 0.75)
    for j, off in enumerate(fields):
        raw[:, off : off + 2] = scales[:, j].astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def encode_weight(w: np.ndarray, qtype: int, rng: np.random.Generator) -> np.ndarray:
    """The bytes (or float array) to store for float32 weights in type qtype."""
    import gguf
    from gguf.quants import quantize

    if qtype == 0:
        return w.astype(np.float32)
    if qtype == 1:
        return w.astype(np.float16)
    if qtype in (30, 8, 2, 3, 6, 7):  # BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: the gguf package quantizes these
        return quantize(w, gguf.GGMLQuantizationType(qtype))
    return random_blocks(qtype, w.shape[0], w.shape[1], rng, float(w.std()))


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float
    context: int
    tied: bool
    head_dim: int = 0  # 0: hidden / heads
    llama3_rope: bool = False  # Llama 3.1 rope_freqs (factor 8, low 1, high 4, original context 8192)
    experts: int = 0  # qwen3moe: experts per layer (ffn is then only the file's feed_forward_length)
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0  # the shared expert's width (qwen35moe)
    # Hybrids (qwen35, qwen35moe, qwen3next): every interval-th layer is gated attention, the others Gated DeltaNet
    # layers with these key/value heads and head dimensions; a quarter of each attention head rotates.
    interval: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0

    @property
    def recurrent(self) -> list[bool]:
        return [self.interval > 0 and (i + 1) % self.interval != 0 for i in range(self.layers)]


SHAPES = {
    "smollm2-135m": Shape("llama", 576, 30, 9, 3, 1536, 49152, 100000.0, 8192, True),
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, 1000000.0, 32768, True),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 152064, 1000000.0, 32768, False),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, 500000.0, 131072, False, llama3_rope=True),
    # Qwen3-30B-A3B's published config: 128 experts of width 768, 8 active (30.5 B parameters, 3.3 B active).
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 6144, 151936, 1000000.0, 40960, False, head_dim=128,
                           experts=128, experts_used=8, expert_ffn=768),
    "qwen3moe-tiny": Shape("qwen3moe", 128, 2, 4, 2, 256, 2048, 1000000.0, 4096, False, head_dim=32, experts=8,
                           experts_used=2, expert_ffn=64),
    # Qwen3.5-9B and Qwen3.5-35B-A3B as transformers 5.24's Qwen3_5TextConfig and Qwen3_5MoeTextConfig default to
    # them (their docstrings name those checkpoints; Hugging Face was out of reach to read the published
    # config.json): 3 of every 4 layers Gated DeltaNet (16 key heads, 32 value heads, both 128 wide), gated
    # attention with heads of 256, theta 1e7 (llama.cpp's converter notes and the fixtures' configs), vocabulary
    # 248,320; the MoE: 256 experts of 512, 8 active, a shared expert of 512. Contexts are transformers' 32,768.
    "qwen3.5-9b": Shape("qwen35", 4096, 32, 16, 4, 12288, 248320, 1e7, 32768, False, head_dim=256, interval=4,
                        linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128),
    "qwen3.5-35b-a3b": Shape("qwen35moe", 2048, 40, 16, 2, 512, 248320, 1e7, 32768, False, head_dim=256,
                             experts=256, experts_used=8, expert_ffn=512, shared_ffn=512, interval=4,
                             linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128),
    # A small hybrid for tests: key heads narrower than value heads, two value heads per key head; attention heads
    # of 64, the narrowest the GPU's attention takes.
    "qwen35-tiny": Shape("qwen35", 128, 4, 4, 2, 256, 2048, 1e7, 4096, False, head_dim=64, interval=4,
                         linear_k_heads=2, linear_v_heads=4, linear_k_dim=16, linear_v_dim=32),
    # Qwen3-Next-80B-A3B as its model card quotes Qwen/Qwen3-Next-80B-A3B-Instruct's config.json: 48 layers of hidden
    # 2048, every fourth gated attention (16 query / 2 KV heads of 256), the Gated DeltaNets of 16 key / 32 value
    # heads of 128, 512 experts of 512 (10 active) and a shared expert of 512, vocabulary 151,936, context 262,144.
    "qwen3-next-80b-a3b": Shape("qwen3next", 2048, 48, 16, 2, 5120, 151936, 1e7, 262144, False, head_dim=256,
                                experts=512, experts_used=10, expert_ffn=512, shared_ffn=512, interval=4,
                                linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128),
    # Qwen3-Next's layout (ssm_ba, value heads in transformers' grouped order) at the tiny MoE hybrid's size, with key
    # heads of 64: the narrowest the GPU's chunked delta rule takes (the other tiny hybrids' 16 run token by token).
    "qwen3next-tiny": Shape("qwen3next", 128, 4, 4, 2, 64, 2048, 1e7, 4096, False, head_dim=64, experts=8,
                            experts_used=2, expert_ffn=64, shared_ffn=64, interval=4, linear_k_heads=2,
                            linear_v_heads=4, linear_k_dim=64, linear_v_dim=32),
    "qwen35moe-tiny": Shape("qwen35moe", 128, 4, 4, 2, 64, 2048, 1e7, 4096, False, head_dim=64, experts=8,
                            experts_used=2, expert_ffn=64, shared_ffn=64, interval=4, linear_k_heads=2,
                            linear_v_heads=4, linear_k_dim=16, linear_v_dim=32),
}  # fmt: skip

TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
         "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30}  # fmt: skip
QUANTS = sorted(TYPES) + ["Q4_K_M"]


def tensor_type(quant: str, name: str, layer: int, num_layers: int, cols: int) -> int:
    """The type llama.cpp's quantizer would pick for a tensor (Q4_K_M's mixture; others uniform)."""
    if quant == "Q4_K_M":
        # llama.cpp: attn_v and ffn_down get Q6_K on the first and last eighth and every third layer between (every
        # tensor whose name holds ffn_down: a MoE layer's experts and shared expert alike).
        more_bits = layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2
        down = ("attn_v", "ffn_down", "ffn_down_exps", "ffn_down_shexp")
        if name == "output.weight" or (name.split(".")[-2] in down and more_bits):
            t = TYPES["Q6_K"]
        else:
            t = TYPES["Q4_K"]
    else:
        t = TYPES[quant]
    if t in (10, 11, 12, 13, 14, 23) and cols % 256:
        # Rows that are not a whole number of 256-element super-blocks fall back as llama.cpp does.
        t = TYPES["Q8_0"] if t == TYPES["Q6_K"] else TYPES["Q5_0"]
    return t


def write_synthetic(shape_name: str, quant: str, path: Path, seed: int = 0, progress=None) -> Path:
    """Write a GGUF of the named shape with random weights and a working byte-level tokenizer."""
    import gguf

    if shape_name not in SHAPES:
        raise InferoError(f"unknown shape {shape_name!r} (choose from {', '.join(SHAPES)})")
    if quant not in QUANTS:
        raise InferoError(f"unknown quantization {quant!r} (choose from {', '.join(QUANTS)})")
    s, rng = SHAPES[shape_name], np.random.default_rng(seed)
    head_dim = s.head_dim or s.hidden // s.heads
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"synthetic {shape_name} {quant}")
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_dimension_count(head_dim // 4 if s.interval else head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-5 if s.arch == "llama" else 1e-6)
    if s.experts or s.interval:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
        w.add_expert_feed_forward_length(s.expert_ffn)
    if s.shared_ffn:
        w.add_expert_shared_feed_forward_length(s.shared_ffn)
    if s.interval:
        _add_delta_net_keys(w, s)
    _add_tokenizer(w, s)

    plan = tensor_plan(shape_name, quant)
    for name, shp, t in plan:
        qt = gguf.GGMLQuantizationType(t)
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qt]
        if t == 0:
            w.add_tensor_info(name, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
        else:  # the writer takes quantized shapes in bytes per row
            byte_shape = (*shp[:-1], shp[-1] // block_elems * block_bytes)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp, t in plan:
        w.write_tensor_data(_make_tensor(name, shp, t, rng, s))
        if progress is not None:
            progress(1)
    w.close()
    return path


def _add_delta_net_keys(w, s: Shape) -> None:
    w.add_ssm_conv_kernel(4)
    w.add_ssm_state_size(s.linear_k_dim)
    w.add_ssm_group_count(s.linear_k_heads)
    w.add_ssm_time_step_rank(s.linear_v_heads)
    w.add_ssm_inner_size(s.linear_v_heads * s.linear_v_dim)
    w.add_full_attention_interval(s.interval)
    w.add_array(f"{s.arch}.attention.recurrent_layers", s.recurrent)
    if s.arch != "qwen3next":  # Qwen3.5's M-RoPE sections; llama.cpp's converter writes none for Qwen3-Next
        w.add_rope_dimension_sections([11, 11, 10, 0])


def tensor_plan(shape_name: str, quant: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, numpy shape, ggml type) of every tensor of the named shape, in file order."""
    s = SHAPES[shape_name]
    head_dim = s.head_dim or s.hidden // s.heads
    plan: list[tuple[str, tuple[int, ...], int]] = []  # name, numpy shape, type
    plan.append(
        ("token_embd.weight", (s.vocab, s.hidden), tensor_type(quant, "token_embd.weight", 0, s.layers, s.hidden))
    )
    if s.llama3_rope:
        plan.append(("rope_freqs.weight", (head_dim // 2,), 0))
    for i in range(s.layers):
        p = f"blk.{i}."
        if s.interval:
            plan += _hybrid_layer_plan(s, i, quant, head_dim)
            continue
        plan.append((p + "attn_norm.weight", (s.hidden,), 0))
        q, kv = s.heads * head_dim, s.kv_heads * head_dim
        matrices = [("attn_q", q, s.hidden), ("attn_k", kv, s.hidden), ("attn_v", kv, s.hidden),
                    ("attn_output", s.hidden, q)]  # fmt: skip
        if not s.experts:
            matrices += [("ffn_gate", s.ffn, s.hidden), ("ffn_up", s.ffn, s.hidden), ("ffn_down", s.hidden, s.ffn)]
        for name, rows, cols in matrices:
            plan.append(
                (p + name + ".weight", (rows, cols), tensor_type(quant, p + name + ".weight", i, s.layers, cols))
            )
            if s.arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                plan.append((p + name + ".bias", (rows,), 0))
        if s.experts:  # Qwen3's q/k norms; the router stays F32, as llama.cpp's quantizer leaves it
            plan += [(p + "attn_q_norm.weight", (head_dim,), 0), (p + "attn_k_norm.weight", (head_dim,), 0)]
            plan.append((p + "ffn_gate_inp.weight", (s.experts, s.hidden), 0))
            experts = [("ffn_gate_exps", s.expert_ffn, s.hidden), ("ffn_up_exps", s.expert_ffn, s.hidden),
                       ("ffn_down_exps", s.hidden, s.expert_ffn)]  # fmt: skip
            for name, rows, cols in experts:
                t = tensor_type(quant, p + name + ".weight", i, s.layers, cols)
                plan.append((p + name + ".weight", (s.experts, rows, cols), t))
        plan.append((p + "ffn_norm.weight", (s.hidden,), 0))
    plan.append(("output_norm.weight", (s.hidden,), 0))
    if not s.tied:
        plan.append(("output.weight", (s.vocab, s.hidden), tensor_type(quant, "output.weight", 0, s.layers, s.hidden)))
    return plan


def _hybrid_layer_plan(s: Shape, i: int, quant: str, head_dim: int) -> list[tuple[str, tuple[int, ...], int]]:
    """Layer i of a hybrid: a Gated DeltaNet or a gated attention mixer (q projection [q | gate] per head), then a
    dense or routed + shared expert feed-forward. Vectors, the conv taps, the small gate projections and the
    routers stay F32."""
    p, d = f"blk.{i}.", s.hidden
    q, kv, inner = s.heads * head_dim, s.kv_heads * head_dim, s.linear_v_heads * s.linear_v_dim
    channels = 2 * s.linear_k_heads * s.linear_k_dim + inner
    if s.recurrent[i]:
        vectors = [("ssm_a", (s.linear_v_heads,)), ("ssm_dt.bias", (s.linear_v_heads,)),
                   ("ssm_norm.weight", (s.linear_v_dim,)), ("ssm_conv1d.weight", (channels, 4))]  # fmt: skip
        if s.arch == "qwen3next":  # one projection: per key head its betas, then its alphas
            vectors.append(("ssm_ba.weight", (2 * s.linear_v_heads, d)))
        else:
            vectors += [("ssm_alpha.weight", (s.linear_v_heads, d)), ("ssm_beta.weight", (s.linear_v_heads, d))]
        matrices = [("attn_qkv", channels, d), ("attn_gate", inner, d), ("ssm_out", d, inner)]
    else:
        vectors = [("attn_q_norm.weight", (head_dim,)), ("attn_k_norm.weight", (head_dim,))]
        matrices = [("attn_q", 2 * q, d), ("attn_k", kv, d), ("attn_v", kv, d), ("attn_output", d, q)]
    vectors += [("attn_norm.weight", (d,)), ("post_attention_norm.weight", (d,))]
    if s.experts:
        vectors += [("ffn_gate_inp.weight", (s.experts, d)), ("ffn_gate_inp_shexp.weight", (1, d))]
        matrices += [("ffn_gate_shexp", s.shared_ffn, d), ("ffn_up_shexp", s.shared_ffn, d),
                     ("ffn_down_shexp", d, s.shared_ffn)]  # fmt: skip
    else:
        matrices += [("ffn_gate", s.ffn, d), ("ffn_up", s.ffn, d), ("ffn_down", d, s.ffn)]
    plan = [(p + name, shape, 0) for name, shape in vectors]
    plan += [(p + name + ".weight", (rows, cols), tensor_type(quant, p + name + ".weight", i, s.layers, cols))
             for name, rows, cols in matrices]  # fmt: skip
    if s.experts:
        experts = [("ffn_gate_exps", s.expert_ffn, d), ("ffn_up_exps", s.expert_ffn, d),
                   ("ffn_down_exps", d, s.expert_ffn)]  # fmt: skip
        for name, rows, cols in experts:
            t = tensor_type(quant, p + name + ".weight", i, s.layers, cols)
            plan.append((p + name + ".weight", (s.experts, rows, cols), t))
    return plan


def _make_tensor(name: str, shape: tuple[int, ...], t: int, rng: np.random.Generator, s: Shape) -> np.ndarray:
    if len(shape) == 1:
        if name == "rope_freqs.weight":
            return _llama3_freq_factors(shape[0] * 2, s.rope_theta)
        if name.endswith(".bias"):
            return rng.normal(0, 0.02, size=shape).astype(np.float32)
        if name.endswith("ssm_a"):  # -exp(A_log) < 0: each token decays the delta rule's state
            return -rng.uniform(0.02, 1.0, size=shape).astype(np.float32)
        return (1.0 + rng.normal(0, 0.05, size=shape)).astype(np.float32)
    rows, cols = int(np.prod(shape[:-1])), shape[-1]  # an expert tensor: its experts' matrices one after another
    std = 1.0 if name == "token_embd.weight" else 0.5 / np.sqrt(cols)
    if t in FP16_FIELDS and t not in (2, 3, 6, 7, 8):  # K and IQ types: random valid blocks, no float detour
        return random_blocks(t, rows, cols, rng, std).reshape(*shape[:-1], -1)
    chunk = []
    for start in range(0, rows, 8192):  # quantize in row chunks to bound memory
        n = min(8192, rows - start)
        chunk.append(encode_weight(rng.normal(0, std, size=(n, cols)).astype(np.float32), t, rng))
    return np.concatenate(chunk).reshape(*shape[:-1], -1)


def _llama3_freq_factors(head_dim: int, base: float) -> np.ndarray:
    """Llama 3.1's rope_freqs: wavelength-dependent divisors (factor 8, low 1, high 4, original context 8192)."""
    factor, low, high, orig = 8.0, 1.0, 4.0, 8192
    freqs = base ** (-np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    out = np.where(
        wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth))
    )
    return out.astype(np.float32)


def _add_tokenizer(w, s: Shape) -> None:
    """A byte-level BPE vocabulary (special tokens, 256 byte symbols, merges of common English pieces) padded to
    the model's vocabulary size with ordinary tokens no merge reaches (" t0", " t1", ...), and the family's chat
    template. Random weights sample mostly padding tokens: as unused tokens they rendered as nothing, so a
    streamed response carried no content and `bench serve` had no first token to time."""
    words = ["the", " the", "ing", " and", " of", " to", "tion", " in", " is", " a", "er", "ed", " that", " for",
             " it", " with", " as", " was", " on", " be", "hello", " world", " GPU", " model"]  # fmt: skip
    if s.arch == "llama":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        bos, eos, pre = 0, 4, "llama-bpe"
        template = (
            "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
            " + m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
        )
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        bos, eos, pre = 0, 2, "qwen2"
        template = (
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
        )
    tokens, merges = byte_level_vocab(specials, words)
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    pad = s.vocab - len(tokens)
    tokens += [f"\u0120t{i}" for i in range(pad)]  # U+0120: the byte-level alphabet's space
    types += [1] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(s.arch == "llama")
    w.add_chat_template(template)


def byte_level_vocab(specials: list[str], words: list[str]) -> tuple[list[str], list[str]]:
    """Special tokens, GPT-2's 256 byte symbols, and merges that build each of `words` left to right."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_symbol = {b: chr(c) for b, c in zip(bs, cs, strict=True)}
    tokens = list(specials) + [byte_symbol[b] for b in range(256)]
    known, merges = set(tokens), []
    for word in words:
        symbols = [byte_symbol[b] for b in word.encode()]
        cur = symbols[0]
        for sym in symbols[1:]:
            if cur + sym not in known:
                merges.append(f"{cur} {sym}")
                tokens.append(cur + sym)
                known.add(cur + sym)
            cur += sym
    return tokens, merges
