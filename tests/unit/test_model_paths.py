"""Converting the default model into a cache folder that several processes share (pods on one
volume): each converts into its own folder, and the first whole result stays in place."""
from __future__ import annotations

import threading
from pathlib import Path

import transformers

from shared import model_paths
from shared.model_paths import DEFAULT_NAME, _move_into_place


def _whole(folder: Path, mark: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_text(mark)
    (folder / "tokenizer.json").write_text(mark)
    return folder


def test_the_converted_folder_is_renamed_into_place(tmp_path):
    _move_into_place(_whole(tmp_path / "m.partial-a", "a"), tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_text() == "a"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_a_whole_folder_another_process_put_there_first_is_kept(tmp_path):
    target = _whole(tmp_path / "m", "first")
    _move_into_place(_whole(tmp_path / "m.partial-b", "second"), target)
    assert (target / "model.safetensors").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_a_half_made_folder_is_replaced(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "tokenizer.json").write_text("old")  # no weights
    _move_into_place(_whole(tmp_path / "m.partial-c", "new"), target)
    assert (target / "model.safetensors").read_text() == "new"


class _Saves:
    """Stands in for the model and the tokenizer: saving waits until both conversions are saving."""

    def __init__(self, both_saving: threading.Barrier, folders: list[Path]):
        self.both_saving, self.folders = both_saving, folders
        self.config = object()

    def save_pretrained(self, folder: Path) -> None:
        self.folders.append(folder)
        self.both_saving.wait(timeout=30)
        folder.mkdir(exist_ok=True)
        for name in ("model.safetensors", "tokenizer.json"):
            (folder / name).write_text(str(folder))


def test_two_conversions_at_once_each_write_their_own_folder(tmp_path, monkeypatch):
    folders: list[Path] = []
    both_saving = threading.Barrier(2)
    fake = _Saves(both_saving, folders)
    monkeypatch.setattr(model_paths, "default_gguf_path", lambda: tmp_path / "package" / model_paths.DEFAULT_GGUF)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: fake)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: fake)
    target = tmp_path / "cache" / DEFAULT_NAME
    target.parent.mkdir()
    errors: list[BaseException] = []

    def convert() -> None:
        try:
            model_paths._convert_default(target)
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
    assert model_paths._converted(target)
    assert (target / "model.safetensors").read_text() in {str(p) for p in partials}
    assert [p.name for p in target.parent.iterdir()] == [DEFAULT_NAME]  # the loser's folder is gone
