import pytest
from tiny_gguf import TinyShape, write_tiny_model

from infero.backends.cpu import CpuBackend
from infero.checkpoint import load_checkpoint
from infero.models import load_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A tiny F32 llama with GQA, written once per test session."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", shape=TinyShape(), seed=1)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path):
    backend = CpuBackend()
    return load_model(load_checkpoint(tiny_model_path), backend.ops), backend
