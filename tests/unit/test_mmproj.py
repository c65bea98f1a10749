"""llama.cpp's mmproj GGUF beside a text GGUF (shared/mmproj.py): what the api reads of the pair
(no torch), what it refuses, and the weights the worker's conversion takes. Through the stack:
tests/e2e/test_images_gguf.py."""
from __future__ import annotations

import json

import pytest

from shared import mmproj, vision_model
from shared.model_source import ModelNotFound
from shared.settings import CommonSettings
from streamq.testing.tiny_vision import build_gemma3, write_gemma3_ggufs


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pair")
    model = build_gemma3(folder / "hf", gguf_shaped=True)
    return (model, *write_gemma3_ggufs(model, folder / "text.gguf", folder / "mmproj.gguf"))


def _tokenizer_folder(model, tmp_path):
    """A tokenizer folder as write_from_gguf leaves one (its config.json without the vision)."""
    import shutil

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(model / "tokenizer.json", folder / "tokenizer.json")
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    return folder


def test_the_description_is_the_vision_model_the_api_counts_images_of(pair, tmp_path):
    model, _, projector = pair
    folder = _tokenizer_folder(model, tmp_path)
    assert not mmproj.described(folder)
    mmproj.describe(projector, folder)
    assert mmproj.described(folder)
    vision = vision_model.read(folder)
    original = vision_model.read(model)
    assert vision == original  # family, image tokens, tokens an image: as the model it was made from
    config = json.loads((folder / "config.json").read_text())
    want = json.loads((model / "config.json").read_text())["vision_config"]
    assert {k: config["vision_config"][k] for k in ("hidden_size", "num_hidden_layers", "image_size", "patch_size")} \
        == {k: want[k] for k in ("hidden_size", "num_hidden_layers", "image_size", "patch_size")}
    assert json.loads((folder / "preprocessor_config.json").read_text())["size"] == {"height": 56, "width": 56}


def test_the_vision_weights_are_the_original_model_s(pair):
    import torch
    from safetensors.torch import load_file

    model, _, projector = pair
    weights = mmproj.vision_weights(projector, 2)
    original = {}
    for name, tensor in load_file(model / "model.safetensors").items():  # saved as vision_tower.*, multi_modal_projector.*
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            original["model." + name] = tensor
    assert set(weights) == set(original)
    for name, tensor in weights.items():
        assert torch.allclose(tensor, original[name].float(), atol=1e-6), name


def test_an_mmproj_of_another_projector_is_refused_naming_it(pair, tmp_path):
    import gguf

    from streamq.testing.tiny_models import finish

    model, _, _ = pair
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(other), "clip")
    writer.add_string("clip.projector_type", "qwen2vl_merger")
    finish(writer)
    with pytest.raises(mmproj.UnsupportedMmproj, match="qwen2vl_merger"):
        mmproj.describe(other, _tokenizer_folder(model, tmp_path))


def test_a_text_model_without_gemma3_image_tokens_is_refused(pair, tmp_path):
    model, _, projector = pair
    folder = _tokenizer_folder(model, tmp_path)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<image_soft_token>"]
    tokenizer["model"]["vocab"].pop("<image_soft_token>", None)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(mmproj.UnsupportedMmproj, match="image_soft_token"):
        mmproj.describe(projector, folder)


def test_an_mmproj_beside_a_model_that_is_no_gguf_is_refused(pair, tmp_path):
    from shared import model_paths

    model, _, projector = pair
    settings = CommonSettings(model=str(model), mmproj=projector, model_cache_dir=tmp_path)
    with pytest.raises(ModelNotFound, match="beside a GGUF model"):
        model_paths.model_dir(settings)
