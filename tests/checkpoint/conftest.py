"""Hostile model files: the default model's header over a 2-layer model (scripts/gguf_fields.py), edited per test."""

import copy
import sys
from pathlib import Path

import pytest

from infero.default_model import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gguf_fields  # noqa: E402

SEED_VOCAB = 2048  # the seed's vocabulary cut to its first 2,048 tokens: its tokenizer builds in milliseconds


@pytest.fixture(scope="session")
def seed_fields():
    fields = gguf_fields.tiny_seed(default_model_path())
    gguf_fields.cut_vocabulary(fields, SEED_VOCAB)
    return fields


@pytest.fixture
def hostile(tmp_path, seed_fields):
    """hostile({key: Value or None}, edit) -> the path of the seed with those metadata values set (None removes the
    key), after `edit(fields)` when given."""

    def make(metadata: dict | None = None, edit=None) -> Path:
        f = copy.copy(seed_fields)
        f.metadata, f.tensors = dict(f.metadata), [copy.copy(t) for t in f.tensors]
        if edit is not None:
            edit(f)
        for key, value in (metadata or {}).items():
            if value is None:
                f.metadata.pop(key, None)
            else:
                f.metadata[key] = value
        return gguf_fields.write(f, tmp_path / "hostile.gguf")

    return make
