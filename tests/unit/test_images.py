"""Images as the api reads and checks them (api/core/images.py), and how a vision-language model
counts their tokens (shared/vision_model.py). Through the stack: tests/e2e/test_images.py."""
from __future__ import annotations

import asyncio

import pytest

from api.core import images
from api.core.errors import ApiError
from shared import vision_model
from streamq.testing.tiny_vision import build_gemma3, build_llava, build_qwen2_vl, data_url, png, processor_inputs

LIMITS = images.Limits(max_images=3, max_bytes=200_000, max_pixels=1_000_000)


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_is_read_with_its_size_and_sha256(kind):
    import hashlib

    data = png(1, (40, 30), kind)
    image = images.check(images.data_of(data_url(data, f"image/{kind.lower()}"), "image 1", LIMITS), "image 1", LIMITS)
    assert (image.format, image.width, image.height) == (kind, 40, 30)
    assert image.sha256 == hashlib.sha256(data).hexdigest() and image.data == data


def test_an_animated_gif_is_read_from_its_first_frame():
    import io

    from PIL import Image

    frames = [Image.new("RGB", (8, 8), color) for color in ("red", "blue")]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    assert images.check(out.getvalue(), "gif", LIMITS).format == "GIF"


@pytest.mark.parametrize("url, status, says", [
    ("https://example.com/cat.png", 400, "not fetched"),
    ("file:///etc/passwd", 400, "data URL"),
    ("data:text/plain;base64,aGVsbG8=", 400, "data URL"),
    ("data:image/png;base64,@@@@", 400, "base64"),
    ("data:image/png;base64," + "A" * 300_000, 413, "larger than"),
])
def test_a_url_that_is_no_image_data_url_is_refused(url, status, says):
    with pytest.raises(ApiError) as refused:
        images.data_of(url, "image 1", LIMITS)
    assert refused.value.status == status and says in str(refused.value.message)


@pytest.mark.parametrize("data, status, says", [
    (b"\x00" * 100, 400, "not an image"),
    (b"<svg xmlns='http://www.w3.org/2000/svg'/>", 400, "not an image"),
    (png(2)[:200], 400, "cannot be decoded"),
    (None, 400, "pixels"),  # a plain 1200×900 picture: small in bytes, over the pixels
    (b"\x89PNG" + bytes(250_000), 413, "larger than"),
])
def test_a_bad_image_is_refused_naming_why(data, status, says):
    if data is None:
        import io

        from PIL import Image

        out = io.BytesIO()
        Image.new("RGB", (1200, 900)).save(out, format="PNG")
        data = out.getvalue()
    with pytest.raises(ApiError) as refused:
        images.check(data, "image 1", LIMITS)
    assert refused.value.status == status and says in str(refused.value.message)
    assert "image 1" in str(refused.value.message)


def test_more_images_than_the_limit_are_refused_before_any_is_decoded():
    urls = [(f"image {i}", data_url(png(i))) for i in range(4)]
    with pytest.raises(ApiError, match="at most 3"):
        asyncio.run(images.check_all(urls, LIMITS))
    assert len(asyncio.run(images.check_all(urls[:3], LIMITS))) == 3


def test_a_llava_counts_its_image_tokens_as_its_processor_does(tmp_path):
    folder = build_llava(tmp_path)
    vision = vision_model.read(folder)
    assert vision is not None and vision.tokens(40, 50) == vision.tokens(900, 20) == 4
    from transformers import AutoProcessor

    from PIL import Image
    import io

    processor = AutoProcessor.from_pretrained(folder)
    prompt = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"}]}], add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(png(i))).convert("RGB") for i in (1, 2)]
    want = processor(images=pictures, text=prompt, add_special_tokens=False)["input_ids"][0]
    ids = processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert vision.expand(ids, [(40, 50)] * 2) == list(want)
    with pytest.raises(ValueError, match="2 image tokens for 3 images"):
        vision.expand(ids, [(40, 50)] * 3)


def test_a_llava_next_counts_each_image_by_its_size_as_its_processor_does(tmp_path):
    """Anyres: the count depends on the best grid pinpoint for the image's shape and the padding
    it leaves; equal to the processor's on 60 sizes from thin strips to squares, two at a time."""
    import io
    import random

    from PIL import Image
    from transformers import AutoProcessor

    folder = build_llava(tmp_path, family="llava_next")
    vision = vision_model.read(folder)
    assert vision is not None and vision.family == "llava_next"
    processor = AutoProcessor.from_pretrained(folder)
    prompt = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}], add_generation_prompt=True)
    ids = processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    sizes = [(1, 300), (300, 1), (28, 28), (56, 28), (29, 57)] + [(rng.randint(1, 200), rng.randint(1, 200))
                                                                     for _ in range(55)]
    counts = set()
    for first, second in zip(sizes[::2], sizes[1::2]):
        pictures = [Image.open(io.BytesIO(png(i, size))).convert("RGB") for i, size in enumerate((first, second))]
        want = processor(images=pictures, text=prompt, add_special_tokens=False)["input_ids"][0]
        assert vision.expand(ids, [first, second]) == list(want), (first, second)
        counts |= {vision.tokens(*first), vision.tokens(*second)}
    assert len(counts) > 3  # the sizes made different counts


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_qwen2_vl_counts_each_image_by_its_size_as_its_processor_does(tmp_path, family):
    """Dynamic resolution: the image resized to multiples of 28 within the pixel bounds, a token
    per 2 × 2 patches; equal to the image processor's grid on 40 sizes; a strip longer than 200
    times its width is refused as the processor refuses it."""
    import io
    import random

    from PIL import Image

    folder = build_qwen2_vl(tmp_path, family=family)
    vision = vision_model.read(folder)
    assert vision is not None and vision.family == family
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    ids = processor_inputs(folder, messages, None)["input_ids"][0].tolist()
    rng = random.Random(1)
    sizes = [(1, 150), (150, 1), (28, 28), (500, 400)] + [(rng.randint(2, 300), rng.randint(2, 300)) for _ in range(36)]
    counts = set()
    for first, second in zip(sizes[::2], sizes[1::2]):
        pictures = [Image.open(io.BytesIO(png(i, size))).convert("RGB") for i, size in enumerate((first, second))]
        want = processor_inputs(folder, messages, pictures)["input_ids"][0].tolist()
        assert vision.expand(ids, [first, second]) == want, (first, second)
        counts |= {vision.tokens(*first), vision.tokens(*second)}
    assert len(counts) > 3
    with pytest.raises(ValueError, match="200 times"):
        vision.tokens(1, 201)


def test_a_gemma3_writes_each_image_out_as_its_processor_does(tmp_path):
    """Gemma 3's processor writes "\n\n<start_of_image>", the soft tokens, "<end_of_image>\n\n" in
    the text where the template put <start_of_image>, then tokenizes (the newlines may merge with
    the text's): the api's ids are the processor's, for images first, between words and last."""
    import io

    from PIL import Image

    from shared.tokenizer import Tokenizer

    folder = build_gemma3(tmp_path)
    tok = Tokenizer(folder)
    assert tok.vision is not None and tok.vision.family == "gemma3" and tok.vision.tokens(900, 20) == 4
    for parts in ([png(1), "What?"], ["Compare\n", png(2), "\nwith", png(3, (20, 90))], ["Just words"]):
        content = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts]
        messages = [{"role": "user", "content": content}]
        pictures = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)]
        want = processor_inputs(folder, messages, pictures or None)["input_ids"][0].tolist()
        assert tok.vision.expand(tok.encode_chat(messages), [p.size for p in pictures]) == want, parts


def test_a_gemma3_with_pan_and_scan_crops_is_refused(tmp_path):
    import json

    folder = build_gemma3(tmp_path)
    config = json.loads((folder / "processor_config.json").read_text())
    config["image_processor"]["do_pan_and_scan"] = True
    (folder / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(vision_model.UnsupportedVision, match="pan and scan"):
        vision_model.read(folder)


def test_llava_next_grid_pinpoints_off_the_crop_size_are_refused(tmp_path):
    import json

    folder = build_llava(tmp_path, family="llava_next")
    path = folder / "preprocessor_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        config["image_grid_pinpoints"] = [[30, 56]]
        path.write_text(json.dumps(config))
    path = folder / "processor_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        if "image_processor" in config:
            config["image_processor"]["image_grid_pinpoints"] = [[30, 56]]
            path.write_text(json.dumps(config))
    with pytest.raises(vision_model.UnsupportedVision, match="multiples of the crop size"):
        vision_model.read(folder)


def test_a_text_model_is_no_vision_model(tiny_llama):
    assert vision_model.read(tiny_llama) is None
