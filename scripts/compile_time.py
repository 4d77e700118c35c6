"""Cold compile time of the kernels one model needs, one unit at a time and in parallel (no GPU needed).

python scripts/compile_time.py                       # the embedded default model (SmolLM2, Q4_1)
python scripts/compile_time.py --model FILE.gguf
python scripts/compile_time.py --types Q4_K,Q6_K --head-dim 128   # llama-3.1-8b Q4_K_M's without the file

Each run compiles into a fresh empty cache directory, so nothing is reused between the sequential and the parallel
pass; both passes' cubins are compared byte for byte. Prints one row per pass (wall and CPU seconds) and the units
that took the most CPU: with a core each, the longest of them bounds the parallel pass.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

from infero.backends.cuda import compiler, runtime
from infero.backends.cuda.ops import CudaOps  # noqa: F401  (importing the launchers declares their kernels)
from infero.backends.cuda.sampler import CudaRowSampler  # noqa: F401
from infero.checkpoint.tensor_types import GGMLType


def model_needs(args) -> frozenset[str]:
    if args.types:
        types = [GGMLType[name] for name in args.types.split(",")]
        return runtime.model_needs(args.head_dim, types)
    from infero.checkpoint import load_checkpoint
    from infero.default_model import default_model_path

    checkpoint = load_checkpoint(args.model or default_model_path())
    return runtime.checkpoint_needs(checkpoint)


unit_seconds: dict[str, float] = {}


def timed_pass(jobs: list[compiler.Job], arch: str, workers: int) -> tuple[float, float, dict[str, bytes]]:
    """Wall and CPU seconds of compiling jobs into an empty cache; the cubins."""
    with tempfile.TemporaryDirectory() as folder:
        os.environ["INFERO_CACHE_DIR"] = folder
        cpu, start = _cpu_seconds(), time.monotonic()
        if workers == 1:  # one at a time, each one's CPU seconds: the longest bounds any parallel pass
            for job in jobs:
                t = _cpu_seconds()
                compiler.compile_parallel([job], arch, None, 1)
                unit_seconds[job.name] = _cpu_seconds() - t
        else:
            compiler.compile_parallel(jobs, arch, None, workers)
        wall, cpu = time.monotonic() - start, _cpu_seconds() - cpu
        cubins = {j.name: compiler.compile_cached(j.filename, arch, None, list(j.names)).cubin for j in jobs}
    return wall, cpu, cubins


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF file (default: the embedded default model)")
    parser.add_argument("--types", help="comma-separated GGML types of the model's matrices, instead of a file")
    parser.add_argument("--head-dim", type=int, default=128, help="with --types")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    needs = model_needs(args)
    jobs = [compiler.Job(u.filename, tuple(n), u.name) for u, n in runtime.needed_units(needs).items()]
    every = sum(len(n) for n in runtime.declared().values())
    print(f"{len(jobs)} units, {sum(len(j.names) for j in jobs)} of {every} kernels, for {sorted(needs)}")
    seq_wall, seq_cpu, seq_cubins = timed_pass(jobs, args.arch, 1)
    par_wall, par_cpu, par_cubins = timed_pass(jobs, args.arch, args.workers)
    print(f"{'workers':>8} {'wall s':>8} {'cpu s':>8}")
    print(f"{1:>8} {seq_wall:>8.1f} {seq_cpu:>8.1f}")
    print(f"{args.workers:>8} {par_wall:>8.1f} {par_cpu:>8.1f}")
    slowest = sorted(unit_seconds.items(), key=lambda kv: -kv[1])[:3]
    print("slowest units, CPU: " + ", ".join(f"{name} {s:.1f} s" for name, s in slowest))
    differ = [name for name in seq_cubins if seq_cubins[name] != par_cubins[name]]
    print(f"cubins differ between the passes: {differ}" if differ else "cubins byte-identical")


if __name__ == "__main__":
    main()
