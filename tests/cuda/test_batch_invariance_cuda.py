"""Issue 29's promise on the GPU in batch-invariant mode (docs/kernels.md, "Batch invariance"): a request's full
logits rows are the same bits however its prompt is split into chunks (1 = decode steps), beside any number of
other decodes, in a step with another sequence's prompt chunk, and replayed from a CUDA graph: for every tensor
type, through every kernel family a linear layer can take (the mat-vec, its tensor-core form and fused decode
epilogues, the int8 GEMM past 16 tokens, the mat-vec in slices), and with the decode step's folded norms. And in
the default mode with ops.SKINNY_GEMV (the skinny GEMM's fp16 numbers at every width) for its types."""

import pytest
from gguf import GGMLQuantizationType as Q
from tiny_gguf import ALL_TYPES, TinyShape, write_tiny_model

from infero import LLM
from infero.bench.invariance import check, format_table

pytestmark = pytest.mark.gpu

# Q4_K and Q6_K at widths their tensor-core kernels take (stored tiled; the norms folded at decode), the others at
# the tiny default.
SHAPES = {
    Q.Q4_K: TinyShape(hidden=512, ffn=1024, head_dim=128),
    Q.Q6_K: TinyShape(hidden=2048, ffn=2048, heads=16, head_dim=128),
}


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_a_requests_logits_are_the_same_bits_however_its_steps_are_made(gpu, tmp_path, qtype):
    path = write_tiny_model(tmp_path / f"{qtype.name}.gguf", qtype, SHAPES.get(qtype, TinyShape()), seed=int(qtype))
    llm = LLM(path, device="cuda", batch_invariant=True)
    cases = check(llm, prompt_tokens=150, chunks=(1, 7, 64), widths=(2, 3, 5, 8, 16, 17, 33, 64), mixed=(1, 30, 100))
    print(format_table(cases))
    assert [c.name for c in cases if c.differ] == []


def test_a_mixed_type_file_is_invariant_too(gpu, tmp_path):
    """A Q4_K file whose token embedding (and so its tied head) is Q6_K, as Q4_K_M files mix them."""
    shape = TinyShape(hidden=512, ffn=1024, head_dim=128, tied=True)
    path = write_tiny_model(tmp_path / "mixed.gguf", Q.Q4_K, shape, seed=5, embed_type=Q.Q6_K)
    llm = LLM(path, device="cuda", batch_invariant=True)
    cases = check(llm, prompt_tokens=150, chunks=(1, 64), widths=(2, 17, 40), mixed=(30,))
    print(format_table(cases))
    assert [c.name for c in cases if c.differ] == []


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_the_default_mode_on_the_skinny_family_is_invariant(gpu, tmp_path, monkeypatch, qtype):
    """ops.SKINNY_GEMV: skinny_gemv to 8 tokens, skinny_gemm to 64, past that in slices of 64; the MoE-free tiny
    models of its types (a 150-token prompt: whole, in chunks of 1 / 7 / 64, beside 2-64 decodes)."""
    from infero.backends.cuda import ops

    monkeypatch.setattr(ops, "SKINNY_GEMV", 1)
    path = write_tiny_model(tmp_path / f"{qtype.name}.gguf", qtype, SHAPES.get(qtype, TinyShape()), seed=int(qtype))
    llm = LLM(path, device="cuda")
    cases = check(llm, prompt_tokens=150, chunks=(1, 7, 64), widths=(2, 3, 5, 8, 9, 16, 17, 33, 64), mixed=(1, 30, 100))
    print(format_table(cases))
    assert [c.name for c in cases if c.differ] == []
