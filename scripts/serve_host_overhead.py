"""What the serving stack adds per generated token, without a GPU: `infero serve`'s app on uvicorn, with the
backend's forward pass and sampler replaced by a stand-in device that takes a fixed time per step (steps run one
after another, each from the later of its launch and the previous one's end; reading a step's tokens waits for
its end, without the GIL, as a GPU step would), driven by `infero bench serve`.

    python scripts/serve_host_overhead.py [--step-ms 3.0] [--clients 1,8] [--duration 8] [--async-scheduling off]

At 1 client a perfect server streams 1000 / step-ms tokens per second; the shortfall is the engine loop's own
work (scheduler, batch, detokenizing), the hand-off to the event loop, SSE framing and HTTP, plus the prefill
of each request's prompt (one extra step per request here). With asynchronous scheduling (on by default here,
as on the GPU) the host's work for a step overlaps the device's previous step, so only what exceeds a step shows.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

from infero.engine.sampling import SampledTokens, SampleResult


class StubDevice:
    """Steps that each take `step_s`, one after another: a step ends step_s after the later of its launch and the
    end of the step before it."""

    def __init__(self, step_s: float):
        self.step_s, self.free_at = step_s, 0.0

    def launch(self) -> None:
        self.free_at = max(time.perf_counter(), self.free_at) + self.step_s


class StubSampled(SampledTokens):
    """Constant tokens, readable once the device has finished the step that sampled them."""

    def __init__(self, results: list[SampleResult], done_at: float):
        super().__init__(results)
        self.done_at = done_at

    def results(self) -> list[SampleResult]:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return self._results


class StubSampler:
    def __init__(self, device: StubDevice):
        self.device = device

    def sample(self, logits, rows, *args, **kwargs):
        return self.launch(logits, rows).results()

    def launch(self, logits, rows, *args, **kwargs) -> StubSampled:
        return StubSampled([SampleResult(100 + i % 50, None, None) for i in range(len(rows))], self.device.free_at)


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
    parser.add_argument("--async-scheduling", choices=("on", "off"), default="on")
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    def load():
        llm = LLM(None, device="cpu")
        vocab, device = llm.config.vocab_size, StubDevice(args.step_ms / 1e3)

        def forward(model, batch, cache, feed=None):
            device.launch()
            return np.zeros((len(batch.logits_indices), vocab), np.float32)

        llm.backend.forward = forward
        llm.engine.sampler = StubSampler(device)
        llm.engine.async_scheduling = args.async_scheduling == "on"
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
    print(f"stub step {args.step_ms} ms, asynchronous scheduling {args.async_scheduling}: ideal "
          f"{1000 / args.step_ms:,.1f} tok/s per stream")  # fmt: skip
    for clients in args.clients.split(","):
        subprocess.run([sys.executable, "-m", "infero", "bench", "serve", "--url", url, "--clients", clients,
                        "--max-tokens", "200", "--duration", str(args.duration)], check=True)  # fmt: skip
    server.should_exit = True


if __name__ == "__main__":
    main()
