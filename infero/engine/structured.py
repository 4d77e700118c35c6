"""Structured output: decoding constrained by a grammar, so the text is well formed by construction.

A request's constraint is a `StructuredOutput` (a JSON schema, any JSON object, a regex, a list of choices, or a
Lark/GBNF grammar). `GrammarCompiler` turns it into a `Matcher` with llguidance (the constraint engine vLLM and
SGLang use): a per-sequence parser that, before each token, says which token ids may come next. The engine puts
that mask on the row's logits before sampling (`Sampler.sample(..., allowed_masks=...)`) and feeds the sampled
token back with `Matcher.accept`. Per decode step, for each constrained sequence:

    matcher.fill_mask(mask_row)            # or compiler.fill_masks(matchers, masks) for the whole batch at once
    token = sampler.sample(..., allowed_masks=[..., mask_row, ...])
    matcher.accept(token)                  # False: the token broke the grammar (cannot happen through the mask)
    if matcher.is_finished(): stop         # the grammar is complete (or an EOS was taken)

Once the grammar is complete and cannot be extended, the mask allows only the end-of-generation tokens.

JSON whitespace. llguidance's JSON compiler by default allows any run of whitespace between tokens, so a weak
model can emit spaces and newlines forever and never close the object. We compile JSON with
`JSON_COMPILE_DEFAULTS`: no free whitespace (`whitespace_flexible: false`), items separated by ", " and keys by
": " (Python's `json.dumps` layout, which models see most). A schema may override this with llguidance's own
`"x-guidance"` key: when it sets any of whitespace_flexible, whitespace_pattern, item_separator or key_separator,
the layout is llguidance's defaults plus those options (e.g. `{"x-guidance": {"whitespace_flexible": true}}` gives
free whitespace around "," and ":"); other x-guidance options (e.g. `lenient`) combine with our layout.
Keywords llguidance does not implement (e.g. `uniqueItems`) are rejected at compile time rather than silently
ignored, since ignoring them would break the "valid by construction" promise; `"x-guidance": {"lenient": true}`
in the schema opts into ignoring them.

Token bytes. The llguidance tokenizer is built from the same per-token bytes the detokenizer concatenates
(`Tokenizer.pieces`), so what the grammar sees is exactly the text the user gets. Control tokens are marked as
special (a grammar never produces them). For SentencePiece vocabularies whose detokenizer strips the first
leading space of the output, the grammar sees that space, so the first token of constrained output cannot be one
that starts with a space (e.g. "▁{"); the model has to pick the space-less token. Byte-level BPE vocabularies
(GPT-2 style, as SmolLM2, Llama 3, Qwen) have no such quirk.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from infero.engine.sampling import unpack_bitmask
from infero.errors import InferoError
from infero.tokenizer import Tokenizer

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# Applied before the schema's own "x-guidance" options (see the module docstring).
JSON_COMPILE_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 64


class StructuredOutputError(InferoError):
    """A structured-output constraint is malformed: bad JSON schema, regex or grammar, or an empty choice list."""


@dataclass(frozen=True, eq=False)
class StructuredOutput:
    """What the output must match. Build one with the helpers: `StructuredOutput.json_schema(schema)`, ...

    kind          value
    json_object   None: any JSON object
    json_schema   the schema, a dict (JSON Schema as llguidance implements it)
    regex         the pattern (Rust `regex` syntax, Unicode-aware: \\d is any Unicode digit, write [0-9] for
                  ASCII; the whole output must match)
    choice        a tuple of strings: the output is exactly one of them
    grammar       grammar text: Lark (llguidance's dialect, https://github.com/guidance-ai/llguidance) or GBNF

    Construction checks the shape of `value`; the content (is the schema valid, does the regex parse) is checked
    by `GrammarCompiler.compile`, when the request arrives. Equal and hashed by `cache_key`.
    """

    kind: str
    value: Any = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise StructuredOutputError(f"structured output kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        value = self.value
        if self.kind == "json_object":
            if value is not None:
                raise StructuredOutputError(f"json_object takes no value; got {value!r}")
        elif self.kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise StructuredOutputError(f"a JSON schema must be a JSON object; got {type(value).__name__}")
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise StructuredOutputError(f"the JSON schema holds something that is not JSON: {e}") from None
        elif self.kind == "choice":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
                raise StructuredOutputError(f"choice takes a non-empty list of strings; got {value!r}")
            if not all(isinstance(c, str) for c in value):
                raise StructuredOutputError(f"every choice must be a string; got {value!r}")
            value = tuple(value)
        else:  # regex, grammar
            if not isinstance(value, str) or not value:
                raise StructuredOutputError(f"{self.kind} takes a non-empty string; got {value!r}")
        object.__setattr__(self, "value", value)

    def __eq__(self, other):
        return isinstance(other, StructuredOutput) and self.cache_key == other.cache_key

    def __hash__(self):
        return hash(self.cache_key)

    # -- helpers ----------------------------------------------------------------------------------------------

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        """JSON matching `schema` (a dict, or its JSON text)."""
        return cls("json_schema", schema)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        """Text the regex matches in full."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredOutput:
        """Exactly one of `options`."""
        return cls("choice", options)

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        """Text of a Lark (llguidance dialect) or GBNF grammar."""
        return cls("grammar", text)

    @classmethod
    def from_response_format(cls, response_format: dict[str, Any] | None) -> StructuredOutput | None:
        """From an OpenAI `response_format`: {"type": "text" | "json_object" | "json_schema", ...}; None for text."""
        if response_format is None:
            return None
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
            if schema is None:
                raise StructuredOutputError('response_format json_schema needs "json_schema": {"schema": {...}}')
            return cls.json_schema(schema)
        raise StructuredOutputError(
            f'response_format type must be "text", "json_object" or "json_schema"; got {kind!r}'
        )

    # -- compilation ------------------------------------------------------------------------------------------

    @property
    def cache_key(self) -> str:
        """A canonical text of this constraint: equal constraints (dict key order aside) have equal keys."""
        return json.dumps([self.kind, self.value], sort_keys=True, separators=(",", ":"))

    def to_llguidance(self) -> str:
        """The llguidance grammar text (not yet checked: `GrammarCompiler.compile` checks it)."""
        try:
            if self.kind in ("json_object", "json_schema"):
                schema = {"type": "object"} if self.kind == "json_object" else self.value
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_json_defaults(schema))
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.value)
            if self.kind == "choice":
                # Lark string literals take JSON string escapes.
                return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
            return llguidance.grammar_from("grammar", self.value)
        except ValueError as e:
            raise StructuredOutputError(f"invalid {self.kind}: {e}") from None


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A constraint compiled against one tokenizer; shared (read only) by every `Matcher` made from it."""

    spec: StructuredOutput
    grammar: str  # llguidance's grammar text
    _template: llguidance.LLMatcher = field(repr=False)  # initial state, never advanced: matchers copy it
    _compiler: GrammarCompiler = field(repr=False)

    def matcher(self) -> Matcher:
        """A new matcher at the start of the output."""
        return Matcher(self)


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Build it once per model: the llguidance tokenizer is built here.

    `compile(spec)` is cheap for a constraint seen recently: the last `cache_size` compiled grammars are kept
    (least recently used goes first), keyed by `spec.cache_key`. Safe to call from several threads.
    """

    def __init__(self, tokenizer: Tokenizer, cache_size: int = DEFAULT_CACHE_SIZE):
        self.tokenizer = tokenizer
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        # Every end-of-generation id may end a complete output; the engine stops on any of them.
        self.eos_token_ids: tuple[int, ...] = tuple(eos + sorted(set(tokenizer.eog_token_ids) - set(eos)))
        if not self.eos_token_ids:
            raise StructuredOutputError("structured output needs a tokenizer with an end-of-sequence token")
        self.ll_tokenizer = _ll_tokenizer(tokenizer, list(self.eos_token_ids))
        self.vocab_size = self.ll_tokenizer.vocab_size  # the tokenizer's; a model's logits may be wider
        self._mask_words = (self.vocab_size + 31) // 32
        self.cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None

    def compile(self, spec: StructuredOutput) -> Matcher:
        """A fresh matcher for `spec`. Raises StructuredOutputError when the schema, regex or grammar is invalid."""
        return self.compile_grammar(spec).matcher()

    def compile_grammar(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar for `spec`, from the cache when it is there."""
        if not isinstance(spec, StructuredOutput):
            raise TypeError(f"expected a StructuredOutput, got {type(spec).__name__}")
        key = spec.cache_key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        grammar = spec.to_llguidance()
        # Building the matcher compiles the grammar (llguidance drops the GIL meanwhile) and reports its errors.
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise StructuredOutputError(f"invalid {spec.kind}: {_first_line(template.get_error())}")
        compiled = CompiledGrammar(spec, grammar, template, self)
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def fill_masks(self, matchers: Sequence[Matcher | None], out: np.ndarray) -> np.ndarray:
        """Row i of `out` (bool [len(matchers), vocab]) = matchers[i]'s allowed tokens, computed in parallel.

        Rows whose matcher is None are left as they are. Equivalent to `m.fill_mask(out[i])` for each row.
        """
        if out.ndim != 2 or out.dtype != np.bool_ or out.shape[0] != len(matchers):
            raise ValueError(f"out must be bool [{len(matchers)}, vocab]; got {out.dtype} {out.shape}")
        for i, bits in enumerate(self.bitmasks(matchers, out.shape[1])):
            if bits is not None:
                out[i] = unpack_bitmask(bits, out.shape[1])
        return out

    def bitmasks(self, matchers: Sequence[Matcher | None], vocab_size: int) -> list[np.ndarray | None]:
        """Per matcher its allowed next tokens as a bitmask over `vocab_size` ids (uint32 [ceil(vocab_size / 32)],
        bit t % 32 of word t // 32; llguidance's own layout), computed in parallel; None where the matcher is None.
        No per-token work on the host: the GPU sampler takes these words as they are."""
        rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
        out: list[np.ndarray | None] = [None] * len(matchers)
        if not rows:
            return out
        for _, m in rows:
            if m.grammar._compiler is not self:
                raise ValueError("every matcher must come from this compiler")
        bits = llg_numpy.allocate_token_bitmask(len(rows), self.vocab_size)
        healthy = [(k, m) for k, (_, m) in enumerate(rows) if not m._ll.is_error()]
        if healthy:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llg_numpy.fill_next_token_bitmask_par(self._executor, [(m._ll, k) for k, m in healthy], bits)
        words = -(-vocab_size // 32)
        for k, (i, m) in enumerate(rows):
            row = np.zeros(words, np.uint32)
            if m._ll.is_error():  # a mask computation can fail too (e.g. a parser limit): only end-of-generation
                for t in self.eos_token_ids:
                    if t < vocab_size:
                        row[t // 32] |= np.uint32(1 << (t % 32))
            else:  # ids past either vocabulary are never allowed
                valid = min(vocab_size, self.vocab_size)
                full, rest = divmod(valid, 32)
                row[:full] = bits[k, :full].view(np.uint32)
                if rest:
                    row[full] = np.uint32(int(bits[k, full].view(np.uint32)) & ((1 << rest) - 1))
            out[i] = row
        return out

    def _eos_only(self, out: np.ndarray) -> None:
        out[:] = False
        ids = [t for t in self.eos_token_ids if t < out.shape[0]]
        out[ids] = True


class Matcher:
    """One sequence's position in its grammar: which tokens may come next, and the tokens taken so far.

    Not thread safe; one per sequence (an n > 1 request needs one per child). Ids at or past the tokenizer's
    vocabulary (padding rows of a wider model vocabulary) are never allowed.
    """

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self._ll = grammar._template.deep_copy()
        self._bits = np.empty(grammar._compiler._mask_words, dtype=np.int32)
        self.num_tokens = 0  # tokens accepted since the start (or the last reset)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size: ids from here on are never allowed."""
        return self.grammar._compiler.vocab_size

    def fill_mask(self, out: np.ndarray) -> np.ndarray:
        """Write the allowed next tokens into `out` (bool, one entry per id of the model's vocabulary); return it.

        When the grammar is complete and cannot go on, only the end-of-generation ids are allowed. When the
        matcher is in error (see `error`), also only those, so the sequence ends instead of the step failing.
        """
        if out.ndim != 1 or out.dtype != np.bool_:
            raise ValueError(f"out must be a 1-D bool array; got {out.dtype} {out.shape}")
        if self._ll.is_error():
            self.grammar._compiler._eos_only(out)
            return out
        self._ll.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._unpack(self._bits, out)
        return out

    def allowed_mask(self, vocab_size: int | None = None) -> np.ndarray:
        """A new bool array of `vocab_size` (default: the tokenizer's) with the allowed next tokens."""
        return self.fill_mask(np.empty(self.vocab_size if vocab_size is None else vocab_size, dtype=np.bool_))

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token. False if the grammar does not allow it (the matcher is then in error)."""
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            return False
        ok = self._ll.consume_token(token_id)
        if ok:
            self.num_tokens += 1
        return ok

    def is_accepting(self) -> bool:
        """True when the text so far is complete (an end-of-generation token is allowed now)."""
        return self._ll.is_accepting()

    def is_finished(self) -> bool:
        """True when no more text may come: the grammar is complete and cannot be extended, an end-of-generation
        token was accepted, or the matcher is in error. The engine should stop the sequence."""
        return self._ll.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token against the grammar, a parser resource limit), or None."""
        return _first_line(self._ll.get_error()) if self._ll.is_error() else None

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (for speculative decoding)."""
        if not 0 <= num_tokens <= self.num_tokens or not self._ll.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        self.num_tokens -= num_tokens

    def reset(self) -> None:
        """Back to the start of the output (also clears an error)."""
        self._ll = self.grammar._template.deep_copy()
        self.num_tokens = 0

    def _unpack(self, bits: np.ndarray, out: np.ndarray) -> None:
        compiler = self.grammar._compiler
        if self._ll.is_error():  # a mask computation can fail too (e.g. a parser limit)
            compiler._eos_only(out)
            return
        n = min(out.shape[0], compiler.vocab_size)
        out[:n] = unpack_bitmask(bits, compiler.vocab_size)[:n]
        out[n:] = False


class _TokenizerWrapper:
    """What `llguidance.TokenizerWrapper` reads: token bytes, eos/bos ids, special ids, and text -> ids."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int):
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = list(tokenizer.pieces)
        self.special_token_ids = sorted(t for t in tokenizer.special_token_ids if t < len(self.tokens))

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def _ll_tokenizer(tokenizer: Tokenizer, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    try:
        if tokenizer.pieces is not None:
            wrapper = llguidance.TokenizerWrapper(_TokenizerWrapper(tokenizer, eos_token_ids[0]))
            return llguidance.LLTokenizer(wrapper, eos_token=eos_token_ids)
        # No byte table (a decoder we do not model): llguidance reads the tokenizer.json itself.
        return llguidance.LLTokenizer(
            tokenizer.hf_tokenizer.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos_token_ids
        )
    except ValueError as e:
        raise StructuredOutputError(f"cannot build the structured-output tokenizer: {e}") from None


def _json_defaults(schema: dict[str, Any]) -> dict[str, Any] | None:
    """Our compact layout, unless the schema's "x-guidance" sets a layout of its own (then llguidance's defaults)."""
    own = schema.get("x-guidance")
    if isinstance(own, dict) and own.keys() & _LAYOUT_OPTIONS:
        return None
    return JSON_COMPILE_DEFAULTS


_LAYOUT_OPTIONS = {"whitespace_flexible", "whitespace_pattern", "item_separator", "key_separator"}


def _first_line(message: str) -> str:
    """llguidance errors may append a dump of the parser state after the message: keep the message."""
    head = message.split("\n<state>", 1)[0].strip()
    return head or "unknown grammar error"
