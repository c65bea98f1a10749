"""The seed tutorials' endpoints and curl commands, as printed, against a live stack."""
from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from api.native.answers import GeneratedText, GeneratedTexts, QueryAnswer, VllmTexts
from api.native.seed import SEED_MAX_TOKENS
from shared.tokenizer import Tokenizer
from tests.e2e.helpers import hf_greedy
from tests.stack import stream_events


@pytest.fixture(scope="module")
def api(stack):
    return stack.urls[0]


def sh(command: str) -> str:
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True,
                          check=True, timeout=120).stdout


@pytest.fixture(scope="module")
def greedy_text(tiny_llama):
    """What the first tutorial's server answered: the prompt, then transformers' greedy text."""
    tok = Tokenizer(tiny_llama)
    return lambda prompt: prompt + tok.decode(hf_greedy(tiny_llama, tok.encode(prompt), SEED_MAX_TOKENS))


def test_basic_generate_as_printed(api, greedy_text):
    out = json.loads(sh(f"""curl -s -X POST {api}/basic_generate -H "Content-Type: application/json" """
                        """-d '{"prompt": "Hello, I am"}'"""))
    assert out["generated_text"] == greedy_text("Hello, I am")
    GeneratedText.model_validate(out)
    assert len(out["generated_text"]) > len("Hello, I am")


def test_generate_batch_gives_one_result_per_prompt_with_ids(api, greedy_text):
    out = json.loads(sh(f"""curl -X POST {api}/generate -s -H "Content-Type: application/json" """
                        """-d '{"prompts": ["Hello, I am", "The weather is"]}'"""))
    assert len(out["generated_texts"]) == 2 and len(set(out["request_ids"])) == 2
    GeneratedTexts.model_validate(out)
    assert out["generated_texts"] == [greedy_text("Hello, I am"), greedy_text("The weather is")]
    # Each result is the greedy text of its own prompt, as if it were sent alone.
    with httpx.Client(timeout=60) as client:
        alone = client.post(f"{api}/basic_generate", json={"prompt": "The weather is"}).json()
    assert alone["generated_text"] == out["generated_texts"][1]


def test_generate_vllm_as_printed_and_edge_cases(api):
    out = json.loads(sh(f"""curl -s -X POST {api}/generate_vllm -H "Content-Type: application/json" """
                        """-d '{"prompts": ["Hello, I am", "The weather is", "Once upon a time"]}'"""))
    assert len(out["generated_texts"]) == 3
    VllmTexts.model_validate(out)
    empty = sh(f"""curl -s -w "\\nHTTP %{{http_code}}\\n" -X POST {api}/generate_vllm """
               """-H "Content-Type: application/json" -d '{"prompts": []}'""")
    assert empty.splitlines() == ['{"generated_texts":[]}', "HTTP 200"]
    wrong = sh(f"""curl -s -w "\\nHTTP %{{http_code}}\\n" -X POST {api}/generate_vllm """
               """-H "Content-Type: application/json" -d '{"invalid_field": ["Hello"]}'""")
    assert wrong.splitlines()[-1] == "HTTP 422" and '"prompts"' in wrong


def test_streaming_pipeline_as_printed(api):
    out = sh(f"""curl -N -s -X POST {api}/generate_stream -H "Content-Type: application/json" """
             """-d '{"prompt": "Hello, I am"}' | grep --line-buffered '^data: ' | sed -u 's/^data: //' """
             """| jq -r --unbuffered '.token'""")
    assert out.strip()
    with httpx.Client(timeout=60) as client:
        events = stream_events(client, "POST", f"{api}/generate_stream", json={"prompt": "Hello, I am"})
    tokens = [e["data"] for e in events]
    assert tokens and all(set(t) == {"token", "sequence_id"} for t in tokens)
    assert len({t["sequence_id"] for t in tokens}) == 1
    basic = httpx.post(f"{api}/basic_generate", json={"prompt": "Hello, I am"}, timeout=60).json()
    assert "Hello, I am" + "".join(t["token"] for t in tokens) == basic["generated_text"]


def test_batch_and_stream_at_the_same_time(api):
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(4) as pool:
        batch = pool.submit(client.post, f"{api}/generate", json={"prompts": ["a", "b", "c", "d"]})
        streams = [pool.submit(stream_events, client, "POST", f"{api}/generate_stream", json={"prompt": p})
                   for p in ("x", "y", "z")]
        assert batch.result().status_code == 200 and len(batch.result().json()["generated_texts"]) == 4
        for s in streams:
            assert s.result()


def test_second_tutorial_query_and_plain_text_stream(api):
    with httpx.Client(timeout=60) as client:
        reply = client.post(f"{api}/generate/", json={"query": "What is Redis?", "max_tokens": 8, "temperature": 0})
        assert set(reply.json()) == {"response"} and reply.json()["response"]
        QueryAnswer.model_validate(reply.json())
        body = {"request_id": "abc", "query": "What is Redis?", "n": 1, "top_p": 1.0, "temperature": 0,
                "max_tokens": 8, "seed": 1}
        with client.stream("POST", f"{api}/generate_stream/", json=body) as stream:
            assert stream.headers["content-type"].startswith("text/plain")
            text = "".join(stream.iter_text())
        assert text == reply.json()["response"]
