"""The GPU sampler: device logits rows -> token ids (and logprobs), by exactly the rules of
`infero.engine.sampling.Sampler` (same steps, same order, same Philox4x64-10 noise), so the same rows, parameters
and seeds give the same tokens. kernels/sampling.cu says how each step is computed and why it matches.

Interface (per step, everything uploaded in three small copies; the logits never leave the device):
- `RowParams` [S] (ROW_DTYPE): per sampled row its parameters, the logits row it samples (n > 1 siblings share
  one), its Philox key and counters, its slice of the modifier list, its mask row, its logprob count.
- Modifiers [E] (MOD_DTYPE): per row, one entry for each *distinct* token id whose z is not just the masked logit:
  logit_bias ids (with the bias), banned ids, ids seen in the prompt or output (repetition penalty, only when it
  is != 1) and output ids with their counts (frequency/presence penalties, only when used). Rows without
  penalties, bias or bans contribute nothing; a penalised row contributes its distinct context ids (O(context),
  never O(vocabulary)). This is the cheapest exact interface: no [S, V] count buffer to keep in step with the
  batch's row order, no atomics, one thread per distinct id. `pack_modifiers` builds it from the same
  arguments `Sampler.sample` takes (the engine may cache a request's distinct prompt ids; see `distinct_ids`).
- Allowed-token masks [M, ceil(V/32)] uint32 (bit t % 32 of word t // 32; llguidance's layout), one row per
  constrained row.
Scratch is sized once for (max_rows, vocab): the float64 z rows dominate (max_rows * V * 8 bytes: 311 MB for
256 rows of 151,936). `GpuSampler.launch` = `upload` (three asynchronous copies through pinned memory) + `run` (six
kernel launches on fixed buffers, no host work: capturable in a CUDA graph, replayed after each `upload` as long
as the modifier list fits its buffer).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np

from infero.backends.cuda import driver, runtime
from infero.backends.cuda.tensor import DeviceTensor, empty
from infero.engine.sampling import (
    ENGINE_STREAM,
    MAX_LOGPROBS,
    NON_FINITE_LOGITS,
    SEEDED_STREAM,
    SampledTokens,
    SampleResult,
    SamplingError,
    SamplingParams,
)

SOURCE = "sampling.cu"
CHUNK = 2048  # ids per chunk (CHUNK in sampling.cu)
NUM_BUCKETS = 4096  # NB in sampling.cu
MAX_TOP = 20  # MAX_TOP in sampling.cu
HIST_SMEM = NUM_BUCKETS * 20
MAX_HIST_CHUNKS = 8  # chunks per sampler_histogram block, at most (MAX_HIST_CHUNKS in sampling.cu)
SELECT_SMEM = 60 * 1024
CHUNK_THREADS, SELECT_THREADS = 256, 512
assert MAX_TOP >= MAX_LOGPROBS

ROW_GREEDY, ROW_TEMPERATURE, ROW_MIN_P, ROW_TOP_P, ROW_REPETITION, ROW_FREQ_PRES = 1, 2, 4, 8, 16, 32
MOD_BIAS, MOD_BANNED, MOD_SEEN = 1, 2, 4

ROW_DTYPE = np.dtype([
    ("temperature", "<f8"), ("top_p", "<f8"), ("log_min_p", "<f8"), ("repetition_penalty", "<f8"),
    ("frequency_penalty", "<f8"), ("presence_penalty", "<f8"), ("key", "<u8"), ("counter", "<u8"),
    ("stream", "<u8"), ("top_k", "<i4"), ("flags", "<i4"), ("logit_row", "<i4"), ("mask_row", "<i4"),
    ("mod_begin", "<i4"), ("mod_end", "<i4"), ("num_logprobs", "<i4"), ("pad", "<i4"),
])  # fmt: skip
MOD_DTYPE = np.dtype([("id", "<i4"), ("count", "<i4"), ("flags", "<i4"), ("pad", "<i4"), ("bias", "<f8")])
assert ROW_DTYPE.itemsize == 104 and MOD_DTYPE.itemsize == 24

KERNELS = ("sampler_modify", "sampler_prepare", "sampler_histogram", "sampler_select", "sampler_gumbel",
           "sampler_finalize")  # fmt: skip
runtime.declare(SOURCE, list(KERNELS))

_UINT64 = 1 << 64
_P, _I = ctypes.c_void_p, ctypes.c_int
NO_TOKEN_MESSAGE = "no token can be sampled: every token of the vocabulary is banned or masked"


def distinct_ids(ids) -> np.ndarray:
    """The sorted distinct token ids of a sequence (what a request may cache for its prompt)."""
    return np.unique(np.asarray(ids, dtype=np.int64))


def pack_modifiers(params: SamplingParams, prompt_ids, output_ids, banned_token_ids, vocab_size: int,
                   prompt_distinct: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """One row's modifiers (MOD_DTYPE, sorted by id): every distinct id that bias, bans or penalties touch."""
    bias_ids = banned = seen = out_ids = None
    if params.logit_bias:
        bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
        bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float64, count=len(params.logit_bias))
        if bias_ids.max() >= vocab_size:
            raise SamplingError(
                f"logit_bias token id {int(bias_ids.max())} is outside the vocabulary (size {vocab_size})"
            )
    if banned_token_ids:
        banned = np.fromiter(banned_token_ids, dtype=np.int64, count=len(banned_token_ids))
        banned = banned[(banned >= 0) & (banned < vocab_size)]
    output = np.asarray(output_ids, dtype=np.int64)
    if params.repetition_penalty != 1.0:
        prompt = distinct_ids(prompt_ids) if prompt_distinct is None else prompt_distinct
        seen = np.union1d(prompt, output)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and output.size:
        out_ids, out_counts = np.unique(output, return_counts=True)
    parts = [a for a in (bias_ids, banned, seen, out_ids) if a is not None and a.size]
    if not parts:
        return np.zeros(0, MOD_DTYPE)
    # seen and out_ids come sorted and distinct; only a mixture needs another sort.
    ids = (
        parts[0] if len(parts) == 1 and (parts[0] is seen or parts[0] is out_ids) else np.unique(np.concatenate(parts))
    )
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got {int(ids[0])}..{int(ids[-1])}")
    mods = np.zeros(ids.size, MOD_DTYPE)
    mods["id"] = ids
    flags = np.zeros(ids.size, np.int32)
    if bias_ids is not None:
        where = np.searchsorted(ids, bias_ids)
        flags[where] |= MOD_BIAS
        mods["bias"][where] = bias_values
    if banned is not None and banned.size:
        flags[np.searchsorted(ids, banned)] |= MOD_BANNED
    if seen is not None and seen.size:
        flags[np.searchsorted(ids, seen)] |= MOD_SEEN
    if out_ids is not None:
        mods["count"][np.searchsorted(ids, out_ids)] = out_counts
    mods["flags"] = flags
    return mods


def pack_mask(mask, vocab_size: int) -> np.ndarray:
    """An allowed-token mask as uint32 words: from bool [vocab] (True = allowed) or an int32/uint32 bitmask."""
    words = -(-vocab_size // 32)
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        if mask.shape != (vocab_size,):
            raise ValueError(f"an allowed mask must be bool of shape ({vocab_size},); got {mask.shape}")
        packed = np.zeros(words * 4, np.uint8)
        bits = np.packbits(mask, bitorder="little")
        packed[: bits.size] = bits
        return packed.view("<u4")
    if mask.dtype in (np.int32, np.uint32) and mask.shape == (words,):
        return mask.astype("<u4", copy=False).view("<u4")
    raise ValueError(f"an allowed mask must be bool [{vocab_size}] or a 32-bit bitmask [{words}]; got {mask.dtype} "
                     f"{mask.shape}")  # fmt: skip


@dataclass
class PackedStep:
    """A step's sampler inputs on the host, ready to upload."""

    rows: np.ndarray  # ROW_DTYPE [S]
    modifiers: np.ndarray  # MOD_DTYPE [E]
    masks: np.ndarray  # uint32 [M, ceil(V / 32)]
    logprobs: list[int | None]  # per row: params.logprobs

    @property
    def num_rows(self) -> int:
        return len(self.rows)


class _Readback:
    """Page-locked host buffers one step's results are copied into, and the event that marks them there."""

    def __init__(self, rows: int):
        self._buffers = [driver.PinnedBuffer(rows * n) for n in (4, 8, 4 * MAX_TOP, 8 * MAX_TOP)]
        tokens, lp, ids, top = (b.array for b in self._buffers)
        self.tokens, self.token_logprobs = tokens.view(np.int32), lp.view(np.float64)
        self.top_ids = ids.view(np.int32).reshape(rows, MAX_TOP)
        self.top_logprobs = top.view(np.float64).reshape(rows, MAX_TOP)
        self.done = driver.Event(timing=False)


class PendingSample(SampledTokens):
    """A GPU step's sampling, queued: results() waits for its copies to reach the host; device_tokens is where the
    next step can read the tokens from before then."""

    def __init__(self, step: PackedStep, readback: _Readback, device_tokens: int):
        super().__init__()
        self.step, self.readback, self.device_tokens = step, readback, device_tokens

    def results(self) -> list[SampleResult]:
        if self._results is None:
            self._results = self._read()
        return self._results

    def _read(self) -> list[SampleResult]:
        s, rb = self.step.num_rows, self.readback
        rb.done.synchronize()
        if s == 0:
            return []
        tokens = rb.tokens[:s].copy()
        if (tokens == -1).any():
            raise SamplingError(NO_TOKEN_MESSAGE)
        results = []
        for i, n in enumerate(self.step.logprobs):
            if n is None or tokens[i] == NON_FINITE_LOGITS:
                results.append(SampleResult(int(tokens[i]), None, None))
            else:
                pairs = [(int(rb.top_ids[i, k]), float(rb.top_logprobs[i, k])) for k in range(n)]
                results.append(SampleResult(int(tokens[i]), float(rb.token_logprobs[i]), pairs))
        return results


class GpuSampler:
    """Samples rows of device logits on the GPU; a drop-in for `Sampler` (same seed -> same tokens)."""

    def __init__(self, vocab_size: int, max_rows: int, seed: int | None = None, max_modifiers: int = 1 << 16):
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1, dtype=np.uint64)[0])
        self.engine_key = seed % _UINT64
        self.num_engine_draws = 0  # unseeded rows drawn so far, as Sampler counts them
        self.vocab_size, self.max_rows = vocab_size, max_rows
        self.num_chunks = -(-vocab_size // CHUNK)
        self.mask_words = -(-vocab_size // 32)
        r, v, g, w = max_rows, vocab_size, self.num_chunks, self.mask_words

        def buf(nbytes: int) -> DeviceTensor:
            return empty((max(nbytes, 1),), np.uint8)

        self.rows = buf(r * ROW_DTYPE.itemsize)
        self.masks = buf(r * w * 4)
        self._allocate_modifiers(max_modifiers)
        # Inputs go up through page-locked staging, so the copies are asynchronous; `upload` waits for the
        # previous step's copies before it overwrites the staging.
        self._staging_rows = driver.PinnedBuffer(r * ROW_DTYPE.itemsize)
        self._staging_masks = driver.PinnedBuffer(r * w * 4)
        self._uploaded: driver.Event | None = None
        self.z = buf(r * v * 8)
        self.modified = buf(r * w * 4)  # self-cleaning
        self.stats = buf(r * g * 32)
        self.tops = buf(r * g * MAX_TOP * 8)
        self.hist_count = buf(r * NUM_BUCKETS * 4)  # self-cleaning
        self.hist_mass = buf(r * NUM_BUCKETS * 16)  # self-cleaning
        self.support = buf(r * 24)
        self.best = buf(r * g * 16)
        self.tokens = buf(r * 4)
        self.token_logprobs = buf(r * 8)
        self.top_ids = buf(r * MAX_TOP * 4)
        self.top_logprobs = buf(r * MAX_TOP * 8)
        self._readbacks = (_Readback(r), _Readback(r))
        self._turn = 0
        self.reset()
        self._fns = None

    def _allocate_modifiers(self, capacity: int) -> None:
        self.max_modifiers = capacity
        self.modifiers = empty((max(capacity * MOD_DTYPE.itemsize, 1),), np.uint8)
        self._staging_mods = driver.PinnedBuffer(capacity * MOD_DTYPE.itemsize)

    def reset(self, stream: driver.Stream | None = None) -> None:
        """Zero the self-cleaning scratch (after an interrupted step)."""
        s = stream or runtime.stream()
        for t in (self.modified, self.hist_count, self.hist_mass):
            driver.memset_d8(t.ptr, 0, t.nbytes, s)
        s.synchronize()

    # ---- host side -------------------------------------------------------------------------------------------
    def pack(self, params: list[SamplingParams], prompt_ids, output_ids, banned_token_ids=None,
             allowed_masks=None, logit_rows=None, prompt_distinct=None) -> PackedStep:  # fmt: skip
        """The step's inputs, with the same arguments as `Sampler.sample` (plus which logits row each row samples:
        default row i). Advances the engine's draw counter for the unseeded sampled rows, as Sampler does."""
        n, vocab = len(params), self.vocab_size
        if n > self.max_rows:
            raise ValueError(f"{n} rows exceed this sampler's max_rows ({self.max_rows})")
        banned_token_ids = banned_token_ids or [None] * n
        allowed_masks = allowed_masks or [None] * n
        logit_rows = list(range(n)) if logit_rows is None else list(logit_rows)
        prompt_distinct = prompt_distinct or [None] * n
        lengths = {len(prompt_ids), len(output_ids), len(banned_token_ids), len(allowed_masks), len(logit_rows)}
        if lengths != {n}:
            raise ValueError(f"{n} rows need as many prompt_ids, output_ids, bans, masks and logit rows")
        # One tuple per row, in ROW_DTYPE's field order, turned into the structured array at once (assigning
        # fields of numpy records one by one costs ~1 us each).
        records, mods, masks, begin = [], [], [], 0
        for i, p in enumerate(params):
            flags, log_min_p, top_k, key, counter, stream = 0, 0.0, 0, 0, 0, 0
            if p.greedy:
                flags |= ROW_GREEDY
            else:
                if p.temperature != 1.0:
                    flags |= ROW_TEMPERATURE
                if p.min_p > 0.0:
                    flags |= ROW_MIN_P
                    log_min_p = math.log(p.min_p)
                if p.top_p < 1.0:
                    flags |= ROW_TOP_P
                top_k = p.top_k if 0 < p.top_k < vocab else 0
                if p.seed is not None:
                    key, counter, stream = p.seed % _UINT64, len(output_ids[i]), SEEDED_STREAM
                else:
                    key, counter, stream = self.engine_key, self.num_engine_draws, ENGINE_STREAM
                    self.num_engine_draws += 1
            penalised = (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and len(output_ids[i]) > 0
            if p.repetition_penalty != 1.0:
                flags |= ROW_REPETITION
            if penalised:
                flags |= ROW_FREQ_PRES
            count = 0
            if p.logit_bias or banned_token_ids[i] or p.repetition_penalty != 1.0 or penalised:
                m = pack_modifiers(p, prompt_ids[i], output_ids[i], banned_token_ids[i], vocab, prompt_distinct[i])
                mods.append(m)
                count = m.size
            mask_row = -1
            if allowed_masks[i] is not None:
                mask_row = len(masks)
                masks.append(pack_mask(allowed_masks[i], vocab))
            records.append((
                p.temperature, p.top_p, log_min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
                key, counter, stream, top_k, flags, logit_rows[i], mask_row, begin, begin + count,
                -1 if p.logprobs is None else p.logprobs, 0,
            ))  # fmt: skip
            begin += count
        rows = np.array(records, dtype=ROW_DTYPE)
        modifiers = np.concatenate(mods) if mods else np.zeros(0, MOD_DTYPE)
        mask_array = np.stack(masks) if masks else np.zeros((0, self.mask_words), "<u4")
        return PackedStep(rows, modifiers, mask_array, [p.logprobs for p in params])

    # ---- device side -----------------------------------------------------------------------------------------
    def _functions(self):
        if self._fns is None:
            fns = {name: runtime.kernel(SOURCE, name) for name in KERNELS}
            driver.set_max_dynamic_shared(fns["sampler_histogram"], HIST_SMEM)
            driver.set_max_dynamic_shared(fns["sampler_select"], SELECT_SMEM)
            self._num_sms = runtime.context().info.num_sms
            self._fns = fns
        return self._fns

    def launch(self, logits: DeviceTensor, step: PackedStep, stream: driver.Stream) -> None:
        """Upload the step's inputs and run the six kernels on `stream`; results stay on the device."""
        self._check_logits(logits)
        used = step.rows["logit_row"]
        if step.num_rows and (int(used.min()) < 0 or int(used.max()) >= logits.shape[0]):
            raise ValueError(f"logit rows must lie in [0, {logits.shape[0]})")
        self.upload(step, stream)
        self.run(logits, step.num_rows, stream)

    def _check_logits(self, logits: DeviceTensor) -> None:
        if logits.dtype != np.float32 or len(logits.shape) != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be float32 [rows, {self.vocab_size}], got {logits.dtype} {logits.shape}")

    def upload(self, step: PackedStep, stream: driver.Stream) -> None:
        """Copy the step's row parameters, modifiers and masks to the buffers `run` reads (asynchronous)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's copies have left the staging buffers
        else:
            self._uploaded = driver.Event(timing=False)
        if step.modifiers.size > self.max_modifiers:  # grows outside graphs only
            self._allocate_modifiers(2 * step.modifiers.size)
        for staging, device, array in (
            (self._staging_rows, self.rows, step.rows),
            (self._staging_mods, self.modifiers, step.modifiers),
            (self._staging_masks, self.masks, step.masks),
        ):
            if array.size:
                raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
                staging.array[: raw.size] = raw
                driver.copy_host_to_device(device.ptr, staging.array[: raw.size], stream)
        self._uploaded.record(stream)

    def run(self, logits: DeviceTensor, num_rows: int, stream: driver.Stream, events=None) -> None:
        """The six kernels for the first `num_rows` uploaded rows (no host work: capturable in a CUDA graph).
        `events`, a list of 7 driver.Events, times each kernel (profiling only)."""
        self._check_logits(logits)
        s, v, g, w = num_rows, self.vocab_size, self.num_chunks, self.mask_words
        if s == 0:
            return
        f = self._functions()
        rows, z, stats = self.rows.ptr, self.z.ptr, self.stats.ptr
        mark = (lambda i: events[i].record(stream)) if events else (lambda i: None)
        mark(0)
        driver.launch(f["sampler_modify"], (s,), (CHUNK_THREADS,),
                      (rows, self.modifiers.ptr, logits.ptr, self.masks.ptr, z, self.modified.ptr, v, w),
                      (_P, _P, _P, _P, _P, _P, _I, _I), stream)  # fmt: skip
        mark(1)
        driver.launch(f["sampler_prepare"], (g, s), (CHUNK_THREADS,),
                      (rows, logits.ptr, self.masks.ptr, z, self.modified.ptr, stats, self.tops.ptr, v, w, g),
                      (_P, _P, _P, _P, _P, _P, _P, _I, _I, _I), stream)  # fmt: skip
        mark(2)
        # Enough histogram blocks to fill the GPU (a few per SM); the sums are exact, so this changes no result.
        per_block = min(MAX_HIST_CHUNKS, max(1, -(-s * g // (4 * self._num_sms))))
        driver.launch(f["sampler_histogram"], (-(-g // per_block), s), (CHUNK_THREADS,),
                      (rows, z, stats, self.hist_count.ptr, self.hist_mass.ptr, v, g, per_block),
                      (_P, _P, _P, _P, _P, _I, _I, _I), stream, shared=HIST_SMEM)  # fmt: skip
        mark(3)
        driver.launch(f["sampler_select"], (s,), (SELECT_THREADS,),
                      (rows, z, stats, self.hist_count.ptr, self.hist_mass.ptr, self.support.ptr, v, g),
                      (_P, _P, _P, _P, _P, _P, _I, _I), stream, shared=SELECT_SMEM)  # fmt: skip
        mark(4)
        driver.launch(f["sampler_gumbel"], (g, s), (CHUNK_THREADS,),
                      (rows, z, stats, self.support.ptr, self.best.ptr, v, g),
                      (_P, _P, _P, _P, _P, _I, _I), stream)  # fmt: skip
        mark(5)
        driver.launch(f["sampler_finalize"], (s,), (CHUNK_THREADS,),
                      (rows, logits.ptr, stats, self.tops.ptr, self.best.ptr, self.tokens.ptr,
                       self.token_logprobs.ptr, self.top_ids.ptr, self.top_logprobs.ptr, v, g),
                      (_P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I), stream)  # fmt: skip
        mark(6)

    def collect(self, step: PackedStep, stream: driver.Stream) -> list[SampleResult]:
        """Wait for the step and bring its tokens (and logprobs where asked) to the host."""
        return self.collect_async(step, stream).results()

    def collect_async(self, step: PackedStep, stream: driver.Stream) -> PendingSample:
        """Queue the copies of the step's results to the host behind its kernels; the PendingSample waits for them
        only when asked. Two sets of host buffers take turns, so a step's results must be read before the launch
        after next (the engine keeps at most one step queued behind the one it reads)."""
        readback = self._readbacks[self._turn]
        self._turn ^= 1
        s = step.num_rows
        if s:
            driver.copy_device_to_host(readback.tokens[:s], self.tokens.ptr, stream)
            if any(n is not None for n in step.logprobs):
                driver.copy_device_to_host(readback.token_logprobs[:s], self.token_logprobs.ptr, stream)
                driver.copy_device_to_host(readback.top_ids[:s], self.top_ids.ptr, stream)
                driver.copy_device_to_host(readback.top_logprobs[:s], self.top_logprobs.ptr, stream)
        readback.done.record(stream)
        return PendingSample(step, readback, self.tokens.ptr)

    def sample(self, logits: DeviceTensor, params: list[SamplingParams], prompt_ids, output_ids,
               banned_token_ids=None, allowed_masks=None, logit_rows=None,
               stream: driver.Stream | None = None) -> list[SampleResult]:  # fmt: skip
        """`Sampler.sample` on device logits: pack, launch, collect."""
        stream = stream or runtime.stream()
        step = self.pack(params, prompt_ids, output_ids, banned_token_ids, allowed_masks, logit_rows)
        self.launch(logits, step, stream)
        return self.collect(step, stream)
