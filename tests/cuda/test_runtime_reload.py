"""runtime.reload_kernels: what scripts/ab_step.py --define relies on to time two builds of the kernels in one
process. No GPU needed: it only drops what the launchers cached."""

import importlib
import pkgutil

import infero.backends.cuda as cuda_pkg
from infero.backends.cuda import runtime

CACHES = ("_functions", "_launches")  # the launchers' caches of CUfunctions (and of launches holding them)


def launcher_caches() -> dict[str, dict]:
    found = {}
    for module in pkgutil.iter_modules(cuda_pkg.__path__):
        mod = importlib.import_module(f"infero.backends.cuda.{module.name}")
        for name in CACHES:
            cache = getattr(mod, name, None)
            if isinstance(cache, dict):
                found[f"{module.name}.{name}"] = cache
    return found


def test_every_launcher_cache_is_found():
    caches = launcher_caches()
    for launcher in ("matvec", "attention", "elementwise", "embedding", "gemm", "skinny_gemm", "runtime"):
        assert f"{launcher}._functions" in caches
    assert "matvec._launches" in caches


def test_reload_kernels_drops_every_cached_function():
    caches = launcher_caches()
    stale = object()
    for cache in caches.values():
        cache[("stale",)] = stale
    try:
        runtime.reload_kernels()
        kept = [name for name, cache in caches.items() if ("stale",) in cache]
        assert not kept, f"not dropped at reload_kernels: {kept}"
    finally:
        for cache in caches.values():
            cache.pop(("stale",), None)
