"""The CUDA backend: weights in their GGUF encoding on the GPU, fp16 paged KV cache, our kernels, CUDA graphs.

A step uploads the batch's integer arrays in one copy into fixed device buffers, resets the workspace and
runs the model's forward pass. Decode steps (every sequence adds one token) are captured once per padded
batch size into a CUDA graph and replayed; mixed and prefill steps run eagerly. A hybrid model's sequences that
start at position 0 get their recurrent state zeroed at the upload, outside any graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infero.backends.cuda import delta_net, delta_rule_chunked, driver, embedding, runtime
from infero.backends.cuda import sampling as _sampling  # noqa: F401  (declares its kernels before compile_kernels)
from infero.backends.cuda.compiler import cache_dir as compiler_cache_dir
from infero.backends.cuda.compiler import compile_parallel
from infero.backends.cuda.ops import CudaHybridCache, CudaKVCache, CudaOps
from infero.backends.cuda.tensor import DeviceTensor, Workspace, empty
from infero.checkpoint.config import ModelConfig
from infero.engine.batch import Batch, SequenceStep, TokenFeed, build_batch
from infero.errors import InferoError

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class DeviceBatch:
    """A Batch whose arrays live on the GPU, plus the host-side sizes kernels are launched with."""

    token_ids: DeviceTensor
    positions: DeviceTensor
    slot_mapping: DeviceTensor
    logits_indices: DeviceTensor
    block_tables: DeviceTensor
    context_lens: DeviceTensor
    query_starts: DeviceTensor
    state_slots: DeviceTensor  # int32 [num_seqs]: recurrent-state slots (hybrid models; padded rows: the spare)
    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_context_len: int
    num_decode_seqs: int  # sequences with exactly one new token
    # Whole 64-position chunks the sequences' tokens fill (hybrid models): the delta rule launches its chunked
    # kernel only where there is one, so a decode step stays one recurrent launch.
    num_whole_chunks: int


class CudaBackend:
    name = "cuda"
    # The engine queues step k + 1 (its input tokens read from step k's sampling on the device) before it reads
    # step k's tokens, so the host's work between steps overlaps the GPU's (asynchronous scheduling).
    overlaps_steps = True
    # The engine's budget before the CPU got its own (b3a2e05): a whole 2,048-token chunk in one step.
    default_max_num_batched_tokens = 2048

    def __init__(self):
        self.ctx = runtime.context()
        self.stream = runtime.stream()
        self.weights_arena = driver.Arena()
        self.ops = CudaOps(self)
        self.workspace: Workspace | None = None
        self.use_graphs = True
        self._batch_invariant = False
        self._graphs: dict[tuple[int, int], tuple[driver.Graph, DeviceTensor]] = {}  # (bucket, id(cache))
        self.kernel_status = ""
        self.startup_seconds: dict[str, float] = {}  # the parts of the time to ready spent here: compile, graphs

    @property
    def batch_invariant(self) -> bool:
        """CudaOps.invariant: every row of a linear layer the same bits at every width (docs/kernels.md); set before
        the model loads (it sizes the workspace and picks the kernels to compile)."""
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._batch_invariant = bool(on)

    def compile_kernels(self, checkpoint) -> None:
        """Compile the kernels this checkpoint's model runs (its weight types, its head dim) for this GPU where the
        disk cache lacks them, one unit a core at a time, with a progress bar."""
        import sys
        import time

        from infero.progress import Progress

        start, arch = time.monotonic(), self.ctx.info.arch
        jobs, cached = runtime.uncompiled(arch, runtime.checkpoint_needs(checkpoint))
        # The other mode's linear kernels wait until a launch asks for them (runtime.kernel compiles on first use).
        other_mode = ("skinny_gemm.cu", "gemm.cu") if self._batch_invariant else ("linear_mma.cu",)
        jobs = [job for job in jobs if job.filename not in other_mode]
        if jobs:
            bar = Progress(f"compiling kernels for {arch}", len(jobs), unit="units")
            compile_parallel(jobs, arch, runtime.defines or None, progress=lambda job: bar(1))
            bar.close()
            print(f"infero: compiled {len(jobs)} kernel units for {arch} in {time.monotonic() - start:.0f} s "
                  f"(cached in {compiler_cache_dir()})", file=sys.stderr)  # fmt: skip
        self.kernel_status = f"kernels {arch}: {cached} units cached, {len(jobs)} compiled"
        self.startup_seconds["compile"] = time.monotonic() - start

    # --- sizing -------------------------------------------------------------------------------------------
    def kv_block_bytes(self, config: ModelConfig, block_size: int) -> int:
        """A block's fp16 K and V of every layer that keeps them (a hybrid model's full-attention layers only)."""
        layers = config.num_layers - config.num_recurrent_layers
        return 2 * layers * block_size * config.num_kv_heads * config.head_dim * 2

    def state_bytes_per_slot(self, config: ModelConfig) -> int:
        """One sequence's float32 recurrent state (a hybrid model's Gated DeltaNet layers); 0 for other models."""
        if not config.is_hybrid:
            return 0
        return 4 * sum(int(np.prod(shape[1:])) for shape in CudaHybridCache.state_shapes(config, 1))

    def prepare(self, config: ModelConfig, engine_config) -> None:
        """Allocate the step's fixed buffers: workspace and batch arrays, sized for the largest step."""
        t = engine_config.max_num_batched_tokens
        s = max(engine_config.max_num_seqs, GRAPH_BUCKETS[0])
        # Every activation of a forward pass is carved afresh (the workspace resets per step, not per layer), so
        # the budget is the sum over layers; plus the logits (prompt logprobs may want every row of a chunk) and
        # kernels' scratch (fp16/int8 copies of activations, attention split partials; the expert pairs' buffers and
        # the chunked delta rule's records, each handed back within its op, so never both at once).
        widest = max(config.hidden_size, config.q_size, config.intermediate_size)
        activations = t * (4 * _layer_floats(config) * config.num_layers + 8 * config.hidden_size + 2 * widest)
        if self._batch_invariant:  # past 16 rows each linear's input is quantized into the workspace too: at most
            activations += activations * 5 // 8  # one copy of 2.5 bytes an element per float activation counted
        logits = 4 * t * config.vocab_size
        scratch = max(_moe_scratch_bytes(config, t), _delta_scratch_bytes(config, t))
        self.workspace = Workspace(activations + logits + scratch + (256 << 20))
        self.ops.prepare(config)
        max_len = engine_config.max_model_len or config.context_length
        self.max_blocks_per_seq = -(-min(max_len, config.context_length) // engine_config.block_size) + 1
        self.max_seqs, self.max_tokens = max(s, max(b for b in GRAPH_BUCKETS if b <= max(s, 1))), max(t, s)
        self._vocab_size = config.vocab_size
        self._layout = _BatchLayout(self.max_tokens, self.max_seqs + 1, self.max_blocks_per_seq)
        self._batch_memory = empty((self._layout.nbytes,), np.uint8)
        self._staging = driver.PinnedBuffer(self._layout.nbytes)
        self._staging_free = driver.Event(timing=False)  # recorded after each upload's copy
        self._staging_free.record(self.stream)

    def kv_cache_bytes(self, engine_config) -> int:
        free, total = self.ctx.memory_info()
        if engine_config.kv_cache_bytes is not None:  # an explicit budget, as far as free memory goes
            return min(engine_config.kv_cache_bytes, free)
        reserve = total * (1.0 - engine_config.gpu_memory_utilization)
        return max(0, int(free - reserve))

    def allocate_kv_cache(
        self, config: ModelConfig, num_blocks: int, block_size: int, num_state_slots: int = 0
    ) -> CudaKVCache:
        """fp16 KV blocks of every layer that keeps them, and for a hybrid model the float32 recurrent state of
        num_state_slots sequences beside them (layout: CudaHybridCache)."""
        # One extra block at the end (and one extra state slot): padded rows of a graph-replayed decode step write
        # there.
        shape = (num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        layers = config.num_layers - config.num_recurrent_layers
        k = [empty(shape, np.float16) for _ in range(layers)]
        v = [empty(shape, np.float16) for _ in range(layers)]
        state = []
        if config.is_hybrid:
            state = [empty(s, np.float32) for s in CudaHybridCache.state_shapes(config, num_state_slots + 1)]
        for t in k + v + state:
            driver.memset_d8(t.ptr, 0, t.nbytes, self.stream)
        self._graphs.clear()
        if config.is_hybrid:
            return CudaHybridCache(k, v, block_size, num_blocks, *state)
        return CudaKVCache(k, v, block_size, num_blocks)

    def capture_graphs(self, model, cache: CudaKVCache) -> None:
        """Capture the decode graph of every batch bucket up to max_seqs before serving, not at the first decode step
        of each width (_graph)."""
        import time

        start = time.monotonic()
        if self.use_graphs:
            self.ctx.make_current()
            for bucket in (b for b in GRAPH_BUCKETS if b <= self.max_seqs):
                self._graph(model, cache, bucket)
            self.stream.synchronize()
        self.startup_seconds["graphs"] = time.monotonic() - start

    def discard_graphs(self) -> None:
        """Forget the captured decode-step graphs: the next decode step of each width captures anew, with the
        launch choices as they now stand (benchmarks comparing variants)."""
        self._graphs.clear()

    # --- a step ---------------------------------------------------------------------------------------
    def forward(self, model, batch: Batch, cache: CudaKVCache, feed: TokenFeed | None = None) -> DeviceTensor:
        """The step's logits rows (float32 [len(batch.logits_indices), vocab], on the device). feed: input tokens
        that come from the sampling queued before this step, read there on the device."""
        # The engine may step on another thread than the one that loaded the model (the server's engine thread):
        # a CUDA context is current per thread.
        self.ctx.make_current()
        if feed is not None and feed.sampled.device_tokens is None:  # sampled on the host: known already
            batch, feed = feed.resolve(batch), None
        decode = (
            batch.num_seqs > 0 and batch.num_tokens == batch.num_seqs and len(batch.logits_indices) == batch.num_seqs
        )
        bucket = next((b for b in GRAPH_BUCKETS if b >= batch.num_seqs), None)
        if self.use_graphs and decode and bucket is not None and bucket <= self.max_seqs:
            return self._replay(model, batch, cache, bucket, feed)
        device_batch = self._upload(batch, cache, pad_to=None, feed=feed)
        self.workspace.reset()
        return model.forward(device_batch, cache)

    def _replay(self, model, batch: Batch, cache: CudaKVCache, bucket: int, feed: TokenFeed | None) -> DeviceTensor:
        graph, logits = self._graph(model, cache, bucket)
        self._upload(batch, cache, pad_to=bucket, feed=feed)
        graph.replay(self.stream)
        return logits.rows(0, batch.num_seqs)

    def _graph(self, model, cache: CudaKVCache, bucket: int) -> tuple[driver.Graph, DeviceTensor]:
        """The decode graph of this width over this cache (a graph holds its cache's addresses: a benchmark may run
        a second cache), captured on first use. Its warm-up forward (which compiles and loads every kernel outside
        the capture) runs padding rows, which read and write only the block and state slot allocate_kv_cache
        reserved: on the step's own rows it would advance a hybrid model's recurrent state once more than the
        replay does."""
        key = (bucket, id(cache))
        entry = self._graphs.get(key)
        if entry is None:
            padding = [SequenceStep([0], 0, [cache.num_blocks], state_slot=_spare_slot(cache))] * bucket
            device_batch = self._upload(build_batch(padding, cache.block_size), cache, pad_to=bucket)
            self.workspace.reset()
            model.forward(device_batch, cache)
            entry = self._graphs[key] = self._capture(model, device_batch, cache)
        return entry

    def _capture(self, model, device_batch: DeviceBatch, cache: CudaKVCache) -> tuple[driver.Graph, DeviceTensor]:
        self.workspace.reset()
        holder = {}
        graph = driver.Graph(self.stream, lambda: holder.setdefault("logits", model.forward(device_batch, cache)))
        return graph, holder["logits"]

    def capture_decode_step(self, model, batch: Batch, cache: CudaKVCache):
        """A decode step captured as a fresh graph (not the engine's), and a function that uploads the next
        decode batch of the same width into the graph's buffers: for profiling inside a graph."""
        bucket = next(b for b in GRAPH_BUCKETS if b >= batch.num_seqs)
        graph, logits = self._capture(model, self._upload(batch, cache, pad_to=bucket), cache)
        return graph, logits, lambda next_batch: self._upload(next_batch, cache, pad_to=bucket)

    def _upload(self, batch: Batch, cache: CudaKVCache, pad_to: int | None, feed: TokenFeed | None = None
                ) -> DeviceBatch:  # fmt: skip
        """Pack the batch's arrays into pinned memory and copy them to the device in one transfer; then write the
        fed tokens into token_ids on the device."""
        n, s = batch.num_tokens, batch.num_seqs
        rows = pad_to or s
        tokens = pad_to or n
        dummy_block = cache.num_blocks  # the extra block allocate_kv_cache reserved
        spare_slot = _spare_slot(cache)  # and the extra state slot (-1: no recurrent state)
        lay, host = self._layout, self._staging.array
        if tokens > lay.max_tokens or rows > lay.max_rows or batch.block_tables.shape[1] > lay.max_blocks:
            # Past these the arrays would overrun each other in the staging buffer (and the workspace, sized alike).
            raise InferoError(
                f"a step of {n} tokens of {s} sequences ({batch.block_tables.shape[1]} cache blocks each) is larger "
                f"than the engine was sized for: {lay.max_tokens} tokens (max_num_batched_tokens), {lay.max_rows} "
                f"sequences, {lay.max_blocks} blocks (the context length); run a longer prompt in chunks"
            )
        # The previous step's copy may still be queued behind its predecessor's kernels: wait until the GPU has
        # read the pinned buffer before overwriting it (steps without sampling never synchronize otherwise).
        self._staging_free.synchronize()
        tables = np.full((rows, lay.max_blocks), dummy_block, np.int32)
        used = batch.block_tables.shape[1]
        tables[:s, :used] = np.where(batch.block_tables >= 0, batch.block_tables, dummy_block)
        fields = {
            "token_ids": _padded(batch.token_ids, tokens, 0, np.int32),
            "positions": _padded(batch.positions, tokens, 0, np.int32),
            "slot_mapping": _padded(batch.slot_mapping, tokens, dummy_block * cache.block_size, np.int64),
            "logits_indices": _padded(batch.logits_indices, rows if pad_to else len(batch.logits_indices),
                                      0, np.int32, fill_range=True),
            "context_lens": _padded(batch.context_lens, rows, 1, np.int32),
            "query_starts": np.concatenate([batch.query_starts, np.arange(n + 1, n + 1 + rows - s)]).astype(np.int32),
            "state_slots": _padded(batch.state_slots, rows, spare_slot, np.int32),
            "block_tables": tables,
        }  # fmt: skip
        if spare_slot >= 0:
            fresh = batch.state_slots[batch.context_lens == batch.query_lens]
            if (batch.state_slots < 0).any():  # the delta-net kernels would answer a slotless sequence with NaN
                raise ValueError("every sequence of a hybrid model's batch needs a recurrent-state slot")
            fields["fresh_slots"] = fresh.astype(np.int32)
        if feed is not None:  # read by feed_tokens only
            fields["feed_rows"] = _padded(feed.rows, tokens, -1, np.int32)
        views = {}
        for name, array in fields.items():
            offset = lay.offsets[name]
            host[offset : offset + array.nbytes] = array.view(np.uint8).reshape(-1)
            views[name] = DeviceTensor(self._batch_memory.ptr + offset, array.shape, array.dtype, self._batch_memory)
        # block_tables comes last: copy through this step's rows only (the whole buffer, its tables sized for
        # max_seqs rows of the longest context, is 2.3 MB on llama-3.1-8b at 64 sequences; a batch-1 step's
        # prefix 0.2 MB).
        driver.copy_host_to_device(self._batch_memory.ptr, host[: lay.end_of_tables(rows)], self.stream)
        self._staging_free.record(self.stream)
        if feed is not None:
            embedding.feed_tokens(views["token_ids"], feed.sampled.device_tokens, views.pop("feed_rows"), self.stream)
        fresh_slots = views.pop("fresh_slots", None)
        if fresh_slots is not None and fresh_slots.numel:
            # A new sequence (or one recomputed after preemption) must not see what its slot held: zeroed here, in
            # the stream before the step, so a replayed decode graph needs no reset of its own.
            delta_net.reset_states(cache.conv, cache.delta, fresh_slots, self.stream)
        max_context = int(batch.context_lens.max()) if s else 0
        chunks = delta_rule_chunked.whole_chunks(batch.positions, batch.query_starts) if spare_slot >= 0 else 0
        return DeviceBatch(
            **views,
            num_tokens=tokens,
            num_seqs=rows,
            max_query_len=int(batch.query_lens.max()) if s else 0,
            # A graph is replayed for any context length: launch its attention for the longest possible one.
            max_context_len=(self.max_blocks_per_seq - 1) * cache.block_size if pad_to else max_context,
            num_decode_seqs=int(np.sum(batch.query_lens == 1)) + rows - s,
            num_whole_chunks=chunks,
        )

    # --- after the step -------------------------------------------------------------------------------
    def sampler(self, seed: int | None):
        from infero.backends.cuda.sampler import CudaRowSampler

        return CudaRowSampler(self, seed, self._vocab_size, self.max_seqs)

    def to_host(self, logits: DeviceTensor, start: int, stop: int) -> np.ndarray:
        return logits.rows(start, stop).to_host(self.stream)

    def copy_bandwidth(self, nbytes: int = 1 << 30, repeats: int = 5) -> float:
        """Device-to-device copy bandwidth in bytes/s, bytes read plus written (median of repeats, events)."""
        src, dst = empty((nbytes,), np.uint8), empty((nbytes,), np.uint8)
        start, end = driver.Event(), driver.Event()
        times = []
        for _ in range(repeats + 1):
            start.record(self.stream)
            driver.copy_device_to_device(dst.ptr, src.ptr, nbytes, self.stream)
            end.record(self.stream)
            end.synchronize()
            times.append(end.elapsed_ms(start) / 1e3)
        return 2 * nbytes / float(np.median(times[1:]))

    def event_timer(self, in_graph: bool = False) -> EventTimer:
        return EventTimer(self.stream, in_graph)

    def copy_state(self, cache: CudaHybridCache, src_slot: int, dst_slot: int) -> None:
        """Copy a slot's whole recurrent state (every recurrent layer) to another, for sequences that fork."""
        for t in (cache.conv, cache.delta):
            slot_bytes = t.nbytes // t.shape[0]
            driver.copy_device_to_device(t.ptr + dst_slot * slot_bytes, t.ptr + src_slot * slot_bytes, slot_bytes,
                                         self.stream)  # fmt: skip

    def copy_blocks(self, cache: CudaKVCache, pairs: list[tuple[int, int]]) -> None:
        for layer_k, layer_v in zip(cache.k, cache.v, strict=True):
            block_bytes = layer_k.nbytes // layer_k.shape[0]
            for src, dst in pairs:
                for t in (layer_k, layer_v):
                    driver.copy_device_to_device(t.ptr + dst * block_bytes, t.ptr + src * block_bytes, block_bytes,
                                                 self.stream)  # fmt: skip


def _spare_slot(cache: CudaKVCache) -> int:
    """The state slot allocate_kv_cache reserved past the last for padded rows; -1 without recurrent state."""
    return cache.num_state_slots if isinstance(cache, CudaHybridCache) else -1


def _layer_floats(config: ModelConfig) -> int:
    """Floats a token's activations take from the workspace in one layer (over-counted: every intermediate of the
    widest kind of layer, none freed before the step ends)."""
    c = config
    attention = 4 * c.hidden_size + 2 * c.q_size + 2 * c.kv_size
    mixer = attention
    if c.is_hybrid:  # [q | gate] doubles q; the contiguous q and the gated output; a delta net's every stage
        mixer = max(attention + 3 * c.q_size,
                    2 * c.conv_channels + 3 * c.ssm_inner_size + 2 * c.ssm_group_count * c.ssm_state_size
                    + 4 * c.ssm_time_step_rank + 3 * c.hidden_size)  # fmt: skip
    ffn = 3 * c.intermediate_size
    if c.num_experts:  # router logits, ids and weights, the routed sum; a shared expert's three and its gate
        ffn = max(ffn, c.num_experts + 2 * c.num_experts_used + 2 * c.hidden_size
                  + 3 * c.shared_expert_intermediate_size + 1)  # fmt: skip
    return mixer + ffn


def _moe_scratch_bytes(config: ModelConfig, tokens: int) -> int:
    """The expert pairs' buffers moe_experts carves and gives back within a layer (gate, up, down's outputs, the
    quantized SwiGLU, the sort): the peak over one layer."""
    if not config.num_experts:
        return 0
    pairs = tokens * (config.num_experts_used + (config.shared_expert_intermediate_size > 0))  # a folded shared one
    width = config.expert_intermediate_size
    return pairs * (4 * (2 * width + config.hidden_size) + 2 * width + 64) + 16 * config.num_experts * 4


def _delta_scratch_bytes(config: ModelConfig, tokens: int) -> int:
    """The chunked delta rule's records for a step of `tokens` (a hybrid model's Gated DeltaNet layers; 168 MB at
    Qwen3.5-35B-A3B's 32 value heads of 128 and 2,048 tokens)."""
    if not config.is_hybrid:
        return 0
    return delta_rule_chunked.scratch_bytes(tokens, config.ssm_time_step_rank, config.ssm_state_size,
                                            config.linear_v_dim)  # fmt: skip


def _padded(values: np.ndarray, length: int, fill, dtype, fill_range: bool = False) -> np.ndarray:
    out = np.arange(length, dtype=dtype) if fill_range else np.full(length, fill, dtype=dtype)
    out[: len(values)] = values
    return out


class _BatchLayout:
    """Byte offsets of the batch arrays inside one device buffer (8-byte aligned)."""

    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int):
        self.max_tokens, self.max_rows, self.max_blocks = max_tokens, max_rows, max_blocks
        sizes = {
            "token_ids": 4 * max_tokens, "feed_rows": 4 * max_tokens, "positions": 4 * max_tokens,
            "slot_mapping": 8 * max_tokens,
            "logits_indices": 4 * max_tokens, "context_lens": 4 * max_rows, "query_starts": 4 * (max_rows + 1),
            "state_slots": 4 * max_rows, "fresh_slots": 4 * max_rows, "block_tables": 4 * max_rows * max_blocks,
        }  # fmt: skip
        self.offsets, offset = {}, 0
        for name, size in sizes.items():  # block_tables last: a step's used bytes are one prefix (end_of_tables)
            self.offsets[name] = offset
            offset += -(-size // 256) * 256
        self.nbytes = offset

    def end_of_tables(self, rows: int) -> int:
        """Bytes from the start through the first `rows` block-table rows: everything a step of that many rows
        reads."""
        return self.offsets["block_tables"] + 4 * rows * self.max_blocks


class EventTimer:
    """CUDA events recorded on the compute stream, for per-op profiles. in_graph: the marks are made while the
    stream is captured and become nodes of the graph, so each replay re-records them between the kernels."""

    def __init__(self, stream: driver.Stream, in_graph: bool = False):
        self.stream, self.in_graph = stream, in_graph

    def mark(self) -> driver.Event:
        event = driver.Event()
        event.record(self.stream, in_graph=self.in_graph)
        return event

    def elapsed_us(self, start: driver.Event, end: driver.Event) -> float:
        end.synchronize()
        return end.elapsed_ms(start) * 1e3
