"""Chat templates render byte for byte what transformers' apply_chat_template renders (fixtures written by
scripts/make_chat_template_fixtures.py), and fail with one-line ChatTemplateErrors."""

import datetime
import json
from pathlib import Path

import pytest

from infero.errors import ChatTemplateError
from infero.tokenizer import chat_template
from infero.tokenizer.chat_template import ChatTemplate, prepare_messages, require_template

FIXTURES = sorted((Path(__file__).parent.parent / "fixtures" / "chat_templates").glob("*.json"))
TEMPLATES = {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in FIXTURES}
CASES = [(name, case["name"]) for name, fixture in TEMPLATES.items() for case in fixture["cases"]]


def _freeze_now(monkeypatch, iso: str) -> None:
    frozen = datetime.datetime.fromisoformat(iso)

    class FrozenDatetime(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return frozen

    monkeypatch.setattr(chat_template, "datetime", FrozenDatetime)


def _case(template_name: str, case_name: str) -> tuple[dict, dict]:
    fixture = TEMPLATES[template_name]
    return fixture, next(case for case in fixture["cases"] if case["name"] == case_name)


def test_fixtures_are_present():
    assert len(TEMPLATES) >= 7 and len(CASES) >= 100


@pytest.mark.parametrize("template_name,case_name", CASES)
def test_matches_transformers(monkeypatch, template_name, case_name):
    fixture, case = _case(template_name, case_name)
    _freeze_now(monkeypatch, fixture["now"])
    template = ChatTemplate(fixture["source"], fixture["bos_token"], fixture["eos_token"])

    def render():
        return template.render(
            case["messages"], add_generation_prompt=case["add_generation_prompt"], tools=case["tools"], **case["kwargs"]
        )

    if "error" in case:
        with pytest.raises(ChatTemplateError) as raised:
            render()
        if case["error_kind"] == "raise_exception":
            assert str(raised.value) == case["error"]
    else:
        assert render() == case["expected"]


@pytest.mark.parametrize("template_name,case_name", CASES)
def test_messages_are_fitted_as_vllm_does(template_name, case_name):
    # The fixture script fits messages to the template by its own code; ours must give transformers the same input.
    fixture, case = _case(template_name, case_name)
    assert prepare_messages(case["messages"], fixture["content_format"]) == _hf_normalized(case["template_messages"])


def _hf_normalized(messages: list[dict]) -> list[dict]:
    # What transformers itself does to the messages it is given: drop None values, alias the reasoning fields.
    normalized = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


@pytest.mark.parametrize("template_name", sorted(TEMPLATES))
def test_content_format_detection(template_name):
    fixture = TEMPLATES[template_name]
    assert ChatTemplate(fixture["source"]).content_format == fixture["content_format"]


def test_strftime_now_uses_the_clock():
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert ChatTemplate("{{ strftime_now('%d %b %Y') }}").render([{"role": "user", "content": "x"}]) == today


def test_tojson_keeps_non_ascii_and_takes_hf_arguments():
    template = ChatTemplate("{{ tools | tojson }}|{{ tools[0] | tojson(indent=2, sort_keys=true) }}")
    out = template.render([{"role": "user", "content": "x"}], tools=[{"b": "é<&>", "a": 1}])
    assert out == '[{"b": "é<&>", "a": 1}]|{\n  "a": 1,\n  "b": "é<&>"\n}'


def test_raise_exception_becomes_chat_template_error():
    template = ChatTemplate("{{ raise_exception('System role not supported') }}")
    with pytest.raises(ChatTemplateError, match="^System role not supported$"):
        template.render([{"role": "system", "content": "x"}])


def test_undefined_becomes_one_line_error():
    template = ChatTemplate("{{ messages[0].content.missing.deeper }}")
    with pytest.raises(ChatTemplateError) as raised:
        template.render([{"role": "user", "content": "x"}])
    assert str(raised.value) == "chat template failed: 'str object' has no attribute 'missing'"


def test_syntax_error_becomes_chat_template_error():
    with pytest.raises(ChatTemplateError, match="does not parse: line 1"):
        ChatTemplate("{% for message in messages %}")


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__ }}",
        "{{ dict.fromkeys.__self__.__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.append(1) }}",
    ],
)
def test_sandbox_blocks_escapes(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_sandbox_hides_private_attributes():
    # One unsafe step renders as undefined (nothing); the next step on it raises, as the cases above show.
    assert ChatTemplate("{{ messages.__class__ }}{{ dict.__class__ }}").render([{"role": "user", "content": "x"}]) == ""


def test_missing_template_message():
    with pytest.raises(ChatTemplateError) as raised:
        require_template(None, "SmolLM2-135M")
    assert str(raised.value) == "model SmolLM2-135M has no chat template; pass --chat-template FILE"
    assert require_template("{{ x }}", "m") == "{{ x }}"


def test_from_file_jinja_and_json(tmp_path):
    source = TEMPLATES["chatml"]["source"]
    messages = [{"role": "user", "content": "Hi"}]
    jinja_file = tmp_path / "chatml.jinja"
    jinja_file.write_text(source, encoding="utf-8")
    config_file = tmp_path / "tokenizer_config.json"
    config = {"chat_template": source, "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "<|im_end|>"}
    config_file.write_text(json.dumps(config), encoding="utf-8")

    from_jinja = ChatTemplate.from_file(jinja_file)
    from_json = ChatTemplate.from_file(config_file)
    assert from_jinja.render(messages) == from_json.render(messages) == ChatTemplate(source).render(messages)
    assert (from_json.bos_token, from_json.eos_token) == ("<s>", "<|im_end|>")
    assert from_jinja.bos_token is None


def test_from_file_errors(tmp_path):
    with pytest.raises(ChatTemplateError, match="cannot read"):
        ChatTemplate.from_file(tmp_path / "absent.jinja")
    no_key = tmp_path / "config.json"
    no_key.write_text('{"bos_token": "<s>"}', encoding="utf-8")
    with pytest.raises(ChatTemplateError, match='no "chat_template"'):
        ChatTemplate.from_file(no_key)


def test_render_leaves_caller_messages_unchanged():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]},
    ]
    before = json.dumps(messages)
    ChatTemplate(TEMPLATES["qwen2.5"]["source"]).render(messages)
    assert json.dumps(messages) == before


def test_non_text_parts_and_empty_conversation_are_rejected():
    template = ChatTemplate(TEMPLATES["chatml"]["source"])
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    with pytest.raises(ChatTemplateError, match="image_url"):
        template.render([{"role": "user", "content": [image]}])
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        template.render([])
