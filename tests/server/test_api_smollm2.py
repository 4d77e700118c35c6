"""The default model (SmolLM2-135M-Instruct) behind the API: checks that need a model that knows things."""

import pytest
from live_server import TEST_DEVICE, start_server

from infero.engine.engine import EngineConfig
from infero.errors import ModelFileError
from infero.llm import LLM
from infero.server.app import ServerSettings

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol():
    from infero.default_model import default_model_path

    try:
        path = default_model_path()
    except ModelFileError as e:
        pytest.skip(str(e))
    live = start_server(
        lambda: LLM(path, device=TEST_DEVICE, engine_config=EngineConfig(kv_cache_bytes=64 << 20)),
        ServerSettings("SmolLM2-135M-Instruct.Q4_1"),
    )
    yield live
    live.stop()


def test_smollm2_answers_the_same_streamed_or_not_and_counts_its_prompt(smol):
    client = smol.client()
    full = client.chat.completions.create(model=smol.model, messages=QUESTION, max_tokens=20, temperature=0)
    assert "Paris" in full.choices[0].message.content and full.choices[0].finish_reason == "stop"
    assert full.usage.prompt_tokens == len(smol.state.llm.encode_chat(QUESTION))
    stream = client.chat.completions.create(model=smol.model, messages=QUESTION, max_tokens=20, temperature=0,
                                            stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream) == full.choices[0].message.content
    tokens = smol.http().post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
    assert tokens == smol.state.llm.encode_chat(QUESTION)


def test_smollm2_scores_a_true_sentence_with_echo(smol):
    r = smol.client().completions.create(
        model=smol.model, prompt="The capital of France is Paris", max_tokens=0, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    assert lp.tokens[-1] == " Paris" and lp.token_logprobs[0] is None
    assert lp.token_logprobs[-1] > -2.5  # the model expects " Paris" here
    smol.wait_idle()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def test_named_tool_choice_returns_a_well_formed_call_from_smollm2(smol):
    import json

    import jsonschema

    client = smol.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=smol.model, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                       max_tokens=60, temperature=0)  # fmt: skip
    choice = r.choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id and choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # Streamed, the SDK's delta accumulation must rebuild the same call.
    stream = client.chat.completions.create(model=smol.model, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                            max_tokens=60, temperature=0, stream=True)  # fmt: skip
    name, arguments, finish = None, "", None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            name = tc.function.name or name
            arguments += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, arguments, finish) == ("get_weather", call.function.arguments, "tool_calls")
    smol.wait_idle()


def test_required_tool_choice_returns_calls_of_offered_tools(smol):
    import json

    client = smol.client()
    r = client.chat.completions.create(model=smol.model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=120, temperature=0)  # fmt: skip
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    import jsonschema

    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    smol.wait_idle()
