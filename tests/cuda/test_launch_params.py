"""driver.Params: each launch's parameters packed as cuLaunchKernel reads them, byte for byte what ctypes makes of
the same (values, types) (no GPU needed). The models' forward passes run with the GPU stubbed out
(infero.bench.gpu_stub), so every launch they make on the way (dense, MoE and hybrid models, the default and the
batch-invariant mode) is read back from the pointer array it hands the driver: the CUDA backend's host code runs
here end to end without a GPU."""

import ctypes
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from tiny_gguf import tiny_shape, write_tiny_model
from tiny_moe import write_tiny_moe

from infero.backends.cuda import driver

HERE = Path(__file__).parent
P, INT, L, F, D, B = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float, ctypes.c_double, ctypes.c_uint8


class Pair(ctypes.Structure):
    _fields_ = [("a", ctypes.c_int), ("b", ctypes.c_double), ("c", ctypes.c_char * 3)]


def expected_bytes(values, types) -> list[bytes]:
    """Each parameter's bytes as ctypes makes them (what cuda.bindings packs from the same pair)."""
    out = []
    for value, t in zip(values, types, strict=True):
        if t is None:
            out.append(ctypes.string_at(ctypes.addressof(value), ctypes.sizeof(value)))
        else:
            out.append(bytes(t(value)))
    return out


def read_back(address: int, sizes: list[int]) -> list[bytes]:
    pointers = (ctypes.c_void_p * len(sizes)).from_address(address)
    return [ctypes.string_at(pointers[i], size) for i, size in enumerate(sizes)]


def test_every_type_at_its_alignment():
    values = (1 << 40, -3, 7, np.float32(0.25), 3 << 33, 2.5, 255, np.int64(9), 1.0 / 3, 1 << 63)
    types = (P, INT, B, F, L, D, B, INT, F, ctypes.c_ulonglong)
    expected = expected_bytes(values, types)
    assert read_back(driver.packed(values, types), [len(e) for e in expected]) == expected


def test_a_struct_by_value_and_the_values_around_it():
    pair = Pair(5, 0.125, b"xyz")
    values, types = (1 << 41, pair, 17, 4.0), (P, None, INT, F)
    expected = expected_bytes(values, types)
    assert read_back(driver.packed(values, types), [len(e) for e in expected]) == expected
    other = Pair(6, 2.0, b"abc")  # the next launch of the signature points at its own struct
    values = (1 << 42, other, 18, 5.0)
    expected = expected_bytes(values, types)
    assert read_back(driver.packed(values, types), [len(e) for e in expected]) == expected


def test_a_thread_has_its_own_buffers():
    types = (P, INT)
    here = driver.packed((1, 2), types)
    there = []
    worker = threading.Thread(target=lambda: there.append(driver.packed((3, 4), types)))
    worker.start()
    worker.join()
    assert there[0] != here
    assert read_back(here, [8, 4]) == expected_bytes((1, 2), types)


def test_a_type_it_does_not_pack_is_named():
    with pytest.raises(TypeError, match="parameter 1"):
        driver.packed((1, b"x"), (P, ctypes.c_char))


def test_a_value_the_type_cannot_hold_is_an_error():
    with pytest.raises(struct.error):
        driver.packed((1.5,), (INT,))
    with pytest.raises(struct.error):
        driver.packed((1 << 32,), (INT,))


def checked_generation(path: str, batch_invariant: bool = False, flags: dict | None = None, expect=()) -> int:
    """Stub the GPU out, generate from path (prefill, decode graphs, both samplers), and compare every launch's
    packed parameters with ctypes' bytes of its (values, types). Returns how many launches were checked. Run in a
    process of its own (the stubs replace the driver's calls for good). flags: module attributes set first
    ({"infero.backends.cuda.ops:SKINNY_GEMV": 1}); expect: (kernel file, names) of which each must have launched
    at least one."""
    import importlib

    from cuda.bindings import driver as cu  # noqa: F401

    from infero import LLM, SamplingParams
    from infero.backends.cuda import runtime
    from infero.bench import gpu_stub

    for flag, value in (flags or {}).items():
        module, attribute = flag.split(":")
        setattr(importlib.import_module(module), attribute, value)

    expected, checked = threading.local(), []

    def launch(*args):  # cuLaunchKernelEx(config, fn, params, extra) or cuLaunchKernel(fn, 3 x grid, 3 x block, ...)
        params = args[2] if len(args) == 4 else args[9]
        assert isinstance(params, int), f"{expected.name}: the launch did not pass packed parameters"
        want = expected.bytes
        assert read_back(params, [len(b) for b in want]) == want, f"{expected.name}: parameters packed wrong"
        checked.append(expected.name)
        return (gpu_stub.OK,)

    real = driver.launch

    def recorded(fn, grid, block, args, types, *rest, **kw):
        expected.bytes, expected.name = expected_bytes(args, types), fn
        return real(fn, grid, block, args, types, *rest, **kw)

    gpu_stub.stub_the_gpu(launch)
    driver.launch = recorded
    llm = LLM(path, device="cuda", batch_invariant=batch_invariant)
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=3, ignore_eos=True)]  # fmt: skip
    llm.generate(["hello world the", "and tion 12 hello world " * 15], params)  # a prompt past a 64-token chunk
    for source, names in expect:
        functions = {runtime.kernel(source, name) for name in names}
        assert any(fn in functions for fn in checked), f"none of {names} launched"
    return len(checked)


def assert_launches_packed(path, batch_invariant: bool = False, flags: dict | None = None, expect=()) -> None:
    call = f"t.checked_generation({str(path)!r}, {batch_invariant}, {flags!r}, {expect!r})"
    code = f"import test_launch_params as t; print('checked', {call})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    checked = int(done.stdout.split("checked")[-1])
    assert checked > 20, done.stdout


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_1, Q.F16])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_dense_model_launches(tmp_path, qtype, batch_invariant):
    shape = tiny_shape(arch="qwen3", hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64)
    assert_launches_packed(write_tiny_model(tmp_path / "m.gguf", qtype, shape), batch_invariant)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0])
def test_dense_model_launches_with_skinny_gemv(tmp_path, qtype):
    shape = tiny_shape(arch="qwen3", hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64)
    gemv = ("skinny_gemm.cu", [f"skinny_gemv<{int(qtype)}>"])
    slices = ("skinny_gemm.cu", [f"skinny_gemm<{int(qtype)}, 8>"])  # the long prompt's 64-token slices
    # a decode step's gate, up and SwiGLU into down's input: one launch, or (Q6_K's splits) two
    glu = ("skinny_gemm.cu", [f"skinny_gemv<{int(qtype)}, true>", f"skinny_swiglu_to_f16<{int(qtype)}>"])
    assert_launches_packed(write_tiny_model(tmp_path / "m.gguf", qtype, shape),
                           flags={"infero.backends.cuda.ops:SKINNY_GEMV": 1}, expect=[gemv, slices, glu])  # fmt: skip


def test_moe_model_launches(tmp_path):
    assert_launches_packed(write_tiny_moe(tmp_path / "moe.gguf", qtype=Q.Q8_0, head_dim=64))


def test_moe_model_launches_on_the_fp16_experts(tmp_path):
    """moe.FP16_EXPERTS: a decode step's pairs each a group (NI 1), a prompt's sorted into runs (expert rows of
    whole 128-column superblocks)."""
    grouped = ("skinny_gemm.cu", [f"skinny_experts<{int(Q.Q8_0)}, {ni}>" for ni in (1, 2, 4, 8)])
    fused = ("skinny_gemm.cu", [f"skinny_experts_combine<{int(Q.Q8_0)}>"])  # a decode step of one sequence
    path = write_tiny_moe(tmp_path / "moe.gguf", qtype=Q.Q8_0, head_dim=64, expert_ffn=128, hidden=128)
    assert_launches_packed(path, flags={"infero.backends.cuda.moe:FP16_EXPERTS": 1}, expect=[grouped, fused])


@pytest.mark.parametrize("shape, quant", [("qwen35-tiny", "Q4_K_M"), ("qwen35moe-tiny", "Q8_0"),
                                          ("qwen3next-tiny", "Q8_0")])  # fmt: skip
def test_hybrid_model_launches(tmp_path, shape, quant):
    from infero.checkpoint.synthetic import write_synthetic

    assert_launches_packed(write_synthetic(shape, quant, tmp_path / "hybrid.gguf", seed=3))
