"""What STREAMQ_MODEL names, and converting a GGUF model (the default one too) into a cache folder
that several processes share (pods on one volume): each converts into its own folder, and the first
whole result stays in place."""
from __future__ import annotations

import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers

from shared import gguf_convert, hub_revision, model_paths, model_source, tokenizer_files
from shared.atomic_folder import move_into_place
from shared.gguf_convert import converted
from shared.model_source import DEFAULT_GGUF, DEFAULT_NAME, ModelNotFound, Source
from shared.settings import CommonSettings


def _whole(folder: Path, mark: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_text(mark)
    (folder / "tokenizer.json").write_text(mark)
    return folder


def test_the_converted_folder_is_renamed_into_place(tmp_path):
    move_into_place(_whole(tmp_path / "m.partial-a", "a"), tmp_path / "m", converted)
    assert (tmp_path / "m" / "model.safetensors").read_text() == "a"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_a_whole_folder_another_process_put_there_first_is_kept(tmp_path):
    target = _whole(tmp_path / "m", "first")
    move_into_place(_whole(tmp_path / "m.partial-b", "second"), target, converted)
    assert (target / "model.safetensors").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_a_half_made_folder_is_replaced(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "tokenizer.json").write_text("old")  # no weights
    move_into_place(_whole(tmp_path / "m.partial-c", "new"), target, converted)
    assert (target / "model.safetensors").read_text() == "new"


class _Saves:
    """Stands in for the model: saving waits until both conversions are saving."""

    def __init__(self, both_saving: threading.Barrier, folders: list[Path]):
        self.both_saving, self.folders = both_saving, folders
        self.config = object()

    def save_pretrained(self, folder: Path) -> None:
        self.folders.append(folder)
        self.both_saving.wait(timeout=30)
        folder.mkdir(exist_ok=True)
        (folder / "model.safetensors").write_text(str(folder))


def test_two_conversions_at_once_each_write_their_own_folder(tmp_path, monkeypatch):
    folders: list[Path] = []
    both_saving = threading.Barrier(2)
    fake = _Saves(both_saving, folders)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: fake)
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    target = tmp_path / "cache" / DEFAULT_NAME
    target.parent.mkdir()
    (tmp_path / "package").mkdir()
    write_gguf(tmp_path / "package" / DEFAULT_GGUF)  # a decoder's header: transformers converts it
    errors: list[BaseException] = []

    def convert() -> None:
        try:
            gguf_convert.convert_gguf(tmp_path / "package" / DEFAULT_GGUF, target, tokenizer)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
    threads = [threading.Thread(target=convert) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    partials = set(folders)
    assert len(partials) == 2, "both conversions wrote into one folder"
    assert converted(target)
    assert (target / "model.safetensors").read_text() in {str(p) for p in partials}
    assert [p.name for p in target.parent.iterdir()] == [DEFAULT_NAME]  # the loser's folder is gone


def write_gguf(path: Path, context: int = 4096, template: str = "{{ messages }}") -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(context)
    writer.add_token_list(["<s>", "</s>", "hé", "llo"])  # an array of strings: skipped, not read
    writer.add_token_scores([0.0, 0.0, -1.0, -2.0])
    writer.add_eos_token_id(1)
    writer.add_chat_template(template)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_header_is_read_without_its_arrays(tmp_path):
    meta = tokenizer_files.gguf_metadata(write_gguf(tmp_path / "m.gguf", template="{{ 'é' }}"))
    assert meta["general.architecture"] == "llama"
    assert meta["llama.context_length"] == 4096
    assert meta["tokenizer.ggml.eos_token_id"] == 1
    assert meta["tokenizer.chat_template"] == "{{ 'é' }}"
    assert "tokenizer.ggml.tokens" not in meta


def test_a_file_that_is_no_gguf_says_so(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        tokenizer_files.gguf_metadata(tmp_path / "x.gguf")


def test_what_the_model_setting_names(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    file = write_gguf(tmp_path / "small.Q4_K_M.gguf")

    def named(model: str) -> tuple[Source, str]:
        settings = CommonSettings(model=model, model_cache_dir=tmp_path / "cache")
        return model_source.source(settings), model_source.served_name(settings)
    assert named(str(folder)) == (Source("folder", str(folder)), "my-model")
    assert named(str(file)) == (Source("gguf", str(file)), "small.Q4_K_M")
    assert named("Qwen/Qwen2.5-0.5B-Instruct") == (Source("hub", "Qwen/Qwen2.5-0.5B-Instruct"),
                                                   "Qwen/Qwen2.5-0.5B-Instruct")
    assert named("Qwen/Qwen2.5-0.5B-Instruct-GGUF:qwen2.5-0.5b-instruct-q4_k_m.gguf") == (
        Source("hub_gguf", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf"),
        "qwen2.5-0.5b-instruct-q4_k_m")
    with pytest.raises(ModelNotFound, match="no folder or .gguf file"):
        named(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFound, match="no folder or .gguf file"):
        named("not a model")
    renamed = CommonSettings(model=str(file), served_model_name="mine")
    assert model_source.served_name(renamed) == "mine"


def test_the_default_model_is_a_gguf_file_like_any_other(tmp_path):
    settings = CommonSettings(model_cache_dir=tmp_path)
    path = model_source.default_gguf_path()
    assert model_source.source(settings) == Source("gguf", str(path))
    assert model_paths.gguf_file(settings) == path
    assert model_source.served_name(settings) == DEFAULT_NAME
    assert model_paths.weights_dir(settings).parent == tmp_path
    assert model_paths.weights_dir(settings).name.startswith("SmolLM2-135M-Instruct.Q4_1-")


def test_a_changed_gguf_file_gets_other_cache_folders(tmp_path):
    settings = CommonSettings(model=str(write_gguf(tmp_path / "m.gguf")), model_cache_dir=tmp_path / "cache")
    first = model_paths.weights_dir(settings)
    assert model_paths.weights_dir(settings) == first
    write_gguf(tmp_path / "m.gguf", template="{{ messages }} (another)")  # the size tells, whatever the clock
    assert model_paths.weights_dir(settings) != first


def test_a_commit_as_the_revision_needs_neither_redis_nor_the_hub():
    commit = "0123456789abcdef0123456789abcdef01234567"
    settings = CommonSettings(model="org/name", model_revision=commit, redis_url="redis://127.0.0.1:1/0")
    assert hub_revision.hub_commit(settings, "org/name") == commit
