"""The GGUF reader against the `gguf` package's own reader, and its errors on bad files."""

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from tiny_gguf import TinyShape, write_tiny_model

from infero.checkpoint import load_checkpoint
from infero.checkpoint.gguf import GGUFFile
from infero.default_model import default_model_path
from infero.errors import ModelFileError, UnsupportedModelError


def assert_same_as_gguf_package(path):
    ours = GGUFFile.open(path)
    theirs = GGUFReader(path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        mine = ours.metadata[key]
        if isinstance(mine, np.ndarray):
            np.testing.assert_array_equal(mine, value, err_msg=key)
        elif isinstance(mine, float):
            assert mine == pytest.approx(value), key
        else:
            assert mine == value, key
    assert set(ours.metadata) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type)
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        np.testing.assert_array_equal(mine.data, t.data.reshape(-1).view(np.uint8), err_msg=t.name)


def test_reader_matches_gguf_package_on_tiny_models(tmp_path):
    for qtype in (Q.F32, Q.Q4_K, Q.Q6_K, Q.IQ4_XS):
        assert_same_as_gguf_package(write_tiny_model(tmp_path / f"{qtype.name}.gguf", qtype))


def test_reader_matches_gguf_package_on_smollm2():
    assert_same_as_gguf_package(default_model_path())


def test_smollm2_config():
    c = load_checkpoint(default_model_path()).config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.rope_pairing, c.tie_word_embeddings) == (49152, 64, "interleaved", True)


def test_gguf_v2_file_reads_like_v3(tmp_path):
    path = write_tiny_model(tmp_path / "v3.gguf", Q.Q8_0)
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)  # v2 and v3 share the layout for little-endian files
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(bytes(data))
    a, b = GGUFFile.open(path), GGUFFile.open(v2)
    assert b.version == 2 and a.metadata.keys() == b.metadata.keys()
    assert all(np.array_equal(a.tensors[n].data, b.tensors[n].data) for n in a.tensors)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is a text file, not a model, but it is long enough")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_checkpoint(p)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_file(tmp_path, keep):
    path = write_tiny_model(tmp_path / "m.gguf", Q.Q4_0)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFileError, match="truncated"):
        load_checkpoint(cut)


def test_unsupported_architecture(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", Q.F32, TinyShape(arch="gpt2"))
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2' is not supported"):
        load_checkpoint(path)


def test_split_model_with_a_missing_part(tmp_path):
    first = write_tiny_model(tmp_path / "s.gguf", Q.Q8_0, split_max_tensors=8)
    (tmp_path / "s-00002-of-00003.gguf").unlink()
    with pytest.raises(ModelFileError, match="missing s-00002-of-00003.gguf"):
        load_checkpoint(first)
