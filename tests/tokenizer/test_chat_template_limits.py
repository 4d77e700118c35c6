"""What the chat template refuses before a prompt is built: tools whose parameters are no JSON Schema, and a
rendered text longer than a bound (stopped as it is produced, not after)."""

import pytest

from infero.errors import ChatTemplateError, PromptTooLongError
from infero.tokenizer.chat_template import ChatTemplate, schema_problem

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
HELLO = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    "schema, where",
    [({"type": 5}, "at type"), ({"type": "object", "properties": {"a": {"type": "strin"}}}, "properties/a/type"),
     ({"required": "a"}, "at required"), (["type", "object"], "got list")],
)  # fmt: skip
def test_a_parameters_object_that_is_no_json_schema_is_named_with_where(schema, where):
    problem = schema_problem(schema)
    assert problem is not None and where in problem
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(ChatTemplateError, match=r"tools\[0\]: parameters is not a valid JSON Schema"):
        ChatTemplate(CHATML).render(HELLO, tools=[tool])


def test_valid_schemas_of_any_draft_pass():
    assert schema_problem(None) is None and schema_problem(True) is None
    assert schema_problem({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}) is None
    assert schema_problem({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object"}) is None
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "minimum": 0, "exclusiveMinimum": True}
    assert schema_problem(draft4) is None
    assert schema_problem({"$schema": "http://json-schema.org/draft-07/schema#", "exclusiveMinimum": True}) is not None


def test_a_render_longer_than_max_chars_is_refused_and_one_within_is_whole():
    template = ChatTemplate(CHATML)
    text = template.render(HELLO)
    assert template.render(HELLO, max_chars=len(text)) == text
    with pytest.raises(PromptTooLongError, match=f"longer than {len(text) - 1} characters"):
        template.render(HELLO, max_chars=len(text) - 1)
