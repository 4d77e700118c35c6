"""Mutation fuzzer of infero's model-file load path: GGUF header, ModelConfig, tensor directory, tokenizer.

Each case is the seed (scripts/gguf_fields.py: the default model's header and vocabulary over a 2-layer model)
with one to three mutations, loaded in a forked child the way `infero inspect` loads a file: open the GGUF,
build the ModelConfig, check the tensor shapes, build the tokenizer and encode a text. The child runs under an
address-space limit (RLIMIT_AS) and a deadline. Outcomes:

    ok      the mutated file loads (the mutation was harmless)
    clean   an InferoError with a one-line message of at most MAX_MESSAGE characters
    crash   any other exception, a signal, or an over-long or multi-line message
    hang    no answer within --timeout seconds (the child is killed)
    memory  MemoryError, or a peak RSS above the file size + --memory-allowance MiB

Failing cases are written to --out with their mutation and error. Run it for hours with --seconds; the test suite
runs a few dozen cases with a fixed seed (tests/checkpoint/test_fuzz_gguf.py).

    .venv/bin/python scripts/fuzz_gguf.py --seconds 3600 --jobs 2 --seed 1
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import resource
import select
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # children are forked: no Rust thread pools across a fork

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_fields as g  # noqa: E402

MAX_MESSAGE = 1000
OUTCOMES = ("ok", "clean", "crash", "hang", "memory")
BOUNDARY_INTS = [0, 1, 2, 3, 7, 8, 0x7F, 0x80, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                 2**63 - 1, 2**63, 2**64 - 1, -1, -2, -(2**31), -(2**63)]  # fmt: skip
BOUNDARY_FLOATS = [0.0, -0.0, -1.0, 1.0, 1e-45, 1e30, 1e308, -1e308, math.inf, -math.inf, math.nan]
INT_TYPES = (g.UINT8, g.INT8, g.UINT16, g.INT16, g.UINT32, g.INT32, g.UINT64, g.INT64)
NESTING = [2, 3, 4, 5, 8, 100, 3000]


def fit(value: int, vtype: int) -> int:
    """value wrapped into the range of an integer GGUF type (as its bytes would be)."""
    bits = g.DTYPES[vtype].itemsize * 8
    value &= (1 << bits) - 1
    return value - (1 << bits) if g.DTYPES[vtype].kind == "i" and value >= 1 << (bits - 1) else value


def random_value(rng: random.Random, depth: int = 0) -> g.Value:
    """A value of a random type: boundary numbers, odd strings, arrays (nested a little)."""
    kind = rng.choice(("int", "float", "bool", "str", "array"))
    if kind == "int":
        t = rng.choice(INT_TYPES)
        return g.Value(t, fit(rng.choice(BOUNDARY_INTS), t))
    if kind == "float":
        return g.Value(rng.choice((g.FLOAT32, g.FLOAT64)), rng.choice(BOUNDARY_FLOATS))
    if kind == "bool":
        return g.Value(g.BOOL, rng.random() < 0.5)
    if kind == "str":
        return g.Value(g.STRING, random_string(rng))
    elem = rng.choice((*INT_TYPES, g.FLOAT32, g.STRING, g.ARRAY) if depth < 2 else (g.UINT32, g.STRING))
    n = rng.choice((0, 1, 2, 5, 100))
    if elem == g.STRING:
        return g.Value(g.ARRAY, [random_string(rng) for _ in range(n)], g.STRING)
    if elem == g.ARRAY:
        return g.Value(g.ARRAY, [random_value_array(rng) for _ in range(min(n, 3))], g.ARRAY)
    return g.Value(g.ARRAY, [fit(rng.choice(BOUNDARY_INTS), elem) if elem in INT_TYPES else rng.choice(BOUNDARY_FLOATS)
                             for _ in range(n)], elem)  # fmt: skip


def random_value_array(rng: random.Random) -> g.Value:
    return g.Value(g.ARRAY, [rng.randrange(256) for _ in range(rng.randrange(4))], g.UINT8)


def random_string(rng: random.Random) -> str | bytes:
    return rng.choice(("", " ", "\x00", "a" * rng.choice((1, 100, 100_000)), "<|im_end|>", "\u2581x", "Ġ",
                       b"\xff\xfe\x80", "llama", "gpt2", "none", "yarn", "é" * 7, "\n"))  # fmt: skip


# ---- mutations on fields ----


def nest(value: g.Value, depth: int) -> g.Value:
    for _ in range(depth):
        value = g.Value(g.ARRAY, [value] if value.type == g.ARRAY else [], g.ARRAY)
    return value


def m_swap_type(f: g.GGUFFields, rng: random.Random) -> str:
    key = rng.choice(list(f.metadata))
    f.metadata[key] = random_value(rng)
    return f"{key} := {describe(f.metadata[key])}"


def m_hyperparameter(f: g.GGUFFields, rng: random.Random) -> str:
    arch = f.metadata["general.architecture"].value
    if not isinstance(arch, str):  # an earlier mutation retyped it (maybe to an array nested 3,000 deep)
        arch = "llama"
    keys = [k for k in f.metadata if k.startswith(f"{arch}.") or k.endswith("_token_id")] + [
        f"{arch}.rope.scaling.type", f"{arch}.rope.scaling.factor", f"{arch}.rope.scaling.original_context_length",
        f"{arch}.rope.scale_linear", f"{arch}.attention.key_length", f"{arch}.attention.value_length",
        "general.alignment", "split.tensors.count"]  # fmt: skip
    key = rng.choice(keys)
    if rng.random() < 0.5:
        t = rng.choice(INT_TYPES)
        f.metadata[key] = g.Value(t, fit(rng.choice(BOUNDARY_INTS), t))
    else:
        f.metadata[key] = g.Value(rng.choice((g.FLOAT32, g.FLOAT64)), rng.choice(BOUNDARY_FLOATS))
    if key.endswith("scaling.factor"):
        f.metadata[f"{arch}.rope.scaling.type"] = g.Value(g.STRING, rng.choice(("linear", "yarn", "longrope")))
    return f"{key} := {describe(f.metadata[key])}"


def m_nesting(f: g.GGUFFields, rng: random.Random) -> str:
    key, depth = rng.choice(list(f.metadata)), rng.choice(NESTING)
    f.metadata[key] = nest(g.Value(g.ARRAY, [1], g.UINT8), depth)
    return f"{key} nested {depth} deep"


def m_tokenizer(f: g.GGUFFields, rng: random.Random) -> str:
    key = rng.choice(["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                      "tokenizer.ggml.scores", "tokenizer.ggml.model", "tokenizer.ggml.pre"])  # fmt: skip
    v = f.metadata.get(key)
    edit = rng.choice(("drop", "duplicate", "set", "truncate", "empty", "retype", "remove"))
    if key in ("tokenizer.ggml.model", "tokenizer.ggml.pre") or v is None or v.type != g.ARRAY:
        f.metadata[key] = g.Value(g.STRING, random_string(rng)) if edit != "remove" else None
    elif edit == "remove":
        f.metadata[key] = None
    elif edit == "retype":
        f.metadata[key] = random_value(rng)
    elif edit == "empty":
        f.metadata[key] = g.Value(g.ARRAY, [], v.elem_type)
    else:
        items = list(v.value)
        # Half the edits land on the first ids, where the special tokens are.
        i = rng.randrange(min(len(items), 32) if rng.random() < 0.5 else len(items)) if items else 0
        if edit == "drop" and items:
            del items[i]
        elif edit == "duplicate" and items:
            items.insert(i, items[rng.randrange(len(items))])
        elif edit == "truncate":
            items = items[: rng.randrange(len(items) + 1)]
        elif items:
            if v.elem_type == g.STRING:
                items[i] = random_string(rng)
            elif v.elem_type == g.ARRAY:
                items[i] = random_value_array(rng)
            elif v.elem_type in INT_TYPES:
                items[i] = fit(rng.choice(BOUNDARY_INTS + [5, 6, 4]), v.elem_type)
            else:
                items[i] = rng.choice(BOUNDARY_FLOATS)
        f.metadata[key] = g.Value(g.ARRAY, items, v.elem_type)
        return f"{key}: {edit} at {i}"
    if f.metadata[key] is None:
        del f.metadata[key]
    return f"{key}: {edit}"


def m_tensor(f: g.GGUFFields, rng: random.Random) -> str:
    i = rng.randrange(len(f.tensors))
    t = copy.copy(f.tensors[i])
    what = rng.choice(("dim", "ndims", "type", "name", "duplicate", "drop"))
    if what == "dim" and t.dims:
        t.dims = list(t.dims)
        t.dims[rng.randrange(len(t.dims))] = rng.choice(BOUNDARY_INTS) % 2**64
    elif what == "ndims":
        t.dims = [1] * rng.choice((0, 1, 3, 4, 5, 9))
    elif what == "type":
        t.ggml_type = rng.choice((1, 2, 4, 5, 12, 14, 30, 31, 39, 40, 2**31))
    elif what == "name":
        t.name = rng.choice((f.tensors[0].name, "", "blk.99.attn_q.weight", "output.weight", "x" * 1000))
    elif what == "duplicate":
        f.tensors.insert(i, t)
        return f"tensor {t.name}: duplicated"
    else:
        del f.tensors[i]
        return f"tensor {t.name}: dropped"
    f.tensors[i] = t
    return f"tensor {f.tensors[i].name[:40]}: {what} -> {t.dims} type {t.ggml_type}"


FIELD_MUTATIONS = (m_swap_type, m_hyperparameter, m_nesting, m_tokenizer, m_tensor)


# ---- mutations on bytes ----


def b_bitflip(data: bytearray, header_end: int, slots, rng: random.Random) -> str:
    end = max(header_end if rng.random() < 0.8 else len(data), 1)
    if not data:
        return "no bytes to flip"
    flips = [rng.randrange(end * 8) for _ in range(rng.choice((1, 1, 2, 4)))]
    for bit in flips:
        data[bit // 8] ^= 1 << (bit % 8)
    return f"bit flips {flips}"


def b_boundary(data: bytearray, header_end: int, slots, rng: random.Random) -> str:
    offset, width = (
        rng.choice(slots) if rng.random() < 0.8 else (rng.randrange(max(header_end, 1)), rng.choice((1, 4, 8)))
    )
    value = rng.choice(BOUNDARY_INTS) % (1 << (8 * width))
    data[offset : offset + width] = value.to_bytes(width, "little")
    return f"bytes {offset}..{offset + width} := {value:#x}"


def b_truncate(data: bytearray, header_end: int, slots, rng: random.Random) -> str:
    in_header = rng.random() < 0.7 or header_end >= len(data)
    cut = rng.randrange(max(header_end, 1)) if in_header else rng.randrange(header_end, len(data))
    del data[cut:]
    return f"truncated at {cut}"


BYTE_MUTATIONS = (b_bitflip, b_boundary, b_boundary, b_truncate)


def describe(v: g.Value) -> str:
    text = repr(v.value) if not isinstance(v.value, list) else f"[{len(v.value)} items]"
    return f"type {v.type} {text[:60]}"


class Mutator:
    def __init__(self, seed_fields: g.GGUFFields):
        self.fields = seed_fields
        self.slots: list[tuple[int, int]] = []
        self.data = g.serialize(seed_fields, self.slots)
        self.header_end = self.slots[-1][0] + 8

    def case(self, rng: random.Random) -> tuple[bytes, list[str]]:
        """One mutated file and the mutations applied, each as a line."""
        steps = []
        if rng.random() < 0.5:
            f = copy.copy(self.fields)
            f.metadata, f.tensors = dict(f.metadata), list(f.tensors)
            for _ in range(rng.choice((1, 1, 2))):
                steps.append(rng.choice(FIELD_MUTATIONS)(f, rng))
            slots: list[tuple[int, int]] = []
            data = bytearray(g.serialize(f, slots))
            header_end = slots[-1][0] + 8 if slots else 24
        else:
            data, slots, header_end = bytearray(self.data), self.slots, self.header_end
        if not steps or rng.random() < 0.3:
            for _ in range(rng.choice((1, 1, 2, 3))):
                steps.append(rng.choice(BYTE_MUTATIONS)(data, min(header_end, len(data)), slots, rng))
        return bytes(data), steps


# ---- running cases ----

TEXT = "Hello, world! <|im_start|>user\n12345 ünïcödé 😀<|im_end|>"


def load(path: str) -> None:
    """What `infero inspect` does with a file, plus an encode and a decode."""
    from infero.checkpoint import load_checkpoint
    from infero.tokenizer import Tokenizer

    ckpt = load_checkpoint(path)
    tok = Tokenizer.from_gguf_metadata(ckpt.metadata)
    tok.decode(tok.encode(TEXT))


def child(path: str, limit: int, write_fd: int) -> None:
    """Run one case; report {"outcome", "error", "rss"} on write_fd. Never returns."""
    from infero.errors import InferoError

    for sig in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C or a kill of the group stops the campaign, not this case
        signal.signal(sig, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        load(path)
        result = {"outcome": "ok", "error": None}
    except InferoError as e:
        message = str(e)
        short = len(message) <= MAX_MESSAGE and "\n" not in message
        result = {"outcome": "clean" if short else "crash", "error": f"{type(e).__name__}: {message[:300]}"}
    except MemoryError:
        result = {"outcome": "memory", "error": "MemoryError"}
    except BaseException as e:  # noqa: BLE001 (everything that is not an InferoError is the finding)
        tb = traceback.format_exception(e)
        result = {"outcome": "crash", "error": "".join(tb)[-2000:]}
    result["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    os.write(write_fd, json.dumps(result).encode())
    os._exit(0)


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


class Runner:
    """Forks one child per case, up to `jobs` at a time, and classifies each."""

    def __init__(self, jobs: int, timeout: float, allowance: int, workdir: Path):
        self.jobs, self.timeout, self.allowance, self.workdir = jobs, timeout, allowance, workdir
        self.running: dict[int, tuple] = {}  # pid -> (read fd, start, path, case)
        self.base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def start(self, data: bytes, case) -> None:
        lane = next(i for i in range(self.jobs) if all(c[2] != self._path(i) for c in self.running.values()))
        path = self._path(lane)
        path.write_bytes(data)
        limit = vm_size() + len(data) + self.allowance
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            child(str(path), limit, w)
        os.close(w)
        self.running[pid] = (r, time.monotonic(), path, case, len(data))

    def _path(self, lane: int) -> Path:
        return self.workdir / f"case-{lane}.gguf"

    def wait_one(self) -> list[tuple[object, dict]]:
        """Block until at least one child is done (or past its deadline); their (case, result)."""
        done = []
        while not done:
            fds = {v[0]: pid for pid, v in self.running.items()}
            now = time.monotonic()
            wait = max(0.0, min(v[1] + self.timeout - now for v in self.running.values()))
            ready, _, _ = select.select(list(fds), [], [], wait)
            now = time.monotonic()
            for pid, (fd, start, _, case, size) in list(self.running.items()):
                if fd in ready:
                    result = self._finish(pid, fd, size)
                elif now - start > self.timeout:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    os.close(fd)
                    result = {"outcome": "hang", "error": f"no answer in {self.timeout} s", "rss": 0}
                else:
                    continue
                del self.running[pid]
                done.append((case, result))
        return done

    def _finish(self, pid: int, fd: int, size: int) -> dict:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        os.close(fd)
        _, status = os.waitpid(pid, 0)
        if not chunks:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            return {"outcome": "crash", "error": f"child died (signal {sig}, status {status})", "rss": 0}
        result = json.loads(b"".join(chunks))
        if result["outcome"] in ("ok", "clean") and result["rss"] - self.base_rss > size + self.allowance:
            result["outcome"], result["error"] = "memory", f"peak RSS {result['rss']:,} bytes"
        return result


def build_seed(vocab_size: int | None) -> g.GGUFFields:
    from infero.default_model import default_model_path

    seed = g.tiny_seed(default_model_path())
    if vocab_size is not None:
        g.cut_vocabulary(seed, vocab_size)
    return seed


def run(cases: int | None, seconds: float | None, seed: int, jobs: int, timeout: float, allowance_mib: int,
        out: Path | None, vocab_size: int | None, report_every: float = 60.0) -> dict:  # fmt: skip
    """Run the campaign; the summary: counts per outcome, cases/s, peak RSS above the parent's, failures."""
    rng = random.Random(seed)
    mutator = Mutator(build_seed(vocab_size))
    import infero.checkpoint  # noqa: F401 (imported once here, not in every forked child)
    import infero.tokenizer  # noqa: F401

    counts = dict.fromkeys(OUTCOMES, 0)
    failures, peak = [], 0
    started = last_report = time.monotonic()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        runner = Runner(jobs, timeout, allowance_mib << 20, Path(tmp))
        n, stop = 0, []
        for sig in (signal.SIGINT, signal.SIGTERM):  # stop starting cases; the running ones finish, then the summary
            signal.signal(sig, lambda *_: stop.append(True))
        while True:
            more = (cases is None or n < cases) and (seconds is None or time.monotonic() - started < seconds)
            more = more and not stop
            if more and len(runner.running) < jobs:
                data, steps = mutator.case(rng)
                runner.start(data, (n, steps, data))
                n += 1
                continue
            if not runner.running:
                break
            for (index, steps, data), result in runner.wait_one():
                counts[result["outcome"]] += 1
                peak = max(peak, result["rss"])
                if result["outcome"] in ("crash", "hang", "memory"):
                    failures.append({"case": index, "outcome": result["outcome"], "mutations": steps,
                                     "error": result["error"]})  # fmt: skip
                    if out is not None:
                        out.mkdir(parents=True, exist_ok=True)
                        (out / f"case-{index}.gguf").write_bytes(data)
                        (out / f"case-{index}.json").write_text(json.dumps(failures[-1], indent=1))
            if time.monotonic() - last_report > report_every:
                last_report = time.monotonic()
                rate = sum(counts.values()) / (last_report - started)
                print(f"{sum(counts.values()):,} cases, {rate:.1f}/s, {counts}", file=sys.stderr, flush=True)
    elapsed = time.monotonic() - started
    total = sum(counts.values())
    return {"cases": total, "seconds": round(elapsed, 1), "cases_per_second": round(total / elapsed, 2),
            "counts": counts, "peak_child_rss_bytes": peak, "parent_rss_bytes": runner.base_rss,
            "seed": seed, "vocab_size": vocab_size, "failures": failures[:50]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, help="stop after this many cases")
    ap.add_argument("--seconds", type=float, help="stop after this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="cases run at once (one child each)")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds before a case is a hang")
    ap.add_argument("--memory-allowance", type=int, default=512, help="MiB a case may use beyond the file's size")
    ap.add_argument("--vocab-size", type=int, help="cut the seed's vocabulary to this many tokens (faster cases)")
    ap.add_argument("--out", type=Path, help="where failing cases are written")
    ap.add_argument("--report-every", type=float, default=60.0, help="seconds between progress lines")
    args = ap.parse_args()
    if args.cases is None and args.seconds is None:
        ap.error("give --cases or --seconds")
    summary = run(args.cases, args.seconds, args.seed, args.jobs, args.timeout, args.memory_allowance, args.out,
                  args.vocab_size, args.report_every)  # fmt: skip
    print(json.dumps(summary, indent=1))
    return 0 if not summary["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
