"""The serving engine's own host time per step, without the forward pass or sampling (no GPU needed).

    python scripts/engine_host_overhead.py [--model FILE] [--profile]

Runs closed batches of 1, 8, 32 and 64 requests (256-token prompts, 200 generated tokens) through `Engine.step`
with the backend's forward replaced by a zero-logits stub and the sampler by a constant: what remains is the
scheduler, batch building, detokenizing and bookkeeping that every backend pays per step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from infero import LLM, SamplingParams
from infero.engine.sampling import SampleResult


class ConstantSampler:
    def sample(self, logits, rows, params, *args, **kwargs):
        return [SampleResult(100 + i % 50, None, None) for i in range(len(rows))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    llm = LLM(args.model, device="cpu")
    engine, vocab = llm.engine, llm.config.vocab_size
    llm.backend.forward = lambda model, batch, cache, feed=None: np.zeros((len(batch.logits_indices), vocab), "f4")
    engine.sampler = ConstantSampler()
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    profiler = cProfile.Profile() if args.profile else None
    for batch in (1, 8, 32, 64):
        for i in range(batch):
            engine.add_request(f"r{batch}-{i}", list(range(1, 257)), params)
        steps, start = 0, None
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps == 20:  # past the prefills: decode steps only
                start, first = time.perf_counter(), steps
                if profiler and batch == 64:
                    profiler.enable()
        if profiler and batch == 64:
            profiler.disable()
        per_step = (time.perf_counter() - start) / (steps - first)
        us = per_step * 1e6
        print(f"batch {batch:>2}: {us:7.0f} us per decode step ({us / batch:5.1f} per sequence)")
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)


if __name__ == "__main__":
    main()
