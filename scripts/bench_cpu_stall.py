"""How long running streams stall while the server prefills one long prompt (docs/performance.md, "CPU backend").

    .venv/bin/python scripts/bench_cpu_stall.py [--budget N] [--clients 4] [--prompt-tokens 2000]
                                                [--disconnect-after S] [-- extra infero serve flags]

Starts `infero serve --device cpu` on the default model (--max-num-batched-tokens N when given, else the CPU's
default), runs `--clients` greedy streams, and once they all stream sends one completion of about
`--prompt-tokens` tokens. Prints the largest gap between two tokens of any stream before the long prompt, while
it is prefilled (sent -> its first token), and the long prompt's time to first token. With --disconnect-after S
the long prompt's client disconnects S seconds after sending it instead, and the largest gap from one second
after the disconnect on is printed: whether the server went on with the prompt nobody waits for.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from infero.bench.serve import Connection, RequestRecord, make_prompt, parse_url, stream_request

STREAM_TOKENS = 4000  # the streams outlast the measurement (the default model's context is 8,192)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, budget: int | None, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "infero", "serve", "--device", "cpu", "--port", str(port), *extra]
    if budget is not None:
        cmd += ["--max-num-batched-tokens", str(budget)]
    log = tempfile.TemporaryFile("w+")  # a pipe nobody reads would fill with the progress bar and block it
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    log.seek(0)
    raise SystemExit(f"the server did not become ready: {log.read()[-2000:]}")


def max_gap(times: list[float], start: float, stop: float) -> float:
    """The longest wait for a token within [start, stop]: gaps between tokens, the one running at `start` counted
    from its last token before, and a wait still open at `stop` counted up to it."""
    inside = [t for t in times if start < t <= stop]
    before = [t for t in times if t <= start]
    points = before[-1:] + inside + [stop]
    return max(b - a for a, b in zip(points, points[1:], strict=False))


async def measure(url: str, args: argparse.Namespace) -> dict:
    target = parse_url(url)
    path = target.base_path + "/completions"

    def payload(prompt: str, max_tokens: int) -> dict:
        return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip

    records = [RequestRecord(i) for i in range(args.clients)]
    conns = [Connection(target, {}) for _ in range(args.clients + 1)]
    streams = [
        asyncio.create_task(stream_request(c, path, payload(make_prompt(1, i, 16), STREAM_TOKENS), r))
        for i, (c, r) in enumerate(zip(conns, records, strict=False))
    ]
    while min(len(r.chunk_times) for r in records) < 10:
        for task in streams:
            if task.done():
                task.result()  # a stream that failed raises its error here
        await asyncio.sleep(0.1)
    await asyncio.sleep(args.settle)
    long_rec = RequestRecord(args.clients)
    sent = time.perf_counter()
    long = asyncio.create_task(stream_request(conns[-1], path, payload(make_prompt(2, 0, args.prompt_tokens), 1),
                                              long_rec))  # fmt: skip
    result: dict = {"before_ms": 1e3 * max(max_gap(r.chunk_times, 0, sent) for r in records)}
    if args.disconnect_after is None:
        await long
        first = long_rec.t_first
        result["prompt_tokens"] = long_rec.usage_prompt
        result["ttft_s"] = first - sent
        result["during_ms"] = 1e3 * max(max_gap(r.chunk_times, sent, first) for r in records)
    else:
        await asyncio.sleep(args.disconnect_after)
        long.cancel()
        conns[-1].close()
        gone = time.perf_counter()
        await asyncio.sleep(args.after)
        result["after_disconnect_ms"] = 1e3 * max(
            max_gap(r.chunk_times, gone + 1.0, gone + args.after) for r in records
        )
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, long, return_exceptions=True)
    for conn in conns:
        conn.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=None, help="--max-num-batched-tokens (default: the CPU's)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds of streaming before the long prompt")
    parser.add_argument("--disconnect-after", type=float, default=None, metavar="S")
    parser.add_argument("--after", type=float, default=8.0, help="seconds watched after the disconnect")
    args, extra = parser.parse_known_args()
    port = free_port()
    server = start_server(port, args.budget, [a for a in extra if a != "--"])
    try:
        result = asyncio.run(measure(f"http://127.0.0.1:{port}", args))
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:  # still inside a long step
            server.kill()
    budget = args.budget if args.budget is not None else "default"
    load = os.getloadavg()[0]
    print(f"budget {budget}, {args.clients} streams, load {load:.1f}: "
          + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))  # fmt: skip


if __name__ == "__main__":
    main()
