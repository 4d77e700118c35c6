"""`infero synth`: real shapes, llama.cpp's Q4_K_M type mixture, a working tokenizer, a model that runs."""

import re

import pytest

from infero import LLM, SamplingParams
from infero.checkpoint import load_checkpoint
from infero.checkpoint.synthetic import SHAPES, tensor_type, write_synthetic
from infero.cli import main


@pytest.fixture(scope="module")
def smollm2_q4km(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "smollm2-q4km.gguf"
    assert main(["synth", "smollm2-135m", "--quant", "Q4_K_M", "-o", str(path)]) == 0
    return path


def test_shape_and_type_mixture(smollm2_q4km):
    ckpt = load_checkpoint(smollm2_q4km)
    c, s = ckpt.config, SHAPES["smollm2-135m"]
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == (
        s.layers, s.hidden, s.heads, s.kv_heads, s.ffn, s.vocab)  # fmt: skip
    types = {name: t.type_name for name, t in ckpt.tensors.items()}
    # 576 columns are not whole 256-blocks: K types fall back to Q5_0 (Q6_K to Q8_0), as llama.cpp does.
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.0.attn_v.weight"] == "Q8_0"
    assert types["blk.4.attn_v.weight"] == "Q5_0"  # a middle layer without the extra bits
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.4.ffn_down.weight"] == "Q4_K"  # 1536 columns
    assert "output.weight" not in types  # tied


def test_llama_8b_plan_matches_llama_cpp_q4_k_m():
    n = SHAPES["llama-3.1-8b"].layers
    v_types = [tensor_type("Q4_K_M", f"blk.{i}.attn_v.weight", i, n, 4096) for i in range(n)]
    assert v_types.count(14) == 16 and v_types.count(12) == 16  # half the layers in Q6_K
    assert tensor_type("Q4_K_M", "output.weight", 0, n, 4096) == 14
    assert tensor_type("Q4_K_M", "blk.0.attn_q.weight", 0, n, 4096) == 12


def test_synthetic_model_runs_with_its_tokenizer(smollm2_q4km):
    llm = LLM(smollm2_q4km)
    assert llm.tokenizer.vocab_size == SHAPES["smollm2-135m"].vocab
    assert llm.tokenizer.decode(llm.tokenizer.encode("hello GPU world", add_special_tokens=False)) == "hello GPU world"
    [out] = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.completion_ids) == 4
    # Random weights pick mostly the tokens that pad the vocabulary: they render as text, so a streamed response
    # carries content (bench serve times its chunks).
    last = llm.tokenizer.vocab_size - 1
    assert re.fullmatch(r" t\d+", llm.tokenizer.decode([last], skip_special_tokens=True))
    assert out.text.strip(), f"{out.completion_ids} rendered as {out.text!r}"


def test_unknown_shape_is_a_clear_error(tmp_path):
    from infero.errors import InferoError

    with pytest.raises(InferoError, match="unknown shape"):
        write_synthetic("gpt-5", "Q8_0", tmp_path / "x.gguf")


def test_qwen3_30b_a3b_plan_has_the_published_parameter_counts():
    from math import prod

    from infero.checkpoint.synthetic import tensor_plan

    plan = tensor_plan("qwen3-30b-a3b", "Q4_K_M")
    total = sum(prod(shape) for _, shape, _ in plan)
    experts = sum(prod(shape) for name, shape, _ in plan if "_exps." in name)
    active = total - experts * (128 - 8) // 128
    # Qwen3-30B-A3B's model card: "30.5B in total and 3.3B activated"
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 <= active < 3.4e9
    shapes = {name: shape for name, shape, _ in plan}
    assert shapes["blk.47.ffn_gate_exps.weight"] == (128, 768, 2048)
    assert shapes["blk.47.ffn_down_exps.weight"] == (128, 2048, 768)
    assert shapes["blk.0.attn_q.weight"] == (32 * 128, 2048) and shapes["blk.0.attn_k.weight"] == (4 * 128, 2048)


def test_synthetic_moe_runs_and_inspect_shows_its_experts(tmp_path, capsys):
    import json

    path = tmp_path / "moe.gguf"
    assert main(["synth", "qwen3moe-tiny", "--quant", "Q8_0", "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["inspect", "--model", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["experts"] == {"count": 8, "used": 2, "width": 64}
    per_layer_experts = 3 * 8 * 64 * 128
    assert info["parameters"] - info["active_parameters"] == 2 * per_layer_experts * 6 // 8
    llm = LLM(path, device="cpu")
    [out] = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.completion_ids) == 4


def test_qwen35_plans_have_the_published_parameter_counts():
    from math import prod

    from infero.checkpoint.synthetic import tensor_plan

    moe = tensor_plan("qwen3.5-35b-a3b", "Q4_K_M")
    total = sum(prod(shape) for _, shape, _ in moe)
    experts = sum(prod(shape) for name, shape, _ in moe if "_exps." in name)
    active = total - experts * (256 - 8) // 256
    # the names say it: 35 B parameters, 3 B active (the text model: the vision encoder is not in the plan)
    assert round(total / 1e9) == 35 and 3e9 <= active < 3.5e9
    dense = tensor_plan("qwen3.5-9b", "Q4_K_M")
    assert round(sum(prod(shape) for _, shape, _ in dense) / 1e9) == 9
    shapes = {name: shape for name, shape, _ in moe}
    # 3 of every 4 layers Gated DeltaNet: q, k (16 heads of 128) and v (32 of 128) through the conv
    assert shapes["blk.0.attn_qkv.weight"] == (2 * 16 * 128 + 32 * 128, 2048)
    assert shapes["blk.0.ssm_conv1d.weight"] == (8192, 4) and "blk.0.attn_q.weight" not in shapes
    assert shapes["blk.3.attn_q.weight"] == (2 * 16 * 256, 2048) and "blk.3.attn_qkv.weight" not in shapes


def test_the_qwen3_next_plan_has_the_published_parameter_counts_and_one_beta_alpha_projection():
    from math import prod

    from infero.checkpoint.synthetic import tensor_plan

    plan = tensor_plan("qwen3-next-80b-a3b", "Q4_K_M")
    total = sum(prod(shape) for _, shape, _ in plan)
    experts = sum(prod(shape) for name, shape, _ in plan if "_exps." in name)
    active = total - experts * (512 - 10) // 512
    assert round(total / 1e9) == 80 and 3e9 <= active < 4e9  # 80 B, 3 B active (the name's A3B, rounded down)
    shapes = {name: shape for name, shape, _ in plan}
    assert shapes["blk.0.ssm_ba.weight"] == (2 * 32, 2048) and "blk.0.ssm_alpha.weight" not in shapes


def test_synthetic_hybrid_runs_and_inspect_shows_its_layer_kinds(tmp_path, capsys):
    import json

    path = tmp_path / "hybrid.gguf"
    assert main(["synth", "qwen35moe-tiny", "--quant", "Q8_0", "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["inspect", "--model", str(path)]) == 0
    text = capsys.readouterr().out
    assert "3 Gated DeltaNet, 1 attention" in text and "a shared expert of width 64" in text
    assert main(["inspect", "--model", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layer_kinds"] == {"gated_deltanet": 3, "attention": 1}
    assert info["delta_net"] == {"key_heads": 2, "value_heads": 4, "key_dim": 16, "value_dim": 32, "conv_kernel": 4}
    llm = LLM(path, device="cpu")
    [out] = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.completion_ids) == 4
