"""Time CPU engine steps that hold one decode and a prompt chunk of N tokens, for choosing the CPU backend's
max_num_batched_tokens (docs/performance.md, "CPU backend").

    .venv/bin/python scripts/bench_cpu_step.py [--chunks 16,32,64,128,256] [--repeats 7] [--model FILE]

A step = one decode at context 300 plus an N-token chunk of a prompt at positions 1000 ... 1000 + N (the middle
of a 2,000-token prompt). Prints each width's median wall time and the median CPU time the process spent in it:
on a shared machine the wall time includes waiting for a core, the CPU time (one BLAS thread) does not.
Threads: INFERO_CPU_THREADS (default 1), as the engine sets them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from infero import LLM
from infero.engine.batch import SequenceStep, build_batch

BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", default="16,32,64,128,256")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    llm = LLM(args.model, device="cpu")
    model, backend = llm.model, llm.backend
    cache = backend.allocate_kv_cache(model.config, 200, BLOCK)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=1300).tolist()
    prompt_table, decode_table = list(range(100)), list(range(100, 200))
    for table, n in ((prompt_table, 1000), (decode_table, 300)):
        for start in range(0, n, 250):
            step = SequenceStep(ids[start : start + 250], start, table, logits="none")
            backend.forward(model, build_batch([step], BLOCK), cache)
    print(f"{llm.config.name}, {backend.threads} BLAS thread(s); step = 1 decode + an N-token prompt chunk")
    print(f"{'N':>5} {'wall ms':>9} {'cpu ms':>9} {'cpu ms/token':>13}")
    for n in [0] + [int(c) for c in args.chunks.split(",")]:
        walls, cpus = [], []
        for _ in range(args.repeats):
            steps = [SequenceStep([ids[300]], 300, decode_table)]
            if n:
                steps.append(SequenceStep(ids[1000 : 1000 + n], 1000, prompt_table, logits="none"))
            batch = build_batch(steps, BLOCK)
            wall, cpu = time.perf_counter(), time.process_time()
            backend.forward(model, batch, cache)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        wall_ms, cpu_ms = 1e3 * float(np.median(walls)), 1e3 * float(np.median(cpus))
        print(f"{n:>5} {wall_ms:>9.1f} {cpu_ms:>9.1f} {cpu_ms / (n + 1):>13.2f}", flush=True)


if __name__ == "__main__":
    main()
