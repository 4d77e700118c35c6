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


def test_matvec_segments_layout_matches_the_kernel():
    """matvec_q takes its matrices as one struct by value: the launcher's ctypes copy must lay it out exactly as
    the kernel's mv::Segments (checked by static_asserts compiled against matvec.cu)."""
    import ctypes

    from infero.backends.cuda import matvec

    segments = matvec.Segments
    checks = [f"static_assert(sizeof(mv::Segments) == {ctypes.sizeof(segments)}, \"size\");",
              f"static_assert(alignof(mv::Segments) == {ctypes.alignment(segments)}, \"alignment\");",
              f"static_assert(mv::MAX_SEGMENTS == {matvec.MAX_SEGMENTS}, \"segments\");"]  # fmt: skip
    # Member sizes always; offsets where the compiler has the builtin (NVRTC 13.5 does, the GPU machine's 13.0
    # does not): with the sizes, the total size and the same member order, they pin the layout there too.
    offsets = []
    for field, _ in segments._fields_:
        member = getattr(segments, field)
        checks.append(f'static_assert(sizeof(mv::Segments::{field}) == {member.size}, "{field} size");')
        offsets.append(f'static_assert(__builtin_offsetof(mv::Segments, {field}) == {member.offset}, "{field}");')
    checks += ["#if defined(__has_builtin)", "#if __has_builtin(__builtin_offsetof)", *offsets, "#endif", "#endif"]
    source = (compiler.KERNEL_DIR / "matvec.cu").read_text() + "\n" + "\n".join(checks) + "\n"
    compiler.compile_source(source, "matvec.cu", "sm_90a")  # raises CompileError naming a failed assert
