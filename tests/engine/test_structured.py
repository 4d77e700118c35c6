"""Structured output: llguidance matchers over our tokenizers, driven through the Sampler with random logits.

Random logits stand in for a model that knows nothing about the format: whatever it "wants", the mask must
keep the output inside the grammar, and the finished text must parse and validate.
"""

import json
import re
import time

import jsonschema
import numpy as np
import pytest

from infero.checkpoint.gguf import GGUFModel
from infero.default_model import default_model_path
from infero.engine.sampling import Sampler, SamplingError, SamplingParams
from infero.engine.structured import (
    JSON_COMPILE_DEFAULTS,
    GrammarCompiler,
    Matcher,
    StructuredOutput,
    StructuredOutputError,
)
from infero.errors import InferoError, ModelFileError
from infero.tokenizer import Tokenizer

# -- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_tok():
    try:
        path = default_model_path()
    except ModelFileError as e:
        pytest.skip(str(e))
    return Tokenizer.from_gguf_metadata(GGUFModel.open(path).metadata)


@pytest.fixture(scope="module")
def smol(smol_tok):
    return GrammarCompiler(smol_tok)


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_path):
    return Tokenizer.from_gguf_metadata(GGUFModel.open(tiny_model_path).metadata)


@pytest.fixture(scope="module")
def tiny(tiny_tok):
    return GrammarCompiler(tiny_tok)


@pytest.fixture(params=["tiny", "smol"])
def compiler(request):
    return request.getfixturevalue(request.param)


# -- driving a matcher --------------------------------------------------------------------------------------------

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0),  # greedy: the argmax must be taken over allowed tokens only
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=1.3, top_p=0.9, min_p=0.01),
]


def generate(compiler, spec, seed, *, vocab_size=None, max_tokens=500, params=None, logit_bias=None):
    """Sample with random logits under the grammar until it finishes or an end-of-generation token is taken."""
    tok = compiler.tokenizer
    vocab_size = vocab_size or compiler.vocab_size
    rng = np.random.default_rng(seed)
    params = params or PARAMS[seed % len(PARAMS)]
    params = SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        seed=seed,
        logit_bias=logit_bias,
    )
    sampler = Sampler(seed)
    matcher = compiler.compile(spec)
    mask = np.empty(vocab_size, dtype=bool)
    out = []
    for _ in range(max_tokens):
        matcher.fill_mask(mask)
        assert mask.any()
        logits = rng.normal(0.0, 4.0, size=(1, vocab_size)).astype(np.float32)
        [result] = sampler.sample(logits, [params], [[1]], [out], None, [mask])
        token = result.token_id
        assert mask[token]
        assert matcher.accept(token), matcher.error
        if token in compiler.eos_token_ids:
            break
        out.append(token)
        if matcher.is_finished():
            break
    else:
        pytest.fail(f"no end after {max_tokens} tokens: {tok.decode(out)!r}")
    assert matcher.error is None and matcher.is_accepting()
    return tok.decode(out), matcher


def closer_bias(compiler) -> dict[int, float]:
    """Favour tokens with a quote or a closing brace, so that a free-form JSON object ends in a few dozen tokens."""
    tok = compiler.tokenizer
    return {i: 8.0 for i, p in enumerate(tok.pieces) if (b'"' in p or b"}" in p) and i not in tok.special_token_ids}


# -- JSON schemas -------------------------------------------------------------------------------------------------

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "height": {"type": "number"},
            "alive": {"type": "boolean"},
        },
        "required": ["name", "age", "alive"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "pos": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "z": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "meta": {
                "type": "object",
                "properties": {
                    "owner": {
                        "type": "object",
                        "properties": {"n": {"type": "string", "maxLength": 6}},
                        "additionalProperties": False,
                    }
                },
                "required": ["owner"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "pos", "meta"],
        "additionalProperties": False,
    },
    "arrays_enums": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 4},
            "kind": {"enum": ["cat", "dog", 3, None, 'with "quote" and \\ slash']},
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "scores": {"type": "array", "items": {"type": "number", "minimum": -10, "maximum": 10}, "maxItems": 3},
            "const": {"const": "fixed"},
        },
        "required": ["tags", "kind", "color", "const"],
        "additionalProperties": False,
    },
    "defs_anyof": {
        "type": "object",
        "$defs": {"pt": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}},
        "properties": {
            "a": {"$ref": "#/$defs/pt"},
            "b": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}, {"$ref": "#/$defs/pt"}]},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "top_level_array": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "v": {"type": "integer"}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_random_logits_give_json_that_validates(compiler, name):
    schema = SCHEMAS[name]
    seeds = range(16) if compiler.vocab_size < 1000 else range(6)
    for seed in seeds:
        text, _ = generate(compiler, StructuredOutput.json_schema(schema), seed)
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert_compact(text)


def assert_compact(text: str) -> None:
    """No whitespace outside strings but the single spaces of the ", " and ": " separators."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert re.fullmatch(r"(?:[^\s]|(?<=[,:]) (?! ))*", outside), text


def test_strings_with_escapes(compiler):
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    matcher = compiler.compile(StructuredOutput.json_schema(schema))
    text = json.dumps({"s": 'q"b\\s/\n\t\u00e9 \u2603 end'}, ensure_ascii=False)
    for token in compiler.tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept(token), (text, matcher.error)
    assert matcher.is_finished()
    # Random strings: whatever escapes the sampler wandered into, the result parses.
    for seed in range(8):
        schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30}}, "required": ["s"]}
        spec = StructuredOutput.json_schema({**schema, "additionalProperties": False})
        text, _ = generate(compiler, spec, seed)
        jsonschema.validate(json.loads(text), schema)


def test_whitespace_is_compact(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    spec = StructuredOutput.json_schema(schema)
    assert JSON_COMPILE_DEFAULTS["whitespace_flexible"] is False

    def accepts(text):
        m = compiler.compile(spec)
        return all(m.accept(t) for t in compiler.tokenizer.encode(text, add_special_tokens=False))

    assert accepts('{"a": 1, "b": 2}')
    assert not accepts('{"a":1}')
    assert not accepts('{ "a": 1}')
    assert not accepts('{"a": 1,\n "b": 2}')
    # A schema can opt back into free whitespace through llguidance's own options.
    flexible = StructuredOutput.json_schema({**schema, "x-guidance": {"whitespace_flexible": True}})
    m = compiler.compile(flexible)
    assert all(m.accept(t) for t in compiler.tokenizer.encode('{\n  "a" :1}', add_special_tokens=False))


def test_json_object(compiler):
    bias = closer_bias(compiler)
    for seed in range(12):
        text, _ = generate(compiler, StructuredOutput.json_object(), seed, logit_bias=bias)
        assert isinstance(json.loads(text), dict)


# -- regex, choice, grammar ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern",
    [r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)!?", r"[A-Z][a-z/]{0,5} \([0-9]\)"],
)
def test_regex(compiler, pattern):
    for seed in range(10):
        text, _ = generate(compiler, StructuredOutput.regex(pattern), seed)
        assert re.fullmatch(pattern, text), text


def test_choice(compiler):
    options = ["yes", "no", "maybe", "may", 'say "hi"', "café"]
    seen = set()
    for seed in range(40):
        text, _ = generate(compiler, StructuredOutput.choice(options), seed)
        assert text in options
        seen.add(text)
    assert len(seen) >= 3


def test_lark_and_gbnf_grammars(compiler):
    lark = 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[A-Z][a-z]{1,6}/\n'
    for seed in range(10):
        text, _ = generate(compiler, StructuredOutput.grammar(lark), seed)
        assert re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,6}!", text), text
    gbnf = 'root ::= answer "."\nanswer ::= "yes" | "no"\n'
    for seed in range(6):
        text, _ = generate(compiler, StructuredOutput.grammar(gbnf), seed)
        assert text in ("yes.", "no.")


# -- masks --------------------------------------------------------------------------------------------------------

VALUE_STARTS = set(b'{["-0123456789tfn')


def piece_id(tokenizer, text: str) -> int:
    """The id of the token whose bytes are exactly `text` (token_to_id wants the vocabulary's spelling, e.g. "Ġ")."""
    return tokenizer.pieces.index(text.encode())


def _advance(matcher: Matcher, text: str) -> Matcher:
    for token in matcher.grammar._compiler.tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept(token), matcher.error
    return matcher


def test_mask_after_a_key_allows_only_value_starts(tiny, smol):
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"a": {}}, "required": ["a"]})
    for compiler in (tiny, smol):
        pieces = compiler.tokenizer.pieces
        mask = _advance(compiler.compile(spec), '{"a": ').allowed_mask()
        allowed = np.flatnonzero(mask)
        assert allowed.size > 10
        assert all(pieces[t] and pieces[t][0] in VALUE_STARTS for t in allowed)
        for text in ["{", "[", '"', "1", "-", "t", "n"]:  # single-character tokens every vocabulary has
            assert mask[piece_id(compiler.tokenizer, text)], text
        for text in ["}", ",", " ", ":", "a", "]"]:
            assert not mask[piece_id(compiler.tokenizer, text)], text
        assert not mask[list(compiler.eos_token_ids)].any()


def test_mask_is_exactly_the_tokens_the_grammar_accepts(tiny):
    """Every token of the tiny vocabulary, at several points: allowed by the mask <=> the grammar takes it."""
    spec = StructuredOutput.json_schema(SCHEMAS["person"])
    for prefix in ["", "{", '{"name": "ab', '{"name": "x", "age": 1', '{"name": "x", "age": 12, "alive": true']:
        mask = _advance(tiny.compile(spec), prefix).allowed_mask()
        probe = _advance(tiny.compile(spec), prefix)
        for token in range(tiny.vocab_size):
            ok = probe.accept(token)
            assert ok == bool(mask[token]), (prefix, token, tiny.tokenizer.pieces[token])
            if ok:
                probe.rollback(1)
            else:
                probe = _advance(tiny.compile(spec), prefix)


def test_spot_check_random_tokens_against_the_grammar(smol):
    spec = StructuredOutput.json_schema(SCHEMAS["nested"])
    rng = np.random.default_rng(0)
    for prefix in ['{"id": 3', '{"id": 3, "pos": {"x": 1.5', '{"id": -1, "pos": {"x": 0, "y": 2}, "meta": {"owner": {']:
        matcher = _advance(smol.compile(spec), prefix)
        mask = matcher.allowed_mask()
        tokens = np.concatenate((rng.choice(smol.vocab_size, 300, replace=False), rng.choice(np.flatnonzero(mask), 50)))
        for token in tokens:
            ok = matcher.accept(int(token))
            assert ok == bool(mask[token]), (prefix, smol.tokenizer.pieces[token])
            if ok:
                matcher.rollback(1)
            else:
                matcher = _advance(smol.compile(spec), prefix)


def test_complete_grammar_allows_only_end_of_generation(compiler):
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                         "additionalProperties": False})  # fmt: skip
    matcher = _advance(compiler.compile(spec), '{"a": 12}')
    assert matcher.is_finished() and matcher.is_accepting()
    assert set(np.flatnonzero(matcher.allowed_mask())) == set(compiler.eos_token_ids)
    # Complete but extendable: more text or an end-of-generation token.
    matcher = _advance(compiler.compile(StructuredOutput.regex("ab+")), "ab")
    assert matcher.is_accepting() and not matcher.is_finished()
    mask = matcher.allowed_mask()
    assert mask[list(compiler.eos_token_ids)].all() and mask[piece_id(compiler.tokenizer, "b")]
    assert matcher.accept(compiler.eos_token_ids[-1]) and matcher.is_finished()


def test_wider_model_vocabulary_and_out_of_range_ids(compiler):
    matcher = compiler.compile(StructuredOutput.json_object())
    mask = matcher.allowed_mask(compiler.vocab_size + 64)
    assert mask.shape == (compiler.vocab_size + 64,) and mask[: compiler.vocab_size].any()
    assert not mask[compiler.vocab_size :].any()
    assert not matcher.accept(compiler.vocab_size + 3)
    narrow = matcher.allowed_mask(compiler.vocab_size - 1)
    assert (narrow == matcher.allowed_mask()[:-1]).all()


def test_a_rejected_token_ends_the_sequence_cleanly(tiny):
    matcher = tiny.compile(StructuredOutput.json_object())
    assert not matcher.accept(piece_id(tiny.tokenizer, "x"))
    assert matcher.error and matcher.is_finished()
    assert set(np.flatnonzero(matcher.allowed_mask())) == set(tiny.eos_token_ids)
    matcher.reset()
    assert matcher.error is None and matcher.num_tokens == 0 and matcher.accept(piece_id(tiny.tokenizer, "{"))


def test_special_tokens_are_never_allowed(compiler):
    matcher = compiler.compile(StructuredOutput.regex(r"[^\n]{1,40}"))
    mask = matcher.allowed_mask()
    specials = sorted(compiler.tokenizer.special_token_ids - set(compiler.eos_token_ids))
    assert specials and not mask[specials].any()


def test_fill_masks_batch_equals_one_by_one(smol):
    specs = [SCHEMAS["person"], SCHEMAS["arrays_enums"], None, SCHEMAS["nested"]]
    prefixes = ['{"name": "a', '{"tags": [', None, '{"id": 1, "pos": {"x": ']
    matchers = [
        None if s is None else _advance(smol.compile(StructuredOutput.json_schema(s)), p)
        for s, p in zip(specs, prefixes, strict=True)
    ]
    matchers.append(smol.compile(StructuredOutput.json_object()))
    matchers[-1].accept(piece_id(smol.tokenizer, "x"))  # in error: only end-of-generation
    out = np.ones((len(matchers), smol.vocab_size + 5), dtype=bool)
    smol.fill_masks(matchers, out)
    for row, m in enumerate(matchers):
        expected = np.ones(smol.vocab_size + 5, bool) if m is None else m.allowed_mask(smol.vocab_size + 5)
        assert (out[row] == expected).all(), row
    # The packed form the engine hands its sampler: the same bits, for a model vocabulary larger, equal or smaller
    # than the tokenizer's (ids past either are never allowed).
    for vocab in (smol.vocab_size + 40, smol.vocab_size, smol.vocab_size - 7):
        packed = smol.bitmasks(matchers, vocab)
        for row, m in enumerate(matchers):
            if m is None:
                assert packed[row] is None
                continue
            assert packed[row].dtype == np.uint32 and packed[row].shape == (-(-vocab // 32),)
            bits = np.unpackbits(packed[row].view(np.uint8), bitorder="little")
            assert np.array_equal(bits[:vocab].astype(bool), m.allowed_mask(vocab)), (vocab, row)
            assert not bits[vocab:].any()


# -- compilation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: StructuredOutput.json_schema({"type": "objec"}),
        lambda: StructuredOutput.json_schema({"properties": 5}),
        lambda: StructuredOutput.json_schema({"type": "string", "pattern": "a(b"}),
        lambda: StructuredOutput.json_schema({"type": "string", "format": "no-such-format"}),
        lambda: StructuredOutput.json_schema({"type": "array", "uniqueItems": True}),  # not implemented: refused
        lambda: StructuredOutput.regex("a(b"),
        lambda: StructuredOutput.regex("[z-a]"),
        lambda: StructuredOutput.grammar("start: ("),
        lambda: StructuredOutput.grammar("blah blah"),
        lambda: StructuredOutput.grammar('start: foo\nfoo: "a" bar'),
    ],
)
def test_invalid_constraints_raise_at_compile(tiny, make):
    with pytest.raises(InferoError) as e:
        tiny.compile(make())
    assert isinstance(e.value, StructuredOutputError) and str(e.value).startswith("invalid ")


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        ("xml", "x"),
        ("json_object", {"type": "object"}),
        ("json_schema", "{not json"),
        ("json_schema", [1, 2]),
        ("json_schema", {"x": object()}),
        ("regex", ""),
        ("regex", 5),
        ("choice", []),
        ("choice", "yes"),
        ("choice", ["a", 1]),
        ("grammar", None),
    ],
)
def test_malformed_specs_raise_on_construction(kind, value):
    with pytest.raises(StructuredOutputError):
        StructuredOutput(kind, value)


def test_helpers_and_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert StructuredOutput.json_schema(json.dumps(schema)) == StructuredOutput("json_schema", schema)
    assert StructuredOutput.choice(["a", "b"]).value == ("a", "b")
    reordered = StructuredOutput.json_schema({"properties": schema["properties"], "type": "object"})
    assert (
        reordered == StructuredOutput.json_schema(schema)
        and len({reordered, StructuredOutput.json_schema(schema)}) == 1
    )
    assert StructuredOutput.regex("a") != StructuredOutput.grammar("a")
    assert StructuredOutput.from_response_format(None) is None
    assert StructuredOutput.from_response_format({"type": "text"}) is None
    assert StructuredOutput.from_response_format({"type": "json_object"}) == StructuredOutput.json_object()
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert StructuredOutput.from_response_format(rf) == StructuredOutput.json_schema(schema)
    with pytest.raises(StructuredOutputError):
        StructuredOutput.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(StructuredOutputError):
        StructuredOutput.from_response_format({"type": "yaml"})


def test_cache_returns_the_same_compiled_grammar(tiny_tok):
    compiler = GrammarCompiler(tiny_tok, cache_size=2)
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}
    a_reordered = {"properties": {"y": {"type": "string"}, "x": {"type": "integer"}}, "type": "object"}
    first = compiler.compile(StructuredOutput.json_schema(a))
    second = compiler.compile(StructuredOutput.json_schema(a_reordered))
    assert first.grammar is second.grammar and first is not second
    # Matchers of one grammar are independent.
    _advance(first, '{"x": 1')
    assert second.num_tokens == 0 and second.allowed_mask()[piece_id(tiny_tok, "{")]
    # Least recently used goes first.
    regex = compiler.compile_grammar(StructuredOutput.regex("a+"))
    assert compiler.compile(StructuredOutput.json_schema(a)).grammar is first.grammar  # a is now the most recent
    compiler.compile(StructuredOutput.choice(["p", "q"]))  # evicts the regex, keeps a
    assert compiler.compile(StructuredOutput.json_schema(a)).grammar is first.grammar
    assert compiler.compile_grammar(StructuredOutput.regex("a+")) is not regex  # compiled again
    assert len(compiler._cache) == 2


def test_invalid_specs_are_not_cached(tiny_tok):
    compiler = GrammarCompiler(tiny_tok)
    for _ in range(2):
        with pytest.raises(StructuredOutputError):
            compiler.compile(StructuredOutput.regex("a(b"))
    assert not compiler._cache


# -- the sampler's mask -------------------------------------------------------------------------------------------


def test_sampler_mask_applies_before_everything():
    rng = np.random.default_rng(3)
    vocab = 50
    logits = rng.normal(size=(1, vocab)).astype(np.float32)
    allowed = np.zeros(vocab, bool)
    allowed[[4, 9, 31]] = True
    sampler = Sampler(0)
    greedy = SamplingParams(temperature=0, logprobs=3)
    [r] = sampler.sample(logits, [greedy], [[1]], [[]], None, [allowed])
    assert r.token_id == [4, 9, 31][int(np.argmax(logits[0, [4, 9, 31]]))]
    # Logprobs are the raw model's, not the masked distribution's.
    [free] = sampler.sample(logits, [greedy], [[1]], [[]])
    assert r.top_logprobs == free.top_logprobs and r.logprob < 0
    # Neither logit_bias nor penalties revive a masked token.
    biased = SamplingParams(temperature=0, logit_bias={0: 100.0}, repetition_penalty=0.5)
    [r] = sampler.sample(logits, [biased], [[0]], [[0]], None, [allowed])
    assert r.token_id in (4, 9, 31)
    for seed in range(50):
        params = SamplingParams(temperature=2.0, top_k=3, seed=seed)
        [r] = sampler.sample(logits, [params], [[1]], [[]], None, [allowed])
        assert allowed[r.token_id]


def test_sampler_mask_rows_are_independent_and_none_is_unconstrained():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 20)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    only7 = np.zeros(20, bool)
    only7[7] = True
    masked = Sampler(0).sample(logits, params, [[1]] * 3, [[]] * 3, None, [None, only7, None])
    free = Sampler(0).sample(logits, params, [[1]] * 3, [[]] * 3)
    assert masked[1].token_id == 7
    assert masked[0] == free[0] and masked[2] == free[2]


def test_sampler_mask_errors():
    logits = np.zeros((1, 10), np.float32)
    p = [SamplingParams(temperature=0)]
    with pytest.raises(SamplingError, match="masked"):
        Sampler(0).sample(logits, p, [[1]], [[]], None, [np.zeros(10, bool)])
    with pytest.raises(ValueError, match="allowed mask"):
        Sampler(0).sample(logits, p, [[1]], [[]], None, [np.ones(11, bool)])
    with pytest.raises(ValueError, match="allowed mask"):
        Sampler(0).sample(logits, p, [[1]], [[]], None, [np.ones(10, np.int8)])
    with pytest.raises(ValueError, match="allowed masks"):
        Sampler(0).sample(logits, p, [[1]], [[]], None, [])
    # A complete grammar allows only EOS; banning EOS (min_tokens) then leaves nothing to sample.
    eos_only = np.zeros(10, bool)
    eos_only[2] = True
    with pytest.raises(SamplingError):
        Sampler(0).sample(logits, p, [[1]], [[]], [{2}], [eos_only])


# -- cost ---------------------------------------------------------------------------------------------------------


def test_mask_cost_on_smollm2(smol, record_property):
    """Not an assertion on time: records the cost of one mask over SmolLM2's 49k vocabulary (see -rP)."""
    spec = StructuredOutput.json_schema(SCHEMAS["nested"])
    matcher = smol.compile(spec)
    tokens = smol.tokenizer.encode(
        '{"id": 12345, "pos": {"x": 1.25, "y": -3}, "meta": {"owner": {"n": "abc"}}}', add_special_tokens=False
    )
    mask = np.empty(smol.vocab_size, bool)
    times = []
    for token in tokens:
        start = time.perf_counter()
        matcher.fill_mask(mask)
        times.append(time.perf_counter() - start)
        assert mask[token] and matcher.accept(token)
    per_token_us = 1e6 * float(np.median(times))
    record_property("mask_us_per_token_median", per_token_us)
    print(f"SmolLM2 ({smol.vocab_size} tokens): mask median {per_token_us:.0f} us, max {1e6 * max(times):.0f} us")
