"""A boolean switch of the engine, on and off, inside the batch-1 decode step (GPU machine): the step's GPU time
for each, alternated so that the drift between measurements (tens of microseconds) falls on both alike.

    python scripts/ab_step.py --model FILE.gguf --flag MODULE:ATTRIBUTE [--repeats 8]

The flag is a module attribute the launchers read at capture time (one added for the comparison: decode attention's
early K/V loads were measured through attention.DECODE_EARLY_KV, then the switch was removed); the graph is
re-captured for every measurement.
"""

from __future__ import annotations

import argparse
import importlib

import numpy as np

from infero import LLM
from infero.bench.decode import graph_step_timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--flag", required=True, help="module:ATTRIBUTE, a bool")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    module_name, attribute = args.flag.split(":")
    module = importlib.import_module(module_name)
    default = getattr(module, attribute)
    step_us = graph_step_timer(LLM(args.model, device="cuda"), args.prompt, args.steps)
    step_us()
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for value in (True, False):
            setattr(module, attribute, value)
            times[value].append(step_us())
    setattr(module, attribute, default)
    print(f"{attribute:<24} {'median us':>10}  each")
    for value, values in times.items():
        print(f"{str(value):<24} {np.median(values):>10.1f}  {' '.join(f'{v:.0f}' for v in values)}")
    print(f"True - False: {np.median(times[True]) - np.median(times[False]):+.1f} us")


if __name__ == "__main__":
    main()
