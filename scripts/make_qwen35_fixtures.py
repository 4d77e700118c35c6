#!/usr/bin/env python3
"""Tiny random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrid models, converted by llama.cpp's convert_hf_to_gguf.py,
with transformers' logits (tests/fixtures/models/tiny-qwen35*.gguf, tiny-qwen3next.gguf and .logits.npz).

Runs in a throwaway venv (never install torch into .venv), with llama.cpp's converter from the llama-cpp-python
source distribution on PyPI:

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0 transformers==5.24.0 gguf numpy
    /tmp/ref/bin/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llama
    tar xzf /tmp/llama/llama_cpp_python-*.tar.gz -C /tmp/llama
    /tmp/ref/bin/python scripts/make_qwen35_fixtures.py --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp

Each model: seeded HF-layout float32 weights in a transformers Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM or
Qwen3NextForCausalLM (hidden 64, 4 layers: 3 Gated DeltaNet layers then one gated full-attention layer, as
full_attention_interval 4 makes them; delta net with 2 key heads of 16 and 4 value heads of 32, so each key head
serves two value heads and the converter's V-head reordering matters; attention with 4 query / 2 KV heads of 32,
a quarter of each rotated; dense FFN of width 64; MoE: 8 experts of width 16, 2 per token, and a shared expert of
width 32) with the byte-level BPE of make_tiny_models.py (vocab 300), saved with save_pretrained and converted with
`--outtype f32 --no-mtp` (transformers' models have no multi-token-prediction block). tiny-qwen35-mtp is
tiny-qwen35 with a random MTP block added to the saved checkpoint, as published Qwen3.5 checkpoints carry one,
converted without --no-mtp. Then transformers' teacher-forced logits of 3 seeded prompts (5, 17 and 70 tokens:
the last spans two of the 64-token chunks of the chunked delta rule) at every position, and its greedy
continuation of 2 of them (its decode steps run the token-by-token recurrence).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "tests" / "fixtures" / "models"
sys.path.insert(0, str(REPO / "scripts"))
from make_moe_fixtures import save_hf  # noqa: E402
from make_tiny_models import BOS_ID, EOS_ID  # noqa: E402

VOCAB, HIDDEN, LAYERS, INTERVAL = 300, 64, 4, 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
LIN_K_HEADS, LIN_V_HEADS, LIN_K_DIM, LIN_V_DIM, CONV_KERNEL = 2, 4, 16, 32, 4
FFN, EXPERTS, USED, EXPERT_FFN, SHARED_FFN = 64, 8, 2, 16, 32
PROMPT_LENGTHS = (5, 17, 70)
GREEDY_PROMPTS, GREEDY_TOKENS = (0, 1), 16


@dataclass(frozen=True)
class HybridSpec:
    name: str
    arch: str  # the GGUF general.architecture the converter writes
    seed: int
    description: str
    mtp: bool = False  # add a random multi-token-prediction block to the checkpoint and convert it too


SPECS = [
    HybridSpec("tiny-qwen35", "qwen35", 3101, "Qwen3_5ForCausalLM: dense SwiGLU FFN"),
    HybridSpec("tiny-qwen35-mtp", "qwen35", 3101,
               "tiny-qwen35's model plus a random MTP block (blk.4, nextn_predict_layers 1) that no forward runs",
               mtp=True),
    HybridSpec("tiny-qwen35moe", "qwen35moe", 3102, "Qwen3_5MoeForCausalLM: 8 experts, 2 per token, shared expert"),
    HybridSpec("tiny-qwen3next", "qwen3next", 3103,
               "Qwen3NextForCausalLM: fused in_proj_qkvz / in_proj_ba, 8 experts, 2 per token, shared expert"),
]  # fmt: skip

# As the published Qwen3.5 and Qwen3-Next models have: theta 1e7, a quarter of each head rotated; Qwen3.5's
# interleaved M-RoPE sections scaled to the 4 rotated pairs of a 32-wide head (the published [11, 11, 10] covers
# the 32 pairs of a 256-wide head).
ROPE_QWEN3NEXT = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
ROPE_QWEN35 = {**ROPE_QWEN3NEXT, "mrope_section": [2, 1, 1], "mrope_interleaved": True}


def hf_config(spec: HybridSpec):
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, linear_num_key_heads=LIN_K_HEADS,
        linear_num_value_heads=LIN_V_HEADS, linear_key_head_dim=LIN_K_DIM, linear_value_head_dim=LIN_V_DIM,
        linear_conv_kernel_dim=CONV_KERNEL, full_attention_interval=INTERVAL, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=EOS_ID, attn_implementation="eager", dtype="float32",
    )  # fmt: skip
    moe = dict(
        num_experts=EXPERTS, num_experts_per_tok=USED, moe_intermediate_size=EXPERT_FFN,
        shared_expert_intermediate_size=SHARED_FFN,
    )  # fmt: skip
    if spec.arch == "qwen35":
        cls = transformers.Qwen3_5TextConfig
        return cls(intermediate_size=FFN, rope_parameters=dict(ROPE_QWEN35), **common), "Qwen3_5ForCausalLM"
    if spec.arch == "qwen35moe":
        cls = transformers.Qwen3_5MoeTextConfig
        return cls(rope_parameters=dict(ROPE_QWEN35), **moe, **common), "Qwen3_5MoeForCausalLM"
    cls = transformers.Qwen3NextConfig
    config = cls(intermediate_size=FFN, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                 rope_parameters=dict(ROPE_QWEN3NEXT), **moe, **common)  # fmt: skip
    return config, "Qwen3NextForCausalLM"


def draw(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One HF parameter. The zero-centred RMSNorms (x * (1 + w)) get w ~ 0.1 N; the delta net's gated norm
    multiplies by w itself, so it gets 1 + 0.1 N. A = exp(A_log) in [0.02, 1] and dt_bias ~ 0.5 N make the
    per-token decay exp(g) 0.06 to 0.99 (median 0.75 over the fixture prompts), so the state carries over many
    tokens (transformers' initial A in [0.01, 16] forgets within a token or two)."""
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name.endswith("norm.weight") or "layernorm" in name:
        return 0.1 * rng.standard_normal(shape)
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.02, 1.0, shape))
    if name.endswith("dt_bias"):
        return 0.5 * rng.standard_normal(shape)
    if name == "model.embed_tokens.weight":
        return 0.5 * rng.standard_normal(shape)
    if name == "lm_head.weight":
        return 0.2 * rng.standard_normal(shape)
    if name.endswith("mlp.gate.weight"):  # the router: a wide spread keeps top-k choices far from ties
        return 0.5 * rng.standard_normal(shape)
    return 0.8 / math.sqrt(shape[-1]) * rng.standard_normal(shape)  # fan-in is the last axis (conv1d: the 4 taps)


def hf_model(spec: HybridSpec):
    import torch
    import transformers

    config, cls_name = hf_config(spec)
    model = getattr(transformers, cls_name)(config).eval()
    expected = ["linear_attention"] * (INTERVAL - 1) + ["full_attention"]
    assert list(config.layer_types) == expected * (LAYERS // INTERVAL), config.layer_types
    rng = np.random.default_rng(spec.seed)
    weights = {name: draw(name, tuple(p.shape), rng).astype(np.float32) for name, p in model.state_dict().items()}
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    return model


CONVERT = """
import sys
sys.path[:0] = [{llama!r}, {llama!r} + "/gguf-py"]
from conversion.base import TextModel
# The tiny tokenizer is nobody's published one, so the converter's table of pre-tokenizers (by a hash of its
# output on a test text) cannot know it; its pre-tokenizer is GPT-2's, llama.cpp's "default".
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outfile", {dst!r}, "--outtype", "f32", *{flags!r}]
convert_hf_to_gguf.main()
"""


def add_mtp(spec: HybridSpec, hf_dir: Path) -> None:
    """A multi-token-prediction block as the published Qwen3.5 checkpoints hold it (`mtp_num_hidden_layers` 1 and
    `mtp.*` weights: fc over [embedding | hidden], its two input norms, one full-attention decoder layer, a final
    norm), drawn at random: transformers has no MTP module (it drops `mtp.*` on load), so the block changes none
    of the reference logits; it is there for the converter to write and for a loader to skip."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(hf_dir / "model.safetensors")
    rng = np.random.default_rng(spec.seed + 200)
    last = f"model.layers.{LAYERS - 1}."  # a full-attention layer: the MTP layer has the same tensors
    shapes = {"mtp.layers.0." + k[len(last) :]: tuple(v.shape) for k, v in weights.items() if k.startswith(last)}
    shapes |= {"mtp.fc.weight": (HIDDEN, 2 * HIDDEN), "mtp.norm.weight": (HIDDEN,)}
    shapes |= {f"mtp.pre_fc_norm_{n}.weight": (HIDDEN,) for n in ("embedding", "hidden")}
    for name, shape in sorted(shapes.items()):
        weights[name] = torch.from_numpy(draw(name, shape, rng).astype(np.float32))
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def convert(llama_cpp: Path, src: Path, dst: Path, mtp: bool) -> None:
    flags = [] if mtp else ["--no-mtp"]  # without an MTP block and without the flag, the converter asserts
    code = CONVERT.format(llama=str(llama_cpp.resolve()), src=str(src), dst=str(dst.resolve()), flags=flags)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=llama_cpp)


def reference(model, spec: HybridSpec) -> tuple[dict[str, np.ndarray], dict]:
    """Teacher-forced logits (one forward per prompt, no cache: the chunked delta rule), greedy continuations
    (generate with a cache: prefill chunked, then one recurrent step per token), and the smallest gaps that could
    flip a choice: between the top two logits where the greedy runs pick, and between the router logits of the
    k-th and the next expert."""
    import torch

    moe = spec.arch != "qwen35"
    rng = np.random.default_rng(spec.seed + 100)
    arrays, chosen, router_margin = {}, np.zeros((LAYERS, EXPERTS), np.int64), math.inf
    for i, length in enumerate(PROMPT_LENGTHS):
        ids = rng.integers(3, VOCAB, size=length).astype(np.int32)
        if i != 1:
            ids[0] = BOS_ID
        with torch.no_grad():
            out = model(torch.from_numpy(ids[None].astype(np.int64)), use_cache=False, output_router_logits=moe)
        arrays[f"ids_{i}"], arrays[f"logits_{i}"] = ids, out.logits[0].numpy().astype(np.float32)
        for layer, logits in enumerate(out.router_logits if moe else ()):
            order = np.argsort(-logits.float().numpy(), axis=-1, kind="stable")
            ranked = np.take_along_axis(logits.float().numpy(), order, axis=-1)
            for e in order[:, :USED].ravel():
                chosen[layer, e] += 1
            router_margin = min(router_margin, float((ranked[:, USED - 1] - ranked[:, USED]).min()))
    model.generation_config.eos_token_id = None  # run every one of the tokens, as ignore_eos does
    greedy_margin = math.inf
    for i in GREEDY_PROMPTS:
        ids = torch.from_numpy(arrays[f"ids_{i}"][None].astype(np.int64))
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=EOS_ID)
            full = model(out[:, :-1], use_cache=False).logits[0, ids.shape[1] - 1 :].numpy()
        arrays[f"greedy_{i}"] = out[0, ids.shape[1] :].numpy().astype(np.int32)
        # The cached decode (recurrent form) and one uncached forward (chunked form) pick the same tokens.
        assert (full.argmax(-1) == arrays[f"greedy_{i}"]).all(), (spec.name, i)
        top2 = np.sort(full, axis=-1)[:, -2:]
        greedy_margin = min(greedy_margin, float((top2[:, 1] - top2[:, 0]).min()))
    facts: dict = {"min_greedy_top2_margin": greedy_margin}
    if moe:
        facts |= {"tokens_per_expert": chosen.tolist(), "min_topk_margin": router_margin}
        # Two float32 forwards agree to ~1e-6 in a router logit: a margin well above that cannot flip a choice.
        assert router_margin > 1e-4, f"{spec.name}: a top-k choice within {router_margin} of a tie; pick another seed"
    assert greedy_margin > 1e-4, f"{spec.name}: a greedy pick within {greedy_margin} of a tie; pick another seed"
    return arrays, facts


def check_gguf(path: Path, spec: HybridSpec) -> None:
    """The converted file reads back with gguf's reader, with the architecture and layer kinds asked for."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == spec.arch
    recurrent = reader.fields[f"{spec.arch}.attention.recurrent_layers"]
    assert [bool(recurrent.parts[j][0]) for j in recurrent.data] == [True, True, True, False] + [False] * spec.mtp
    names = {t.name for t in reader.tensors}
    assert "blk.0.ssm_a" in names and "blk.3.attn_q.weight" in names and "blk.3.ssm_a" not in names
    assert ("blk.4.nextn.eh_proj.weight" in names) == spec.mtp
    assert (f"{spec.arch}.nextn_predict_layers" in reader.fields) == spec.mtp


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's tree (convert_hf_to_gguf.py)")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("names", nargs="*", help="specs to make (default: all)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    for spec in SPECS:
        if args.names and spec.name not in args.names:
            continue
        model = hf_model(spec)
        gguf_path = args.out / f"{spec.name}.gguf"
        with tempfile.TemporaryDirectory() as td:
            hf_dir = Path(td) / spec.name  # the converter names the model (general.name) after the directory
            save_hf(model, hf_dir)
            if spec.mtp:
                add_mtp(spec, hf_dir)
            convert(args.llama_cpp, hf_dir, gguf_path, spec.mtp)
        check_gguf(gguf_path, spec)
        arrays, facts = reference(model, spec)
        meta = {
            "gguf_sha256": hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
            "n_prompts": len(PROMPT_LENGTHS),
            "greedy_prompts": list(GREEDY_PROMPTS),
            "description": spec.description,
            "reference": f"transformers {type(model).__name__}, float32, eager attention, one prompt per forward; "
            "teacher-forced logits without a cache (chunked delta rule), greedy with generate's cache",
            "converter": f"llama.cpp convert_hf_to_gguf.py from {args.llama_cpp.parent.parent.name}, "
            f"--outtype f32{'' if spec.mtp else ' --no-mtp'}",
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "numpy": np.__version__,
            },  # fmt: skip
            **facts,
        }
        np.savez_compressed(args.out / f"{spec.name}.logits.npz", meta=json.dumps(meta), **arrays)
        print(f"{gguf_path} {gguf_path.stat().st_size:,} B; {json.dumps(facts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
