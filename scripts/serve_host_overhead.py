"""What the serving stack adds per generated token, without a GPU: `infero serve`'s app on uvicorn, with the
backend's forward pass replaced by a sleep of a fixed step time (as a GPU step would block the engine thread,
without the GIL) and the sampler by a constant, driven by `infero bench serve`.

    python scripts/serve_host_overhead.py [--step-ms 3.0] [--clients 1,8] [--duration 8]

At 1 client a perfect server streams 1000 / step-ms tokens per second; the shortfall is the engine loop's own
work (scheduler, batch, detokenizing), the hand-off to the event loop, SSE framing and HTTP, plus the prefill
of each request's prompt (one extra step per request here).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

from infero.engine.sampling import SampleResult


class ConstantSampler:
    def sample(self, logits, rows, params, *args, **kwargs):
        return [SampleResult(100 + i % 50, None, None) for i in range(len(rows))]


def main() -> None:
    import uvicorn

    from infero.llm import LLM
    from infero.server.app import ServerSettings, create_app
    from infero.server.serve import listen_socket

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=3.0)
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--duration", type=float, default=8)
    parser.add_argument("--port", type=int, default=8329)
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval for the server process (s)")
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    def load():
        llm = LLM(None, device="cpu")
        vocab = llm.config.vocab_size

        def forward(model, batch, cache):
            time.sleep(args.step_ms / 1e3)
            return np.zeros((len(batch.logits_indices), vocab), np.float32)

        llm.backend.forward = forward
        llm.engine.sampler = ConstantSampler()
        return llm

    app = create_app(load, ServerSettings("stub"))
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    sock = listen_socket("127.0.0.1", args.port)
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    url = f"http://127.0.0.1:{args.port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except Exception:
            time.sleep(0.2)
    print(f"stub step {args.step_ms} ms: ideal {1000 / args.step_ms:,.1f} tok/s per stream")
    for clients in args.clients.split(","):
        subprocess.run([sys.executable, "-m", "infero", "bench", "serve", "--url", url, "--clients", clients,
                        "--max-tokens", "200", "--duration", str(args.duration)], check=True)  # fmt: skip
    server.should_exit = True


if __name__ == "__main__":
    main()
