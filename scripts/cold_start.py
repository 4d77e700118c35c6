"""Time to ready of `infero serve` with an empty kernel cache, then with the cache it left (run on the GPU machine).

python scripts/cold_start.py                          # synthesizes llama-3.1-8b Q4_K_M into a temporary folder
python scripts/cold_start.py --model FILE.gguf

Each run starts the server as a user would, with INFERO_CACHE_DIR pointing at a folder that is empty for the first
run, polls GET /health until it answers 200 and stops the server. Prints one row per run: the seconds from starting
the process to /health 200 (imports included) and the ready line's own account. The model file is in the page cache
for both runs (synthesized or read just before), so neither includes reading it cold from disk.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def time_to_ready(model: Path, cache: Path, log: Path) -> tuple[float, str]:
    """Seconds from starting `infero serve` to /health 200, and the ready line's time to ready."""
    port = free_port()
    env = dict(os.environ, INFERO_CACHE_DIR=str(cache))
    command = [sys.executable, "-m", "infero.cli", "serve", "--model", str(model), "--port", str(port)]
    start = time.monotonic()
    with log.open("w") as err:
        server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            while not healthy(f"http://127.0.0.1:{port}/health"):
                if server.poll() is not None:
                    raise SystemExit(f"the server exited with status {server.returncode}:\n{log.read_text()[-3000:]}")
                if time.monotonic() - start > TIMEOUT_S:
                    raise SystemExit(f"not ready after {TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
                time.sleep(0.1)
            seconds = time.monotonic() - start
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    ready = [line for line in log.read_text().splitlines() if line.startswith("ready:")]
    found = re.search(r", in (\d.*)$", ready[-1]) if ready else None
    return seconds, found.group(1) if found else "(no ready line)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF file (default: synthesize llama-3.1-8b Q4_K_M)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        model = Path(args.model) if args.model else work / "llama-3.1-8b-Q4_K_M.gguf"
        if not args.model:
            synth = [sys.executable, "-m", "infero.cli", "synth", "llama-3.1-8b", "--quant", "Q4_K_M", "-o", str(model)]
            subprocess.run(synth, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with model.open("rb") as f:  # into the page cache, so both runs read it alike
            while f.read(1 << 26):
                pass
        rows = [(name, *time_to_ready(model, work / "cache", work / f"{name}.log")) for name in ("cold", "warm")]
    print(f"{model.name}, {len(os.sched_getaffinity(0))} cores")
    print(f"{'cache':<6} {'to /health 200':>14}  ready line")
    for name, seconds, ready in rows:
        print(f"{name:<6} {seconds:>12.1f} s  {ready}")


if __name__ == "__main__":
    main()
