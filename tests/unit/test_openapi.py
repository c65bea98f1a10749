"""/openapi.json documents every answer: each route's success body as a typed model (a component),
its event stream where it streams; /docs and /redoc browse it. The app is built without its
lifespan, so no Redis is needed."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

import api
from api.app import create_app
from shared.settings import ApiSettings

REF = "#/components/schemas/"
# Media types a body is documented in as a model (a $ref), and those that are text.
MODEL_TYPES = {"application/json", "application/jsonl"}
TEXT_TYPES = {"text/event-stream", "text/plain"}
# Bytes as stored (a file's content): a string of format binary.
BINARY_TYPES = {"application/octet-stream"}


@pytest.fixture(scope="module")
def app():
    return create_app(ApiSettings())


@pytest.fixture(scope="module")
def spec(app):
    return app.openapi()


def _operations(spec: dict):
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            yield method, path, operation


def _routes() -> list[APIRoute]:
    """Every route of every protocol's router (api/*/.../router)."""
    routes = []
    for module in pkgutil.walk_packages(api.__path__, "api."):
        router = getattr(importlib.import_module(module.name), "router", None)
        if router is not None:
            routes += [r for r in router.routes if isinstance(r, APIRoute)]
    return routes


def _streaming() -> set[tuple[str, str]]:
    """The routes whose handler can answer an event stream."""
    return {(method.lower(), r.path) for r in _routes() if r.include_in_schema
            and "EventStreamResponse(" in inspect.getsource(r.endpoint) for method in r.methods}


def test_every_route_of_every_router_is_in_the_schema(spec):
    documented = {(m, p) for m, p, _ in _operations(spec)}
    routes = {(m.lower(), r.path) for r in _routes() if r.include_in_schema for m in r.methods}
    assert len(routes) >= 29 and routes <= documented, routes - documented


def test_every_success_answer_has_a_typed_schema(spec):
    components = spec["components"]["schemas"]
    missing = []
    for method, path, operation in _operations(spec):
        success = {code: r for code, r in operation["responses"].items() if code.startswith("2")}
        if not success:
            missing.append(f"{method} {path}: no success answer")
        for code, response in success.items():
            content = response.get("content") or {}
            if not content:
                missing.append(f"{method} {path} {code}: no content")
            for media, body in content.items():
                schema = body.get("schema") or {}
                if media in MODEL_TYPES:
                    ref = schema.get("$ref", "")
                    if not ref.startswith(REF) or ref.removeprefix(REF) not in components:
                        missing.append(f"{method} {path} {code} {media}: {schema} is no model")
                elif media in BINARY_TYPES and schema == {"type": "string", "format": "binary"}:
                    pass
                elif media not in TEXT_TYPES or schema.get("type") != "string":
                    missing.append(f"{method} {path} {code} {media}: {schema}")
    assert not missing, "\n".join(missing)


def test_every_streaming_route_documents_its_event_stream(spec):
    streaming = _streaming()
    assert {("post", "/v1/chat/completions"), ("post", "/v1/messages"), ("get", "/v1/responses/{response_id}"),
            ("get", "/v1/requests/{request_id}/events"), ("post", "/generate_stream")} <= streaming
    undocumented = []
    for method, path in sorted(streaming):
        responses = spec["paths"][path][method]["responses"]
        if not any("text/event-stream" in (r.get("content") or {}) for c, r in responses.items() if c.startswith("2")):
            undocumented.append(f"{method} {path}")
    assert not undocumented, undocumented


def test_a_route_that_answers_json_or_its_stream_documents_both(spec):
    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert chat["application/json"]["schema"] == {"$ref": f"{REF}ChatCompletion"}
    assert "data: [DONE]" in chat["text/event-stream"]["example"]
    submit = spec["paths"]["/v1/requests"]["post"]["responses"]
    assert submit["202"]["content"]["application/json"]["schema"] == {"$ref": f"{REF}Submitted"}
    assert "application/json" not in submit["200"]["content"]  # 200 is the stream (stream: true)
    events = spec["paths"]["/v1/requests/{request_id}/events"]["get"]["responses"]["200"]["content"]
    assert list(events) == ["text/event-stream"]


def test_the_answer_models_carry_examples_that_they_validate(spec):
    """Each top-level answer's example is one the model accepts (so /docs shows a real shape)."""
    from api.admin import answers as admin
    from api.anthropic import answers as anthropic
    from api.native import answers as native
    from api.openai import answers as openai
    from api.openai.pooling import answers as pooling
    from api.openai.responses import answers as responses

    models = [admin.Healthy, admin.Ready, admin.NotReady, admin.AdapterLoaded, admin.AdapterUnloaded, admin.Cluster,
              anthropic.MessageAnswer, anthropic.TokenCount, anthropic.AnthropicError, native.Submitted,
              native.RequestState, native.Cancelled, native.GeneratedText, native.GeneratedTexts, native.VllmTexts,
              native.QueryAnswer, openai.ModelList, openai.Completion, openai.ChatCompletion, openai.Batch,
              openai.OpenAIError, pooling.EmbeddingList, pooling.Rerank, responses.ResponseObject,
              responses.ResponseDeleted, responses.InputItemList]
    for model in models:
        examples = model.model_json_schema().get("examples")
        assert examples, f"{model.__name__} has no example"
        for example in examples:
            model.model_validate(example)


def test_errors_are_documented_in_each_familys_body(spec):
    """The OpenAI and Anthropic paths answer every error in their own body (never FastAPI's 422)."""
    for path, model in (("/v1/chat/completions", "OpenAIError"), ("/v1/messages", "AnthropicError"),
                        ("/v1/responses", "OpenAIError"), ("/v1/embeddings", "OpenAIError"),
                        ("/v1/load_lora_adapter", "OpenAIError"), ("/v1/unload_lora_adapter", "OpenAIError")):
        responses = spec["paths"][path]["post"]["responses"]
        assert responses["4XX"]["content"]["application/json"]["schema"] == {"$ref": f"{REF}{model}"}, path
        assert "422" not in responses, path


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_and_redoc_are_served(app, page):
    client = TestClient(app, base_url="http://localhost:8000")  # not entered: no lifespan, no Redis
    response = client.get(page)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in response.text
    assert client.get("/openapi.json").json()["paths"]["/v1/messages"]


@pytest.mark.parametrize("lines", [[], ['{"custom_id": "q0"}', '{"custom_id": "é"}']])
def test_batch_results_are_sent_as_the_jsonl_text_they_were(lines):
    """The results' response class (documented as application/jsonl lines) sends the bytes and
    headers of the plain text it replaced."""
    from fastapi.responses import PlainTextResponse

    from api.openai.batches import JSONLines

    before = PlainTextResponse("\n".join(lines) + ("\n" if lines else ""), media_type="application/jsonl")
    after = JSONLines(lines)
    assert (after.body, after.raw_headers, after.status_code) == (before.body, before.raw_headers, before.status_code)
