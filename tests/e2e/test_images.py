"""Images through the whole stack on a tiny LLaVA-1.5, LLaVA-NeXT, Qwen2-VL and Gemma 3
(streamq/testing/tiny_vision.py) beside a tiny text model: OpenAI chat `image_url` parts (data URLs) checked by the api, kept in Redis under their
sha256, run by the worker; the greedy reply equal to transformers' `generate` on the processor's
inputs, for one image, two, none, and all of them at once. Bad images are each a 4xx naming why,
and a good request sent beside them is answered as if alone."""
from __future__ import annotations

import base64
import json
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from shared import redis_keys
from streamq.testing.tiny_vision import build_gemma3, build_llava, build_qwen2_vl, data_url, png, processor_inputs, reference_tokens
from tests.stack import Stack
from tests.waiting import until_sync

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def others(tmp_path_factory) -> dict:
    """The other vision-language models served, by name: their folders."""
    return {"llava-next": build_llava(tmp_path_factory.mktemp("llava-next"), family="llava_next"),
            "qwen2-vl": build_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl")),
            "gemma3": build_gemma3(tmp_path_factory.mktemp("gemma3"))}


@pytest.fixture(scope="module")
def served(redis_url, tiny_llama, others, tmp_path_factory):
    llava = build_llava(tmp_path_factory.mktemp("llava"))
    envs = [{"STREAMQ_SERVED_MODEL_NAME": "llava"}, {"STREAMQ_MODEL": str(tiny_llama), "STREAMQ_SERVED_MODEL_NAME": "text"},
            *({"STREAMQ_MODEL": str(folder), "STREAMQ_SERVED_MODEL_NAME": name} for name, folder in others.items())]
    with Stack(redis_url, llava, tmp_path_factory.mktemp("images"), workers=len(envs), worker_envs=envs,
               env={"STREAMQ_SERVED_MODEL_NAME": "llava"}) as stack:
        url = stack.urls[0]
        until_sync(lambda: {"llava", "text", *others} <= {m["id"] for m in httpx.get(f"{url}/v1/models",
                                                                                     timeout=10).json()["data"]},
                   timeout_s=180, what="every model listed")
        yield stack, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), llava


def _reference(folder, parts: list) -> str:
    """transformers' greedy reply on the processor's inputs (its chat template, its image processing)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).decode(reference_tokens(folder, parts, MAX_TOKENS),
                                                        skip_special_tokens=True)


def _ask(client, parts: list, model: str = "llava"):
    content = [{"type": "image_url", "image_url": {"url": data_url(p)}} if isinstance(p, bytes) else
               {"type": "text", "text": p} for p in parts]
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0)


CASES = {"one image": [png(1), "What is in the picture?"],
         "two images": ["Compare", png(2, (64, 30)), "with", png(3, (20, 90))],
         "no image": ["Just words, no picture."],
         "a JPEG and a GIF": [png(4, kind="JPEG"), png(5, kind="GIF"), "and these?"]}


@pytest.mark.parametrize("model", ["llava", "llava-next", "qwen2-vl", "gemma3"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_reply_with_images_equals_transformers(served, others, case, model):
    stack, client, folder = served
    folder = others.get(model, folder)
    reply = _ask(client, CASES[case], model)
    assert reply.choices[0].message.content == _reference(folder, CASES[case])
    assert reply.usage.prompt_tokens == _processor_tokens(folder, CASES[case])  # each image counted by its size


def _processor_tokens(folder, parts: list) -> int:
    """How many tokens the model's processor makes of one user message of `parts`."""
    import io

    from PIL import Image

    content = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts]
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)] or None
    return len(processor_inputs(folder, [{"role": "user", "content": content}], images)["input_ids"][0])


@pytest.mark.parametrize("model", ["llava", "llava-next", "qwen2-vl", "gemma3"])
def test_all_at_once_each_equals_its_reply_alone(served, others, model):
    _, client, folder = served
    folder = others.get(model, folder)
    with ThreadPoolExecutor(len(CASES)) as pool:
        replies = list(pool.map(lambda parts: _ask(client, parts, model).choices[0].message.content, CASES.values()))
    assert replies == [_reference(folder, parts) for parts in CASES.values()]


def test_an_image_is_kept_once_in_redis_under_its_sha256(served):
    import hashlib

    stack, client, _ = served
    picture = png(6)
    _ask(client, [picture, "once"])
    _ask(client, ["twice", picture])
    with stack.redis() as redis:
        kept = redis.get(redis_keys.image(stack.prefix, hashlib.sha256(picture).hexdigest()))
        assert base64.b64decode(kept) == picture
        assert 0 < redis.ttl(redis_keys.image(stack.prefix, hashlib.sha256(picture).hexdigest())) <= redis_keys.IMAGE_TTL_S


def _huge_png(width: int, height: int) -> bytes:
    """A small file whose header says width × height (its pixels never there): a decompression bomb's shape."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'
BAD = {
    "random bytes": ({"type": "image_url", "image_url": {"url": data_url(bytes(range(256)) * 8)}}, 400, "not an image"),
    "a truncated PNG": ({"type": "image_url", "image_url": {"url": data_url(png(7)[:300])}}, 400, "cannot be decoded"),
    "30000×30000 pixels": ({"type": "image_url", "image_url": {"url": data_url(_huge_png(30000, 30000))}}, 400,
                           "pixels"),
    "an SVG": ({"type": "image_url", "image_url": {"url": data_url(SVG, "image/svg+xml")}}, 400, "not an image"),
    "a URL to 127.0.0.1": ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:6379/x.png"}}, 400, "URL"),
    "a URL to 169.254.169.254": ({"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}},
                                 400, "URL"),
    "not base64": ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%%"}}, 400, "base64"),
    "no URL": ({"type": "image_url", "image_url": {}}, 400, "image_url.url"),
    "detail high": ({"type": "image_url", "image_url": {"url": data_url(png(8)), "detail": "high"}}, 400, "detail"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_image_is_a_clear_4xx_and_its_neighbour_is_answered(served, case):
    stack, client, folder = served
    part, status, says = BAD[case]
    body = {"model": "llava", "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}]}
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(httpx.post, f"{stack.urls[0]}/v1/chat/completions", json=body, timeout=60)
        good = pool.submit(_ask, client, CASES["one image"])
        reply = bad.result()
        assert good.result().choices[0].message.content == _reference(folder, CASES["one image"])
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == "messages" and says in error["message"], error


@pytest.mark.parametrize("messages, says", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(9))}}] * 17}], "at most 16"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": data_url(png(9))}}]}], "user messages"),
])
def test_what_a_request_may_not_carry_is_a_400(served, messages, says):
    stack, _, _ = served
    reply = httpx.post(f"{stack.urls[0]}/v1/chat/completions", json={"model": "llava", "messages": messages,
                                                                      "max_tokens": 2}, timeout=60)
    assert reply.status_code == 400 and says in reply.json()["error"]["message"], reply.text


def test_a_text_model_takes_no_images(served):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(client, [png(1), "what is it?"], model="text")
    assert refused.value.body["param"] == "messages" and "takes no images" in refused.value.body["message"]
    assert _ask(client, ["just text"], model="text").choices[0].message.content is not None


def test_responses_and_messages_take_images_as_chat_does(served):
    """Responses' input_image parts and Messages' image blocks (base64) are the chat's image parts:
    the same reply as transformers' on the same picture and words."""
    import anthropic

    stack, client, folder = served
    picture, words = png(11), "What is in the picture?"
    want = _reference(folder, [picture, words])
    response = client.responses.create(model="llava", max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(picture)},
                                     {"type": "input_text", "text": words}]}])
    assert response.output_text == want
    messages = anthropic.Anthropic(base_url=stack.urls[0], api_key="none", max_retries=0)
    answer = messages.messages.create(model="llava", max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": base64.b64encode(picture).decode()}},
                                     {"type": "text", "text": words}]}])
    assert "".join(b.text for b in answer.content if b.type == "text") == want
    with pytest.raises(anthropic.BadRequestError) as refused:  # a URL source is not fetched
        messages.messages.create(model="llava", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/x.png"}}]}])
    assert "not fetched" in refused.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="llava", max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(b"not a picture")}]}])
    assert bad.value.body["param"] == "input" and "not an image" in bad.value.body["message"]


def test_an_image_goes_beside_tools(served):
    """A user message with a picture in a request with tools: the tool format writes the
    conversation, the picture's tokens where the message is; a forced call comes back parsed."""
    _, client, _ = served
    tools = [{"type": "function", "function": {"name": "describe", "parameters": {
        "type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}}, "required": ["colour"]}}}]
    asked = []
    for parts in ([png(13), "Which colour?"], ["Which colour?"]):
        content = [{"type": "image_url", "image_url": {"url": data_url(p)}} if isinstance(p, bytes) else
                   {"type": "text", "text": p} for p in parts]
        reply = client.chat.completions.create(model="llava", messages=[{"role": "user", "content": content}],
                                               tools=tools, tool_choice="required", max_tokens=200, temperature=0)
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0]
        calls = reply.choices[0].message.tool_calls
        assert calls and all(c.function.name == "describe" and "colour" in json.loads(c.function.arguments)
                             for c in calls)
        asked.append(reply.usage.prompt_tokens)
    assert asked[0] >= asked[1] + 4  # the picture's 4 tokens (and its line) in the prompt


def test_a_responses_image_may_be_an_uploaded_file(served):
    """files.create(purpose="vision") then an input_image naming it by file_id: the reply to the
    picture itself, the stored input keeps the file_id; what is not an image is refused at upload,
    and an unknown or deleted file is a 404 on `input`."""
    _, client, folder = served
    picture, words = png(12), "What is in the picture?"
    uploaded = client.files.create(file=("picture.png", picture), purpose="vision")
    assert uploaded.purpose == "vision" and uploaded.bytes == len(picture)
    assert client.files.content(uploaded.id).content == picture  # the bytes back, unchanged
    content = [{"type": "input_image", "file_id": uploaded.id}, {"type": "input_text", "text": words}]
    response = client.responses.create(model="llava", max_output_tokens=MAX_TOKENS, temperature=0,
                                       input=[{"role": "user", "content": content}])
    assert response.output_text == _reference(folder, [picture, words])
    stored = client.responses.input_items.list(response.id).data[0].content[0]
    assert stored.type == "input_image" and stored.file_id == uploaded.id
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("notes.png", b"not a picture"), purpose="vision")
    assert refused.value.body["param"] == "file" and "not an image" in refused.value.body["message"]
    client.files.delete(uploaded.id)
    for gone in (uploaded.id, "file-" + "0" * 32, "FILE-x"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.create(model="llava", max_output_tokens=2, input=[{"role": "user", "content": [
                {"type": "input_image", "file_id": gone}]}])
        assert missing.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError):  # both, or neither
        client.responses.create(model="llava", max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": uploaded.id, "image_url": data_url(picture)}]}])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "look: <image> what is it?"}]}, "messages"),
    ("/v1/completions", {"prompt": "<image> a picture of"}, "prompt"),
    ("/v1/completions", {"prompt": [1, 5, 5, 5, 5, 9]}, "prompt"),
])
def test_the_image_token_without_an_image_is_a_400_and_fails_no_neighbour(served, path, body, param):
    """Written as text or sent as a token id, the image token would ask the model for pictures it
    does not have (and fail the static batch it ran in): refused before it queues."""
    stack, client, folder = served
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(httpx.post, f"{stack.urls[0]}{path}", json={"model": "llava", "max_tokens": 4, **body},
                          timeout=60)
        good = pool.submit(_ask, client, CASES["one image"])
        reply = bad.result()
        assert good.result().choices[0].message.content == _reference(folder, CASES["one image"])
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert "image token" in reply.json()["error"]["message"]


def test_an_image_qwen2_vl_cannot_take_is_a_400_and_its_neighbour_is_answered(served, others):
    """Qwen2-VL's processor refuses a picture longer than 200 times its width: the api says so
    before the request is queued, and a good request sent beside it is answered as if alone."""
    _, client, _ = served
    strip = png(9, (201, 1))
    good = ["What is in the picture?", png(1)]
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(_ask, client, [strip, "and this?"], "qwen2-vl")
        answer = pool.submit(_ask, client, good, "qwen2-vl")
        with pytest.raises(openai.BadRequestError) as refused:
            bad.result()
        assert answer.result().choices[0].message.content == _reference(others["qwen2-vl"], good)
    assert refused.value.status_code == 400 and "200 times" in str(refused.value)
