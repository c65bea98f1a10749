"""Which api modules a Messages request (non-streaming, no tools) enters, in order, and how often it
comes back to a module it had left: a measure of how far a reader follows one request through the
code. The generation is a stand-in (no Redis, no worker); every call into it counts as one module.
It reads the tree it runs in, this layout or the one before api/ was split by protocol (api/routes/):

    .venv/bin/python benchmarks/request_walk.py
"""
from __future__ import annotations

import asyncio
import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)

from shared.messages import FinalEvent, FinishReason, RequestPayload, RequestStatus, TokenEvent, Usage

old = os.path.isdir("api/routes")
routes = importlib.import_module("api.routes.messages" if old else "api.anthropic.messages")
schemas = importlib.import_module("api.anthropic_schemas" if old else "api.anthropic.schemas")



class Tok:
    vocab_size, context_length, chat_template = 1000, 512, None

    def decode(self, ids, skip_special_tokens=True):
        return "".join("x" for _ in ids)


class Gen:
    """The generation (and the served models) as a stand-in."""

    model_name = "m"
    tokenizer = Tok()

    def check_model(self, model):
        pass

    async def encode(self, prompt=None, messages=None, tools=None):
        return [1, 2, 3]

    def build(self, prompt_ids, params, priority=0):
        return RequestPayload(id="r", model="m", prompt_token_ids=prompt_ids, params=params)

    async def submit(self, payloads, tenant=""):
        pass

    async def follow(self, ids):
        yield 0, TokenEvent(index=0, token_id=5, text="hi")
        yield 0, FinalEvent(status=RequestStatus.DONE, finish_reason=FinishReason.STOP,
                            usage=Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=0))

    async def get(self, name):
        return self


body = schemas.MessagesRequest.model_validate({"model": "m", "max_tokens": 4,
                                               "messages": [{"role": "user", "content": "hello"}]})
seq = []


def prof(frame, event, arg):
    if event == "call":
        name = frame.f_globals.get("__name__", "")
        if name.startswith("api.") or frame.f_globals is globals() and frame.f_code.co_name != "prof":
            name = name if name.startswith("api.") else "generation(stand-in)"
            if not seq or seq[-1] != name:
                seq.append(name)


sys.setprofile(prof)
result = asyncio.run(routes.messages(body, Gen(), ""))
sys.setprofile(None)
seq = [s for s in seq if s != "__main__"]
returns = sum(1 for i, s in enumerate(seq) if s in seq[:i])
print(" -> ".join(seq))
print(f"modules entered: {len(set(seq))}, entries: {len(seq)}, returns to a module already left: {returns}")
