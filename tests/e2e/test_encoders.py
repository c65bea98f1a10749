"""Encoder models served beside a chat model, through the whole stack: a worker of the tiny chat
model, one of all-MiniLM-L6-v2 (a real sentence-transformers model), one of a tiny BERT
cross-encoder and one of a tiny NomicBERT from a GGUF file in llama.cpp's layout, behind one api; requests routed by `model`. Every answer is checked against
sentence-transformers on the same weights."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from streamq.testing.tiny_encoders import build_cross_encoder, build_encoder, minilm, write_gguf
from tests.stack import Stack
from tests.waiting import until_sync

st = pytest.importorskip("sentence_transformers")
TEXTS = ["A man is eating food.", "A man is riding a horse.", "The new movie is awesome.", "x",
         "Paris is the capital and largest city of France, on the Seine."]
QUERY = "Which city is the capital of France?"


@pytest.fixture(scope="module")
def served(redis_url, tiny_llama, tmp_path_factory):
    cross = build_cross_encoder(tmp_path_factory.mktemp("cross"), "bert")
    matryoshka = build_encoder(tmp_path_factory.mktemp("mrl"), "bert", pooling="mean", matryoshka=[16, 8],
                               prompts={"query": "query: ", "document": "passage: "}, default_prompt="document",
                               include_prompt=False)
    nomic = build_encoder(tmp_path_factory.mktemp("nomic"), "nomic_bert", pooling="cls")
    models = {"minilm": minilm(), "cross": cross, "mrl": matryoshka, "nomic-gguf": nomic}
    sources = {**models, "nomic-gguf": write_gguf(nomic, nomic.parent / "nomic.F32.gguf")}
    envs = [{}] + [{"STREAMQ_MODEL": str(path), "STREAMQ_SERVED_MODEL_NAME": name} for name, path in sources.items()]
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("encoders"), workers=5, worker_envs=envs) as stack:
        url = stack.urls[0]
        until_sync(lambda: set(models) <= _listed(url), timeout_s=180, what="every model listed")
        yield url, models


def _listed(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_models_lists_the_chat_model_and_the_encoders(served, tiny_llama):
    url, models = served
    assert _listed(url) == {tiny_llama.name, *models}


def test_minilm_embeddings_equal_sentence_transformers(served):
    url, models = served
    reply = _post(url, "/v1/embeddings", {"model": "minilm", "input": TEXTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    want = st.SentenceTransformer(str(models["minilm"]), device="cpu").encode(TEXTS)
    assert got.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(got, want, atol=2e-5)
    from shared.tokenizer import Tokenizer
    tok = Tokenizer(models["minilm"])
    assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in TEXTS)


def test_a_gguf_encoder_embeds_as_sentence_transformers_on_its_source(served):
    url, models = served
    reply = _post(url, "/v1/embeddings", {"model": "nomic-gguf", "input": TEXTS})
    assert reply.status_code == 200, reply.text
    got = [d["embedding"] for d in reply.json()["data"]]
    np.testing.assert_allclose(got, st.SentenceTransformer(str(models["nomic-gguf"]), device="cpu").encode(TEXTS),
                               atol=2e-5)


def test_named_prompts_and_matryoshka_cuts_as_sentence_transformers(served):
    url, models = served
    model = st.SentenceTransformer(str(models["mrl"]), device="cpu")
    default = _post(url, "/v1/embeddings", {"model": "mrl", "input": TEXTS}).json()["data"]
    np.testing.assert_allclose([d["embedding"] for d in default], model.encode(TEXTS), atol=2e-5)  # "passage: "
    query = _post(url, "/v1/embeddings", {"model": "mrl", "input": TEXTS, "prompt_name": "query"}).json()["data"]
    np.testing.assert_allclose([d["embedding"] for d in query], model.encode(TEXTS, prompt_name="query"), atol=2e-5)
    cut = _post(url, "/v1/embeddings", {"model": "mrl", "input": TEXTS, "dimensions": 8}).json()["data"]
    full = model.encode(TEXTS)[:, :8]
    np.testing.assert_allclose([d["embedding"] for d in cut], full / np.linalg.norm(full, axis=1, keepdims=True),
                               atol=2e-5)


def test_cross_encoder_rerank_and_score_equal_sentence_transformers(served):
    url, models = served
    want = st.CrossEncoder(str(models["cross"]), device="cpu").predict([(QUERY, t) for t in TEXTS])
    reply = _post(url, "/v1/rerank", {"model": "cross", "query": QUERY, "documents": TEXTS})
    assert reply.status_code == 200, reply.text
    got = {r["index"]: r["relevance_score"] for r in reply.json()["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(TEXTS))], want, atol=2e-5)
    score = _post(url, "/v1/score", {"model": "cross", "text_1": QUERY, "text_2": TEXTS})
    assert score.status_code == 200, score.text
    np.testing.assert_allclose([d["score"] for d in score.json()["data"]], want, atol=2e-5)
    pairwise = _post(url, "/v1/score", {"model": "cross", "text_1": [QUERY, "a horse"], "text_2": TEXTS[:2]})
    want_pairs = st.CrossEncoder(str(models["cross"]), device="cpu").predict([(QUERY, TEXTS[0]), ("a horse", TEXTS[1])])
    np.testing.assert_allclose([d["score"] for d in pairwise.json()["data"]], want_pairs, atol=2e-5)


def test_an_embedding_model_reranks_by_cosine(served):
    url, models = served
    model = st.SentenceTransformer(str(models["minilm"]), device="cpu")
    q, docs = model.encode([QUERY]), model.encode(TEXTS)
    want = (docs @ q.T).ravel() / np.linalg.norm(docs, axis=1) / np.linalg.norm(q)
    reply = _post(url, "/v1/rerank", {"model": "minilm", "query": QUERY, "documents": TEXTS})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert results[0]["index"] == 4  # the Paris sentence
    got = {r["index"]: r["relevance_score"] for r in results}
    np.testing.assert_allclose([got[i] for i in range(len(TEXTS))], want, atol=2e-5)


@pytest.mark.parametrize("model, path, body, param", [
    ("minilm", "/v1/completions", {"prompt": "hello", "max_tokens": 4}, "model"),
    ("cross", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("minilm", "/v1/responses", {"input": "hi"}, "model"),
    ("minilm", "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("cross", "/v1/embeddings", {"input": "hello"}, "model"),
    ("minilm", "/v1/embeddings", {"input": "hello", "prompt_name": "nope"}, "prompt_name"),
    ("minilm", "/v1/embeddings", {"input": "hello", "dimensions": 128}, "dimensions"),
    ("mrl", "/v1/embeddings", {"input": "hello", "dimensions": 64}, "dimensions"),
    ("mrl", "/v1/embeddings", {"input": [[101, 102]], "prompt_name": "query"}, "prompt_name"),
    ("minilm", "/v1/embeddings", {"input": "word " * 300}, "input"),
    ("cross", "/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
])
def test_what_a_model_cannot_do_is_a_400_naming_the_field(served, model, path, body, param):
    url, _ = served
    reply = _post(url, path, {"model": model, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error.get("param", param) == param and (param != "model" or "generates no text" in reply.text
                                                   or "cross-encoder" in reply.text)


def test_the_chat_model_still_answers_beside_them(served, tiny_llama):
    url, _ = served
    reply = _post(url, "/v1/completions", {"model": tiny_llama.name, "prompt": "hello", "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
