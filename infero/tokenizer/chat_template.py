"""Render a conversation into a prompt with the model's Jinja chat template.

A model only answers well when its prompt is byte-for-byte the text it was trained on, and the reference for that
text is Hugging Face transformers' `apply_chat_template(..., tokenize=False)`
(transformers/utils/chat_template_utils.py). So we copy its rules:
- the environment: sandboxed (`ImmutableSandboxedEnvironment`), `trim_blocks`, `lstrip_blocks`, no
  `keep_trailing_newline`, the loop-controls extension and a `{% generation %}` tag that renders its body;
- the globals: `raise_exception`, `strftime_now`, a `tojson` filter that keeps non-ASCII text and takes `indent`,
  `separators` and `sort_keys`, a `dict` and a `namespace` that give no handle on Python internals;
- the variables: `messages`, `tools`, `documents`, `add_generation_prompt`, `bos_token`, `eos_token`, and any extra
  keyword argument (`enable_thinking`, `date_string`, ...), which overrides the special tokens;
- the message clean-up: keys whose value is None are dropped, and `reasoning`/`thinking`/`reasoning_content` are
  copied to one another's names, because templates read different ones.

Messages arrive in OpenAI's shape, which templates were not all written for, so first we fit them to the template as
vLLM does (vllm/entrypoints/chat_utils.py):
- Content format. A template takes content parts when it loops over a message's content (`{% for part in
  message['content'] %}`, where `message` is the target of a loop over `messages` or over a variable assigned from
  it, such as `loop_messages = messages[1:]`); any other template takes strings. For a string template a list of
  parts becomes its texts joined with "\\n"; for a parts template a string becomes `[{"type": "text", "text": ...}]`.
  Missing content becomes "" (or []). Only text parts are accepted: infero runs text models.
- A tool result always becomes one string, since templates print tool content as text.
- Tool-call `arguments` sent as a JSON string (the OpenAI wire form) are parsed, because templates print them with
  `tojson`; a string that is not JSON becomes {}. An empty `tool_calls` list is dropped.
"""

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import jsonschema
from jinja2.sandbox import ImmutableSandboxedEnvironment

from infero.errors import ChatTemplateError, PromptTooLongError

# Where each kind of text part keeps its text; other part types (images, audio) have nothing a text model can read.
_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}

# Names a message's reasoning comes under; the first is the one most templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _RaisedByTemplate(jinja2.TemplateError):
    """What `raise_exception(message)` throws, so that render() can pass on the template's own words."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML and sorts keys; templates were written against HF's.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for HF's training masks; we just render it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


class _TemplateDict:
    """`dict` as templates see it: it builds dicts but is not the type object, which leads to Python internals."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, as HF's does, so a template cannot reach its private state."""

    def __init__(*args, **kwargs) -> None:  # noqa: N805 (jinja's signature trick, so namespace(self=...) works)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_TemplateNamespace,
    )
    return env


_ENV = _make_environment()


def _one_line(text: str) -> str:
    return " ".join(str(text).splitlines()).strip()


class ChatTemplate:
    """A model's chat template, compiled once and rendered per request."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        """Compile `source`; raise ChatTemplateError if it is not valid Jinja."""
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _ENV.from_string(source)
            self.content_format = detect_content_format(_ENV.parse(source))
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not parse: line {e.lineno}: {_one_line(e.message)}") from e

    @classmethod
    def from_file(cls, path: str | Path, bos_token: str | None = None, eos_token: str | None = None) -> "ChatTemplate":
        """Load `--chat-template FILE`: a Jinja source file, or a JSON object with a "chat_template" key (such as a
        tokenizer_config.json, whose "bos_token" and "eos_token" fill in the tokens not given here)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"cannot read chat template file {path}: {e}") from e
        try:
            config = json.loads(text)
        except json.JSONDecodeError:
            config = None
        if not isinstance(config, dict):
            return cls(text, bos_token, eos_token)  # not a JSON object, so the file is the template itself
        if "chat_template" not in config:
            raise ChatTemplateError(f'{path} is JSON but has no "chat_template" key')
        source = config["chat_template"]
        if isinstance(source, list):
            # Named templates ({"name", "template"}); HF renders with "default" unless tools pick "tool_use".
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ChatTemplateError(f'{path} has named chat templates {sorted(named)} but no "default"')
            source = named["default"]
        if not isinstance(source, str):
            raise ChatTemplateError(f'{path}: "chat_template" is not a string')
        return cls(
            source,
            bos_token if bos_token is not None else _token_text(config.get("bos_token")),
            eos_token if eos_token is not None else _token_text(config.get("eos_token")),
        )

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        max_chars: int | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Return the prompt text for `messages` (OpenAI-style dicts), with the assistant header appended when
        `add_generation_prompt`; `tools` are JSON schemas and `template_kwargs` become template variables.
        `continue_final_message`: the text ends where the last message's content does (whatever the template
        writes after it, an end-of-turn token, is cut), so the model goes on with that message, as transformers'
        apply_chat_template(continue_final_message=True).
        Raise ChatTemplateError with one line when the template rejects the conversation or fails, and
        PromptTooLongError as soon as the text passes `max_chars` characters (before it is joined)."""
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
        if tools is not None and not all(isinstance(tool, dict) for tool in tools):
            raise ChatTemplateError("tools must be a list of JSON schema objects")
        for i, tool in enumerate(tools or []):
            function = tool.get("function", tool)
            problem = schema_problem(function.get("parameters")) if isinstance(function, dict) else None
            if problem is not None:
                raise ChatTemplateError(f"tools[{i}]: parameters is not a valid JSON Schema: {problem}")
        special_tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        variables = {name: token for name, token in special_tokens.items() if token is not None}
        variables.update(_plain_data(template_kwargs))  # as in HF, the caller's values override the special tokens
        conversation = prepare_messages(messages, self.content_format)
        try:
            pieces = self._template.generate(
                messages=conversation,
                tools=_plain_data(tools),
                documents=_plain_data(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
            text = _join_at_most(pieces, max_chars)
        except PromptTooLongError:
            raise
        except _RaisedByTemplate as e:
            raise ChatTemplateError(_one_line(e.message or "the chat template rejected the conversation")) from e
        except Exception as e:  # anything the template's code can raise is the template's or the conversation's fault
            raise ChatTemplateError(f"chat template failed: {_one_line(e)}") from e
        return _cut_after_final_message(text, messages[-1]) if continue_final_message else text


def schema_problem(schema: Any) -> str | None:
    """Why a tool's `parameters` is not a JSON Schema (checked against the meta-schema its "$schema" names, else
    draft 2020-12's), or None: a model told to call a tool whose schema is broken can only guess."""
    if schema is None:
        return None
    if not isinstance(schema, dict | bool):
        return f"a schema is an object, got {type(schema).__name__}"
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(part) for part in e.absolute_path)
        return f"{e.message}" + (f" (at {where})" if where else "")
    except RecursionError:
        return "it is nested too deeply"
    return None


def _cut_after_final_message(text: str, message: dict) -> str:
    """`text` up to the end of the last occurrence of `message`'s content (its last text part's), keeping the
    content's trailing whitespace only where the template kept it."""
    content = message.get("content")
    if isinstance(content, (list, tuple)):
        parts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = parts[-1] if parts else None
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a last message with text to continue")
    at = text.rfind(content.strip())
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not write the last message's text")
    kept = content.lstrip()
    end = at + len(kept) if text.startswith(kept, at) else at + len(content.strip())
    return text[:end]


def _join_at_most(pieces: Iterable[str], max_chars: int | None) -> str:
    if max_chars is None:
        return "".join(pieces)
    kept, size = [], 0
    for piece in pieces:
        size += len(piece)
        if size > max_chars:
            raise PromptTooLongError(f"the rendered prompt is longer than {max_chars:,} characters")
        kept.append(piece)
    return "".join(kept)


def require_template(source: str | None, model_name: str) -> str:
    """Return `source`, or raise the error that tells the user how to give a model without a template one."""
    if not source:
        raise ChatTemplateError(f"model {model_name} has no chat template; pass --chat-template FILE")
    return source


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json writes a special token either as its text or as a serialized AddedToken.
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


# --- content format: vLLM's `_detect_content_format`, read off the template's syntax tree ---------------------------


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` is `name` (or `name[key]` / `name.key`), possibly sliced, filtered or tested."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getitem):
        return _reads(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _reads(node.node, name) and node.attr == key
    return False


def _aliases(ast: jinja2.nodes.Template, name: str) -> set[str]:
    """`name` and every variable assigned from it, transitively (`{% set loop_messages = messages[1:] %}`)."""
    names, pending = {name}, [name]
    while pending:
        source = pending.pop()
        for assign in ast.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and target.name not in names and _reads(assign.node, source):
                names.add(target.name)
                pending.append(target.name)
    return names


def detect_content_format(ast: jinja2.nodes.Template) -> str:
    """Return "openai" if the template loops over a message's content (it takes parts), else "string"."""
    message_lists = _aliases(ast, "messages")
    loops = list(ast.find_all(jinja2.nodes.For))
    messages = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, jinja2.nodes.Name) and any(_reads(loop.iter, name) for name in message_lists)
    }
    if any(_reads(loop.iter, message, "content") for loop in loops for message in messages):
        return "openai"
    return "string"


# --- messages: fit OpenAI-style messages to the template ------------------------------------------------------------


def _plain_data(value: Any) -> Any:
    """A copy of `value` made of JSON types only, as HF does: other objects become a "<TypeName>" placeholder, so no
    object whose methods the sandbox does not know reaches the template, and edits never touch the caller's data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses of str, int and float (enums, for one) carry methods of their own: keep only the base value.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain_data(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(item) for item in value)
    return f"<{type(value).__name__}>"


def _part_text(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    part_type = part.get("type") if isinstance(part, dict) else None
    if part_type not in _TEXT_PART_KEYS:
        raise ChatTemplateError(f"content part type {part_type!r} is not supported: infero models take text only")
    return part.get(_TEXT_PART_KEYS[part_type])  # None (a part without text) is skipped, as vLLM does


def _fit_content(content: Any, content_format: str, role: Any) -> str | list[dict]:
    parts = [] if content is None else [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise ChatTemplateError("message content must be a string or a list of content parts")
    texts = [text for text in map(_part_text, parts) if text is not None]
    if content_format == "string" or role == "tool":
        return "\n".join(texts)
    return [{"type": "text", "text": text} for text in texts]


def _parse_tool_call_arguments(tool_calls: list) -> None:
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                function["arguments"] = {}
        elif not isinstance(arguments, (dict, list)):
            function["arguments"] = {}


def prepare_messages(messages: list[dict], content_format: str) -> list[dict]:
    """The messages as the template will see them (see the module docstring); the input is left unchanged."""
    prepared = []
    for message in _plain_data(list(messages)):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"a chat message must be an object, not {type(message).__name__}")
        role = message.get("role")
        message["content"] = _fit_content(message.get("content"), content_format, role)
        tool_calls = message.get("tool_calls")
        if role == "assistant" and isinstance(tool_calls, list):
            if tool_calls:
                _parse_tool_call_arguments(tool_calls)
            else:
                del message["tool_calls"]  # an empty list would send templates down their tool-call branch
        # OpenAI clients send `"tool_calls": null` and the like; templates treat an absent key better than None.
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}  # HF's key order
        prepared.append(message)
    return prepared
