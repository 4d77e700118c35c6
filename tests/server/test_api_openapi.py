"""/openapi.json describes every route with its request body and its answers, and real answers match it."""

import jsonschema
import pytest

HELLO = [{"role": "user", "content": "hello"}]
ROUTES = {
    ("get", "/health"): (None, "HealthResponse", {"503"}),
    ("get", "/version"): (None, "VersionResponse", set()),
    ("get", "/v1/models"): (None, "ModelList", {"401", "503"}),
    ("get", "/v1/models/{model_id}"): (None, "ModelCard", {"401", "404", "503"}),
    ("post", "/v1/chat/completions"): ("ChatCompletionRequest", "ChatCompletionResponse", {"400", "401", "404", "413",
                                                                                            "503"}),
    ("post", "/v1/completions"): ("CompletionRequest", "CompletionResponse", {"400", "401", "404", "413", "503"}),
    ("post", "/tokenize"): ("TokenizeRequest", "TokenizeResponse", {"400", "401", "404", "413", "503"}),
    ("post", "/detokenize"): ("DetokenizeRequest", "DetokenizeResponse", {"400", "401", "404", "413", "503"}),
    ("post", "/v1/responses"): ("ResponsesRequest", "ResponseObject", {"400", "401", "404", "413", "503"}),
}  # fmt: skip


@pytest.fixture(scope="module")
def spec(server) -> dict:
    r = server.http().get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def validator(spec: dict, name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": spec["components"]})


def json_schema_ref(content: dict) -> str:
    return content["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]


def test_every_route_has_its_request_body_answer_and_error_responses(spec):
    operations = {(method, path): op for path, ops in spec["paths"].items() for method, op in ops.items()}
    assert set(ROUTES) <= set(operations)
    for key, (request, answer, errors) in ROUTES.items():
        op = operations[key]
        if request is None:
            assert "requestBody" not in op, key
        else:
            assert op["requestBody"]["required"] and json_schema_ref(op["requestBody"]["content"]) == request, key
        assert json_schema_ref(op["responses"]["200"]["content"]) == answer, key
        assert set(op["responses"]) == {"200"} | errors, key
        for status in errors:
            assert json_schema_ref(op["responses"][status]["content"]) == "ErrorResponse", (key, status)
        assert ("security" in op) == ("401" in errors), key
    stream = operations["post", "/v1/chat/completions"]["responses"]["200"]["content"]
    assert "text/event-stream" in stream


def test_the_request_schemas_are_the_pydantic_models(spec):
    schemas = spec["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert {"messages", "max_tokens", "max_completion_tokens", "tools", "response_format"} <= set(chat["properties"])
    assert chat["required"] == ["messages"]
    assert "prompt" in schemas["CompletionRequest"]["required"] and "tokens" in schemas["DetokenizeRequest"]["required"]
    validator(spec, "ChatCompletionRequest").validate({"messages": HELLO, "max_tokens": 3})
    with pytest.raises(jsonschema.ValidationError):
        validator(spec, "ChatCompletionRequest").validate({"messages": "hello"})


def test_real_answers_and_errors_match_their_declared_schemas(server, spec):
    http = server.http()
    answers = {
        "HealthResponse": http.get("/health"),
        "VersionResponse": http.get("/version"),
        "ModelList": http.get("/v1/models"),
        "ModelCard": http.get("/v1/models/tiny"),
        "ChatCompletionResponse": http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3,
                                                                          "logprobs": True, "top_logprobs": 2}),
        "CompletionResponse": http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3, "logprobs": 1,
                                                                 "echo": True}),
        "TokenizeResponse": http.post("/tokenize", json={"prompt": "hello", "return_token_strs": True}),
        "DetokenizeResponse": http.post("/detokenize", json={"tokens": [5, 6]}),
        "ResponseObject": http.post("/v1/responses", json={"input": "hello", "max_output_tokens": 3}),
    }  # fmt: skip
    for name, r in answers.items():
        assert r.status_code == 200, (name, r.text)
        validator(spec, name).validate(r.json())
    errors = [http.post("/v1/chat/completions", json={"messages": []}), http.get("/v1/models/other"),
              http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6})]  # fmt: skip
    for r in errors:
        assert r.status_code in (400, 404)
        validator(spec, "ErrorResponse").validate(r.json())
    server.wait_idle()


def test_docs_and_the_description_are_open_when_the_api_needs_a_key(fresh_server):
    live = fresh_server(api_key="sekrit")
    http = live.http()
    assert http.get("/v1/models").status_code == 401
    docs = http.get("/docs")
    assert docs.status_code == 200 and docs.headers["content-type"].startswith("text/html")
    assert "swagger" in docs.text.lower() and "/openapi.json" in docs.text
    assert http.get("/openapi.json").json()["info"]["title"] == "infero"
