#!/usr/bin/env python3
"""Tiny random Qwen3MoeForCausalLM models, converted by llama.cpp's convert_hf_to_gguf.py, with transformers' logits
(tests/fixtures/models/tiny-qwen3moe*.gguf and .logits.npz).

Runs in a throwaway venv (never install torch into .venv), with llama.cpp's converter from the llama-cpp-python
source distribution on PyPI:

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0 transformers==5.24.0 gguf numpy
    /tmp/ref/bin/pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llama
    tar xzf /tmp/llama/llama_cpp_python-*.tar.gz -C /tmp/llama
    /tmp/ref/bin/python scripts/make_moe_fixtures.py --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp

Each model: seeded HF-layout float32 weights in a Qwen3MoeForCausalLM (hidden 64, 2 layers, 4 query / 2 KV heads
of 16, 8 experts of width 32, norm_topk_prob true as in the published Qwen3-30B-A3B) with the byte-level BPE of
make_tiny_models.py (vocab 300), saved with save_pretrained, converted with `--outtype f32`; then transformers'
teacher-forced logits of 3 seeded prompts at every position and its greedy continuation of 2 of them.
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
from make_tiny_models import BOS_ID, CHAT_TEMPLATE, EOS_ID, SPECIAL_TOKENS, build_tokenizer  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, EXPERT_FFN = 300, 64, 2, 4, 2, 16, 8, 32
PROMPT_LENGTHS = (5, 17, 40)
GREEDY_PROMPTS, GREEDY_TOKENS = (0, 1), 16


@dataclass(frozen=True)
class MoeSpec:
    name: str
    seed: int
    used: int  # experts per token
    skewed: bool = False  # expert 0 chosen by every token, experts 6 and 7 by none
    description: str = ""


SPECS = [
    MoeSpec("tiny-qwen3moe", 2001, 2, description="8 experts, 2 per token"),
    MoeSpec("tiny-qwen3moe-k1", 2002, 1, description="8 experts, 1 per token (its weight is 1)"),
    MoeSpec("tiny-qwen3moe-k8", 2003, 8, description="8 experts, all 8 per token (weights = the softmax)"),
    MoeSpec("tiny-qwen3moe-skewed", 2004, 2, skewed=True,
            description="8 experts, 2 per token; expert 0 chosen by every token, experts 6 and 7 by none"),
]  # fmt: skip


def hf_model(spec: MoeSpec):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * EXPERT_FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=EXPERTS,
        num_experts_per_tok=spec.used, moe_intermediate_size=EXPERT_FFN, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
        attn_implementation="eager", dtype="float32",
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config).eval()
    rng = np.random.default_rng(spec.seed)
    weights = {}
    for name, param in model.state_dict().items():
        if name.endswith("norm.weight") or "layernorm" in name:
            w = 1.0 + 0.1 * rng.standard_normal(param.shape)
        elif name == "model.embed_tokens.weight":
            w = 0.5 * rng.standard_normal(param.shape)
        elif name == "lm_head.weight":
            w = 0.2 * rng.standard_normal(param.shape)
        elif name.endswith("mlp.gate.weight"):  # the router: a wide spread keeps top-k choices far from ties
            w = 0.5 * rng.standard_normal(param.shape)
        else:
            w = 0.8 / math.sqrt(param.shape[-1]) * rng.standard_normal(param.shape)
        weights[name] = w.astype(np.float32)
    if spec.skewed:
        skew(weights)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    return model


def skew(weights: dict[str, np.ndarray]) -> None:
    """Hidden dimension 0 holds 2.0 in every token's residual (its embedding column is constant, and no attention
    output or expert writes it), so the normed input of every router has a positive dimension 0; router rows
    leaning on it make expert 0 win for every token and experts 6 and 7 lose for every token."""
    weights["model.embed_tokens.weight"][:, 0] = 2.0
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights[p + "self_attn.o_proj.weight"][0, :] = 0.0
        weights[p + "mlp.experts.down_proj"][:, 0, :] = 0.0  # [experts, hidden, width]
        weights[p + "post_attention_layernorm.weight"][0] = 1.0
        weights[p + "mlp.gate.weight"][0, 0] = 8.0
        weights[p + "mlp.gate.weight"][6:, 0] = -8.0


def save_hf(model, out: Path) -> None:
    """save_pretrained plus the tiny byte-level BPE as tokenizer.json / tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(out)
    tokens, _, merges = build_tokenizer(VOCAB)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[BOS_ID],
                                   eos_token=SPECIAL_TOKENS[EOS_ID], pad_token=SPECIAL_TOKENS[EOS_ID],
                                   additional_special_tokens=SPECIAL_TOKENS)  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


CONVERT = """
import sys
sys.path[:0] = [{llama!r}, {llama!r} + "/gguf-py"]
from conversion.base import TextModel
# The tiny tokenizer is nobody's published one, so the converter's table of pre-tokenizers (by a hash of its
# output on a test text) cannot know it; its pre-tokenizer is GPT-2's, llama.cpp's "default".
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outfile", {dst!r}, "--outtype", "f32"]
convert_hf_to_gguf.main()
"""


def convert(llama_cpp: Path, src: Path, dst: Path) -> None:
    code = CONVERT.format(llama=str(llama_cpp.resolve()), src=str(src), dst=str(dst.resolve()))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=llama_cpp)


def reference(model, spec: MoeSpec) -> tuple[dict[str, np.ndarray], dict]:
    """Teacher-forced logits, greedy continuations, and what the routers chose (and the smallest gap between the
    router logits of the k-th and the next expert)."""
    import torch

    rng = np.random.default_rng(spec.seed + 100)
    arrays, chosen, margin = {}, np.zeros((LAYERS, EXPERTS), np.int64), math.inf
    for i, length in enumerate(PROMPT_LENGTHS):
        ids = rng.integers(3, VOCAB, size=length).astype(np.int32)
        if i != 1:
            ids[0] = BOS_ID
        with torch.no_grad():
            out = model(torch.from_numpy(ids[None].astype(np.int64)), output_router_logits=True)
        arrays[f"ids_{i}"], arrays[f"logits_{i}"] = ids, out.logits[0].numpy().astype(np.float32)
        for layer, logits in enumerate(out.router_logits):  # softmax keeps the order: rank by the logits
            logits = logits.float().numpy()
            order = np.argsort(-logits, axis=-1, kind="stable")
            for e in order[:, : spec.used].ravel():
                chosen[layer, e] += 1
            if spec.used < EXPERTS:
                ranked = np.take_along_axis(logits, order, axis=-1)
                margin = min(margin, float((ranked[:, spec.used - 1] - ranked[:, spec.used]).min()))
    model.generation_config.eos_token_id = None  # run every one of the tokens, as ignore_eos does
    for i in GREEDY_PROMPTS:
        ids = torch.from_numpy(arrays[f"ids_{i}"][None].astype(np.int64))
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=EOS_ID)
        arrays[f"greedy_{i}"] = out[0, ids.shape[1] :].numpy().astype(np.int32)
    facts = {"tokens_per_expert": chosen.tolist(), "min_topk_margin": None if margin == math.inf else margin}
    if spec.skewed:
        assert (chosen[:, 0] == sum(PROMPT_LENGTHS)).all() and (chosen[:, 6:] == 0).all(), chosen
    # Two float32 forwards agree to ~1e-6 in a router logit: a margin well above that cannot flip a choice.
    assert margin > 1e-4, f"{spec.name}: a top-k choice within {margin} of a tie; pick another seed"
    return arrays, facts


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
            save_hf(model, Path(td))
            convert(args.llama_cpp, Path(td), gguf_path)
        arrays, facts = reference(model, spec)
        meta = {
            "gguf_sha256": hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
            "n_prompts": len(PROMPT_LENGTHS),
            "greedy_prompts": list(GREEDY_PROMPTS),
            "description": spec.description,
            "reference": "transformers Qwen3MoeForCausalLM, float32, eager attention, one prompt per forward",
            "converter": f"llama.cpp convert_hf_to_gguf.py from {args.llama_cpp.parent.parent.name}, --outtype f32",
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
