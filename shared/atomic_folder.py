"""A folder in the model cache written whole or not at all: built under a name of its own, then
renamed into place. Processes that share the cache (pods on one volume) may build the same folder
at once; each writes its own, and the first whole one stays."""
from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(target: Path, whole: Callable[[Path], bool]) -> Iterator[Path]:
    """A fresh folder beside `target` to write into: renamed to `target` when the block ends,
    removed when it raises. `whole` tells a finished `target` from a half-made one."""
    partial = target.with_name(f"{target.name}.partial-{uuid.uuid4().hex}")
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    move_into_place(partial, target, whole)


def move_into_place(partial: Path, target: Path, whole: Callable[[Path], bool]) -> None:
    """Rename the finished `partial` folder to `target`: atomic, so a reader sees no folder or a
    whole one. A whole one already there (another process made it at the same time) is kept,
    since a process may be reading it, and `partial` is dropped."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not whole(target):
        shutil.rmtree(target, ignore_errors=True)  # left half-made by some other means: renames never do
    try:
        partial.rename(target)
    except OSError:  # the target is there and not empty: the other process's whole folder
        shutil.rmtree(partial, ignore_errors=True)
