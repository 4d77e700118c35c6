"""A qwen3moe file whose expert keys or tensors are wrong: one `infero: error:` line, exit status 2."""

import pytest
from tiny_moe import write_tiny_moe

from infero.cli import main


def assert_one_line_error(capsys, argv, needle):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.strip().splitlines() if line.startswith("infero: error:")]
    assert len(errors) == 1 and err.strip().endswith(errors[0]) and needle in errors[0], err
    assert "Traceback" not in err


def generate(path):
    return ["generate", "--model", str(path), "--device", "cpu", "--max-tokens", "2", "hello"]


def test_expert_tensors_that_disagree_with_expert_count(capsys, tmp_path):
    path = write_tiny_moe(tmp_path / "moe.gguf", experts=8, expert_count_key=6)
    assert_one_line_error(capsys, generate(path), "qwen3moe.expert_count (6)")


@pytest.mark.parametrize("used", [0, 9])
def test_expert_used_count_outside_one_to_expert_count(capsys, tmp_path, used):
    path = write_tiny_moe(tmp_path / "moe.gguf", experts=8, used=used)
    assert_one_line_error(capsys, generate(path), f"qwen3moe.expert_used_count = {used} is invalid")


@pytest.mark.parametrize("name", ["blk.1.ffn_up_exps.weight", "blk.0.ffn_gate_inp.weight"])
def test_a_missing_expert_tensor(capsys, tmp_path, name):
    path = write_tiny_moe(tmp_path / "moe.gguf", drop=(name,))
    assert_one_line_error(capsys, generate(path), f"missing tensor {name!r}")
