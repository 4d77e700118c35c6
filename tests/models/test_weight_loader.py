"""The model loader's stacked weights: several matrices of one type and width as one (one linear launch for both),
row for row the matrices in turn; matrices that differ are not stacked."""

import numpy as np
import pytest

from infero.backends.cpu.ops import CpuOps
from infero.checkpoint import load_checkpoint
from infero.checkpoint.synthetic import write_synthetic
from infero.errors import ModelFileError
from infero.models.llama import weight_loader


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return load_checkpoint(write_synthetic("qwen35-tiny", "Q8_0", tmp_path_factory.mktemp("w") / "h.gguf", seed=1))


def test_stacked_matrices_are_their_rows_in_turn(checkpoint):
    weight = weight_loader(checkpoint, CpuOps())
    names = ("blk.0.ssm_alpha.weight", "blk.0.ssm_beta.weight")
    stacked = weight(names)
    assert np.array_equal(stacked, np.concatenate([weight(n) for n in names]))
    assert stacked.shape == (2 * checkpoint.config.ssm_time_step_rank, checkpoint.config.hidden_size)


def test_matrices_of_another_type_or_width_are_not_stacked(checkpoint):
    weight = weight_loader(checkpoint, CpuOps())
    tensors = checkpoint.tensors
    alpha, qkv, down = "blk.0.ssm_alpha.weight", "blk.0.attn_qkv.weight", "blk.0.ffn_down.weight"
    assert tensors[alpha].ggml_type != tensors[qkv].ggml_type
    assert weight((alpha, qkv)) is None
    assert tensors[qkv].ggml_type == tensors[down].ggml_type and tensors[qkv].shape[1] != tensors[down].shape[1]
    assert weight((qkv, down)) is None


def test_a_missing_part_is_the_files_error(checkpoint):
    weight = weight_loader(checkpoint, CpuOps())
    with pytest.raises(ModelFileError, match="missing tensor 'blk.0.ssm_gamma.weight'"):
        weight(("blk.0.ssm_alpha.weight", "blk.0.ssm_gamma.weight"))
