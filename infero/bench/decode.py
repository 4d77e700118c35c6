"""`infero bench decode`: prefill and single-stream decode speed, and how close decode runs to the memory roofline.

roofline fraction = (bytes a decode step must read / measured copy bandwidth) / measured step time
A decode step is timed end to end, one at a time: upload the batch, the forward pass (a CUDA graph replay on the
GPU), the engine's own sampler picking the greedy next token (on the GPU there: the logits never leave it), and
that token back on the host. The engine loop's rate is measured too: one stream through `LLM.stream`, from the
gaps between its tokens, where asynchronous scheduling (CUDA) overlaps each step's host work with the GPU's.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from infero.engine.batch import SequenceStep, build_batch
from infero.engine.sampling import SamplingParams
from infero.errors import InferoError

BLOCK_SIZE = 16  # the benchmarks' KV cache blocks


EXPERT_TENSORS = ("gate_exps", "up_exps", "down_exps")  # a MoE layer's routed experts, [experts, rows, cols]


def decode_step_bytes(model, backend, context_len: int) -> int:
    """Bytes one decode step of one sequence moves: every weight except the embedding table (one row) and the experts
    its token was not routed to (of a MoE layer's expert tensors, the k of E experts it reads), the KV prefix, and a
    hybrid model's recurrent state (read and written)."""
    c = model.config
    total = sum(_weight_bytes(layer, _active_experts(c, layer)) for layer in model.layers)
    total += model.output.nbytes + model.output_norm.nbytes
    total += model.embedding.nbytes // model.config.vocab_size
    total += backend.kv_block_bytes(model.config, 16) // 16 * context_len
    if model.config.is_hybrid:
        total += 2 * backend.state_bytes_per_slot(model.config)
    return total


def _active_experts(config, layer) -> float:
    """The share of a layer's expert tensors a token reads: k of E, or k + 1 of E + 1 where the shared expert is
    folded in as one more expert (Qwen3.5-MoE: its feed-forward then has no shexp_gate)."""
    if not config.num_experts:
        return 1.0
    ffn = getattr(layer, "ffn", None)
    shared = config.shared_expert_intermediate_size > 0
    folded = int(shared and isinstance(ffn, dict) and "shexp_gate" not in ffn)
    return (config.num_experts_used + folded) / (config.num_experts + folded)


def _weight_bytes(weights, active: float = 1.0) -> int:
    """A layer's weights: tensors, or groups of them (a hybrid's mixer, a feed-forward dict), None where absent; expert
    tensors count `active` of their bytes (the experts one token reads)."""
    if weights is None:
        return 0
    if hasattr(weights, "nbytes"):
        return weights.nbytes
    group = weights if isinstance(weights, dict) else vars(weights)
    return sum(round(_weight_bytes(w) * active) if name in EXPERT_TENSORS else _weight_bytes(w, active)
               for name, w in group.items())  # fmt: skip


def run(llm, prompt_len: int = 512, decode_tokens: int = 64, seed: int = 0) -> dict:
    model, backend, block = llm.model, llm.backend, BLOCK_SIZE
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model.config.vocab_size, size=prompt_len).tolist()
    blocks = -(-(prompt_len + decode_tokens + 16) // block)
    cache = backend.allocate_kv_cache(model.config, blocks, block, state_slots(model.config, 1))
    table, slot = list(range(blocks)), state_slot(model.config, 0)
    params = [SamplingParams(temperature=0, max_tokens=decode_tokens + 1, ignore_eos=True)]
    output: list[int] = []

    def forward(tokens: list[int], start: int) -> int:
        step = SequenceStep(tokens, start, table, state_slot=slot)
        logits = backend.forward(model, build_batch([step], block), cache)
        token = llm.engine.sampler.sample(logits, [0], params, [ids], [output])[0].token_id
        output.append(token)
        return token

    def prefill() -> int:  # from position 0: a hybrid model's state starts afresh
        last = prefill_chunks(llm, cache, table, ids, slot)
        return forward(ids[last:], last)

    forward(ids[:16], 0)  # warm-up: kernels compiled and loaded
    prefill()
    prefill_times = []
    for _ in range(3):
        t = time.perf_counter()
        token = prefill()
        prefill_times.append(time.perf_counter() - t)
    prefill_s = float(np.median(prefill_times))
    times = []
    for i in range(decode_tokens):
        t = time.perf_counter()
        token = forward([token], prompt_len + i)
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times[2:] or times))
    step_bytes = decode_step_bytes(model, backend, prompt_len + decode_tokens // 2)
    bandwidth = backend.copy_bandwidth()
    engine_s = engine_token_seconds(llm, ids, decode_tokens)
    return {
        "engine_decode_tok_s": 1.0 / engine_s,
        "engine_ms": engine_s * 1e3,
        "async_scheduling": llm.engine.async_scheduling,
        "prefill_tokens": prompt_len,
        "prefill_tok_s": prompt_len / prefill_s,
        "decode_tok_s": 1.0 / step_s,
        "step_ms": step_s * 1e3,
        "step_bytes": step_bytes,
        "bandwidth_gb_s": bandwidth / 1e9,
        "roofline_fraction": (step_bytes / bandwidth) / step_s,
    }


def state_slots(config, num_seqs: int) -> int:
    """Recurrent-state slots for num_seqs sequences: one each for a hybrid model, none for others."""
    return num_seqs if config.is_hybrid else 0


def state_slot(config, seq: int) -> int:
    return seq if config.is_hybrid else -1


def prefill_chunks(llm, cache, table: list[int], ids: list[int], slot: int = -1) -> int:
    """Run all but the last chunk of the prompt ids (chunks of the engine's max_num_batched_tokens, as the engine
    runs a long prompt; without logits); the start of the last chunk, which the caller runs."""
    chunk = llm.engine.config.max_num_batched_tokens
    last = (len(ids) - 1) // chunk * chunk
    for start in range(0, last, chunk):
        step = SequenceStep(ids[start : start + chunk], start, table, logits="none", state_slot=slot)
        llm.backend.forward(llm.model, build_batch([step], BLOCK_SIZE), cache)
    return last


def engine_token_seconds(llm, prompt_ids: list[int], tokens: int) -> float:
    """Median seconds between the tokens of one greedy stream through the engine's own loop (scheduling, forward,
    sampling, detokenizing), past its first three."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    stamps = [time.perf_counter() for _ in llm.stream(prompt_ids, params)]
    gaps = np.diff(stamps)
    return float(np.median(gaps[2:] if len(gaps) > 2 else gaps))


def graph_step_timer(llm, prompt_len: int = 512, steps: int = 30, batch: int = 1):
    """A function timing the decode step of `batch` sequences on the GPU alone (the engine's graph, CUDA events,
    median of `steps` replays), re-captured on every call so that it runs the launches as the caller has just set
    them. For A/B comparisons inside one process (scripts/ab_step.py): alternate the variants, since the step's time
    drifts by tens of microseconds between measurements."""
    forward = decode_step(llm, prompt_len, batch)
    timer = llm.backend.event_timer()

    def step_us() -> float:
        llm.backend.discard_graphs()
        forward()
        times = []
        for _ in range(steps):
            begin = timer.mark()
            forward()
            times.append(timer.elapsed_us(begin, timer.mark()))
        return float(np.median(times))

    return step_us


def decode_step(llm, prompt_len: int = 512, batch: int = 1):
    """A function running one decode step of `batch` sequences (the same one each call, its graph once captured),
    each after its own prompt_len-token prompt, with nothing on the host around it."""
    model, backend, block = llm.model, llm.backend, BLOCK_SIZE
    blocks = -(-(prompt_len + 64) // block)
    cache = backend.allocate_kv_cache(model.config, blocks * batch, block, state_slots(model.config, batch))
    rng = np.random.default_rng(0)
    steps = []
    for b in range(batch):
        table, slot = list(range(b * blocks, (b + 1) * blocks)), state_slot(model.config, b)
        ids = rng.integers(0, model.config.vocab_size, size=prompt_len + 1).tolist()
        last = prefill_chunks(llm, cache, table, ids[:-1], slot)
        backend.forward(model, build_batch([SequenceStep(ids[last:-1], last, table, state_slot=slot)], block), cache)
        # The same step each call: a hybrid's state moves on each time, which changes no kernel's work.
        steps.append(SequenceStep(ids[-1:], prompt_len, table, state_slot=slot))
    step = build_batch(steps, block)
    return lambda: backend.forward(model, step, cache)


def batched(llm, batch: int, prompt_len: int = 512, steps: int = 16, seed: int = 0) -> float:
    """Median time (s) of a decode step of `batch` sequences, each after its own prompt_len-token prompt: what a
    server's step costs at that many concurrent requests (upload, forward, the engine's sampler picking the batch's
    greedy next tokens and bringing them to the host)."""
    model, backend, block = llm.model, llm.backend, BLOCK_SIZE
    limit = llm.engine.config.max_num_seqs
    if not 1 <= batch <= limit:
        raise InferoError(f"bench decode --batch: {batch} sequences; this engine steps 1 to {limit} (--max-num-seqs)")
    rng = np.random.default_rng(seed)
    per_seq = -(-(prompt_len + steps + 16) // block)
    cache = backend.allocate_kv_cache(model.config, per_seq * batch, block, state_slots(model.config, batch))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    slots = [state_slot(model.config, i) for i in range(batch)]
    prompts = rng.integers(0, model.config.vocab_size, size=(batch, prompt_len)).tolist()
    params = [SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)] * batch
    outputs: list[list[int]] = [[] for _ in range(batch)]

    def sample(logits) -> list[int]:
        results = llm.engine.sampler.sample(logits, list(range(batch)), params, prompts, outputs)
        for out, r in zip(outputs, results, strict=True):
            out.append(r.token_id)
        return [r.token_id for r in results]

    tokens = []
    for prompt, table, slot in zip(prompts, tables, slots, strict=True):
        last = prefill_chunks(llm, cache, table, prompt, slot)
        step = SequenceStep(prompt[last:], last, table, state_slot=slot)
        logits = backend.forward(model, build_batch([step], block), cache)
        tokens.append(int(np.argmax(backend.to_host(logits, 0, 1)[0])))
    times = []
    for i in range(steps):
        t = time.perf_counter()
        steps_ = [SequenceStep([tok], prompt_len + i, table, state_slot=slot)
                  for tok, table, slot in zip(tokens, tables, slots, strict=True)]  # fmt: skip
        tokens = sample(backend.forward(model, build_batch(steps_, block), cache))
        times.append(time.perf_counter() - t)
    return float(np.median(times[2:] or times))


def format_batched(results: list[tuple[int, float]]) -> str:
    lines = [f"{'decode batch':<14} {'ms/step':>9} {'tok/s':>10}"]
    lines += [f"{b:<14} {s * 1e3:>9.3f} {b / s:>10,.1f}" for b, s in results]
    return "\n".join(lines)


def profile(llm, prompt_len: int = 512, steps: int = 16, batch: int = 1) -> tuple[list[tuple[str, float, int]], float]:
    """Where a decode step of `batch` sequences spends its time on the GPU: (op, microseconds per step, calls per
    step), and the step's GPU time as the engine replays it (microseconds, median).

    The step is captured into its own CUDA graph with an event-record node between consecutive ops and replayed,
    so the ops run back to back as in serving and the events time the kernels, not Python's launches (timing
    eager launches measures the host). The event nodes add a little time of their own: compare the ops' sum
    with the step time of the engine's graph, which has none.
    """
    backend, model = llm.backend, llm.model
    if not hasattr(backend, "capture_decode_step"):
        raise ValueError("--profile needs the CUDA backend")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, size=(batch, prompt_len + steps)).tolist()
    blocks = -(-(prompt_len + steps + 16) // BLOCK_SIZE)
    cache = backend.allocate_kv_cache(model.config, blocks * batch, BLOCK_SIZE, state_slots(model.config, batch))
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
    slots = [state_slot(model.config, b) for b in range(batch)]

    def decode_batch(i: int):
        seqs = [SequenceStep([ids[b][prompt_len + i]], prompt_len + i, tables[b], state_slot=slots[b])
                for b in range(batch)]  # fmt: skip
        return build_batch(seqs, BLOCK_SIZE)

    for b in range(batch):
        last = prefill_chunks(llm, cache, tables[b], ids[b][:prompt_len], slots[b])
        step = SequenceStep(ids[b][last:prompt_len], last, tables[b], state_slot=slots[b])
        backend.forward(model, build_batch([step], BLOCK_SIZE), cache)
    backend.forward(model, decode_batch(0), cache)  # the engine's graph for this width, and every kernel loaded
    timer = backend.event_timer(in_graph=True)
    timed = _TimedOps(model.ops, timer)
    model.ops = timed
    try:
        graph, _, upload = backend.capture_decode_step(model, decode_batch(0), cache)
    finally:
        model.ops = timed.ops
    totals, calls, step_us = defaultdict(float), defaultdict(int), []
    outer = backend.event_timer()
    for i in range(steps):
        upload(decode_batch(i))
        graph.replay(backend.stream)
        for label, start, end in timed.marks:
            totals[label] += timer.elapsed_us(start, end)
            calls[label] += 1
        begin = outer.mark()
        backend.forward(model, decode_batch(i), cache)
        step_us.append(outer.elapsed_us(begin, outer.mark()))
    rows = sorted(((k, v / steps, calls[k] // steps) for k, v in totals.items()), key=lambda r: -r[1])
    return rows, float(np.median(step_us))


def prefill_case(llm, prompt_len: int):
    """(batch, cache): one sequence's prompt of prompt_len random ids from position 0, as a single step, over a cache
    of its own (profile_prefill's, scripts/cuda_host_overhead.py's)."""
    backend, config = llm.backend, llm.model.config
    ids = np.random.default_rng(1).integers(0, config.vocab_size, size=prompt_len).tolist()
    blocks = -(-(prompt_len + 16) // BLOCK_SIZE)
    cache = backend.allocate_kv_cache(config, blocks, BLOCK_SIZE, state_slots(config, 1))
    step = SequenceStep(ids, 0, list(range(blocks)), state_slot=state_slot(config, 0))
    return build_batch([step], BLOCK_SIZE), cache


def profile_prefill(llm, prompt_len: int = 512, repeats: int = 3) -> tuple[list[tuple[str, float, int]], float, int]:
    """Where a prompt_len-token prefill (one chunk, eager, as the engine runs a prompt; at most the engine's token
    budget) spends its GPU time: (op, microseconds, calls), the prefill's GPU time without events between its ops
    (median of repeats), and its tokens. Eager launches are timed between events on the stream: the host queues a
    prefill's kernels faster than they run."""
    backend, model = llm.backend, llm.model
    if not hasattr(backend, "event_timer"):
        raise ValueError("--profile needs the CUDA backend")
    prompt_len = min(prompt_len, llm.engine.config.max_num_batched_tokens)
    batch, cache = prefill_case(llm, prompt_len)
    backend.forward(model, batch, cache)  # every kernel loaded
    timer = backend.event_timer()
    totals, calls, whole = defaultdict(float), defaultdict(int), []
    for _ in range(repeats):
        timed = _TimedOps(model.ops, timer)
        model.ops = timed
        try:
            backend.forward(model, batch, cache)
        finally:
            model.ops = timed.ops
        for label, start, end in timed.marks:
            totals[label] += timer.elapsed_us(start, end)
            calls[label] += 1
        begin = timer.mark()
        backend.forward(model, batch, cache)
        whole.append(timer.elapsed_us(begin, timer.mark()))
    rows = sorted(((k, v / repeats, calls[k] // repeats) for k, v in totals.items()), key=lambda r: -r[1])
    return rows, float(np.median(whole)), prompt_len


# Ops that launch nothing on the GPU (a view of columns; fresh states are zeroed at the upload): not profiled.
UNTIMED_OPS = ("columns", "reset_fresh_states")


class _TimedOps:
    """Wraps each op in a pair of CUDA events; labels linear layers by weight type and shape."""

    def __init__(self, ops, timer):
        self.ops, self._timer, self.marks = ops, timer, []

    def __getattr__(self, name):
        fn = getattr(self.ops, name)
        if not callable(fn):
            return fn

        if name in UNTIMED_OPS:
            return fn

        def timed(*args, **kwargs):
            label = name
            if name in ("linear", "linear_add_rms_norm"):
                w = args[1]
                label = f"{name} {_type_name(w)} {w.rows}x{w.cols}"
            elif name in ("linears", "qkv_rotary_store", "swiglu_gate_up"):
                ws = args[1]
                types, rows = "+".join(_type_name(w) for w in ws), "+".join(str(w.rows) for w in ws)
                label = f"{name} {types} {rows}x{ws[0].cols}"
            start = self._timer.mark()
            result = fn(*args, **kwargs)
            self.marks.append((label, start, self._timer.mark()))
            return result

        return timed


def _type_name(weight) -> str:
    from infero.checkpoint.tensor_types import GGMLType

    return GGMLType(weight.ggml_type).name


def format_table(name: str, device: str, r: dict) -> str:
    rows = [
        ("model", name),
        ("device", device),
        (f"prefill {r['prefill_tokens']} tokens", f"{r['prefill_tok_s']:,.1f} tok/s"),
        ("decode, batch 1", f"{r['decode_tok_s']:,.1f} tok/s ({r['step_ms']:.3f} ms/step, median)"),
        (
            "decode, engine loop",
            f"{r['engine_decode_tok_s']:,.1f} tok/s ({r['engine_ms']:.3f} ms/token, median; "
            f"asynchronous scheduling {'on' if r['async_scheduling'] else 'off'})",
        ),
        ("bytes per decode step", f"{r['step_bytes'] / 2**20:,.1f} MiB"),
        ("measured copy bandwidth", f"{r['bandwidth_gb_s']:,.1f} GB/s (read + write)"),
        ("roofline fraction", f"{r['roofline_fraction']:.0%}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_profile(rows: list[tuple[str, float, int]], step_us: float, batch: int = 1,
                   prefill: int = 0) -> str:  # fmt: skip
    """A profile's table: a decode step's of `batch` sequences, or a `prefill`-token prompt's."""
    total = sum(us for _, us, _ in rows)
    title = "op (inside a replayed graph)" if batch == 1 else f"op, {batch} sequences (in a graph)"
    whole = "step on the GPU (graph without events)"
    if prefill:
        title, whole = f"op, prefill of {prefill} tokens (eager)", "prefill on the GPU (without events)"
    width = max([40] + [len(label) for label, _, _ in rows])
    lines = [f"{title:<{width}} {'us/step':>10} {'calls':>6} {'share':>6}"]
    lines += [f"{label:<{width}} {us:>10.1f} {n:>6} {us / total:>6.1%}" for label, us, n in rows]
    lines.append(f"{'sum of the ops':<{width}} {total:>10.1f}")
    lines.append(f"{whole:<{width}} {step_us:>10.1f}")
    return "\n".join(lines)
