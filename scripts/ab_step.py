"""A switch of the engine, each of its values, inside a decode step (GPU machine; one sequence, or --batch N): the
step's GPU time for each, alternated so that the drift between measurements (tens of microseconds) falls on all alike.

    python scripts/ab_step.py --model FILE.gguf --flag MODULE:ATTRIBUTE [--values 16,8] [--repeats 8]
    python scripts/ab_step.py --model FILE.gguf --flag MODULE:PREDICATE --predicate
    python scripts/ab_step.py --model FILE.gguf --flag M:A=2,1 --flag M:B   (each in turn, one model load)
    python scripts/ab_step.py --model FILE.gguf --define NAME[=1,0]     (two builds of the kernels)

A flag's own =VALUES take the place of --values for it. Without values the attribute is a bool, compared True
against False. With --predicate it is a function the launchers ask whether a fused path runs (matvec:glu_fits,
matvec:norm_fits), compared as it is (True) against one that always answers False.
The flag is a module attribute the launchers read at capture time (one added for the comparison: decode attention's
early K/V loads were measured through attention.DECODE_EARLY_KV, then the switch was removed); the graph is
re-captured for every measurement. A --define is a preprocessor name the kernel files test (#if NAME), compared
at each value (0: not defined, the engine's build) by reloading the kernels built with it (runtime.reload_kernels;
compile the builds beforehand, or the first measurement of each compiles it).
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
    parser.add_argument("--flag", default=[], action="append", help="module:ATTRIBUTE (repeat: each in turn)")
    parser.add_argument("--define", default=[], action="append", help="NAME[=VALUES] of the kernel builds (repeat)")
    parser.add_argument("--values", help="comma-separated numbers to compare (default: True,False)")
    parser.add_argument("--predicate", action="store_true", help="the attribute is a function: as is vs False")
    parser.add_argument("--set", action="append", default=[], help="module:ATTRIBUTE=NUMBER held for the whole run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1, help="sequences in the step, each after its own prompt")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    hold(args.set)
    step_us = graph_step_timer(LLM(args.model, device="cuda"), args.prompt, args.steps, args.batch)
    step_us()
    for flag in args.flag:
        compare(flag, args, step_us)
    for define in args.define:
        compare_define(define, args, step_us)


def hold(settings: list[str]) -> None:
    """Set each MODULE:ATTRIBUTE=NUMBER (an int, or a float where it has a point) for the rest of the run (--set)."""
    for setting in settings:
        target, value = setting.split("=")
        module, attribute = target.split(":")
        setattr(importlib.import_module(module), attribute, _number(value))


def _number(text: str) -> int | float:
    return float(text) if "." in text else int(text)


def compare(flag: str, args: argparse.Namespace, step_us) -> None:
    flag, _, own = flag.partition("=")
    module_name, attribute = flag.split(":")
    module = importlib.import_module(module_name)
    default = getattr(module, attribute)
    listed = own or args.values
    values = [_number(v) for v in listed.split(",")] if listed else [True, False]
    settings = {True: default, False: lambda *args, **kwargs: False} if args.predicate else {v: v for v in values}
    times: dict = {value: [] for value in values}
    for _ in range(args.repeats):
        for value in values:
            setattr(module, attribute, settings[value])
            times[value].append(step_us())
    setattr(module, attribute, default)
    report(attribute, values, times)


def compare_define(define: str, args: argparse.Namespace, step_us) -> None:
    from infero.backends.cuda import runtime

    name, _, listed = define.partition("=")
    values = [int(v) for v in (listed or "1,0").split(",")]
    times: dict = {value: [] for value in values}

    def build(value: int) -> None:
        if value:
            runtime.defines[name] = value
        else:
            runtime.defines.pop(name, None)
        runtime.reload_kernels()

    for repeat in range(args.repeats):
        for value in values:
            build(value)
            times[value].append(step_us())
            if repeat == 0:  # the step ran the kernels of this build
                print(f"{name}={value}: {sorted(runtime.loaded_modules())} loaded with {runtime.defines}")
    build(0)
    report(name, values, times)


def report(name: str, values: list, times: dict) -> None:
    print(f"{name:<24} {'median us':>10}  each")
    for value, measured in times.items():
        print(f"{str(value):<24} {np.median(measured):>10.1f}  {' '.join(f'{v:.0f}' for v in measured)}")
    first = values[0]
    for value in values[1:]:
        print(f"{first} - {value}: {np.median(times[first]) - np.median(times[value]):+.1f} us")


if __name__ == "__main__":
    main()
