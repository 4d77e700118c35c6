"""Host time of packing one launch's parameters: cuda.bindings' own packing of a (values, types) pair, which
cuLaunchKernel runs on every launch handed one, against infero's `driver.packed` (no GPU needed).

    python scripts/launch_overhead.py [--args 6,10,16,24]

Signatures of N arguments mixed as the launchers' are (pointers, ints, a float). Run with the cuda-bindings the
engine runs with: its packing changed between releases (13.3 packs in Python-level loops; 13.5 in C).
"""

from __future__ import annotations

import argparse
import ctypes
import timeit

from cuda.bindings import driver as cu

from infero.backends.cuda import driver

POINTER, INT, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def signature(n: int) -> tuple[tuple, tuple]:
    kinds = [(1 << 40, POINTER), (4096, INT), (1 << 41, POINTER), (7, INT), (0.5, FLOAT)]
    pairs = [kinds[i % len(kinds)] for i in range(n)]
    return tuple(v for v, _ in pairs), tuple(t for _, t in pairs)


def microseconds(fn, number: int = 20000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--args", default="6,10,16,24")
    args = parser.parse_args()
    from importlib.metadata import version

    print(f"cuda-bindings {version('cuda-bindings')}; us of host time a launch's parameters")
    print("| arguments | cuda.bindings (values, types) | driver.packed |")
    print("|---|---|---|")
    for n in (int(a) for a in args.args.split(",")):
        values, types = signature(n)
        ours = microseconds(lambda v=values, t=types: driver.packed(v, t))
        # What cuLaunchKernel does with a tuple pair before it calls the driver (the class is cuda.bindings' own).
        theirs = microseconds(lambda v=values, t=types: cu._HelperKernelParams((v, t)))
        print(f"| {n} | {theirs:.2f} | {ours:.2f} |")


if __name__ == "__main__":
    main()
