"""Broken model files end in one `infero: error:` line and exit status 2, never a traceback, a hang or a blowup.

Each file is the default model's header over a 2-layer model (tests/checkpoint/conftest.py) with one field made
hostile, as a corrupt download, a bit flip or a faulty converter would leave it.
"""

import math
import resource
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from gguf_fields import ARRAY, FLOAT32, INT32, STRING, UINT8, UINT32, Value

from infero.cli import main


def cli_error(capsys, *argv) -> str:
    """Run the CLI in-process; assert exit status 2 with one `infero: error:` line and no traceback; the line."""
    code = main(list(argv))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("infero: error:")]
    assert code == 2 and len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    assert "Traceback" not in err
    return errors[0]


def nested(depth: int) -> Value:
    v = Value(ARRAY, [1], UINT8)
    for _ in range(depth):
        v = Value(ARRAY, [v], ARRAY)
    return v


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("llama.attention.head_count", Value(UINT32, 0), "llama.attention.head_count = 0 is invalid"),
        ("llama.attention.head_count_kv", Value(UINT32, 0), "llama.attention.head_count_kv = 0 is invalid"),
        ("llama.attention.head_count_kv", Value(UINT32, 3), "a divisor of the 4 attention heads"),
        ("general.alignment", Value(UINT32, 0), "general.alignment must be a power of two; the file says 0"),
        ("general.alignment", Value(STRING, "32"), "general.alignment must be a power of two; the file says '32'"),
        ("general.alignment", Value(UINT32, 48), "general.alignment must be a power of two; the file says 48"),
        ("llama.block_count", Value(UINT32, 0), "llama.block_count = 0 is invalid"),
        ("llama.context_length", Value(UINT32, 0), "llama.context_length = 0 is invalid"),
        ("llama.vocab_size", Value(UINT32, 0), "the tokenizer has 2,048 tokens but llama.vocab_size is 0"),
        ("llama.attention.layer_norm_rms_epsilon", Value(FLOAT32, -1.0), "layer_norm_rms_epsilon = -1.0 is invalid"),
        ("llama.attention.layer_norm_rms_epsilon", Value(FLOAT32, 0.0), "layer_norm_rms_epsilon = 0.0 is invalid"),
        ("llama.rope.freq_base", Value(FLOAT32, math.nan), "llama.rope.freq_base = nan is invalid"),
        ("llama.rope.freq_base", Value(FLOAT32, math.inf), "llama.rope.freq_base = inf is invalid"),
        ("llama.rope.dimension_count", Value(UINT32, 17), "llama.rope.dimension_count = 17 is invalid"),
        ("llama.attention.key_length", Value(UINT32, 4096), "attention.key_length"),
        ("llama.embedding_length", Value(STRING, "64"), "must be an integer; the file holds '64'"),
        ("llama.feed_forward_length", Value(INT32, -1), "llama.feed_forward_length = -1 is invalid"),
        ("llama.rope.scaling.factor", Value(FLOAT32, math.nan), "rope.scaling.factor = nan is invalid"),
        ("tokenizer.ggml.tokens", Value(ARRAY, [], STRING), "tokenizer.ggml.tokens is empty"),
        ("tokenizer.ggml.token_type", Value(STRING, "normal"), "token_type must be an array of integers"),
        ("tokenizer.ggml.bos_token_id", Value(ARRAY, [1], UINT32), "bos_token_id must be an integer"),
        ("tokenizer.ggml.merges", nested(3), "tokenizer.ggml.merges must be an array of strings"),
        ("general.architecture", Value(STRING, "x" * 10**6), "... (1,000,000 characters) is not supported"),
        ("llama.block_count", nested(3000), "metadata arrays nested deeper than 4"),
    ],
)  # fmt: skip
def test_hostile_metadata_is_one_line_naming_the_field(capsys, hostile, key, value, needle):
    path = hostile({key: value} | ({"llama.rope.scaling.type": Value(STRING, "yarn")} if "scaling" in key else {}))
    for command in ("inspect", "generate"):
        line = cli_error(capsys, command, "--model", str(path), *(["hi"] if command == "generate" else []))
        assert needle in line and len(line) < 400, line


def test_tensor_dimension_of_2_to_the_63_is_an_impossible_shape_not_an_overflow(capsys, hostile):
    def huge(f):
        f.tensors[1].dims = [2**63, 1]

    line = cli_error(capsys, "inspect", "--model", str(hostile(edit=huge)))
    assert "has an impossible shape" in line


def test_tensor_whose_shape_disagrees_with_the_hyperparameters_is_refused_at_load(capsys, hostile):
    def transpose(f):
        q = next(t for t in f.tensors if t.name == "blk.1.attn_q.weight")
        q.dims = [64, 64]
        k = next(t for t in f.tensors if t.name == "blk.1.attn_k.weight")
        k.dims = list(reversed(k.dims))

    line = cli_error(capsys, "generate", "--model", str(hostile(edit=transpose)), "hi")
    assert "tensor 'blk.1.attn_k.weight' has shape (64, 32), but the file's hyperparameters make it (32, 64)" in line


def string_length_offset(data: bytes, text: str) -> int:
    """Where the uint64 length of the first string `text` in a GGUF file is."""
    raw = text.encode()
    at = data.index(struct.pack("<Q", len(raw)) + raw)
    return at


def run_inspect(path) -> tuple[subprocess.CompletedProcess, float, int]:
    """`infero inspect` in a subprocess: its result, wall time and peak RSS (bytes, of all children so far)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "infero", "inspect", "--model", str(path)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    return proc, time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


@pytest.mark.parametrize("bit", [20, 27, 40, 63])
def test_one_flipped_bit_in_a_string_length_gives_a_short_error_in_bounded_time_and_memory(tmp_path, hostile, bit):
    """Bit 20 or 27 makes a token's string swallow megabytes of the file; 40 and 63 point past its end."""
    data = bytearray(hostile().read_bytes())
    at = string_length_offset(data, "<|im_start|>")
    data[at + bit // 8] ^= 1 << (bit % 8)
    path = tmp_path / "flipped.gguf"
    path.write_bytes(data)
    proc, seconds, peak_rss = run_inspect(path)
    assert proc.returncode == 2 and proc.stderr.startswith("infero: error:"), proc.stderr[-2000:]
    assert len(proc.stderr) < 600 and proc.stderr.count("\n") == 1, proc.stderr[:2000]
    assert seconds < 20
    assert peak_rss < len(data) + 1024 * 2**20


def test_array_longer_than_the_file_is_a_truncation_error_before_any_allocation(capsys, hostile):
    data = bytearray(hostile().read_bytes())
    # The token_type array's count, set to 2^60 entries: an allocation of 2^62 bytes if it were believed.
    at = data.index(b"tokenizer.ggml.token_type") + len("tokenizer.ggml.token_type") + 4 + 4
    assert struct.unpack_from("<Q", data, at)[0] == 2048
    struct.pack_into("<Q", data, at, 2**60)
    path = hostile().with_name("long-array.gguf")
    path.write_bytes(data)
    line = cli_error(capsys, "inspect", "--model", str(path))
    assert "truncated GGUF header" in line


def test_model_that_computes_nan_fails_the_request_with_one_line(capsys, hostile):
    def nan_norm(f):
        norm = next(t for t in f.tensors if t.name == "output_norm.weight")
        norm.data = np.full(64, np.nan, np.float32).tobytes()

    line = cli_error(capsys, "generate", "--model", str(hostile(edit=nan_norm)), "--max-tokens", "4", "hi")
    assert "the model produced non-finite logits (NaN or infinity) for this request" in line
    assert "banned or masked" not in line


def test_hostile_counts_are_refused_without_reading_on(capsys, hostile):
    data = bytearray(hostile().read_bytes())
    struct.pack_into("<Q", data, 16, 2**64 - 1)  # the metadata key count
    path = hostile().with_name("counts.gguf")
    path.write_bytes(data)
    assert "corrupt GGUF header" in cli_error(capsys, "inspect", "--model", str(path))


def test_the_unedited_seed_loads_and_generates(capsys, hostile):
    """The hostile files above differ from a working file in their one field only."""
    assert main(["generate", "--model", str(hostile()), "--max-tokens", "3", "--ignore-eos", "hi"]) == 0


def test_a_special_token_of_100000_characters_loads_in_linear_time(capsys, hostile):
    """The special-token overlap check once held every prefix of every special token: 5 GB for this one."""

    def long_special(f):
        tokens = list(f.metadata["tokenizer.ggml.tokens"].value)
        tokens[5] = "a" * 100_000  # id 5 is a control token of the default model
        f.metadata["tokenizer.ggml.tokens"] = Value(ARRAY, tokens, STRING)

    start = time.monotonic()
    assert main(["inspect", "--model", str(hostile(edit=long_special))]) == 0
    assert time.monotonic() - start < 20
