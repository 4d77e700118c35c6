"""Two builds of the mat-vec kernel compared on the decode shapes (GPU machine).

A kernel change measured in seconds, before it goes into the step (docs/performance.md):

    python scripts/ab_matvec_build.py --source changed_matvec.cu [--shapes 8b,0.5b] [--types Q4_K] [--hot]
    python scripts/ab_matvec_build.py --define MV_VARIANT=1     kernels/matvec.cu with and without a define

Build A is kernels/matvec.cu as it is; build B is --source (a changed copy of matvec.cu, anywhere: its #includes
resolve in kernels/) or matvec.cu itself, compiled with the --define values. Only the planned instantiations of the
chosen shapes are compiled (about a second a build, where the whole matvec.cu takes a minute), so the call needs
no kernel cache. For each shape: the two builds' outputs compared bitwise, then each timed in a graph over weight
copies past the L2 (one copy with --hot), the builds alternating, median of --repeats; and each one's registers.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from bench_matvec import ARGS, L2_BYTES, SHAPES, launch_args, time_variant, weights
from cuda.bindings import driver as cu

from infero.backends.cuda import compiler, driver, matvec, runtime
from infero.backends.cuda.tensor import empty, from_host
from infero.checkpoint.synthetic import random_blocks
from infero.checkpoint.tensor_types import GGMLType


def build(source: str, defines: dict[str, str], names: list[str], arch: str) -> tuple[driver.Module, dict]:
    started = time.monotonic()
    compiled = compiler.compile_source(source, "matvec.cu", arch, defines, names)
    print(f"compiled {len(names)} instantiations with {defines or 'no defines'} in {time.monotonic() - started:.1f} s")
    return driver.Module(compiled.cubin), compiled.lowered


def registers(fn) -> int:
    return driver.check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, fn))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", help="build B's source (default: kernels/matvec.cu)")
    parser.add_argument("--define", action="append", default=[], help="NAME=VALUE for build B (repeatable)")
    parser.add_argument("--shapes", default="8b,0.5b", help=f"sets of bench_matvec.py: {', '.join(SHAPES)}")
    parser.add_argument("--types", help="only these weight types (comma-separated, e.g. Q4_K,Q6_K)")
    parser.add_argument("--n", type=int, default=1, help="tokens")
    parser.add_argument("--hot", action="store_true", help="every launch reads one copy: from the L2 where it fits")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ctx, stream, rng, n = runtime.context(), runtime.stream(), np.random.default_rng(0), args.n
    shapes = [s for key in args.shapes.split(",") for s in SHAPES[key]]
    if args.types:
        shapes = [s for s in shapes if s[0] in args.types.split(",")]
    plans = {}
    for name, rows, cols in shapes:
        t = int(GGMLType[name])
        big_n, rpw, wpb, ahead = matvec.plan(rows, n, ctx.info.num_sms, t, cols // matvec.UNIT_ELEMS.get(t, 32))
        plans[(name, rows, cols)] = (f"matvec_q<{t}, {big_n}, {rpw}, {ahead}>", rpw, wpb)
    names = sorted({expression for expression, *_ in plans.values()})
    plain = (compiler.KERNEL_DIR / matvec.SOURCE).read_text()
    changed = open(args.source).read() if args.source else plain
    defines = dict(d.split("=", 1) for d in args.define)
    builds = {"A": build(plain, {}, names, ctx.info.arch), "B": build(changed, defines, names, ctx.info.arch)}
    quantize_x = builds["A"][0].function("matvec_quantize_x")
    print(f"\n{'weight':<22} {'variant':<26} {'A us':>8} {'B us':>8} {'B - A':>7}  registers  bitwise")
    for (name, rows, cols), (expression, rpw, wpb) in plans.items():
        t = int(GGMLType[name])
        nbytes = rows * len(random_blocks(t, 1, cols, rng, 0.02)[0])
        launches = max(2, -(-3 * L2_BYTES // nbytes))
        ws = weights(t, rows, cols, 1, rng) * launches if args.hot else weights(t, rows, cols, launches, rng)
        x = from_host(rng.normal(0, 1, size=(n, cols)).astype(np.float32))
        q_shape, s_shape = matvec.activation_shapes(n, cols)
        xq, xs = empty(q_shape, np.int8), empty(s_shape, np.int32)
        driver.launch(quantize_x, (-(-n * cols // 8 // matvec.QUANTIZE_THREADS),), (matvec.QUANTIZE_THREADS,),
                      (xq.ptr, xs.ptr, x.ptr, n, cols), matvec._QUANTIZE_ARGS, stream)  # fmt: skip
        grid, block = (-(-rows // (rpw * wpb)),), (32 * wpb,)
        fns = {key: module.function(lowered[expression]) for key, (module, lowered) in builds.items()}
        outs = {}
        for key, fn in fns.items():
            out = empty((n, rows), np.float32)
            driver.memset_d8(out.ptr, 0xFF, out.nbytes, stream)
            driver.launch(fn, grid, block, launch_args(out, ws[0], xq, xs, n), ARGS, stream)
            stream.synchronize()
            outs[key] = out.to_host().view(np.uint32)
        same = np.array_equal(outs["A"], outs["B"])
        out = empty((n, rows), np.float32)
        times: dict[str, list[float]] = {key: [] for key in fns}
        for _ in range(args.repeats):
            for key, fn in fns.items():
                times[key].append(time_variant(stream, fn, grid, block, ws, xq, xs, out, n))
        a, b = (float(np.median(times[key])) for key in ("A", "B"))
        regs = f"{registers(fns['A'])} / {registers(fns['B'])}"
        label = f"{name} {rows}x{cols}"
        print(f"{label:<22} {expression:<26} {a:8.2f} {b:8.2f} {b - a:+7.2f}  {regs:>9}  {same}")


if __name__ == "__main__":
    main()
