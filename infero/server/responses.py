"""OpenAI's Responses API (`POST /v1/responses`) over the chat completions path, as vLLM serves it.

A request's `instructions` and `input` items become the chat messages (function calls the model made and their
outputs included), its function tools and `text.format` the chat request's tools and response_format; the one
choice's text, reasoning and tool calls become the response's output items. Stateless: infero keeps no responses,
so `previous_response_id` is refused and the conversation travels in `input`. Streamed, the chat deltas become
the Responses events (response.created ... response.output_text.delta ... response.completed).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import Field

from infero.server import protocol
from infero.server.errors import bad_request
from infero.server.streaming import ChatStreamContext, Generation, chat_choice_deltas, error_object, sse

# The chat request fields a Responses request may carry as they are (vLLM's sampling extensions among them).
PASSED_ON = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "seed", "stop", "ignore_eos", "chat_template_kwargs", "cache_salt", "parallel_tool_calls")  # fmt: skip


class ResponsesRequest(protocol._Model):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None  # accepted; infero stores no response
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None


def to_chat(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completions request that computes this response (validated by the caller as one)."""
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: infero stores no responses; send the whole "
                          "conversation in input", "previous_response_id")  # fmt: skip
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _messages(req.input)
    # instructions and the developer messages before the first turn as one system message: templates take one
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if lead > 1:
        messages[:lead] = [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:lead])}]
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": False}
    chat.update({name: getattr(req, name) for name in PASSED_ON if getattr(req, name) is not None})
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    if req.tools:
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(req.tool_choice)
    format_ = (req.text or {}).get("format")
    if format_ is not None:
        chat["response_format"] = _response_format(format_)
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:  # what reasoning templates read (gpt-oss's, among others)
        chat["chat_template_kwargs"] = {"reasoning_effort": effort, **(req.chat_template_kwargs or {})}
    return chat


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"input[{i}]: role must be user, assistant, system or developer; got {role!r}",
                                  "input")  # fmt: skip
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), f"input[{i}]")})  # fmt: skip
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}  # fmt: skip
            if not isinstance(call["id"], str) or not isinstance(call["function"]["name"], str):
                raise bad_request(f"input[{i}]: a function_call needs its call_id and name", "input")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls of one turn are one assistant message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"input[{i}]: a function_call_output needs its call_id", "input")
            text = output if isinstance(output, str) else _text(output, f"input[{i}]")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # a model's earlier reasoning: templates drop it from earlier turns
        else:
            raise bad_request(f"input[{i}]: items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output and reasoning are)", "input")  # fmt: skip
    if not messages:
        raise bad_request("input holds no message", "input")
    return messages


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or its text parts joined (input_text, output_text, text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: only text content is supported; got a part of type {kind!r}", "input")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where}: content must be a string or a list of text parts", "input")


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(f"tools[{i}]: only function tools (with a name) are supported; got type "
                          f"{tool.get('type')!r}", "tools")  # fmt: skip
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice: a function tool choice is {{'type': 'function', 'name': ...}}; got {choice}",
                      "tool_choice")  # fmt: skip


def _response_format(format_: dict[str, Any]) -> dict[str, Any]:
    kind = format_.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": format_.get("name", "response"),
                                                        "schema": format_.get("schema")}}  # fmt: skip
    raise bad_request(f"text.format: type must be text, json_object or json_schema; got {kind!r}", "text")


# ---- answers ----------------------------------------------------------------------------------------------------


def new_id() -> str:
    """A response id as OpenAI writes them: "resp_" and hex digits."""
    return f"resp_{uuid.uuid4().hex}"


def response(req: ResponsesRequest, response_id: str, created: int, model: str, output: list[dict],
             status: str, usage: dict | None) -> dict[str, Any]:  # fmt: skip
    """The Response object, in OpenAI's shape."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None, "reasoning": req.reasoning,
        "store": False, "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p, "truncation":
        "disabled", "usage": usage, "user": req.user,
    }  # fmt: skip


def usage(chat_usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """A chat completion's usage in the Responses shape."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}  # fmt: skip


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


# ---- streaming ----------------------------------------------------------------------------------------------------


class _Events:
    """The Responses events of one streamed response: output items opened and closed as the chat deltas go from
    reasoning to text to function calls."""

    def __init__(self, req: ResponsesRequest, response_id: str, created: int, model: str):
        self.req, self.response_id, self.created, self.model = req, response_id, created, model
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items closed so far
        self.final: dict[str, Any] | None = None  # the response, once complete
        self.open: dict[str, Any] | None = None  # the item deltas go to: its kind, id and text so far

    def emit(self, type_: str, **fields) -> bytes:
        data = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {type_}\n".encode() + sse(data)

    def snapshot(self, status: str, usage_: dict | None = None) -> dict[str, Any]:
        return response(self.req, self.response_id, self.created, self.model, list(self.output), status, usage_)

    def start(self) -> list[bytes]:
        return [self.emit("response.created", response=self.snapshot("in_progress")),
                self.emit("response.in_progress", response=self.snapshot("in_progress"))]  # fmt: skip

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        events = []
        if delta.get("reasoning_content"):
            events += self._to("reasoning")
            events.append(self._text_delta("response.reasoning_text.delta", delta["reasoning_content"]))
        if delta.get("content"):
            events += self._to("message")
            events.append(self._text_delta("response.output_text.delta", delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or []:
            if call.get("id"):  # a new call
                events += self._to("function_call", call_id=call["id"], name=call["function"]["name"])
            fragment = (call.get("function") or {}).get("arguments") or ""
            if fragment and self.open is not None and self.open["kind"] == "function_call":
                self.open["text"] += fragment
                events.append(self.emit("response.function_call_arguments.delta", item_id=self.open["id"],
                                        output_index=len(self.output), delta=fragment))  # fmt: skip
        return events

    def _text_delta(self, type_: str, text: str, **extra) -> bytes:
        self.open["text"] += text
        return self.emit(type_, item_id=self.open["id"], output_index=len(self.output), content_index=0, delta=text,
                         **extra)  # fmt: skip

    def _to(self, kind: str, **call) -> list[bytes]:
        """Close the open item unless it is a `kind` one deltas continue (a new call always opens its own)."""
        if self.open is not None and self.open["kind"] == kind and kind != "function_call":
            return []
        events = self.close()
        index = len(self.output)
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item_id = f"{prefix}_{self.response_id.removeprefix('resp_')}_{index}"
        self.open = {"kind": kind, "id": item_id, "text": "", **call}
        events.append(self.emit("response.output_item.added", output_index=index, item=self._item("in_progress")))
        if kind != "function_call":
            events.append(self.emit("response.content_part.added", item_id=self.open["id"], output_index=index,
                                    content_index=0, part=self._part("")))  # fmt: skip
        return events

    def _part(self, text: str) -> dict[str, Any]:
        if self.open["kind"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, status: str) -> dict[str, Any]:
        o = self.open
        if o["kind"] == "message":
            item = _message_item(o["id"], o["text"], status)
        elif o["kind"] == "reasoning":
            item = _reasoning_item(o["id"], o["text"], status)
        else:
            item = _call_item(o["id"], o["call_id"], o["name"], o["text"], status)
        if status == "in_progress" and o["kind"] != "function_call":
            item["content"] = []
        return item

    def close(self, status: str = "completed") -> list[bytes]:
        """Close the open item; `status` incomplete where the output stopped at its length limit inside it."""
        if self.open is None:
            return []
        o, index = self.open, len(self.output)
        if o["kind"] == "function_call":
            events = [self.emit("response.function_call_arguments.done", item_id=o["id"], output_index=index,
                                arguments=o["text"], name=o["name"])]  # fmt: skip
        else:
            done = "response.reasoning_text.done" if o["kind"] == "reasoning" else "response.output_text.done"
            extra = {} if o["kind"] == "reasoning" else {"logprobs": []}
            events = [self.emit(done, item_id=o["id"], output_index=index, content_index=0, text=o["text"], **extra),
                      self.emit("response.content_part.done", item_id=o["id"], output_index=index, content_index=0,
                                part=self._part(o["text"]))]  # fmt: skip
        item = self._item(status)
        events.append(self.emit("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.open = None
        return events


async def _events(req: ResponsesRequest, gen: Generation, ctx: ChatStreamContext, events: _Events):
    """The Responses events of one chat generation (one choice); `events.final` is the response after the last.
    Reasoning tokens: where the output reasons, those generated before its answer (text or a call) begins (the
    output that begins it counts as answer)."""
    for event in events.start():
        yield event
    finish, before_answer, reasoned, answering = None, 0, False, False
    async with aclosing(gen.outputs()) as outputs:
        async for index, _, out in outputs:
            choices = chat_choice_deltas(index, out, ctx)
            deltas = [choice["delta"] for choice in choices]
            reasoned = reasoned or any(d.get("reasoning_content") for d in deltas)
            answering = answering or any(d.get("content") or d.get("tool_calls") for d in deltas)
            before_answer += 0 if answering else len(out.new_token_ids)
            for choice in choices:
                for event in events.delta(choice["delta"]):
                    yield event
                finish = choice["finish_reason"] or finish
    status = "incomplete" if finish == "length" else "completed"
    for event in events.close(status):
        yield event
    events.final = events.snapshot(status, usage(gen.usage(gen.num_generated), before_answer if reasoned else 0))
    yield events.emit(f"response.{status}", response=events.final)


async def stream(req: ResponsesRequest, gen: Generation, ctx: ChatStreamContext) -> AsyncIterator[bytes]:
    """The Responses events of one streamed chat generation; an error after the first is one more event."""
    events = _Events(req, ctx.response_id, ctx.created, ctx.model)
    try:
        async for event in _events(req, gen, ctx, events):
            yield event
    except Exception as e:  # noqa: BLE001 (the stream has begun: the error is an event, as OpenAI sends it)
        error = error_object(e)
        yield events.emit("error", code=error["code"] or error["type"], message=error["message"], param=None)


async def collect(req: ResponsesRequest, gen: Generation, ctx: ChatStreamContext) -> dict[str, Any]:
    """The Response of one chat generation, not streamed (an error raises, for its own HTTP status)."""
    events = _Events(req, ctx.response_id, ctx.created, ctx.model)
    async for _ in _events(req, gen, ctx, events):
        pass
    return events.final
