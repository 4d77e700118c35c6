"""What one link of a chain of dependent kernels costs (GPU machine): the floor under a decode step of many short
launches, such as a mixture-of-experts layer's ~11 at one token.

    python scripts/bench_launch_chain.py [--links 480] [--shapes 1x32,132x128,1024x128]

Each kernel of the chain waits for the one before it (programmatic dependent launch inside a captured graph, as the
engine launches a step: kernels/pdl.cuh's pdl_enter), then every block reads one value the previous kernel wrote and
writes one value the next reads: the shortest dependent hop a real kernel makes (a real one then streams its
weights and computes). Also the same chain launched without the PDL attribute (plain stream order), and a chain of
kernels that trigger their dependents before waiting. Prints microseconds a link, from CUDA events around graph
replays after a warm-up one (the median of 20 replays: bench_matvec.time_in_graph).
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np
from bench_matvec import time_in_graph

from infero.backends.cuda import compiler, driver, runtime
from infero.backends.cuda.tensor import empty

SOURCE = r"""
extern "C" __global__ void link(const float* __restrict__ prev, float* __restrict__ next, int early) {
#if __CUDA_ARCH__ >= 900
  if (early) asm volatile("griddepcontrol.launch_dependents;" :::);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (!early) asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  if (threadIdx.x == 0) next[blockIdx.x] = prev[blockIdx.x] + 1.0f;
}
"""


def chain_us(fn, blocks: int, threads: int, links: int, pdl: bool, early: bool, stream, bufs) -> float:
    """Microseconds a link: the median replay of a graph of `links` launches, divided by `links`."""
    types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)

    def record():
        for i in range(links):
            src, dst = bufs[i % 2], bufs[(i + 1) % 2]
            driver.launch(fn, (blocks,), (threads,), (src.ptr, dst.ptr, int(early)), types, stream, pdl=pdl)

    return time_in_graph(stream, record, links, replays=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", type=int, default=480)
    parser.add_argument("--shapes", default="1x32,132x128,264x128,1024x128", help="blocks x threads, comma-separated")
    args = parser.parse_args()
    ctx = runtime.context()
    compiled = compiler.compile_source(SOURCE, "link.cu", ctx.info.arch, None, [])
    fn = driver.Module(compiled.cubin).function("link")
    stream = runtime.stream()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    bufs = [empty((max(b for b, _ in shapes),), np.float32) for _ in range(2)]
    for b in bufs:
        driver.memset_d8(b.ptr, 0, b.nbytes, stream)
    print(f"{ctx.info.name}, {args.links} links a graph, us a link")
    print(f"{'blocks x threads':>17} {'PDL':>7} {'PDL, trigger first':>19} {'no PDL':>7}")
    for blocks, threads in shapes:
        cells = [chain_us(fn, blocks, threads, args.links, pdl, early, stream, bufs)
                 for pdl, early in ((True, False), (True, True), (False, False))]  # fmt: skip
        print(f"{f'{blocks} x {threads}':>17} {cells[0]:7.2f} {cells[1]:19.2f} {cells[2]:7.2f}")


if __name__ == "__main__":
    main()
