"""Where a kernel's warps wait, from Nsight Compute's per-instruction samples (GPU machine, where ncu reads counters).

    ncu --clock-control none --section WarpStateStats --section SourceCounters -k regex:matvec_q \\
        --launch-skip 3 --launch-count 1 --page source --csv --print-source sass \\
        python3 scripts/bench_matvec.py --once --shapes 8b --types Q4_K > stalls.csv
    python scripts/ncu_stalls.py stalls.csv [--top 12] [--before 12]

Prints each stall reason's share of the samples, then the most-sampled SASS instructions with their reasons and
the instructions before each: a sample names the instruction that waits, and what it waits for (a load's register,
usually) is found a few lines up. (Above: the 4th matvec_q launch of that run, Q4_K 4096x14336.)
"""

from __future__ import annotations

import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def read(path: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Each profiled launch's (kernel name, source page header, instruction rows): ncu prints its log lines, then a
    "Kernel Name" line and a table for each launch (--launch-count N gives N)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    starts = [i for i, row in enumerate(rows) if SAMPLES in row and "Source" in row]
    if not starts:
        raise SystemExit(f"{path}: no '{SAMPLES}' column; was ncu run with --page source --csv and SourceCounters?")
    tables = []
    for start, end in zip(starts, starts[1:] + [len(rows)], strict=True):
        name = next((row[1] for row in reversed(rows[:start]) if len(row) > 1 and row[0] == "Kernel Name"), "?")
        header = rows[start]
        tables.append((name, header, [row for row in rows[start + 1 : end] if len(row) == len(header)]))
    return tables


def number(text: str) -> float:
    return float(text.replace(",", "") or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--before", type=int, default=12, help="instructions shown before each top one")
    args = parser.parse_args()
    for name, header, rows in read(args.csv):
        print(f"=== {name}")
        report(header, rows, args.top, args.before)


def report(header: list[str], rows: list[list[str]], top: int, before: int) -> None:
    col = {name: i for i, name in enumerate(header)}
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    totals = {r: sum(number(row[col[r]]) for row in rows) for r in reasons}
    everything = sum(totals.values()) or 1.0
    print(f"{len(rows)} instructions, {everything:.0f} samples; by reason:")
    for reason, total in sorted(totals.items(), key=lambda item: -item[1]):
        if total:
            print(f"  {reason[len('stall_') :]:<20} {100 * total / everything:5.1f}%")
    source = [row[col["Source"]].strip() for row in rows]
    ranked = sorted(range(len(rows)), key=lambda i: -number(rows[i][col[SAMPLES]]))[:top]
    for i in ranked:
        share = 100 * number(rows[i][col[SAMPLES]]) / everything
        why = ", ".join(f"{r[len('stall_') :]} {rows[i][col[r]]}" for r in reasons if number(rows[i][col[r]]))
        print(f"\n{share:5.1f}%  [{i}] {source[i]}   ({why})")
        for j in range(max(0, i - before), i):
            print(f"         [{j}] {source[j]}")


if __name__ == "__main__":
    main()
