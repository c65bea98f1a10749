"""llama.cpp's pair of files for a vision-language model through the whole stack: a Gemma 3 text
GGUF and its mmproj GGUF (STREAMQ_MODEL=...gguf, STREAMQ_MMPROJ=...gguf), written from a tiny
Gemma 3 (streamq/testing/tiny_vision.py; the mmproj laid out as llama.cpp's converter writes one)
and served as the model they make: a chat with images answers as transformers' `generate` does on
the original model with its processor's inputs, its prompt counted as the processor counts it."""
from __future__ import annotations

import httpx
import openai
import pytest

from streamq.testing.tiny_vision import build_gemma3, data_url, png, processor_inputs, reference_tokens, write_gemma3_ggufs
from tests.stack import Stack
from tests.waiting import until_sync

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-pair")
    model = build_gemma3(folder / "hf", gguf_shaped=True)
    text, mmproj = write_gemma3_ggufs(model, folder / "gemma3-tiny.gguf", folder / "mmproj-gemma3-tiny.gguf")
    return model, text, mmproj


@pytest.fixture(scope="module")
def served(redis_url, pair, tmp_path_factory):
    _, text, mmproj = pair
    with Stack(redis_url, text, tmp_path_factory.mktemp("images-gguf"),
               env={"STREAMQ_MMPROJ": str(mmproj), "STREAMQ_SERVED_MODEL_NAME": "gemma3"}) as stack:
        url = stack.urls[0]
        until_sync(lambda: "gemma3" in {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]},
                   timeout_s=180, what="the model listed")
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


CASES = {"one image": [png(1), "What is in the picture?"],
         "two images": ["Compare", png(2, (64, 30)), "with", png(3, (20, 90))],
         "no image": ["Just words, no picture."]}


@pytest.mark.parametrize("case", list(CASES))
def test_the_pair_answers_as_the_model_it_was_made_from(served, pair, case):
    import io

    from PIL import Image
    from transformers import AutoTokenizer

    model, _, _ = pair
    parts = CASES[case]
    content = [{"type": "image_url", "image_url": {"url": data_url(p)}} if isinstance(p, bytes) else
               {"type": "text", "text": p} for p in parts]
    reply = served.chat.completions.create(model="gemma3", messages=[{"role": "user", "content": content}],
                                           max_tokens=MAX_TOKENS, temperature=0)
    want = AutoTokenizer.from_pretrained(model).decode(reference_tokens(model, parts, MAX_TOKENS), skip_special_tokens=True)
    assert reply.choices[0].message.content == want
    template = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts]
    pictures = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)] or None
    counted = processor_inputs(model, [{"role": "user", "content": template}], pictures)["input_ids"].shape[1]
    assert reply.usage.prompt_tokens == counted
