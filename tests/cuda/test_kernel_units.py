"""A model compiles only the kernel units its weight types and head dim need, and parallel compiles give the same
cubins as one at a time. NVRTC needs no GPU, so this runs in CI."""

import importlib
import pkgutil

import infero.backends.cuda as cuda_pkg
from infero.backends.cuda import compiler, runtime
from infero.checkpoint.tensor_types import GGMLType as T


def needed_names(head_dim: int, types: list[T]) -> set[str]:
    for module in pkgutil.iter_modules(cuda_pkg.__path__):  # importing every launcher declares its kernels
        importlib.import_module(f"infero.backends.cuda.{module.name}")
    units = runtime.needed_units(runtime.model_needs(head_dim, types))
    return {f"{unit.filename}: {name}" for unit, names in units.items() for name in names}


# Kernel families whose first template argument is the weight's GGML type; attention's is the head dim.
TYPED = ("matvec_q<", "matvec_f<", "matvec_mma<", "matvec_mma_glu<", "matvec_mma_norm<", "gemm<", "skinny_gemm<",
         "skinny_x_to_f16<", "embedding<")  # fmt: skip


def first_arguments(names: set[str], prefixes: tuple[str, ...]) -> set[int]:
    kernels = [n.split(": ")[1] for n in names]
    return {int(k.split("<")[1].split(",")[0].rstrip(">")) for k in kernels if k.startswith(prefixes)}


def test_a_q4_1_model_compiles_its_types_kernels_and_no_k_quant_or_other_head_dim():
    names = needed_names(64, [T.Q4_1, T.Q8_0])  # SmolLM2's matrices: Q4_1, the tied embedding Q8_0
    for expected in ("matvec.cu: matvec_q<3, 1, 1, -1>", "matvec.cu: matvec_q<8, 16, 2, -1>",
                     "matvec.cu: matvec_quantize_x", "gemm.cu: gemm<3, 128, 256>", "gemm.cu: gemm_x_to_f16",
                     "skinny_gemm.cu: skinny_gemm<8, 8>", "embedding.cu: embedding<8>", "embedding.cu: feed_tokens",
                     "attention.cu: attention_decode<64>", "elementwise.cu: swiglu<true, true>",
                     "sampling.cu: sampler_select"):  # fmt: skip
        assert expected in names
    assert first_arguments(names, TYPED) == {T.Q4_1, T.Q8_0}
    assert first_arguments(names, ("attention_",)) == {64}
    # its prefill on linear_mma (Q4_1 and the Q8_0 head), no other tensor-core kernel
    assert {n for n in names if "mma" in n} == {
        "linear_mma.cu: linear_mma<3, 8, 1>", "linear_mma.cu: linear_mma<3, 4, 2>",
        "linear_mma.cu: linear_mma<8, 8, 1>", "linear_mma.cu: linear_mma<8, 4, 2>", "linear_mma.cu: linear_mma_finish",
    }  # fmt: skip


def test_a_q4_k_m_model_compiles_the_mixed_q4_k_q6_k_kernels_and_no_other_type():
    names = needed_names(128, [T.Q4_K, T.Q6_K])
    for expected in ("matvec.cu: matvec_mma<12, 1, 4, 2, true, 14>", "matvec.cu: matvec_mma_glu<14, 2, 2>",
                     "matvec.cu: matvec_q<12, 1, 2, 1, true>", "skinny_gemm.cu: skinny_x_to_f16<14>",
                     "gemm.cu: gemm<12, 16, 64>", "attention.cu: attention_prefill<128>"):  # fmt: skip
        assert expected in names
    assert first_arguments(names, TYPED) == {T.Q4_K, T.Q6_K}
    assert first_arguments(names, ("attention_",)) == {128}


def test_a_head_dim_256_model_compiles_its_attention_with_two_stages_and_with_one():
    """Qwen3.5's gated attention: two K/V stages where their 132 KiB fit a block's shared memory, one elsewhere."""
    names = needed_names(256, [T.Q8_0])
    assert {n for n in names if n.startswith("attention.cu")} == {
        "attention.cu: attention_prefill<256>", "attention.cu: attention_prefill<256, 1>",
        "attention.cu: attention_decode<256>", "attention.cu: attention_decode<256, 1>",
        "attention.cu: attention_merge_splits<256>",
    }  # fmt: skip


def test_the_mixed_kernels_need_both_types():
    assert "matvec.cu: matvec_mma<12, 1, 4, 2, true, 14>" not in needed_names(128, [T.Q4_K])


def test_parallel_compiles_give_the_cubins_of_one_at_a_time(tmp_path, monkeypatch):
    needed_names(64, [])
    chosen = ("attention.cu [head_dim 64]", "embedding.cu [type 3]", "embedding.cu [common]")
    jobs = [compiler.Job(u.filename, tuple(n), u.name) for u, n in runtime.units().items() if u.name in chosen]
    assert len(jobs) == len(chosen)
    cubins = []
    for workers in (1, 3):
        monkeypatch.setenv("INFERO_CACHE_DIR", str(tmp_path / str(workers)))
        done = []
        compiler.compile_parallel(jobs, "sm_90a", None, workers, progress=done.append)
        assert sorted(j.name for j in done) == sorted(chosen)
        cubins.append({p.name: p.read_bytes() for p in sorted(compiler.cache_dir().iterdir())})
    assert len(cubins[0]) == 2 * len(jobs)  # a cubin and its lowered names each
    assert cubins[0] == cubins[1]


def test_importing_the_backend_declares_every_kernel_file():
    """compile_kernels runs before the engine creates its sampler: every launcher, the sampler's too, must have
    declared its units by then, or its file compiles at the first request."""
    import subprocess
    import sys

    code = "import infero.backends.cuda; from infero.backends.cuda import runtime; " \
           "print(' '.join(sorted({u.filename for u in runtime.units()})))"  # fmt: skip
    declared = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert declared == sorted(p.name for p in compiler.KERNEL_DIR.glob("*.cu"))
