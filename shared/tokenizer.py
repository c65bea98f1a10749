"""The tokenizer and chat template, loaded from a model folder without transformers or torch.

The api counts and templates prompts with this; the worker detokenizes with the same code,
so both sides agree on every token.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers.decoders import DecodeStream

from shared import pooling_model, vision_model
from shared.pooling_model import PoolingModel
from shared.vision_model import VisionModel

log = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """The model's chat template refused the messages, or the model has none."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


# The names render_chat gives the template itself: a request's chat_template_kwargs may not set them.
TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                            "strftime_now"})


class Tokenizer:
    """Encode, decode and apply the chat template of one model folder."""

    def __init__(self, folder: Path | str):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; run `streamq prepare-model` to build it")
        self._tok = _RustTokenizer.from_file(str(path))
        # A tokenizer.json may pad or cut every encoding to a fixed length (sentence-transformers'
        # exports often do): here an input's tokens are its own, and a length over a limit is a 400.
        self._tok.no_padding()
        self._tok.no_truncation()
        config = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")
        generation = _read_json(folder / "generation_config.json")

        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template_file = folder / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.is_file() else config.get("chat_template")
        )
        try:  # an embedding model or cross-encoder: what it computes, and its own input limit
            self.pooling: PoolingModel | None = pooling_model.read(folder)
        except pooling_model.UnsupportedEncoder as exc:  # no worker serves it either: it refuses to start
            log.warning("%s", exc)
            self.pooling = None
        try:  # a vision-language model: how many tokens an image is (shared/vision_model.py)
            self.vision: VisionModel | None = vision_model.read(folder)
        except vision_model.UnsupportedVision as exc:  # no worker serves it either
            log.warning("%s", exc)
            self.vision = None
        self.context_length = served_context(model_config)
        if self.pooling is not None and self.pooling.max_seq_length:
            self.context_length = min(self.context_length, int(self.pooling.max_seq_length))
        # The size of the final hidden states (embeddings): OPT's project_out gives word_embed_proj_dim
        self.hidden_size = int(model_config.get("word_embed_proj_dim") or model_config.get("hidden_size") or 0)
        eos = generation.get("eos_token_id", model_config.get("eos_token_id"))
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if self.eos_token is not None and (tid := self._tok.token_to_id(self.eos_token)) is not None:
            ids.append(tid)
        self.eos_token_ids: frozenset[int] = frozenset(int(i) for i in ids)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # The special tokens (text: id): decoding drops them unless asked to keep them
        self.special_tokens: dict[str, int] = {
            token.content: index for index, token in self._tok.get_added_tokens_decoder().items() if token.special}
        self._template = None

    def rust_tokenizer(self) -> _RustTokenizer:
        """The `tokenizers` library's tokenizer underneath (for libraries that take one)."""
        return self._tok

    def vocabulary(self) -> dict[str, int]:
        """Every token and its id (two models share a tokenizer when these are equal)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def prompt_length(self, prompt: str) -> int:
        """The tokens a prompt put before a text takes, its opening special tokens included and a
        closing one not (as sentence-transformers counts the prompt it leaves out of pooling)."""
        enc = self._tok.encode(prompt)
        return len(enc.ids) - (1 if enc.special_tokens_mask and enc.special_tokens_mask[-1] else 0)

    def pair_frame(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """The tokens of a pair before its second text (the first text with the special tokens around
        it) and after it, as the tokenizer frames a pair (BERT: [CLS] a [SEP] b [SEP]); `second`, any
        text the frame is measured with (a pair's frame does not depend on it)."""
        a = self._tok.encode(first, add_special_tokens=False)
        b = self._tok.encode(second, add_special_tokens=False)
        both = self._tok.post_process(a, b, add_special_tokens=True)
        mask = both.special_tokens_mask
        lead = next((i for i, m in enumerate(mask) if not m), len(mask))
        start = lead + len(a.ids)
        while start < len(mask) and mask[start]:
            start += 1
        return both.ids[:start], both.ids[start + len(b.ids):]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """A fresh incremental decoder for one output: give it each new id; it returns the text
        that id completes (special tokens skipped unless asked, as `decode` does), or None while a
        character is still partial."""
        return partial(DecodeStream(skip_special_tokens=skip_special_tokens).step, self._tok)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, extra: dict[str, Any] | None = None) -> str:
        """The prompt text for chat messages (and `tools`, for a template that renders them), as
        the model was trained to read them; `extra`: more variables for the template (a request's
        chat_template_kwargs, such as enable_thinking), never one the renderer sets itself."""
        if taken := sorted(set(extra or ()) & TEMPLATE_NAMES):
            raise ChatTemplateError(f"chat_template_kwargs may not set {taken}: the server sets them")
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(**(extra or {}), messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         tools=tools)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, add_special_tokens: bool = False,
                    extra: dict[str, Any] | None = None) -> list[int]:
        # The template writes the special tokens itself, as transformers does (unless asked to add them again).
        text = self.render_chat(messages, add_generation_prompt, tools, extra)
        if self.vision is not None and self.vision.frame[0] >= 0:  # Gemma 3: each image written out as its processor does
            first, last = self.vision.frame
            opening, soft, closing = self.token_strs([first, self.vision.image_token_id, last])
            text = text.replace(opening, f"\n\n{opening}{soft}{closing}\n\n")
        return self.encode(text, add_special_tokens)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's piece of the vocabulary, as it is written there (a byte-level BPE's Ġ for a space)."""
        return [self._tok.id_to_token(i) or "" for i in ids]


def served_context(model_config: dict[str, Any]) -> int:
    """The positions a request may use: the model's context. Sliding-window layers (Mistral,
    Phi-3, Qwen2 with use_sliding_window, Gemma 3's local layers) are served with their window
    applied, on either engine, so a window shorter than the context limits nothing."""
    for config in (model_config, model_config.get("text_config") or {}):  # a vision-language model's is its text model's
        if limit := config.get("max_position_embeddings") or config.get("n_positions"):
            return int(limit)
    return 2048


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
