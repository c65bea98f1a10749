"""Which api modules a Messages request (non-streaming, no tools) enters, in order, and how often it
comes back to a module it had left: a measure of how far a reader follows one request through the
code. It reads the tree it runs in, this layout or the one before api/ was split by protocol
(api/routes/):

    .venv/bin/python benchmarks/request_walk.py

The request runs through the real route, chat, generation and parser code; only what touches
Redis or a model is a stand-in: the served models' lookup, `Generation.submit` (queueing) and
`Generation.follow` (the relay's events), counted as the modules they stand in for, and the
tokenizer (shared/, outside api/, not counted). A step is a call into a function of an api module,
as a reader follows one: not the resumption of a coroutine or generator already entered (an
`await` that waited, the next turn of an `async for`), nor code that no source file holds (the
`__init__` a dataclass generates).
"""
from __future__ import annotations

import asyncio
import dis
import importlib
import inspect
import sys
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "api").is_dir() else Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.messages import FinalEvent, FinishReason, RequestStatus, TokenEvent, Usage

OLD = (ROOT / "api" / "routes").is_dir()
routes = importlib.import_module("api.routes.messages" if OLD else "api.anthropic.messages")
schemas = importlib.import_module("api.anthropic_schemas" if OLD else "api.anthropic.schemas")
generation_module = importlib.import_module("api.generation" if OLD else "api.core.generation")
SERVED = "api.served_models" if OLD else "api.core.served_models"


class Tok:
    """The tokenizer (shared/tokenizer.py) as a stand-in."""

    vocab_size, context_length, chat_template = 1000, 512, None
    pooling = None  # a decoder: it generates
    vision = None  # a text model: it takes no images
    special_tokens: dict[str, int] = {}

    def encode_chat(self, messages, tools=None, add_generation_prompt=True, add_special_tokens=False, extra=None):
        return [1, 2, 3]

    def encode(self, text, add_special_tokens=True):
        return [1, 2, 3]

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class Gen(generation_module.Generation):
    """The real Generation, without Redis: queueing does nothing, the relay's events are scripted."""

    async def submit(self, payloads, tenant=""):
        pass

    async def follow(self, ids):
        yield 0, TokenEvent(index=0, token_id=5, text="hi")
        yield 0, FinalEvent(status=RequestStatus.DONE, finish_reason=FinishReason.STOP,
                            usage=Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=0))


class Served:
    """The served models' lookup (api/core/served_models.py) as a stand-in."""

    def __init__(self, generation):
        self.generation = generation

    async def get(self, name):
        return self.generation


STAND_INS = {Gen.submit.__code__: generation_module.__name__, Gen.follow.__code__: generation_module.__name__,
             Served.get.__code__: SERVED}
seq: list[str] = []


def fresh(frame) -> bool:
    """Whether a call event enters the function (at its first RESUME), rather than resumes it."""
    for instruction in dis.get_instructions(frame.f_code):
        if instruction.offset == frame.f_lasti:
            return instruction.opname != "RESUME" or instruction.arg == 0
    return True


def profile(frame, event, arg):
    if event != "call" or not fresh(frame):
        return
    name = STAND_INS.get(frame.f_code) or frame.f_globals.get("__name__", "")
    if name.startswith("api.") and frame.f_code.co_filename.endswith(".py") and (not seq or seq[-1] != name):
        seq.append(name)


def _stream_slots() -> list:
    """The route's stream slots, uncapped, where it takes them (a tree before them does not)."""
    if "streams" not in inspect.signature(routes.messages).parameters:
        return []
    return [importlib.import_module("api.core.stream_slots").StreamSlots(None, "", 0, 30)]


def walk() -> list[str]:
    """The api modules the request enters, in order (one entry for consecutive steps in one module)."""
    seq.clear()
    generation = Gen(None, None, Tok(), "m", default_max_tokens=16)
    body = schemas.MessagesRequest.model_validate({"model": "m", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hello"}]})
    streams = _stream_slots()
    sys.setprofile(profile)
    try:
        answer = asyncio.run(routes.messages(body, Served(generation), "", *streams))
    finally:
        sys.setprofile(None)
    assert answer["content"] == [{"type": "text", "text": "hi"}], answer
    return list(seq)


def returns(entries: list[str]) -> int:
    """How often the walk comes back to a module it had left."""
    return sum(1 for i, name in enumerate(entries) if name in entries[:i])


def main() -> None:
    entries = walk()
    print(" -> ".join(entries))
    print(f"modules entered: {len(set(entries))}, entries: {len(entries)}, "
          f"returns to a module already left: {returns(entries)}")


if __name__ == "__main__":
    main()
