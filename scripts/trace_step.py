"""Where a batch-1 decode step's time goes between and inside its launches (GPU machine): the kernels built with
-DINFERO_TRACE (kernels/trace.cuh) record, per block, the global timer and its SM's clock at six marks: its start,
its PDL wait's release, its activation staged, its first math, its sums complete, and its exit. The step's graph
is replayed as the engine runs it; each launch of the layers' cycle (q/k/v, attention, merge, o, gate + up, down)
is then summarised over the middle layers and the replays.

    python scripts/trace_step.py --model FILE.gguf [--prompt 512] [--replays 5] [--set MODULE:ATTRIBUTE=NUMBER]
                                 [--define NAME=INT]

Per role, medians over layers and replays, µs. Times "after prev" count from the previous launch's last block
exit, so "span" (last exit to last exit) is the launch's share of the step:
  early:        its blocks that started before the previous launch's last exit (resident early, copies in flight)
  release:      its first PDL wait release, after prev
  staging, ready, stream, epilogue: a block's time (its SM's clock) from its wait release to its activation
                staged (attention: Q built; merge: partials loaded), to its first math (a deferred norm's factor
                computed by thread 0's warp; attention: its first K/V tile landed), to its sums complete, to its
                exit; medians
  staging 1st on SM / later: the staging of the blocks that started first on their SM in the launch (whose code
                the SM's instruction cache may not hold yet) and of the others (on the H200: no difference)
  stream, busiest SMs / others: the stream of the blocks on the SMs that hold the most of the launch's blocks, and
                of the rest (a one-wave launch whose blocks do not divide evenly over the SMs)
  summed med / last: the blocks' sums complete, after prev
  last: ...:    the block that ended the launch: its start after prev, its stream and its epilogue
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
from ab_step import hold

from infero.backends.cuda import driver, runtime

MARKS = 6  # kernels/trace.cuh: start, waited, staged, ready, summed, exit
RECORD = np.dtype(
    [("t", "<u8", MARKS), ("c", "<u8", MARKS), ("kind", "<u4"), ("block", "<u4"), ("sm", "<u4"), ("slot", "<u4")]
)
KINDS = {1: "matvec", 2: "qkv", 3: "gate+up", 4: "norm", 5: "attention", 6: "merge"}
CAPACITY = 1 << 17


class Tracer:
    """One device buffer and counter that every loaded kernel module's trace globals point at."""

    def __init__(self):
        self.buffer = driver.DeviceMemory(CAPACITY * RECORD.itemsize)
        self.count = driver.DeviceMemory(4)
        for module in runtime.loaded_modules().values():
            try:
                buffer_at, _ = module.global_address("infero_trace_buffer")
            except driver.CudaError:
                continue  # a kernel file without marks
            count_at, _ = module.global_address("infero_trace_count")
            capacity_at, _ = module.global_address("infero_trace_capacity")
            driver.copy_host_to_device(buffer_at, np.array([self.buffer.ptr], np.uint64))
            driver.copy_host_to_device(count_at, np.array([self.count.ptr], np.uint64))
            driver.copy_host_to_device(capacity_at, np.array([CAPACITY], np.uint32))

    def run(self, forward) -> np.ndarray:
        driver.copy_host_to_device(self.count.ptr, np.zeros(1, np.uint32))
        forward()
        runtime.context().synchronize()
        count = np.zeros(1, np.uint32)
        driver.copy_device_to_host(count, self.count.ptr)
        n = min(int(count[0]), CAPACITY)
        records = np.zeros(n, RECORD)
        driver.copy_device_to_host(records.view(np.uint8), self.buffer.ptr)
        records = records[records["kind"] > 0]  # blocks that took a slot and returned early write none
        return records[np.argsort(records["slot"])]


def launches(records: np.ndarray) -> list[np.ndarray]:
    """The records split into launches: blocks start in launch order (a kernel's blocks are scheduled only once
    every block of the one before has passed its wait), so a launch ends where the kind changes or a block repeats."""
    out, current, seen = [], [], set()
    for i, r in enumerate(records):
        if current and (r["kind"] != records[current[0]]["kind"] or int(r["block"]) in seen):
            out.append(records[current])
            current, seen = [], set()
        current.append(i)
        seen.add(int(r["block"]))
    if current:
        out.append(records[current])
    return out


def roles(runs: list[np.ndarray]) -> list[str]:
    names, after_glu = [], False
    for launch in runs:
        kind = int(launch["kind"][0])
        name = KINDS[kind]
        if kind == 4:
            name = "down" if after_glu else "o"
        after_glu = kind == 3
        names.append(name)
    return names


def sm_clock_ghz(records: np.ndarray) -> float:
    """The SMs' clock while the step ran: clock64 cycles per global-timer ns over the blocks that ran > 5 us."""
    ns = records["t"][:, -1].astype(np.float64) - records["t"][:, 0]
    cycles = records["c"][:, -1].astype(np.float64) - records["c"][:, 0]
    long = ns > 5000
    return float(np.median(cycles[long] / ns[long])) if long.any() else float("nan")


def first_on_sm(launch: np.ndarray) -> np.ndarray:
    """Whether each block was the first of its launch to start on its SM."""
    sm, start = launch["sm"].astype(np.int64), launch["t"][:, 0]
    order = np.lexsort((start, sm))
    first = np.zeros(len(launch), bool)
    first[order[np.r_[True, sm[order][1:] != sm[order][:-1]]]] = True
    return first


def on_busiest_sms(launch: np.ndarray) -> np.ndarray:
    """Whether each block ran on one of the SMs that held the most of its launch's blocks."""
    sm = launch["sm"].astype(np.int64)
    per_sm = np.bincount(sm)[sm]
    return per_sm == per_sm.max()


def summarise(runs: list[np.ndarray], names: list[str], ghz: float, stats: dict) -> None:
    layer_roles = ("qkv", "attention", "merge", "o", "gate+up", "down")
    qkv_at = [i for i, name in enumerate(names) if name == "qkv"]
    middle = set(qkv_at[2:-2])  # the cycle's launches of the middle layers
    for start in middle:
        for k, role in enumerate(layer_roles):
            i = start + k
            if i >= len(runs) or names[i] != role:
                break
            launch, prev_end = runs[i], float(runs[i - 1]["t"][:, -1].max())
            t = launch["t"].astype(np.float64)
            c = launch["c"].astype(np.float64) / (1e3 * ghz)  # us
            s = stats[role]
            s["blocks"].append(len(launch))
            s["early"].append(float(np.mean(t[:, 0] < prev_end)))
            s["start spread"].append((t[:, 0].max() - t[:, 0].min()) / 1e3)
            waited = t[:, 1] > 0
            s["release"].append((t[waited, 1].min() - prev_end) / 1e3)
            # Each phase a block went through: from its previous reached mark to this one.
            for mark, phase in ((2, "staging"), (3, "ready"), (4, "stream"), (5, "epilogue")):
                reached = t[:, mark] > 0
                if not reached.any():
                    continue
                before = np.where(t[:, mark - 1] > 0, mark - 1, np.where(t[:, 2] > 0, 2, 1))
                if mark == 5:  # from the last mark reached before the exit
                    before = np.select([t[:, 4] > 0, t[:, 3] > 0, t[:, 2] > 0], [4, 3, 2], 1)
                rows = np.arange(len(launch))
                spent = c[rows, mark] - c[rows, before]
                s[phase].append(float(np.median(spent[reached])))
                if mark == 2:  # an SM's first block of the launch fetches its code cold; the later ones find it
                    first = first_on_sm(launch)
                    for name, which in (("staging 1st on SM", first), ("staging later", ~first)):
                        if (reached & which).any():
                            s[name].append(float(np.median(spent[reached & which])))
            done = t[:, 4] > 0
            streamed = done & (t[:, 3] > 0)
            if streamed.any():
                busiest = on_busiest_sms(launch)
                spent = c[:, 4] - c[:, 3]
                for name, which in (("stream, busiest SMs", busiest), ("stream, others", ~busiest)):
                    if (streamed & which).any():
                        s[name].append(float(np.median(spent[streamed & which])))
            if done.any():
                s["summed med"].append((np.median(t[done, 4]) - prev_end) / 1e3)
                s["summed last"].append((t[done, 4].max() - prev_end) / 1e3)
            last = int(np.argmax(t[:, 5]))  # the block that ended the launch: when it started, what it spent
            s["last: start"].append((t[last, 0] - prev_end) / 1e3)
            if done[last]:
                s["last: stream"].append(c[last, 4] - c[last, 3 if t[last, 3] > 0 else 1])
                s["last: epilogue"].append(c[last, 5] - c[last, 4])
            s["span"].append((t[:, 5].max() - prev_end) / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], help="module:ATTRIBUTE=NUMBER held for the run")
    parser.add_argument("--define", action="append", default=[], help="NAME=INT of the kernel build, besides the trace")
    args = parser.parse_args()
    runtime.defines["INFERO_TRACE"] = 1
    for define in args.define:
        name, _, value = define.partition("=")
        runtime.defines[name] = int(value or 1)
    hold(args.set)

    from infero import LLM
    from infero.bench.decode import decode_step

    llm = LLM(args.model, device="cuda")
    forward = decode_step(llm, args.prompt)
    for _ in range(5):
        forward()
    runtime.context().synchronize()  # no warm-up step may still run once the kernels' trace pointers are set
    tracer = Tracer()
    stats: dict = defaultdict(lambda: defaultdict(list))
    resolution, steps, clocks, layers = [], [], [], 0
    for _ in range(args.replays):
        records = tracer.run(forward)
        runs = launches(records)
        names = roles(runs)
        layers = names.count("qkv")
        ghz = sm_clock_ghz(records)
        clocks.append(ghz)
        summarise(runs, names, ghz, stats)
        marks = np.unique(records["t"][records["t"] > 0])
        resolution.append(float(np.diff(marks).min()) if len(marks) > 1 else 0.0)
        steps.append((records["t"][:, -1].max() - records["t"][:, 0].min()) / 1e3)
        print(f"replay: {len(records)} blocks in {len(runs)} launches, first start to last exit {steps[-1]:.1f} us")
    print(f"global timer: smallest step between marks {min(resolution):.0f} ns; SM clock {np.median(clocks):.3f} GHz")
    columns = ("blocks", "early", "start spread", "release", "staging", "staging 1st on SM", "staging later",
               "ready", "stream", "stream, busiest SMs", "stream, others", "epilogue", "summed med", "summed last",
               "last: start", "last: stream", "last: epilogue", "span")  # fmt: skip
    print("| role | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    total = 0.0
    for role in ("qkv", "attention", "merge", "o", "gate+up", "down"):
        s = stats.get(role)
        if not s:
            continue
        cells = []
        for c in columns:
            values = s.get(c)
            if not values:
                cells.append("-")
            elif c == "blocks":
                cells.append(f"{int(np.median(values))}")
            elif c == "early":
                cells.append(f"{100 * np.median(values):.0f}%")
            else:
                cells.append(f"{np.median(values):.2f}")
        total += float(np.median(s["span"]))
        print(f"| {role} | " + " | ".join(cells) + " |")
    print(
        f"layer: sum of spans {total:.2f} us (x {layers} = {layers * total:.0f}); step first start to last exit "
        f"{np.median(steps):.1f} us"
    )


if __name__ == "__main__":
    main()
