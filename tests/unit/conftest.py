"""Fixtures the unit tests share."""
from __future__ import annotations

import pytest

from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import CHAT_TEMPLATE, HERMES_TEMPLATE, build_tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    """A tiny tokenizer whose chat template knows no tool format ("generic"), and one whose
    template renders tools and asks for Hermes' <tool_call> blocks ("hermes")."""
    out = {}
    for name, template in (("generic", CHAT_TEMPLATE), ("hermes", HERMES_TEMPLATE)):
        folder = tmp_path_factory.mktemp(name)
        build_tokenizer(folder, chat_template=template)
        out[name] = Tokenizer(folder)
    return out
