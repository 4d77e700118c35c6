"""The CUDA backend's host time per eager forward pass, with the GPU stubbed out (no GPU needed).

    python scripts/cuda_host_overhead.py --model FILE [--tokens 128,512] [--profile] [--gpu]

A prefill or mixed step runs eagerly (only decode steps are graphs): the host queues each kernel with its Python
around it. If the host takes longer than the GPU, the GPU waits and the step takes the host's time. This script
stubs the GPU out (infero.bench.gpu_stub: device memory as made-up addresses, copies, launches and events doing
nothing, kernels not compiled), loads the model, and times `backend.forward` of one prompt of N tokens: what is
left is the Python of the model, the ops and the launchers with the packing of each launch's parameters, all but
the driver's own launch call (estimated at ~5.9 us of host time a launch on the GPU machine,
../shared/gpu/README.md, which the table adds). Run on the GPU machine's CPU for its numbers; this one's are
relative.

--gpu (on a GPU machine): nothing stubbed at first; each width's forward is timed on the host with its real launches
(the stream synchronized between passes, outside the timing), then again with only the two launch calls replaced
by the no-op: the difference is what the driver's launch calls cost that host, the rest its Python.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from cuda.bindings import driver as cu

from infero.bench.gpu_stub import count_launch, launches, stub_the_gpu

LAUNCH_HOST_US = 5.9  # host time of a cuda.bindings launch on the GPU machine (../shared/gpu/README.md)


def timed_passes(backend, model, batch, cache, profiler=None, passes: int = 10) -> tuple[float, int]:
    """Median host milliseconds of backend.forward, and the launches a pass (counted where they are stubbed)."""
    import numpy as np

    times, before = [], launches[0]
    for _ in range(passes):
        backend.stream.synchronize()
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        backend.forward(model, batch, cache)
        times.append(time.perf_counter() - start)
        if profiler:
            profiler.disable()
    backend.stream.synchronize()
    return float(np.median(times)) * 1e3, (launches[0] - before) // passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", default="16,128,512")
    parser.add_argument("--profile", action="store_true", help="cProfile the last width's forward passes")
    parser.add_argument("--gpu", action="store_true", help="real launches, then only the launches stubbed")
    args = parser.parse_args()
    if not args.gpu:
        stub_the_gpu()

    from infero import LLM
    from infero.bench.decode import prefill_case

    llm = LLM(args.model, device="cuda")
    backend, model = llm.backend, llm.model
    layers = model.config.num_layers
    widths = [int(t) for t in args.tokens.split(",")]
    if args.gpu:
        print(f"{layers} layers; host ms an eager forward: real launches, then the launch calls stubbed")
    else:
        print(f"{layers} layers; host ms an eager forward (launches; + {LAUNCH_HOST_US} us each)")
    profiler = None
    for n in widths:
        batch, cache = prefill_case(llm, n)
        backend.forward(model, batch, cache)
        profiler = cProfile.Profile() if args.profile and n == widths[-1] else None
        if args.gpu:
            real, _ = timed_passes(backend, model, batch, cache)
            saved = cu.cuLaunchKernel, cu.cuLaunchKernelEx
            cu.cuLaunchKernel = cu.cuLaunchKernelEx = count_launch
            try:
                ms, per = timed_passes(backend, model, batch, cache, profiler)
            finally:
                cu.cuLaunchKernel, cu.cuLaunchKernelEx = saved
            print(
                f"{n:>5} tokens: {real:7.2f} ms with its {per} launches, {ms:7.2f} without them "
                f"({(real - ms) * 1e3 / max(per, 1):.1f} us a launch; {ms / layers:.3f} ms of Python a layer)"
            )
            continue
        ms, per = timed_passes(backend, model, batch, cache, profiler)
        print(
            f"{n:>5} tokens: {ms:7.2f} ms, {per} launches ({ms / layers:.3f} ms a layer); "
            f"with launches {ms + per * LAUNCH_HOST_US / 1e3:7.2f} ms"
        )
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
