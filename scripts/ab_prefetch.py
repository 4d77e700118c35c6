"""The L2 prefetch of the next weights (infero/backends/cuda/prefetch.py) on and off inside the batch-1 decode step
(GPU machine): step time on the GPU for each setting, the settings alternated so that drift falls on all alike.

    python scripts/ab_prefetch.py --model FILE.gguf [--repeats 6] [--steps 30]

Settings: off; MAX_BYTES of 16 and 32 MiB; 32 MiB issued before the previous kernel completes (EARLY); 32 MiB
from 64 CTAs instead of 32.
"""

from __future__ import annotations

import argparse

import numpy as np

from infero import LLM
from infero.backends.cuda import prefetch
from infero.bench.decode import graph_step_timer

SETTINGS = {  # name -> (MAX_BYTES, EARLY, BLOCKS)
    "off": (0, False, 32),
    "16 MiB": (16 << 20, False, 32),
    "32 MiB": (32 << 20, False, 32),
    "32 MiB early": (32 << 20, True, 32),
    "32 MiB, 64 CTAs": (32 << 20, False, 64),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    step_us = graph_step_timer(LLM(args.model, device="cuda"), args.prompt, args.steps)
    default = (prefetch.MAX_BYTES, prefetch.EARLY, prefetch.BLOCKS)
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    step_us()
    for _ in range(args.repeats):
        for name, (max_bytes, early, blocks) in SETTINGS.items():
            prefetch.MAX_BYTES, prefetch.EARLY, prefetch.BLOCKS = max_bytes, early, blocks
            times[name].append(step_us())
    prefetch.MAX_BYTES, prefetch.EARLY, prefetch.BLOCKS = default
    off = np.median(times["off"])
    print(f"{'prefetch':<18} {'median us':>10} {'vs off':>8}  each")
    for name, values in times.items():
        median = np.median(values)
        print(f"{name:<18} {median:>10.1f} {median - off:>+8.1f}  {' '.join(f'{v:.0f}' for v in values)}")


if __name__ == "__main__":
    main()
