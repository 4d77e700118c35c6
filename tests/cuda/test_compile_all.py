"""Every kernel compiles for Ampere, Ada and Hopper with no error and no warning. NVRTC needs no GPU, so this
runs in CI."""

import importlib
import pkgutil

import pytest

import infero.backends.cuda as cuda_pkg
from infero.backends.cuda import compiler, runtime

KERNELS = sorted(p.name for p in compiler.KERNEL_DIR.glob("*.cu"))


def launcher_declarations() -> dict[str, list[str]]:
    # Importing every launcher registers the template instantiations it will ask for.
    for module in pkgutil.iter_modules(cuda_pkg.__path__):
        importlib.import_module(f"infero.backends.cuda.{module.name}")
    return runtime.declared()


def test_there_are_kernels():
    assert KERNELS, "no .cu files found"


@pytest.mark.parametrize("arch", compiler.ARCHES)
@pytest.mark.parametrize("filename", KERNELS)
def test_kernel_compiles_without_warnings(filename, arch):
    names = launcher_declarations().get(filename, [])
    source = (compiler.KERNEL_DIR / filename).read_text()
    result = compiler.compile_source(source, filename, arch, names=names)
    assert result.cubin
    assert "warning" not in result.log.lower(), result.log
    assert set(result.lowered) == set(names)


def test_compiled_kernels_are_found_in_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERO_CACHE_DIR", str(tmp_path))
    names = launcher_declarations().get("embedding.cu", [])
    assert not compiler.is_cached("embedding.cu", "sm_90a", names)
    first = compiler.compile_cached("embedding.cu", "sm_90a", None, names)
    assert compiler.is_cached("embedding.cu", "sm_90a", names)
    assert not compiler.is_cached("embedding.cu", "sm_80", names)
    again = compiler.compile_cached("embedding.cu", "sm_90a", None, names)
    assert again.cubin == first.cubin and again.lowered == first.lowered


def test_defines_are_part_of_the_cache_key(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERO_CACHE_DIR", str(tmp_path))
    names = launcher_declarations().get("embedding.cu", [])
    compiler.compile_cached("embedding.cu", "sm_90a", {"INFERO_TRACE": 1}, names)
    assert compiler.is_cached("embedding.cu", "sm_90a", names, {"INFERO_TRACE": 1})
    assert not compiler.is_cached("embedding.cu", "sm_90a", names)


# The decode step's kernels that scripts/trace_step.py reads marks from (kernels/trace.cuh), one instantiation each.
TRACED = {
    "attention.cu": ["attention_decode<128>", "attention_merge_splits<128>"],
    "matvec.cu": ["matvec_mma_glu<12, 1, 2>", "matvec_mma_norm<12, 1, 4, 3>", "matvec_mma<12, 1, 4, 2, true, 14>"],
}


@pytest.mark.parametrize("filename", sorted(TRACED))
def test_trace_build_compiles_and_only_it_has_the_trace_buffer(filename):
    source = (compiler.KERNEL_DIR / filename).read_text()
    traced = compiler.compile_source(source, filename, "sm_90a", {"INFERO_TRACE": 1}, TRACED[filename])
    assert "warning" not in traced.log.lower(), traced.log
    assert b"infero_trace_buffer" in traced.cubin
    plain = compiler.compile_source(source, filename, "sm_90a", None, TRACED[filename])
    assert b"infero_trace_buffer" not in plain.cubin


def _struct_checks(cpp: str, struct) -> list[str]:
    """static_asserts that the C++ struct cpp is laid out as the ctypes struct: size, alignment, member sizes
    always; offsets where the compiler has the builtin (NVRTC 13.5 does, the GPU machine's 13.0 does not): with the
    sizes, the total size and the same member order, they pin the layout there too."""
    import ctypes

    checks = [f'static_assert(sizeof({cpp}) == {ctypes.sizeof(struct)}, "size");',
              f'static_assert(alignof({cpp}) == {ctypes.alignment(struct)}, "alignment");']  # fmt: skip
    offsets = []
    for field, _ in struct._fields_:
        member = getattr(struct, field)
        checks.append(f'static_assert(sizeof({cpp}::{field}) == {member.size}, "{field} size");')
        offsets.append(f'static_assert(__builtin_offsetof({cpp}, {field}) == {member.offset}, "{field}");')
    guarded = ["#if defined(__has_builtin)", "#if __has_builtin(__builtin_offsetof)", *offsets, "#endif", "#endif"]
    return checks + guarded


def _struct_cases():
    from infero.backends.cuda import matvec

    return [
        ("matvec.cu", "mv::Segments", matvec.Segments,
         [f'static_assert(mv::MAX_SEGMENTS == {matvec.MAX_SEGMENTS}, "segments");']),
        ("matvec.cu", "mv::Rope", matvec.Rope, []),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(len(_struct_cases())))
def test_structs_passed_by_value_match_the_kernels(case):
    """Kernels take some arguments as one struct by value (matvec_q's matrices and its rotary epilogue): the
    launcher's ctypes copy must lay it out exactly as the kernel's struct (static_asserts compiled against the
    kernel's source; a failed one raises CompileError naming it)."""
    filename, cpp, struct, extra = _struct_cases()[case]
    checks = extra + _struct_checks(cpp, struct)
    source = (compiler.KERNEL_DIR / filename).read_text() + "\n" + "\n".join(checks) + "\n"
    compiler.compile_source(source, filename, "sm_90a")
