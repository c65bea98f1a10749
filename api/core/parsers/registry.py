"""Tool formats by name. A format is one module that registers itself here (`register`); the
api chooses one per served model (`choose`): the one a setting names, or under "auto" the one
its chat template certainly asks for, else the generic JSON format, which any model can write."""
from __future__ import annotations

from typing import TYPE_CHECKING

from api.core.parsers.base import ToolFormat

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer

AUTO = "auto"
FALLBACK = "generic"  # the format any model writes under its constraint
_FORMATS: dict[str, ToolFormat] = {}


def register(tool_format: ToolFormat) -> ToolFormat:
    if tool_format.name in _FORMATS or tool_format.name == AUTO:
        raise ValueError(f"a tool format named {tool_format.name!r} is registered already")
    _FORMATS[tool_format.name] = tool_format
    return tool_format


def names() -> list[str]:
    return sorted(_FORMATS)


def get(name: str) -> ToolFormat:
    """The format registered as `name` (ValueError naming the known ones)."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"no tool format {name!r}; known: {', '.join([AUTO, *names()])}") from None


def check(setting: str) -> None:
    """ValueError where the setting names a format that is not registered, or is not MODEL=FORMAT
    pairs: said when the api starts, before any model is served."""
    names_given = [_pair(part)[1] for part in setting.split(",") if part.strip()] if "=" in setting else [setting.strip()]
    for name in names_given:
        if name != AUTO:
            get(name)


def choose(setting: str, model: str, tokenizer: Tokenizer) -> ToolFormat:
    """The format of `model`'s replies by the setting (STREAMQ_TOOL_PARSER): a format's name, or
    MODEL=FORMAT pairs; under "auto" the first format whose template check is certain, else the
    generic one. ValueError naming the known formats for an unknown one."""
    name = setting.strip()
    if "=" in name:
        pairs = dict(_pair(part) for part in name.split(",") if part.strip())
        name = pairs.get(model, AUTO)
    if name != AUTO:
        return get(name).for_tokenizer(tokenizer)
    found = [f for key, f in sorted(_FORMATS.items()) if key != FALLBACK and f.knows(tokenizer)]
    return (found[0] if found else _FORMATS[FALLBACK]).for_tokenizer(tokenizer)


def _pair(part: str) -> tuple[str, str]:
    model, _, name = part.partition("=")
    if not model.strip() or not name.strip():
        raise ValueError(f"tool parser setting: {part.strip()!r} is not MODEL=FORMAT")
    return model.strip(), name.strip()
