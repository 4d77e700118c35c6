"""The process's CUDA runtime state: one context, one compute stream, and compiled kernels by label.

Kernels are looked up by a small label (file, template expression); the source is hashed once per process,
not per launch (hashing on every launch cost 13 us in an earlier engine).
"""

from __future__ import annotations

import os
import threading

from infero.backends.cuda import compiler, driver
from infero.backends.cuda.driver import Context, Module, Stream

_lock = threading.Lock()
_state: dict = {}


def context() -> Context:
    """The GPU context (created on first use; raises CudaUnavailableError where there is no GPU)."""
    ctx = _state.get("context")
    if ctx is None:
        with _lock:
            ctx = _state.get("context")
            if ctx is None:
                ctx = _state["context"] = Context(0)
                driver.PDL[0] = ctx.info.capability >= (9, 0) and os.environ.get("INFERO_PDL", "1") != "0"
    ctx.make_current()
    return ctx


def stream() -> Stream:
    s = _state.get("stream")
    if s is None:
        context()
        s = _state["stream"] = Stream()
    return s


# Preprocessor definitions every kernel file is compiled with (part of the cache key); empty in the engine.
# scripts/trace_step.py sets {"INFERO_TRACE": 1} before anything compiles (kernels/trace.cuh).
defines: dict[str, int] = {}
_modules: dict[str, tuple[Module, dict[str, str]]] = {}
_functions: dict[tuple[str, str], object] = {}
_declared: dict[str, list[str]] = {}
_reload_hooks: list = []


def declare(filename: str, expressions: list[str]) -> None:
    """Template instantiations a launcher uses from kernels/<filename>; one NVRTC call compiles them all."""
    names = _declared.setdefault(filename, [])
    names.extend(e for e in expressions if e not in names)


def declared() -> dict[str, list[str]]:
    return {k: list(v) for k, v in _declared.items()}


def kernel(filename: str, expression: str):
    """The CUfunction for an extern "C" kernel name or a template instantiation ("matvec<12, 4>")."""
    fn = _functions.get((filename, expression))
    if fn is not None:
        return fn
    with _lock:
        names = _declared.setdefault(filename, [])
        if "<" in expression and expression not in names:
            names.append(expression)
        entry = _modules.get(filename)
        if entry is None or ("<" in expression and expression not in entry[1]):
            compiled = compiler.compile_cached(filename, context().info.arch, defines or None, list(names))
            entry = _modules[filename] = (Module(compiled.cubin), compiled.lowered)
        module, lowered = entry
        fn = _functions[(filename, expression)] = module.function(lowered.get(expression, expression))
    return fn


def precompile(arch: str, progress=None) -> tuple[int, int]:
    """Compile every kernel file with the instantiations its launcher declared into the disk cache, so the
    first step does not stall; (files compiled now, files already cached). `progress(name)` is called per file
    compiled."""
    compiled = cached = 0
    for filename, names in declared().items():
        if compiler.is_cached(filename, arch, names, defines or None):
            cached += 1
            continue
        if progress is not None:
            progress(filename)
        compiler.compile_cached(filename, arch, defines or None, names)
        compiled += 1
    return compiled, cached


def on_reload(hook) -> None:
    """hook() runs at reload_kernels: a launcher drops the functions it cached."""
    _reload_hooks.append(hook)


def reload_kernels() -> None:
    """Load every kernel file afresh at its next use, built with the `defines` set now: two builds of a kernel
    timed in one process (scripts/ab_step.py --define). Functions handed out before stay valid (no module is
    unloaded)."""
    with _lock:
        _modules.clear()
        _functions.clear()
    for hook in _reload_hooks:
        hook()


def loaded_modules() -> dict[str, Module]:
    """The kernel files loaded so far, by file name."""
    return {filename: module for filename, (module, _) in _modules.items()}
