"""NVRTC: kernel sources -> cubin for one architecture, cached on disk.

Always cubin, never PTX: the GPU's driver may be older than the NVRTC wheel and could not JIT newer PTX.
The cache key covers the source, every header it may include, the architecture, NVRTC's version and the
options, so a changed kernel or toolchain never loads a stale binary. Headers come only from the wheels the
package depends on (`nvidia-cuda-runtime`, found by `cuda.pathfinder`).
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"
ARCHES = ("sm_80", "sm_89", "sm_90a")  # what CI compiles every kernel for


class CompileError(RuntimeError):
    pass


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    lowered: dict[str, str]  # C++ name expression (e.g. "matvec<12, 4>") -> mangled symbol
    log: str


def cache_dir() -> Path:
    root = os.environ.get("INFERO_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "infero"
    )
    return Path(root) / "kernels"


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    status, major, minor = nvrtc.nvrtcVersion()
    return major, minor


@functools.cache
def _cuda_include_dir() -> str:
    import cuda.pathfinder

    found = cuda.pathfinder.find_nvidia_header_directory("cudart")
    if not found:
        raise CompileError("CUDA headers not found: install the nvidia-cuda-runtime wheel")
    return str(found)


@functools.cache
def _headers_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.cuh")):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def base_options(arch: str) -> list[str]:
    return [f"-arch={arch}", "-std=c++17", "-default-device", "-I" + str(KERNEL_DIR), "-I" + _cuda_include_dir(),
            "-lineinfo", "--extra-device-vectorization"]  # fmt: skip


def define_options(defines: dict[str, int | str] | None) -> list[str]:
    return [f"-D{k}={v}" for k, v in sorted((defines or {}).items())]


def cache_key(source: str, arch: str, options: list[str], names: list[str]) -> str:
    h = hashlib.sha256()
    for part in (source, _headers_digest(), arch, repr(nvrtc_version()), repr(options), repr(names)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def compile_source(
    source: str, name: str, arch: str, defines: dict[str, int | str] | None = None, names: list[str] | None = None
) -> Compiled:
    """Compile one translation unit; `names` are template instantiations to emit (their mangled names return)."""
    from cuda.bindings import nvrtc

    names = names or []
    options = base_options(arch) + define_options(defines)
    status, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    try:
        for expr in names:
            _check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
        result = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])[0]
        log = _program_log(prog)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"{name} for {arch} failed to compile:\n{log}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        # NVRTC writes into the buffer: it must be a fresh mutable one. (b" " * 1 is CPython's shared one-byte
        # object; writing a log's NUL into it once turned every b" " in the process into b"\0".)
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        lowered = {}
        for expr in names:
            symbol = _check(nvrtc.nvrtcGetLoweredName(prog, expr.encode()), "nvrtcGetLoweredName")
            lowered[expr] = symbol.decode() if isinstance(symbol, bytes) else symbol
        return Compiled(bytes(cubin), lowered, log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_cached(
    filename: str, arch: str, defines: dict[str, int | str] | None = None, names: list[str] | None = None
) -> Compiled:
    """compile_source for kernels/<filename>, through the on-disk cache."""
    import json

    source = (KERNEL_DIR / filename).read_text()
    key = cache_key(source, arch, base_options(arch) + define_options(defines), names or [])
    folder = cache_dir()
    cubin_path, names_path = folder / f"{key}.cubin", folder / f"{key}.json"
    if cubin_path.exists() and names_path.exists():
        return Compiled(cubin_path.read_bytes(), json.loads(names_path.read_text()), "")
    compiled = compile_source(source, filename, arch, defines, names)
    folder.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a concurrent reader never sees half a file.
    for path, data in ((cubin_path, compiled.cubin), (names_path, json.dumps(compiled.lowered).encode())):
        tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return compiled


@dataclass(frozen=True)
class Job:
    """One unit to compile: kernels/<filename> with these name expressions; `name` is what progress shows."""

    filename: str
    names: tuple[str, ...]
    name: str


def compile_parallel(jobs: list[Job], arch: str, defines: dict[str, int | str] | None = None,
                     workers: int | None = None, progress=None) -> None:  # fmt: skip
    """compile_cached for every job, `workers` at a time (default: one per core the process may run on), largest
    first so the longest one starts at once; progress(job) as each finishes. Threads suffice: cuda.bindings lets
    go of the GIL inside nvrtcCompileProgram, and NVRTC compiles programs of one process concurrently."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    workers = workers or len(os.sched_getaffinity(0))
    ordered = sorted(jobs, key=lambda j: -len(j.names))
    with ThreadPoolExecutor(max(1, min(workers, len(ordered) or 1))) as pool:
        futures = {pool.submit(compile_cached, j.filename, arch, defines, list(j.names)): j for j in ordered}
        for future in as_completed(futures):
            future.result()
            if progress is not None:
                progress(futures[future])


def is_cached(
    filename: str, arch: str, names: list[str] | None = None, defines: dict[str, int | str] | None = None
) -> bool:
    """Whether compile_cached would find this file's cubin on disk."""
    source = (KERNEL_DIR / filename).read_text()
    key = cache_key(source, arch, base_options(arch) + define_options(defines), names or [])
    return (cache_dir() / f"{key}.cubin").exists()


def _program_log(prog) -> str:
    from cuda.bindings import nvrtc

    size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    buf = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return bytes(buf).rstrip(b"\0 ").decode(errors="replace")


def _check(result, what: str):
    from cuda.bindings import nvrtc

    status, *values = result
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what}: {status}")
    return values[0] if values else None
