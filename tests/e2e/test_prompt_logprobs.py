"""What lm-eval's local-completions sends, through the stack: `echo` with `logprobs` (each prompt
token's logprob, the first null) and `max_tokens` 0 or 1, vLLM's `prompt_logprobs`, several
token-id prompts in one request; each logprob against transformers' on the same weights (fp32)."""
from __future__ import annotations

import functools

import httpx
import pytest
import torch

from shared.tokenizer import Tokenizer

TEXTS = ["The capital of France is Paris", "a b c d e f g", "streams of tokens flow through the cache"]


@functools.cache
def _reference(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def reference_logprobs(folder, ids: list[int]) -> torch.Tensor:
    """Each position's log-softmax over the vocabulary, for the token after it."""
    with torch.no_grad():
        return torch.log_softmax(_reference(str(folder))(torch.tensor([ids])).logits[0].float(), dim=-1)


def _post(stack, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.urls[0]}/v1/completions", json=body, timeout=120)


def test_echo_with_max_tokens_0_scores_every_prompt_token(stack, model, tiny_llama):
    tok = Tokenizer(tiny_llama)
    prompts = [tok.encode(t) for t in TEXTS]
    reply = _post(stack, {"model": model, "prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 0,
                          "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    for ids, choice in zip(prompts, body["choices"]):
        assert choice["finish_reason"] == "length"
        assert choice["text"] == tok.decode(ids, skip_special_tokens=False)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = reference_logprobs(tiny_llama, ids)
        for k in range(1, len(ids)):
            assert lp["token_logprobs"][k] == pytest.approx(want[k - 1, ids[k]].item(), abs=1e-4)
            top = want[k - 1].topk(2)  # keyed by token text: two ids of one text share an entry
            assert 1 <= len(lp["top_logprobs"][k]) <= 2
            assert max(lp["top_logprobs"][k].values()) == pytest.approx(top.values[0].item(), abs=1e-4)


def test_lm_evals_loglikelihood_request_echo_and_one_token(stack, model, tiny_llama):
    """lm-eval 0.4's request: temperature 0, max_tokens 1, logprobs 1, echo; it reads
    token_logprobs[ctxlen:-1] and checks each against max(top_logprobs) for greediness."""
    tok = Tokenizer(tiny_llama)
    ids = tok.encode(TEXTS[0])
    reply = _post(stack, {"model": model, "prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1,
                          "temperature": 0, "seed": 1234})
    assert reply.status_code == 200, reply.text
    lp = reply.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt's tokens, then the generated one
    want = reference_logprobs(tiny_llama, ids)
    ctxlen = 3
    continuation = lp["token_logprobs"][ctxlen:-1]
    assert sum(continuation) == pytest.approx(sum(want[k - 1, ids[k]].item() for k in range(ctxlen, len(ids))),
                                              abs=1e-3)
    greedy = [lp["token_logprobs"][k] == max(lp["top_logprobs"][k].values()) for k in range(ctxlen, len(ids))]
    assert greedy == [ids[k] == int(want[k - 1].argmax()) for k in range(ctxlen, len(ids))]
    assert lp["tokens"][-1] == reply.json()["choices"][0]["text"][len(tok.decode(ids, skip_special_tokens=False)):]


def test_vllm_prompt_logprobs_beside_a_generation(stack, model, tiny_llama):
    tok = Tokenizer(tiny_llama)
    reply = _post(stack, {"model": model, "prompt": TEXTS[1], "prompt_logprobs": 2, "max_tokens": 3,
                          "temperature": 0})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    ids = tok.encode(TEXTS[1])
    assert choice["text"] and reply.json()["usage"]["completion_tokens"] == 3  # generated as asked, not echoed
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    want = reference_logprobs(tiny_llama, ids)
    for k in range(1, len(ids)):
        entry = scored[k][str(ids[k])]
        assert entry["logprob"] == pytest.approx(want[k - 1, ids[k]].item(), abs=1e-4)
        assert entry["rank"] == int((want[k - 1] > want[k - 1, ids[k]]).sum()) + 1
        assert {int(i) for i, e in scored[k].items() if e["rank"] <= 2} == set(want[k - 1].topk(2).indices.tolist())


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "prompt_logprobs": 21},
    {"prompt": [[1, 2], [10 ** 7]], "echo": True, "logprobs": 1, "max_tokens": 0},
])
def test_what_cannot_be_answered_is_a_400(stack, model, body):
    reply = _post(stack, {"model": model, **body})
    assert reply.status_code == 400, reply.text


def test_a_stream_opens_each_choice_with_its_echoed_prompt_as_the_whole_answer_has_it(stack, model, tiny_llama):
    import json

    tok = Tokenizer(tiny_llama)
    prompts = [tok.encode(t) for t in TEXTS[:2]]
    for max_tokens in (0, 3):
        body = {"model": model, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
                "temperature": 0, "prompt_logprobs": 1}
        whole = _post(stack, body).json()["choices"]
        with httpx.stream("POST", f"{stack.urls[0]}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        for choice in whole:
            mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
            assert "".join(c["text"] for c in mine) == choice["text"]
            assert mine[0]["prompt_logprobs"] == choice["prompt_logprobs"]
            streamed = [t for c in mine if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
            assert streamed == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-6)
            assert mine[-1]["finish_reason"] == choice["finish_reason"]
