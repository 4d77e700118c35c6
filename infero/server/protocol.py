"""OpenAI's request and response shapes: pydantic models that validate what clients send, and builders of the
JSON we answer with (plain dicts: the exact keys OpenAI's API reference and vLLM's `protocol.py` use).

Bodies are parsed with `model_validate_json(body, strict=True)`: a string where a number belongs is a 400, not a
silent conversion. Fields we do not know are ignored (clients send `store`, `metadata`, `service_tier`, ...).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infero.engine import generation_defaults
from infero.engine.request import TokenLogprob
from infero.engine.sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from infero.engine.structured import StructuredOutput, StructuredOutputError
from infero.server.errors import APIError, bad_request
from infero.tokenizer import Tokenizer
from infero.tokenizer.chat_template import schema_problem

MAX_N = 128  # choices per request; the engine also caps n at its --max-num-seqs


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Open(BaseModel):
    """Objects whose extra keys we pass on (a message's custom keys reach the chat template, as in vLLM)."""

    model_config = ConfigDict(extra="allow")


# ---- chat messages and tools ------------------------------------------------------------------------------------


class ContentPart(_Open):
    type: str
    text: str | None = None


class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"  # the wire form is a JSON string; the template wants a dict


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: OpenAI's keys, None values dropped; `developer` is the
        newer name of `system`, which is what templates know."""
        message = self.model_dump(exclude_none=True)
        if message["role"] == "developer":
            message["role"] = "system"
        return message


class FunctionDefinition(_Model):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        problem = schema_problem(parameters)
        if problem is not None:
            raise ValueError(f"not a valid JSON Schema: {problem}")
        return parameters


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Model):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}')
        return self


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs`: one constraint on the output (its options that reshape a JSON schema are not
    taken: an unknown key is a 400)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries the usage so far (with include_usage)


# ---- requests -----------------------------------------------------------------------------------------------------


class _SamplingFields(_Model):
    """What chat and completion requests share: the model name and the sampler's parameters."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    # vLLM's constraints on the output (one at most, response_format included): structured_outputs, and the
    # guided_* fields it took before it
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted; llguidance compiles every constraint
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI uses it only for abuse monitoring
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: only requests with the same salt share cached KV
    return_token_ids: bool = False  # vLLM's: the answer carries the prompt's and the output's token ids
    priority: int = 0  # vLLM's: under --scheduling-policy priority, lower runs first and is preempted last
    # vLLM's: logprobs name each token "token_id:N" (a token that is half a character stays identifiable);
    # None: the server's --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None

    # vLLM's fields for what infero does not do: refused, so that no request gets an answer it did not ask for
    use_beam_search: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    # vLLM's: each prompt token's logprob and rank with the top-N alternatives (-1 asks for the whole vocabulary)
    prompt_logprobs: int | None = Field(None, ge=-1)
    # vLLM's: keep only the prompt's last N tokens (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    @model_validator(mode="after")
    def _nothing_unbuilt(self) -> _SamplingFields:
        unbuilt = {
            "use_beam_search": "beam search is not built; infero samples",
            "allowed_token_ids": "restrict the output with structured_outputs (a regex, choice or grammar) instead",
            "bad_words": "word bans are not built",
            "logits_processors": "infero runs no custom logits processors",
        }
        for name, why in unbuilt.items():
            value = getattr(self, name)
            if value is not None and value is not False:
                raise ValueError(f"{name} is not supported: {why}")
        if self.stream and self.prompt_logprobs is not None:  # as vLLM: they would precede every token
            raise ValueError("prompt_logprobs is not available when streaming")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def _constraints_set(self) -> list[tuple[str, Any, Any]]:
        """(field, value, StructuredOutput maker) of every constraint on the output the request sets."""
        so = self.structured_outputs or StructuredOutputs()
        fields = [("structured_outputs.json", so.json_, StructuredOutput.json_schema),
                  ("structured_outputs.regex", so.regex, StructuredOutput.regex),
                  ("structured_outputs.choice", so.choice, StructuredOutput.choice),
                  ("structured_outputs.grammar", so.grammar, StructuredOutput.grammar),
                  ("structured_outputs.json_object", so.json_object or None, lambda _: StructuredOutput.json_object()),
                  ("guided_json", self.guided_json, StructuredOutput.json_schema),
                  ("guided_regex", self.guided_regex, StructuredOutput.regex),
                  ("guided_choice", self.guided_choice, StructuredOutput.choice),
                  ("guided_grammar", self.guided_grammar, StructuredOutput.grammar)]  # fmt: skip
        if self.response_format is not None and self.response_format.type != "text":
            fields.insert(0, ("response_format", self.response_format, _from_response_format))
        return [field for field in fields if field[1] is not None]

    @property
    def constraint_field(self) -> str:
        """The top-level field that constrains the output (what a grammar that fails to compile is reported as)."""
        return next((name.split(".")[0] for name, _, _ in self._constraints_set()), "response_format")

    def constraints(self) -> list[tuple[str, StructuredOutput]]:
        """(field, constraint) of every constraint on the output the request sets; a 400 naming the field when one
        is malformed."""
        found = []
        for name, value, make in self._constraints_set():
            try:
                found.append((name, make(value)))
            except StructuredOutputError as e:
                raise bad_request(f"{name}: {e}", name.split(".")[0]) from e
        return found


def _from_response_format(response_format: ResponseFormat) -> StructuredOutput | None:
    return StructuredOutput.from_response_format(response_format.model_dump(by_alias=True, exclude_none=True))


class _ChatPromptFields(_Model):
    """vLLM's fields for how a conversation ends its prompt."""

    add_generation_prompt: bool = True  # the template's assistant header after the messages
    continue_final_message: bool = False  # the model goes on with the last message (no generation prompt)

    @property
    def generation_prompt(self) -> bool:
        """add_generation_prompt as the template gets it: off where continue_final_message is on and the request
        left it out (an explicit true beside it is refused by the template)."""
        if self.continue_final_message and "add_generation_prompt" not in self.model_fields_set:
            return False
        return self.add_generation_prompt


class ChatCompletionRequest(_SamplingFields, _ChatPromptFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: only a choice's first tool call is answered
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # vLLM's: for templates that cite documents (RAG)
    echo: bool = False  # vLLM's: the answer's content begins with the last message's, when the model continues it

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice is not None and self.tool_choice != "none" and self.tool_choice != "auto":
            if not self.tools:
                raise ValueError("tool_choice 'required' or a named function needs tools")
            if isinstance(self.tool_choice, NamedToolChoice):
                name = self.tool_choice.function.name
                if name not in {t.function.name for t in self.tools}:
                    raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def echoed(self) -> str:
        """vLLM's echo: the text the answer repeats first, that of the last message when the model goes on in its
        role (no generation prompt after it; with one, only an assistant message, whose role the answer shares)."""
        last = self.messages[-1]
        if not self.echo or (self.generation_prompt and last.role != "assistant"):
            return ""
        if isinstance(last.content, list):
            return "\n".join(part.text for part in last.content if part.text is not None)
        return last.content or ""


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 with echo scores the prompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        if self.suffix is not None:
            raise ValueError("suffix is not supported (infero has no fill-in-the-middle models)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 only makes sense with echo: true (to score the prompt)")
        return self


class TokenizeRequest(_ChatPromptFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give exactly one of "prompt" and "messages"')
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


# ---- requests -> engine parameters ------------------------------------------------------------------------------


def sampling_params(
    req: _SamplingFields,
    *,
    vocab_size: int,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    defaults: dict | None = None,
) -> SamplingParams:
    """The engine's parameters for a request; a 400 naming the field when one is out of range. `defaults`: the
    model's generation defaults (infero.engine.generation_defaults) for what the request leaves out; their
    max_new_tokens caps max_tokens."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    for token_id in req.stop_token_ids or []:
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"stop_token_ids: {token_id} is outside the vocabulary [0, {vocab_size})", "stop_token_ids"
            )
    values = dict(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
    )
    cap = (defaults or {}).get("max_new_tokens")
    max_tokens = max_tokens if cap is None else min(max_tokens, cap)
    try:
        params = generation_defaults.sampling_params(
            defaults or {},
            **values,
            logit_bias=_logit_bias(req.logit_bias, vocab_size),
            seed=req.seed,
            n=req.n,
            max_tokens=max_tokens,
            min_tokens=min(req.min_tokens, max_tokens),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except SamplingError as e:
        name = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param=name if name in type(req).model_fields else None) from e
    return with_structured_output(params, req)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    result = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids; got {key!r}", "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"logit_bias: token id {token_id} is outside the vocabulary [0, {vocab_size})", "logit_bias"
            )
        result[token_id] = value
    return result


def with_structured_output(params: SamplingParams, req: _SamplingFields) -> SamplingParams:
    """Constrain decoding as the request asks: response_format (any JSON object, or JSON matching a schema), or
    vLLM's structured_outputs / guided_* (a schema, regex, choice or grammar); at most one of them."""
    found = req.constraints()
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"the output can follow one constraint; the request sets {names}", found[1][0].split(".")[0])
    return dataclasses.replace(params, structured=found[0][1]) if found else params


# ---- responses --------------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` of the prompt tokens came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip


def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token as logprobs show it: its own text (a half UTF-8 character as U+FFFD) and its exact bytes."""
    if tokenizer.pieces is not None and 0 <= token_id < len(tokenizer.pieces):
        data = tokenizer.pieces[token_id]
        return data.decode("utf-8", "replace"), data
    text = tokenizer.decode([token_id])
    return text, text.encode("utf-8")


def logprob_token(tokenizer: Tokenizer, token_id: int, as_ids: bool) -> tuple[str, bytes]:
    """token_text, its text named "token_id:N" where `as_ids` (vLLM's return_tokens_as_token_ids)."""
    text, data = token_text(tokenizer, token_id)
    return (f"token_id:{token_id}" if as_ids else text), data


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob], as_ids: bool = False) -> list[dict[str, Any]]:
    """`choices[i].logprobs.content` of a chat completion: one entry per generated token (`as_ids`: each token
    named "token_id:N", vLLM's return_tokens_as_token_ids)."""
    content = []
    for entry in entries:
        text, data = logprob_token(tokenizer, entry.token_id, as_ids)
        top = []
        for token_id, logprob in entry.top:
            top_text, top_data = logprob_token(tokenizer, token_id, as_ids)
            top.append({"token": top_text, "logprob": _finite(logprob), "bytes": list(top_data)})
        content.append({"token": text, "logprob": _finite(entry.logprob), "bytes": list(data), "top_logprobs": top})
    return content


def completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprob | None], token_ids: list[int], offset: int, as_ids: bool = False
) -> dict[str, list]:
    """The legacy `logprobs` of a completion choice for `token_ids` (an entry of None, the first prompt token's,
    gives null); `offset` is where the first token's text starts in the choice's text; `as_ids`: each token named
    "token_id:N" (the offsets still count the text)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text, _ = token_text(tokenizer, token_id)
        tokens.append(logprob_token(tokenizer, token_id, as_ids)[0] if as_ids else text)
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(entry.logprob))
        top = {logprob_token(tokenizer, t, as_ids)[0]: _finite(lp) for t, lp in entry.top}
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}  # fmt: skip


def prompt_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob | None], n: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a prompt: null for its first token (nothing predicts it), then per token a map
    from token id to its logprob, rank and text: the prompt's token and the n most likely, ranked 1..n."""
    result: list[dict | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        ranked = [(entry.token_id, entry.logprob, entry.rank)]
        ranked += [(token_id, logprob, rank) for rank, (token_id, logprob) in enumerate(entry.top[:n], 1)]
        result.append({str(token_id): {"logprob": _finite(logprob), "rank": rank,
                                       "decoded_token": token_text(tokenizer, token_id)[0]}
                       for token_id, logprob, rank in ranked})  # fmt: skip
    return result


def _finite(logprob: float) -> float:
    # JSON has no -Infinity; OpenAI clamps to -9999.0 (a token the sampler could never take)
    return max(float(logprob), -9999.0)


def check_model(requested: str | None, served: tuple[str, ...]) -> None:
    """404 unless the request names the served model (by any of its names) or none."""
    if requested is not None and requested not in served:
        names = " or ".join(repr(name) for name in served)
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {names}",
                       param="model", code="model_not_found")  # fmt: skip
