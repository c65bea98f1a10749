"""Tool formats whose markers are special tokens of the model's tokenizer, as in the models' own
tokenizers (Mistral's [TOOL_CALLS] and [ARGS], Llama's <|python_tag|>, gpt-oss's Harmony markers,
DeepSeek's): through the whole stack, one worker per format behind one api. Each tiny llama has
the family's real chat template and the markers as special tokens (one token each).

What must hold (api/core/parsers/base.Markers): the grammar writes each marker as its one special
token, never spelled out in pieces of text, and the reply is decoded with the special tokens kept,
so that the calls are read back, streamed as without stream, and no marker reaches `content`."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from api.core.parsers import deepseek_v3, harmony, llama3_json, mistral
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_model
from tests.stack import Stack
from tests.waiting import until_sync

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
FORMATS = {  # served name: (template, the format's markers, the format the api must choose)
    "mistral": ("mistral.jinja", mistral.FORMAT.MARKERS, "mistral"),
    "mistral_v11": ("mistral_v11.jinja", mistral.FORMAT_V11.MARKERS, "mistral_v11"),
    "llama3": ("llama3.1_json.jinja", llama3_json.FORMAT.MARKERS, "llama3_json"),
    "deepseek": ("deepseek_v3.jinja", deepseek_v3.FORMAT.MARKERS, "deepseek_v3"),
    "gpt-oss": ("gpt_oss.jinja", harmony.FORMAT.MARKERS, "harmony"),
}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "required": ["a", "b"], "additionalProperties": False,
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                   "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}}]
ASK = [{"role": "user", "content": "What is 2 plus 3?"}]
# The first marker each format's call opens with, as one token
OPENS = {"mistral": "[TOOL_CALLS]", "mistral_v11": "[TOOL_CALLS]", "llama3": "<|python_tag|>",
         "deepseek": deepseek_v3.CALLS_BEGIN, "gpt-oss": "<|channel|>"}


@pytest.fixture(scope="module")
def served(redis_url, tmp_path_factory):
    folders = {}
    for name, (template, markers, _) in FORMATS.items():
        text = (TEMPLATES / template).read_text().replace('strftime_now("%Y-%m-%d")', '"2026-01-01"')
        folders[name] = build_model(tmp_path_factory.mktemp(f"tiny-{name}"), "llama", context=4096,
                                    chat_template=text, special_tokens=markers)
    first, *rest = folders.items()
    envs = [{"STREAMQ_SERVED_MODEL_NAME": first[0]}] + [
        {"STREAMQ_MODEL": str(path), "STREAMQ_SERVED_MODEL_NAME": name} for name, path in rest]
    with Stack(redis_url, first[1], tmp_path_factory.mktemp("markers"), workers=len(envs), worker_envs=envs,
               env={"STREAMQ_TOOL_PARSER": "", "STREAMQ_SERVED_MODEL_NAME": first[0]}) as stack:
        url = stack.urls[0]
        until_sync(lambda: set(FORMATS) <= {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]},
                   timeout_s=180, what="every model listed")
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), folders


def _ask(name: str, tokenizer: Tokenizer) -> dict:
    """A forced call, greedy; the call's first marker favoured where the grammar lets the reply open
    otherwise (Llama's calls may open without <|python_tag|>, Harmony's may think first)."""
    opening = tokenizer.special_tokens[OPENS[name]]
    bias = {str(opening): 100}
    if name == "gpt-oss":  # after <|channel|>, commentary rather than analysis (a tiny model's thought wanders)
        bias.update({str(t): -100 for t in range(tokenizer.vocab_size) if tokenizer.decode([t]).startswith("a")})
    return {"model": name, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 0, "max_tokens": 200, "logit_bias": bias}


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_markers_are_one_special_token_each_and_the_calls_read_back(served, name):
    client, folders = served
    tokenizer = Tokenizer(folders[name])
    reply = client.chat.completions.create(**_ask(name, tokenizer), logprobs=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", [t.token for t in choice.logprobs.content]
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    tokens = [t.token for t in choice.logprobs.content]
    assert tokens[0] == OPENS[name]  # the marker as its special token, not spelled out in pieces
    markers = [t for t in tokens if t in tokenizer.special_tokens]
    assert markers and all(m in FORMATS[name][1] for m in markers)
    assert not any(m[:3] in t for t in tokens if t not in markers for m in markers), tokens


@pytest.mark.parametrize("name", list(FORMATS))
def test_streamed_calls_equal_the_whole_reply_and_no_marker_reaches_content(served, name):
    client, folders = served
    ask = _ask(name, Tokenizer(folders[name]))
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls
    content, calls = "", {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
    assert content == ""
    assert [(n, json.loads(a)) for n, a in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_the_api_chose_each_templates_format_with_its_markers_as_tokens(served):
    from api.core.parsers import registry

    _, folders = served
    for name, (_, markers, chosen) in FORMATS.items():
        tool_format = registry.choose(registry.AUTO, name, Tokenizer(folders[name]))
        assert tool_format.name == chosen and set(tool_format.special.ids) == set(markers)
        assert tool_format.keeps_special_tokens


def _harmony_grammar(tokenizer: Tokenizer) -> str:
    """A user's Lark grammar writing a Harmony thought then an answer, the markers as tokens."""
    ids = {m: f"<[{tokenizer.special_tokens[m]}]>" for m in harmony.FORMAT.MARKERS}
    return (f'start: {ids["<|channel|>"]} "analysis" {ids["<|message|>"]} THOUGHT {ids["<|end|>"]} '
            f'{ids["<|start|>"]} "assistant" {ids["<|channel|>"]} "final" {ids["<|message|>"]} ANSWER\n'
            'THOUGHT: /[a-z ]+/\nANSWER: /[a-z]{3,8}/\n')


@pytest.mark.parametrize("budget", [3, 7])
def test_a_thinking_budget_closes_a_harmony_thought(served, budget):
    """The thought may not end by itself (its end token biased away): without a budget it runs to
    max_tokens; with one, <|end|> and the final message's header are forced after `budget` tokens
    of thought, and the answer follows."""
    client, folders = served
    tokenizer = Tokenizer(folders["gpt-oss"])
    ask = {"model": "gpt-oss", "messages": ASK, "temperature": 0, "max_tokens": 60,
           "logit_bias": {str(tokenizer.special_tokens["<|end|>"]): -100},
           "extra_body": {"structured_outputs": {"grammar": _harmony_grammar(tokenizer)}}}
    free = client.chat.completions.create(**ask).choices[0]
    assert free.finish_reason == "length" and not free.message.content
    ask["extra_body"] = {**ask["extra_body"], "thinking_token_budget": budget}
    reply = client.chat.completions.create(**ask)
    choice = reply.choices[0]
    thought = choice.message.to_dict()["reasoning_content"]
    assert choice.finish_reason == "stop" and choice.message.content and thought
    assert len(tokenizer.encode(thought, add_special_tokens=False)) <= budget
    assert free.message.to_dict()["reasoning_content"].startswith(thought)  # the same thought, cut
