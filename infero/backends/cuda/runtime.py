"""The process's CUDA runtime state: one context, one compute stream, and compiled kernels by label.

Kernels are looked up by a small label (file, template expression); the source is hashed once per process,
not per launch (hashing on every launch cost 13 us in an earlier engine). Each label belongs to a unit, one NVRTC
program: a file with the instantiations of one weight type, one head dim or none in particular. A model compiles
only the units its types and head dim need, all at once over the machine's cores (CudaBackend.compile_kernels);
compiling every file whole, one after another, took 160 s on a fresh H200 machine.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Unit:
    """One NVRTC program: a kernel file with some of its instantiations (NVRTC emits every extern "C" kernel of
    the file in each). `needs`: what a model must have for the unit to be compiled before it serves (weight
    types, a head dim); a unit without needs serves every model."""

    filename: str
    label: str
    needs: frozenset[str]

    @property
    def name(self) -> str:
        return f"{self.filename} [{self.label}]"


_units: dict[Unit, list[str]] = {}
_unit_of: dict[tuple[str, str], Unit] = {}  # (file, name expression) -> the unit it is compiled in
_modules: dict[Unit, tuple[Module, dict[str, str]]] = {}
_functions: dict[tuple[str, str], object] = {}
_reload_hooks: list = []


def weight_type(ggml_type: int) -> str:
    """The need of kernels that read weights stored as ggml_type."""
    return f"type {int(ggml_type)}"


def head_dim(dim: int) -> str:
    """The need of attention kernels instantiated for one head dimension."""
    return f"head_dim {dim}"


# The need of a mixture-of-experts model's kernels (routing, the expert mat-vecs), which dense models never run.
EXPERTS = "experts"
# The need of a hybrid model's Gated DeltaNet kernels (conv1d, gates, the delta rule, its norms).
DELTA_NET = "delta net"


def model_needs(dim: int, matrix_types, experts: bool = False, delta_net: bool = False) -> frozenset[str]:
    """What a model needs compiled: the types its matrices are stored as (on the GPU they stay so), its head dim,
    for a mixture of experts the expert kernels, and for a hybrid the delta-net kernels."""
    kinds = ([EXPERTS] if experts else []) + ([DELTA_NET] if delta_net else [])
    return frozenset([weight_type(t) for t in matrix_types] + [head_dim(dim)] + kinds)


def checkpoint_needs(checkpoint) -> frozenset[str]:
    """model_needs of a checkpoint, from its header (vectors become float32 on the host: no kernel reads their type)."""
    types = {t.ggml_type for t in checkpoint.tensors.values() if len(t.shape) >= 2}
    c = checkpoint.config
    return model_needs(c.head_dim, types, c.num_experts > 0, c.is_hybrid)


def declare(filename: str, expressions: list[str], needs: tuple[str, ...] = (), part: str = "") -> None:
    """Kernels a launcher looks up in kernels/<filename> (template instantiations and extern "C" names), compiled
    together in one unit, before serving a model that has every one of `needs`. `part` names one of several
    units with the same needs (compiled in parallel)."""
    label = " ".join([*sorted(needs), part]).strip() or "common"
    unit = Unit(filename, label, frozenset(needs))
    names = _units.setdefault(unit, [])
    for e in expressions:
        if (filename, e) not in _unit_of:
            names.append(e)
            _unit_of[filename, e] = unit


def declared() -> dict[str, list[str]]:
    """Every declared name of each kernel file (what CI compiles)."""
    out: dict[str, list[str]] = {}
    for unit, names in _units.items():
        out.setdefault(unit.filename, []).extend(names)
    return out


def units() -> dict[Unit, list[str]]:
    return {unit: list(names) for unit, names in _units.items()}


def needed_units(needs: frozenset[str] | None) -> dict[Unit, list[str]]:
    """The units a model with these needs runs (every unit where needs is None)."""
    return {u: names for u, names in units().items() if needs is None or u.needs <= needs}


def kernel(filename: str, expression: str):
    """The CUfunction for a declared kernel name or template instantiation ("matvec<12, 4>"); one no launcher
    declared (a benchmark's) is compiled in a unit of its own."""
    fn = _functions.get((filename, expression))
    if fn is not None:
        return fn
    with _lock:
        unit = _unit_of.get((filename, expression))
        if unit is None:
            unit = Unit(filename, expression, frozenset({"undeclared"}))
            _units[unit], _unit_of[filename, expression] = [expression], unit
        entry = _modules.get(unit)
        if entry is None:
            compiled = compiler.compile_cached(filename, context().info.arch, defines or None, _units[unit])
            entry = _modules[unit] = (Module(compiled.cubin), compiled.lowered)
        module, lowered = entry
        fn = _functions[(filename, expression)] = module.function(lowered.get(expression, expression))
    return fn


def uncompiled(arch: str, needs: frozenset[str] | None = None) -> tuple[list[compiler.Job], int]:
    """The units a model with these needs runs that the disk cache lacks for arch, and how many it has."""
    jobs = [compiler.Job(u.filename, tuple(names), u.name) for u, names in needed_units(needs).items()]
    todo = [j for j in jobs if not compiler.is_cached(j.filename, arch, list(j.names), defines or None)]
    return todo, len(jobs) - len(todo)


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
    """The units loaded so far, by name ("matvec.cu [type 12]")."""
    return {unit.name: module for unit, (module, _) in _modules.items()}
