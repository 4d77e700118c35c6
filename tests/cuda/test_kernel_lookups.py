"""Every kernel a model's forward pass looks up lies in a unit its needs compile ahead: the CUDA backend runs tiny
models' prefill, mixed and decode steps at several widths against a stand-in driver that launches nothing, and
each (file, name) the launchers ask the runtime for is checked against the model's units. No GPU needed."""

import itertools
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from infero.backends.cuda import driver, runtime
from infero.checkpoint import load_checkpoint
from infero.engine.batch import SequenceStep, build_batch
from infero.engine.engine import EngineConfig
from infero.models import load_model
from tests.tiny_gguf import TinyShape, write_tiny_model

BLOCK = 16
BLOCKS_PER_SEQ = 8
_pointers = itertools.count(1 << 32, 1 << 20)


class FakeContext:
    info = driver.DeviceInfo(0, "stand-in H200", "sm_90a", (9, 0), 132, 141 << 30, 227 << 10)

    def make_current(self):
        pass

    def memory_info(self):
        return 8 << 30, 141 << 30

    def synchronize(self):
        pass


class FakeStream:
    def synchronize(self):
        pass


class FakeEvent:
    def __init__(self, timing=True):
        pass

    def record(self, stream, in_graph=False):
        pass

    def synchronize(self):
        pass


class FakeMemory:
    def __init__(self, nbytes):
        self.nbytes, self.ptr = nbytes, next(_pointers)


class FakePinned:
    def __init__(self, nbytes):
        self.nbytes, self.array, self.ptr = nbytes, np.zeros(max(nbytes, 1), np.uint8), next(_pointers)


class FakeGraph:
    def __init__(self, stream, record):
        record()

    def replay(self, stream):
        pass


def module_caches():
    """Every module-level dict and list of the CUDA backend's modules (the launchers' caches of functions, launch
    shapes and device sizes) and its functools caches."""
    containers, functions = [], []
    for name, module in list(sys.modules.items()):
        if not name.startswith("infero.backends.cuda"):
            continue
        for attribute, value in vars(module).items():
            if attribute.startswith("__"):
                continue
            if isinstance(value, dict | list):
                containers.append(value)
            elif hasattr(value, "cache_clear"):
                functions.append(value)
    return containers, functions


@pytest.fixture
def lookups(monkeypatch):
    """The (file, name) pairs the launchers look up, with every driver call standing in."""
    seen: set[tuple[str, str]] = set()

    def kernel(filename, expression):
        seen.add((filename, expression))
        return (filename, expression)

    # The launchers cache the stand-in's functions, launch choices and device sizes: a GPU test later in the
    # process must find each cache as it was before this test.
    containers, functions = module_caches()
    saved = [value.copy() for value in containers]
    monkeypatch.setattr(runtime, "kernel", kernel)
    monkeypatch.setattr(runtime, "context", FakeContext)
    monkeypatch.setattr(runtime, "stream", FakeStream)
    for name, value in {"Stream": FakeStream, "Event": FakeEvent, "DeviceMemory": FakeMemory,
                        "PinnedBuffer": FakePinned, "Graph": FakeGraph}.items():  # fmt: skip
        monkeypatch.setattr(driver, name, value)
    for name in ("launch", "copy_host_to_device", "copy_device_to_host", "copy_device_to_device", "memset_d8",
                 "set_max_dynamic_shared"):  # fmt: skip
        monkeypatch.setattr(driver, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(driver, "resident_blocks_per_sm", lambda *args, **kwargs: 2)
    yield seen
    for value, before in zip(containers, saved, strict=True):
        value.clear()
        value.update(before) if isinstance(value, dict) else value.extend(before)
    for function in functions:
        function.cache_clear()


def run_steps(path):
    """A CudaBackend's forward passes over a prefill, decodes of 1-64 sequences, a skinny and a mixed step."""
    from infero.backends.cuda import CudaBackend

    checkpoint = load_checkpoint(path)
    backend = CudaBackend()
    model = load_model(checkpoint, backend.ops)
    backend.prepare(checkpoint.config, EngineConfig(max_num_seqs=64, max_num_batched_tokens=512))
    cache = backend.allocate_kv_cache(checkpoint.config, 64 * BLOCKS_PER_SEQ, BLOCK)

    def step(lengths, start=0):
        tables = [list(range(s * BLOCKS_PER_SEQ, (s + 1) * BLOCKS_PER_SEQ)) for s in range(len(lengths))]
        steps = [SequenceStep([5] * n, start, table) for n, table in zip(lengths, tables, strict=True)]
        backend.forward(model, build_batch(steps, BLOCK), cache)

    step([100])  # a prefill chunk (GEMM)
    step([40])  # a shorter one (skinny GEMM where the type has one)
    step([4, 5, 3])  # a few sequences' short chunks (mat-vec)
    for width in (1, 2, 3, 8, 16, 33, 64):  # decodes, captured as graphs per bucket
        step([1] * width, start=9)
    step([1, 1, 20], start=9)  # decodes beside a prefill chunk
    return runtime.checkpoint_needs(checkpoint)


MODELS = {
    "q4_k": (Q.Q4_K, None, TinyShape(hidden=512, ffn=2048)),
    "q6_k": (Q.Q6_K, None, TinyShape(hidden=2048, ffn=2048, heads=16, kv_heads=4, head_dim=128)),
    "q4_1, q8_0 embedding": (Q.Q4_1, Q.Q8_0, TinyShape(tied=True)),
    "f16": (Q.F16, None, TinyShape()),
    "qwen3 q8_0": (Q.Q8_0, None, TinyShape(arch="qwen3", heads=8, kv_heads=2, head_dim=128)),  # per-head q/k norms
    "head_dim 256 q8_0": (Q.Q8_0, None, TinyShape(arch="qwen3", heads=8, kv_heads=2, head_dim=256)),  # Qwen3.5's
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_kernel_a_forward_pass_looks_up_is_in_the_models_units(tmp_path, lookups, name):
    qtype, embed_type, shape = MODELS[name]
    needs = run_steps(write_tiny_model(tmp_path / "m.gguf", qtype, shape, embed_type=embed_type))
    compiled = {(u.filename, n) for u, names in runtime.needed_units(needs).items() for n in names}
    assert lookups, "no kernel was looked up"
    assert not sorted(lookups - compiled)


def test_head_dim_256_on_a_gpu_of_99_kib_shared_memory_looks_up_its_one_stage_attention(tmp_path, lookups, monkeypatch):
    """Two K/V stages at head_dim 256 (132 KiB) do not fit an sm_89 block's shared memory: the one-stage kernels run
    there, and they are in the model's units too."""
    from infero.backends.cuda import attention

    class Ada(FakeContext):
        info = driver.DeviceInfo(0, "stand-in L40S", "sm_89", (8, 9), 142, 45 << 30, 99 << 10)

    monkeypatch.setattr(runtime, "context", Ada)
    # A GPU test earlier in the process may have cached the real GPU's limit and functions.
    monkeypatch.setattr(attention, "_shared_optin", [])
    monkeypatch.setattr(attention, "_functions", {})
    shape = TinyShape(arch="qwen3", heads=8, kv_heads=2, head_dim=256)
    needs = run_steps(write_tiny_model(tmp_path / "m.gguf", Q.Q8_0, shape))
    compiled = {(u.filename, n) for u, names in runtime.needed_units(needs).items() for n in names}
    looked_up = {name for file, name in lookups if file == "attention.cu"}
    assert looked_up == {"attention_prefill<256, 1>", "attention_decode<256, 1>", "attention_merge_splits<256>"}
    assert not sorted(lookups - compiled)


def test_decode_graphs_of_every_bucket_up_to_max_num_seqs_are_captured_before_serving(tmp_path, lookups):
    from infero.backends.cuda import CudaBackend

    checkpoint = load_checkpoint(write_tiny_model(tmp_path / "m.gguf", Q.Q8_0))
    backend = CudaBackend()
    model = load_model(checkpoint, backend.ops)
    backend.prepare(checkpoint.config, EngineConfig(max_num_seqs=20, max_num_batched_tokens=64))
    cache = backend.allocate_kv_cache(checkpoint.config, 32, BLOCK)
    backend.capture_graphs(model, cache)
    assert sorted(bucket for bucket, _ in backend._graphs) == [1, 2, 4, 8, 16]  # 20 sequences step eagerly
    assert "graphs" in backend.startup_seconds
