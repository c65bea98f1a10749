"""Embeddings and rerank through the whole stack (api replicas, Redis, a worker of the paged engine),
against transformers on the same weights: the official openai client's embeddings.create, the
rerank shape llama.cpp and vLLM answer, their errors, a worker that cannot pool, and a request
whose worker died before it answered."""
from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest
import torch

from api.openai.answers import OpenAIError
from api.openai.pooling.answers import EmbeddingList, Rerank
from api.openai.pooling.inputs import rerank_candidates, rerank_prompt
from shared import redis_keys
from shared.messages import RequestStatus
from shared.tokenizer import Tokenizer
from tests.stack import Stack
from tests.waiting import until_sync

SENTENCES = [f"sentence {i}: {' '.join(['stream', 'batch', 'cache', 'token', 'worker'][: 1 + i % 5])} {i * 7}"
             for i in range(30)] + ["Paris is the capital of France", "a"]


def reference_embeddings(folder, texts: list[str]) -> np.ndarray:
    from transformers import AutoModel

    model, tok = AutoModel.from_pretrained(folder, dtype=torch.float32).eval(), Tokenizer(folder)
    with torch.no_grad():
        rows = [model(torch.tensor([tok.encode(t)])).last_hidden_state[0].mean(dim=0) for t in texts]
    return torch.nn.functional.normalize(torch.stack(rows), dim=1).numpy()


def reference_scores(folder, query: str, documents: list[str]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model, tok = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), Tokenizer(folder)
    yes, no = rerank_candidates(tok)
    scores = []
    for doc in documents:
        ids = rerank_prompt(tok, query, doc)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        scores.append(torch.softmax(logits[[yes, no]], dim=0)[0].item())
    return scores


def test_openai_client_embeddings_equal_transformers_on_the_same_weights(stack, client, model, tiny_llama):
    reply = client.embeddings.create(model=model, input=SENTENCES)  # the client asks for base64 and decodes it
    got = np.array([d.embedding for d in reply.data], dtype=np.float32)
    want = reference_embeddings(tiny_llama, SENTENCES)
    cosines = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert len(cosines) == 32 and cosines.min() >= 0.9999
    assert [d.index for d in reply.data] == list(range(32)) and reply.model == model
    tok = Tokenizer(tiny_llama)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(tok.encode(t)) for t in SENTENCES)

    floats = client.embeddings.create(model=model, input=SENTENCES[:2], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in floats.data], got[:2], atol=1e-6)
    EmbeddingList.model_validate(floats.to_dict())
    by_ids = client.embeddings.create(model=model, input=[tok.encode(SENTENCES[0])], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, got[0], atol=1e-6)


def test_rerank_orders_documents_by_the_models_yes_probability(stack, model, tiny_llama):
    query, docs = "What is the capital of France?", ["Paris is the capital of France", "Bananas are yellow",
                                                     "the cache holds blocks", "France"]
    body = httpx.post(f"{stack.urls[1]}/v1/rerank", json={"model": model, "query": query, "documents": docs},
                      timeout=120).json()
    want = reference_scores(tiny_llama, query, docs)
    scores = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert scores == pytest.approx(dict(enumerate(want)), abs=1e-5)
    assert [r["index"] for r in body["results"]] == sorted(range(4), key=lambda i: -want[i])
    assert [r["document"]["text"] for r in body["results"]] == [docs[r["index"]] for r in body["results"]]
    assert body["usage"]["prompt_tokens"] > 0
    Rerank.model_validate(body)
    top = httpx.post(f"{stack.urls[0]}/rerank", json={"query": query, "documents": docs, "top_n": 2,
                                                      "return_documents": False}, timeout=120).json()
    assert [r["index"] for r in top["results"]] == [r["index"] for r in body["results"][:2]]
    assert all("document" not in r for r in top["results"])
    Rerank.model_validate(top)


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/embeddings", {"input": []}, 400, "input"),
    ("/v1/embeddings", {"input": ""}, 400, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 3}, 400, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "truncate": True}, 400, "truncate"),
    ("/v1/embeddings", {"input": [[10 ** 6]]}, 400, "vocabulary"),
    ("/v1/embeddings", {"input": "word " * 3000}, 400, "context"),
    ("/v1/embeddings", {"input": "x", "model": "nope"}, 404, "nope"),
    ("/v1/rerank", {"query": "q", "documents": []}, 400, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["d"]}, 400, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, 400, "top_n"),
])
def test_bad_pooling_requests_get_a_clear_4xx(stack, path, body, status, words):
    reply = httpx.post(f"{stack.urls[0]}{path}", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    assert words in reply.json()["error"]["message"]
    OpenAIError.model_validate(reply.json())


def test_a_worker_that_cannot_pool_is_never_sent_a_pooling_request(redis_url, tiny_llama, tmp_path):
    env = {"STREAMQ_BACKEND": "null"}
    with Stack(redis_url, tiny_llama, tmp_path, env=env) as stack:
        reply = httpx.post(f"{stack.urls[0]}/v1/embeddings", json={"input": "hello"}, timeout=60)
        assert stack.queued() == 0
    assert reply.status_code == 400 and "computes embeddings" in reply.json()["error"]["message"]


def test_an_embeddings_request_whose_worker_died_is_answered_by_another(redis_url, tiny_llama, tmp_path):
    """A worker took the request and died before answering (a consumer of the group with no
    heartbeat holds it): a worker with room puts it back at its heartbeat and answers it."""
    env = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1"}
    with Stack(redis_url, tiny_llama, tmp_path, env=env) as stack:
        stack.pause_workers()
        replies = []
        call = threading.Thread(target=lambda: replies.append(httpx.post(
            f"{stack.urls[0]}/v1/embeddings", json={"input": SENTENCES[:4], "encoding_format": "float"},
            timeout=120)))
        call.start()
        redis = stack.redis()
        until_sync(lambda: stack.queued() == 1, what="the request queued")
        lanes = redis.smembers(redis_keys.request_lanes(stack.prefix, stack.model_name))
        streams = {redis_keys.request_stream(stack.prefix, stack.model_name, lane): ">" for lane in lanes}
        taken = redis.xreadgroup(redis_keys.WORKER_GROUP, "worker-that-died", streams, count=1)
        assert sum(len(entries) for _, entries in taken) == 1
        stack.resume_worker()
        call.join(timeout=120)
        record = stack.wait_for_record(lambda r: r.status == RequestStatus.DONE)
    assert replies and replies[0].status_code == 200, replies
    got = np.array([d["embedding"] for d in replies[0].json()["data"]])
    np.testing.assert_allclose(got, reference_embeddings(tiny_llama, SENTENCES[:4]), atol=1e-4)
    assert record.attempts == 1
