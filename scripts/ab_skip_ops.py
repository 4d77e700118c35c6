"""What each kernel costs inside the batch-1 decode step (GPU machine): the step's GPU time with the launches of
some kernels left out of the graph, alternated with the full step. The difference is the most a fusion that
removes those kernels could gain (their work, their wait on the kernel before, and what their completion holds
up), before it adds its own work elsewhere. The outputs of a step with launches left out are garbage; only the
time means anything.

    python scripts/ab_skip_ops.py --model FILE.gguf [--skip add_rms_norm --skip swiglu,attention_merge] [--repeats 6]

Each --skip is one variant: comma-separated prefixes of kernel expressions ("matvec_mma", "add_rms_norm<4, true,
true>"); a launch is left out when its kernel's expression starts with one of them.
"""

from __future__ import annotations

import argparse

import numpy as np

from infero import LLM
from infero.backends.cuda import driver, runtime
from infero.bench.decode import graph_step_timer

DEFAULT_SKIPS = ("add_rms_norm", "swiglu", "attention_merge_splits", "attention_", "add_rms_norm,swiglu,attention_")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--skip", action="append", help="comma-separated kernel prefixes (repeatable)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    variants = [tuple(s.split(",")) for s in (args.skip or DEFAULT_SKIPS)]

    names: dict[int, str] = {}  # id of a CUfunction -> its expression
    lookup, launch = runtime.kernel, driver.launch

    def kernel(filename: str, expression: str):
        fn = lookup(filename, expression)
        names[id(fn)] = expression
        return fn

    skipped: list[tuple[str, ...]] = [()]
    counts: dict[str, int] = {}

    def filtered_launch(fn, *rest, **kw):
        name = names.get(id(fn), "")
        if skipped[0] and name.startswith(skipped[0]):
            counts[name] = counts.get(name, 0) + 1
            return None
        return launch(fn, *rest, **kw)

    runtime.kernel, driver.launch = kernel, filtered_launch
    step_us = graph_step_timer(LLM(args.model, device="cuda"), args.prompt, args.steps)
    step_us()
    times: dict = {v: [] for v in [(), *variants]}
    for _ in range(args.repeats):
        for variant in times:
            skipped[0] = variant
            counts.clear()
            times[variant].append(step_us())
    print(f"{'left out':<48} {'median us':>10} {'vs full':>9}  launches left out a step")
    full = np.median(times[()])
    for variant, measured in times.items():
        label = ",".join(variant) or "(full step)"
        if variant:
            skipped[0] = variant
            counts.clear()
            step_us()
        # A step_us call runs the step twice through the launchers: the engine's warm-up, then the capture.
        launches = sum(counts.values()) // 2 if variant else 0
        print(f"{label:<48} {np.median(measured):>10.1f} {np.median(measured) - full:>+9.1f}  {launches}")


if __name__ == "__main__":
    main()
