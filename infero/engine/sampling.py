"""Sampling parameters and the numpy reference sampler: the exact rules by which a row of logits becomes a token.

The GPU sampler mirrors this file and is tested against it, so every rule below is part of the contract.
Per row, in this order (vLLM v1: `vllm/v1/sample/sampler.py`, and the same order in
`vllm/v1/worker/gpu/sample/sampler.py`):

 0. logprobs, if asked: log_softmax (in float64) of the model's raw logits, before any step below (vLLM's
    default `raw_logprobs`), for the chosen token and the top-N alternatives (highest first, lower id on ties).
 1. The logits are widened to float64 (the reference computes everything after this in float64). A constrained
    row (structured output: its entry of `allowed_masks`, bool over the vocabulary or packed in 32-bit words) then
    gets z[t] = -inf for every token its mask disallows, before any step below, so neither logit_bias nor a
    penalty can bring one back and greedy rows take the argmax over allowed tokens only (vLLM applies the
    grammar bitmask to the logits before its sampler too). The logprobs of step 0 stay the raw model's.
 2. `logit_bias`: z[t] += bias[t].
 3. Banned ids (the caller's `banned_token_ids`: eos/stop ids while fewer than `min_tokens` are generated):
    z[t] = -inf. Ids outside the vocabulary are ignored (they can never be sampled anyway).
 4. Repetition penalty r over the SET of prompt and output ids: z > 0 becomes z / r, otherwise z * r.
 5. Frequency f and presence p over the OUTPUT ids only, with c[t] the count of t in the output:
    z -= f * c, then z -= p * (c > 0).
 6. Greedy rows (temperature < 1e-5, vLLM's epsilon) take argmax(z), lowest id on ties, and stop here:
    the steps below never change the argmax.
 7. Temperature T: z /= T.
 8. min_p (0 = off): drop z[t] < max(z) + log(min_p), i.e. prob[t] < min_p * max prob (vLLM applies min_p, an
    "argmax-invariant logits processor", before top-k/top-p).
 9. top_k (0 or -1 = off, >= vocab = off): drop z[t] < the k-th largest z; ties with the k-th value are kept.
10. top_p (1.0 = off): sort the survivors by (z descending, id ascending), q = their softmax; keep a token
    while the mass of the tokens before it is < top_p (the first is always kept). This is vLLM's "drop while
    the ascending cumulative mass <= 1 - top_p" written from the other end.
    "Drop" means z[t] = -inf. Each filter sees the survivors of the previous one (renormalised).
11. Gumbel-max: token = argmax(z[t] + g[t]), g[t] = -log(-log(u[t])), lowest id on ties. This is the same
    draw as vLLM's exponential race argmax(prob / E), E = -log(u).

Noise (counter-based, so a row's draw never depends on its batch): Philox4x64-10 (Random123, as in
`numpy.random.Philox`) with key (k, 0). Token t of a row uses lane t % 4 of the block at counter
(t // 4, i, s, 0), as a uint64 `raw`, and u[t] = ((raw >> 12) + 0.5) * 2**-52, which lies in (0, 1).
- A seeded request: k = seed mod 2**64, i = its output index (tokens generated so far), s = 0. Its token at
  output index i depends only on (seed, i) and its logits.
- An unseeded request: k = the engine key (`Sampler(seed)`; from OS entropy when None), i = the number of
  unseeded rows this Sampler drew before it (counted in batch row order), s = 1.
The sampler sees rows, not requests: an n > 1 request must reach it as n rows, and a seeded one must give child j
the seed `seed + j` (as vLLM's `parallel_sampling.py` does), or its n rows draw the same tokens.
Out-of-range parameters raise `SamplingError`, an `InferoError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from infero.errors import InferoError

if TYPE_CHECKING:
    from infero.engine.structured import StructuredOutput

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
_UINT64 = 1 << 64
SEEDED_STREAM, ENGINE_STREAM = 0, 1  # the third counter word of the noise
NON_FINITE_LOGITS = -2  # the token of a row whose raw logits hold a NaN or an infinity: the model is broken


class SamplingError(InferoError):
    """A sampling parameter is out of range."""


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """What a request asks of the sampler and of the stop logic; validated on construction."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-N alternatives at every prompt position (completions' echo)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the matched stop string ends the text (vLLM's)
    n: int = 1
    structured: StructuredOutput | None = None  # constrain the output to a JSON schema, regex, choice or grammar

    def __post_init__(self):
        self._check_number("temperature", self.temperature, 0.0, math.inf, "0 for greedy, 1.0 for the model's own")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingError(f"top_k must be an integer >= 1, or 0 or -1 to turn it off; got {self.top_k!r}")
        self._check_number("top_p", self.top_p, 0.0, 1.0, "1.0 turns it off", low_open=True)
        self._check_number("min_p", self.min_p, 0.0, 1.0, "0 turns it off")
        self._check_number(
            "repetition_penalty", self.repetition_penalty, 0.0, math.inf, "1.0 turns it off", low_open=True
        )
        self._check_number("presence_penalty", self.presence_penalty, -2.0, 2.0, "0 turns it off")
        self._check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "0 turns it off")
        self._check_logit_bias()
        if self.seed is not None and not _is_int(self.seed):
            raise SamplingError(f"seed must be an integer or None; got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1; got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError(
                f"min_tokens must be an integer between 0 and max_tokens ({self.max_tokens}); got {self.min_tokens!r}"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, or None; got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise SamplingError(
                f"prompt_logprobs must be an integer from 0 to {MAX_LOGPROBS}, or None; got {self.prompt_logprobs!r}"
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingError(f"stop must be a list of non-empty strings; got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise SamplingError(f"stop_token_ids must be a list of integers >= 0; got {self.stop_token_ids!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if not _is_int(self.n) or self.n < 1:
            raise SamplingError(f"n must be an integer >= 1; got {self.n!r}")

    @property
    def greedy(self) -> bool:
        """True when the sampler takes the argmax (temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE

    def _check_number(self, name, value, low, high, hint, low_open=False):
        in_range = _is_number(value) and math.isfinite(value) and (low < value if low_open else low <= value)
        if not in_range or value > high:
            low_side = f"> {low}" if low_open else f">= {low}"
            bound = f"{low_side}" if high == math.inf else f"{low_side} and <= {high}"
            raise SamplingError(f"{name} must be a number {bound} ({hint}); got {value!r}")

    def _check_logit_bias(self):
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise SamplingError(f"logit_bias must map token ids to biases; got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise SamplingError(f"logit_bias keys must be token ids (integers >= 0); got {token_id!r}")
            if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                raise SamplingError(f"logit_bias values must be numbers from -100 to 100; got {bias!r} for {token_id}")


@dataclass(frozen=True)
class SampleResult:
    """One row's token, its raw logprob (when asked) and the top-N raw logprobs, highest first."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


class SampledTokens:
    """A step's sampling, which may still be running on the device: results() waits for it. device_tokens, where
    set, is the address of the sampled token ids on the device (int32, one per sampled row), valid until the
    sampler's next launch: a step queued behind this one reads its input tokens there (TokenFeed), before the host
    has seen them."""

    device_tokens: int | None = None

    def __init__(self, results: list[SampleResult] | None = None):
        self._results = results

    def results(self) -> list[SampleResult]:
        return self._results

    def token_ids(self) -> np.ndarray:
        """int32 [rows]: the sampled tokens, on the host (waits)."""
        return np.array([r.token_id for r in self.results()], np.int32)


# ---- the steps, each on one row (float64, modified in place and returned) ----


def unpack_bitmask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [vocab_size] from a bitmask (bit t % 32 of 32-bit word t // 32 set = token t allowed)."""
    return np.unpackbits(words.view(np.uint8), count=vocab_size, bitorder="little").view(np.bool_)


def apply_allowed_mask(z: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """Step 1, for a constrained row: tokens the mask disallows can't be sampled. The mask is bool [vocab]
    (True = allowed) or the same packed as 32-bit words (bit t % 32 of word t // 32), as the engine passes it."""
    if allowed is not None:
        allowed = np.asarray(allowed)
        words = -(-z.shape[0] // 32)
        if allowed.dtype in (np.uint32, np.int32) and allowed.shape == (words,):
            allowed = unpack_bitmask(allowed, z.shape[0])
        if allowed.dtype != np.bool_ or allowed.shape != z.shape:
            shape = f"{allowed.dtype} {allowed.shape}"
            raise ValueError(f"an allowed mask must be bool {z.shape} or 32-bit words ({words},); got {shape}")
        z[~allowed] = -np.inf
    return z


def apply_logit_bias(z: np.ndarray, logit_bias: dict[int, float] | None) -> np.ndarray:
    """Step 2: add the bias of each listed token."""
    if logit_bias:
        ids = np.fromiter(logit_bias.keys(), dtype=np.int64, count=len(logit_bias))
        if ids.max() >= z.shape[0]:
            raise SamplingError(f"logit_bias token id {int(ids.max())} is outside the vocabulary (size {z.shape[0]})")
        z[ids] += np.fromiter(logit_bias.values(), dtype=np.float64, count=len(logit_bias))
    return z


def apply_banned(z: np.ndarray, banned_token_ids: set[int] | None) -> np.ndarray:
    """Step 3: banned ids can't be sampled; ids outside the vocabulary are ignored."""
    if banned_token_ids:
        ids = np.fromiter(banned_token_ids, dtype=np.int64, count=len(banned_token_ids))
        z[ids[(ids >= 0) & (ids < z.shape[0])]] = -np.inf
    return z


def apply_penalties(z: np.ndarray, params: SamplingParams, prompt_ids, output_ids) -> np.ndarray:
    """Steps 4-5: repetition penalty over prompt + output ids, frequency and presence over output ids."""
    vocab_size = z.shape[0]
    output = np.asarray(output_ids, dtype=np.int64)
    if params.repetition_penalty != 1.0:
        seen = np.zeros(vocab_size, dtype=bool)
        seen[np.asarray(prompt_ids, dtype=np.int64)] = True
        seen[output] = True
        r = params.repetition_penalty
        with np.errstate(over="ignore"):  # a huge penalty takes a negative logit to -inf: what it asks for
            z[seen] = np.where(z[seen] > 0, z[seen] / r, z[seen] * r)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and output.size:
        counts = np.bincount(output, minlength=vocab_size)
        z -= params.frequency_penalty * counts
        z -= params.presence_penalty * (counts > 0)
    return z


def apply_temperature(z: np.ndarray, temperature: float) -> np.ndarray:
    """Step 7."""
    if temperature != 1.0:
        z /= temperature
    return z


def apply_min_p(z: np.ndarray, min_p: float) -> np.ndarray:
    """Step 8: drop tokens whose probability is below min_p times the largest probability."""
    if min_p > 0.0:
        z[z < z.max() + math.log(min_p)] = -np.inf
    return z


def apply_top_k(z: np.ndarray, top_k: int) -> np.ndarray:
    """Step 9: keep the logits >= the k-th largest (ties with it kept); a partition, not a sort."""
    vocab_size = z.shape[0]
    if 0 < top_k < vocab_size:
        kth_largest = np.partition(z, vocab_size - top_k)[vocab_size - top_k]
        z[z < kth_largest] = -np.inf
    return z


def apply_top_p(z: np.ndarray, top_p: float) -> np.ndarray:
    """Step 10: keep the smallest high-probability prefix whose mass reaches top_p; sorts the survivors only."""
    if top_p >= 1.0:
        return z
    candidates = np.flatnonzero(z > -np.inf)
    if candidates.size <= 1:
        return z
    values = z[candidates]
    order = np.lexsort((candidates, -values))  # z descending, id ascending
    candidates, values = candidates[order], values[order]
    weights = np.exp(values - values[0])
    q = weights / weights.sum()
    mass_before = np.concatenate(([0.0], np.cumsum(q)[:-1]))
    z[candidates[mass_before >= top_p]] = -np.inf
    return z


def philox_uniforms(key: int, index: int, stream: int, vocab_size: int) -> np.ndarray:
    """u[t] in (0, 1) for t < vocab_size: lane t % 4 of Philox4x64-10 at counter (t // 4, index, stream, 0)."""
    # numpy's Philox adds one to the 256-bit counter before each block, so start one below (0, index, stream, 0).
    start = ((stream << 128) + (index << 64) - 1) % (1 << 256)
    bits = np.random.Philox(key=key % _UINT64, counter=start).random_raw(-(-vocab_size // 4) * 4)[:vocab_size]
    return ((bits >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0**-52


def gumbel_argmax(z: np.ndarray, u: np.ndarray) -> int:
    """Step 11: argmax of z + Gumbel noise, a draw from softmax(z) restricted to the finite z."""
    return int(np.argmax(z - np.log(-np.log(u))))


def raw_logprobs(logits: np.ndarray) -> np.ndarray:
    """Step 0: log_softmax of one row of raw logits, in float64."""
    x = logits.astype(np.float64)
    shifted = x - x.max()
    return shifted - math.log(np.exp(shifted).sum())


def top_logprobs(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n highest (token id, logprob), highest first, lower id first on ties; a partition, not a sort."""
    vocab_size = logprobs.shape[0]
    if n <= 0:
        return []
    if n < vocab_size:
        nth_largest = np.partition(logprobs, vocab_size - n)[vocab_size - n]
        above = np.flatnonzero(logprobs > nth_largest)
        ties = np.flatnonzero(logprobs == nth_largest)[: n - above.size]
        ids = np.concatenate((above, ties))
    else:
        ids = np.arange(vocab_size)
    ids = ids[np.lexsort((ids, -logprobs[ids]))]
    return [(int(t), float(logprobs[t])) for t in ids]


class Sampler:
    """Turns a batch of logits into one token per row by the rules in this module's docstring."""

    def __init__(self, seed: int | None = None):
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1, dtype=np.uint64)[0])
        self.engine_key = seed % _UINT64
        self.num_engine_draws = 0  # unseeded rows drawn so far: the counter of the engine's noise stream

    def sample(
        self,
        logits: np.ndarray,
        params: list[SamplingParams],
        prompt_ids: list[list[int]] | list[np.ndarray],
        output_ids: list[list[int]],
        banned_token_ids: list[set[int] | None] | None = None,
        allowed_masks: list[np.ndarray | None] | None = None,
    ) -> list[SampleResult]:
        """One token per row of `logits` [num_seqs, vocab]; row i belongs to params[i], prompt_ids[i], ...

        `allowed_masks[i]`, when not None, is row i's grammar mask (bool [vocab], True = allowed, or packed in
        32-bit words; step 1).
        """
        if logits.ndim != 2:
            raise ValueError(f"logits must be [num_seqs, vocab], got shape {logits.shape}")
        num_seqs = logits.shape[0]
        if banned_token_ids is None:
            banned_token_ids = [None] * num_seqs
        if allowed_masks is None:
            allowed_masks = [None] * num_seqs
        if not len(params) == len(prompt_ids) == len(output_ids) == len(banned_token_ids) == num_seqs:
            raise ValueError(f"{num_seqs} rows of logits need as many params, prompt_ids, output_ids and bans")
        if len(allowed_masks) != num_seqs:
            raise ValueError(f"{num_seqs} rows of logits need as many allowed masks (None for an unconstrained row)")
        return [
            self._sample_row(
                logits[row], params[row], prompt_ids[row], output_ids[row], banned_token_ids[row], allowed_masks[row]
            )
            for row in range(num_seqs)
        ]

    def _sample_row(self, logits, params, prompt_ids, output_ids, banned, allowed=None) -> SampleResult:
        if not np.isfinite(logits).all():
            if not params.greedy and params.seed is None:
                self.num_engine_draws += 1  # the row keeps its place in the engine's noise stream, as on the GPU
            return SampleResult(NON_FINITE_LOGITS, None, None)
        z = logits.astype(np.float64)
        z = apply_allowed_mask(z, allowed)
        z = apply_logit_bias(z, params.logit_bias)
        z = apply_banned(z, banned)
        z = apply_penalties(z, params, prompt_ids, output_ids)
        if not np.any(z > -np.inf):
            raise SamplingError("no token can be sampled: every token of the vocabulary is banned or masked")
        if params.greedy:
            token_id = int(np.argmax(z))
        else:
            z = apply_temperature(z, params.temperature)
            z = apply_min_p(z, params.min_p)
            z = apply_top_k(z, params.top_k)
            z = apply_top_p(z, params.top_p)
            token_id = gumbel_argmax(z, self._uniforms(params, len(output_ids), z.shape[0]))
        if params.logprobs is None:
            return SampleResult(token_id, None, None)
        logprobs = raw_logprobs(logits)
        return SampleResult(token_id, float(logprobs[token_id]), top_logprobs(logprobs, params.logprobs))

    def _uniforms(self, params: SamplingParams, output_index: int, vocab_size: int) -> np.ndarray:
        if params.seed is not None:
            return philox_uniforms(params.seed, output_index, SEEDED_STREAM, vocab_size)
        self.num_engine_draws += 1
        return philox_uniforms(self.engine_key, self.num_engine_draws - 1, ENGINE_STREAM, vocab_size)
