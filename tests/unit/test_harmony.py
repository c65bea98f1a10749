"""gpt-oss's Harmony format without a model (api/core/parsers/harmony.py): which chat templates are
Harmony's, the analysis channel kept apart from the answer whole and streamed (however the stream
splits a marker), tool calls read out of a reply (whole, cut or malformed), what the grammar lets a
model write under each tool_choice, the conversation as gpt-oss's template reads it, and the
streamed call deltas, at every split point of the reply's text."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.core.chat import ChatMessage
from api.core.generation import Generation
from api.core.parsers import harmony, reasoning, registry
from api.core.parsers.base import Reply, read_reply
from api.core.parsers.harmony import HarmonyFormat
from api.core.parsers.reply import ReplyParser, read_whole
from api.core.tools import NamedToolChoice, Tool, chosen
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import CHAT_TEMPLATE, HERMES_TEMPLATE, build_tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
GPT_OSS = (TEMPLATES / "gpt_oss.jinja").read_text()

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}}}}})
CONVERT = Tool.model_validate({"type": "function", "function": {"name": "convert", "description": "Km to miles.",
                                                                "parameters": {
    "type": "object", "required": ["km"], "properties": {"km": {"type": "integer", "minimum": 0, "maximum": 1000}}}}})
NAMED_CONVERT = NamedToolChoice.model_validate({"type": "function", "function": {"name": "convert"}})

THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
PARIS = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
PARIS_FIRST = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
KM = '<|start|>assistant<|channel|>commentary to=functions.convert <|constrain|>json<|message|>{"km": 5}<|call|>'
FINAL = "<|channel|>final<|message|>It is sunny.<|return|>"

# (reply as gpt-oss writes it after <|start|>assistant, its thought, its answer)
RECORDED = [
    (THINK + FINAL, "The user wants the weather.", "It is sunny."),
    (FINAL, None, "It is sunny."),
    ("<|channel|>final<|message|>a < b, and a|b too", None, "a < b, and a|b too"),  # no <|return|>: a stop token
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Done.<|return|>", "One.\nTwo.", "Done."),
    ("<|channel|>analysis<|message|>cut by max_tokens <|en", "cut by max_tokens <|en", ""),  # all thought
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Ok.",
     None, "Checking.Ok."),  # a preamble is for the user
    ("Plain text, not Harmony: <|channel|>final", None, "Plain text, not Harmony: <|channel|>final"),
    ("<|chan", None, "<|chan"),
    ("<|channel|>fin", None, ""),  # a cut header is nothing
    ("", None, ""),
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    out = {}
    for name, template in (("harmony", GPT_OSS), ("hermes", HERMES_TEMPLATE), ("generic", CHAT_TEMPLATE)):
        folder = tmp_path_factory.mktemp(name)
        build_tokenizer(folder, context=4096, chat_template=template)
        out[name] = Tokenizer(folder)
    return out


def streamed(parser: ReplyParser, pieces: list[str]) -> tuple[str, str, list]:
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.flush()
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), deltas


def test_only_harmony_templates_are_harmony(tokenizers):
    assert harmony.knows(tokenizers["harmony"])
    assert not harmony.knows(tokenizers["hermes"]) and not harmony.knows(tokenizers["generic"])
    assert registry.choose("auto", "m", tokenizers["harmony"]) is harmony.FORMAT
    assert reasoning.choose("auto", "m", tokenizers["harmony"]) == HarmonyFormat()
    assert reasoning.choose("m=none", "m", tokenizers["harmony"]) is None
    assert reasoning.choose("harmony", "m", tokenizers["generic"]) == HarmonyFormat()
    assert reasoning.choose("auto", "m", tokenizers["generic"]) is None
    assert reasoning.named(HarmonyFormat().key) == HarmonyFormat()
    reasoning.check("harmony")
    reasoning.check("a=harmony,b=think")


@pytest.mark.parametrize("path", sorted(TEMPLATES.glob("*.jinja")), ids=lambda p: p.stem)
def test_every_stored_template_is_harmony_only_where_it_is_gpt_oss(tmp_path, path):
    build_tokenizer(tmp_path, context=4096, chat_template=path.read_text())
    tokenizer = Tokenizer(tmp_path)
    is_gpt_oss = path.stem == "gpt_oss"
    assert harmony.knows(tokenizer) is is_gpt_oss
    assert (registry.choose("auto", "m", tokenizer) is harmony.FORMAT) is is_gpt_oss
    assert isinstance(reasoning.choose("auto", "m", tokenizer), HarmonyFormat) is is_gpt_oss


def test_a_chat_keeps_the_harmony_format_whatever_its_prompt_ends_with(tokenizers):
    tokenizer = tokenizers["harmony"]
    generation = Generation(None, None, tokenizer, "m", default_max_tokens=1, reasoning=HarmonyFormat())
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|start|>assistant")
    assert generation.reasoning_of(ids) == HarmonyFormat()


@pytest.mark.parametrize("text, thought, answer", RECORDED)
def test_a_whole_reply_is_split_into_its_thought_and_answer(text, thought, answer):
    assert HarmonyFormat().split(text) == (thought, answer)
    reply = read_whole(None, text, "stop", HarmonyFormat())
    assert reply.reasoning == thought and reply.content == (answer or (None if thought is not None else answer))


@pytest.mark.parametrize("text, thought, answer", RECORDED)
def test_a_streamed_reply_gives_the_same_at_every_split(text, thought, answer):
    fmt = HarmonyFormat()
    assert streamed(ReplyParser(None, fmt), list(text))[:2] == (thought or "", answer)  # a character at a time
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1, 3):
            pieces = [text[:cut], text[cut:second], text[second:]]
            got_thought, got_answer, deltas = streamed(ReplyParser(None, fmt), pieces)
            assert (got_thought, got_answer) == (thought or "", answer), pieces
            if text.startswith("<|channel|>"):  # no piece of a marker, nor of the thought, is ever content
                assert all(d.content in answer and "<|" not in d.content and "|>" not in d.content
                           for d in deltas), pieces


def test_the_thoughts_tokens_are_counted():
    parser = ReplyParser(None, HarmonyFormat())
    for text in ["<|channel|>", "analysis", "<|message|>", "a", "b", "<|end|>", "<|start|>assistant",
                 "<|channel|>final<|message|>", "x"]:
        parser.feed(text)
    assert parser.thought_tokens == 3  # <|message|> opens the thought, then a and b (<|end|> gives none of it)


@pytest.mark.parametrize("text", [PARIS, THINK + PARIS, PARIS_FIRST, THINK + PARIS_FIRST])
def test_a_call_parses_into_an_openai_tool_call(text):
    content, calls = harmony.parse(text)
    assert content is None and len(calls) == 1 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    reply = read_whole(harmony.FORMAT, text, "stop", HarmonyFormat())
    assert reply.finish_reason == "tool_calls" and reply.content is None
    assert reply.reasoning == ("The user wants the weather." if text.startswith(THINK) else None)
    assert [c["function"] for c in reply.tool_calls] == [c["function"] for c in calls]


def test_parallel_calls_and_other_messages():
    content, calls = harmony.parse(THINK + PARIS + KM)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("convert", {"km": 5})]
    assert harmony.parse(THINK + FINAL) == ("It is sunny.", [])
    assert harmony.parse("It is sunny.") == ("It is sunny.", [])
    assert harmony.parse("") == (None, [])
    # a built-in tool's message (python, browser) is no function call, and no answer
    assert harmony.parse("<|channel|>analysis to=python code<|message|>print(1)<|call|>") == (None, [])


@pytest.mark.parametrize("cut", [PARIS[:40], PARIS[:PARIS.index("{") + 5], PARIS + KM[:-12], PARIS + KM[:-20],
                                 PARIS.replace('{"city": "Paris"}', '{"city": "Par'),
                                 PARIS.replace('{"city": "Paris"}', "[1, 2]"),
                                 PARIS.replace('{"city": "Paris"}', "Paris")])
def test_a_cut_or_malformed_call_gives_no_call_and_no_content(cut):
    assert harmony.parse(cut) == (None, [])
    assert read_reply(cut, "stop", harmony.parse) == Reply(None, [], "stop")  # cut by a stop string
    assert read_reply(cut, "length", harmony.parse) == Reply(None, [], "length")


def test_calls_count_only_in_a_reply_that_ended_on_its_own():
    reply = read_reply(PARIS, "stop", harmony.parse)
    assert reply.finish_reason == "tool_calls" and len(reply.tool_calls) == 1
    assert read_reply(PARIS, "length", harmony.parse) == Reply(None, [], "length")  # the model had not ended
    assert read_reply(FINAL, "length", harmony.parse).content == "It is sunny."


def _fits(tokenizer: Tokenizer, constraint, text: str) -> bool:
    """Whether a constraint takes `text` whole and may end there."""
    from llguidance import LLMatcher, LLTokenizer

    ll = LLTokenizer(tokenizer.rust_tokenizer().to_str(), n_vocab=tokenizer.vocab_size,
                     eos_token=sorted(tokenizer.eos_token_ids))
    matcher = LLMatcher(ll, constraint.grammar_text(), log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


ANSWER = "<|channel|>final<|message|>It is sunny."
KM_FIRST = KM.removeprefix("<|start|>assistant")


@pytest.mark.parametrize("choice, parallel, text, fits", [
    ("required", True, PARIS, True),
    ("required", True, THINK + PARIS, True),  # a thought may come first
    ("required", True, THINK.replace("weather.", "<|call|>") + PARIS, False),  # with no marker in it
    ("required", True, PARIS + KM, True),
    ("required", False, PARIS + KM, False),  # one call at most
    ("required", True, ANSWER, False),  # calls only
    ("required", True, PARIS.replace('"Paris"', "5"), False),  # the arguments keep the schema
    ("required", True, PARIS.replace('"}', '", "days": 2}'), False),  # closed
    ("required", True, PARIS.replace("get_weather", "get_news"), False),  # only the tools given
    ("required", True, PARIS.removesuffix("<|call|>"), False),  # a call ends with <|call|>
    ("required", True, PARIS_FIRST.removeprefix("<|start|>assistant"), False),  # one form: the grammar's
    ("auto", True, ANSWER, True),
    ("auto", True, THINK + ANSWER, True),
    ("auto", True, THINK + PARIS + KM, True),
    ("auto", True, "It is sunny.", False),  # on the final channel
    ("auto", True, "<|channel|>final<|message|> sunny", False),  # an answer opens with neither blank space
    ("auto", True, "<|channel|>final<|message|><b>sunny</b>", False),  # ... nor "<"
    ("auto", True, "<|channel|>final<|message|>sunny<|return|>", False),  # nor holds a marker
    (NAMED_CONVERT, True, KM_FIRST, True),
    (NAMED_CONVERT, True, KM_FIRST + KM, False),  # a named function exactly once
    (NAMED_CONVERT, True, PARIS, False),
    (NAMED_CONVERT, True, ANSWER, False),
])
def test_the_grammar_takes_calls_and_answers_as_tool_choice_says(tokenizers, choice, parallel, text, fits):
    constraint = harmony.constraint(chosen([WEATHER, CONVERT], choice), choice, parallel)  # as a request has it
    assert constraint.compile_error() == ""
    assert _fits(tokenizers["harmony"], constraint, text) is fits


def test_the_conversation_as_gpt_oss_template_reads_it(tokenizers):
    """A turn of two calls goes as one assistant message per call, each followed by its result;
    the template renders each call, and each result as the message of the function it answers."""
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris, and 5 km in miles?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "convert", "arguments": '{"km": 5}'}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "3.1"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny; 3.1 miles."},
        {"role": "user", "content": "Thanks."}]]
    out = harmony.FORMAT.template_messages(messages, [WEATHER, CONVERT], None)
    assert [(m["role"], m.get("tool_call_id"), [c["function"]["name"] for c in m.get("tool_calls", [])])
            for m in out] == [("system", None, []), ("user", None, []), ("assistant", None, ["get_weather"]),
                              ("tool", "c1", []), ("assistant", None, ["convert"]), ("tool", "c2", []),
                              ("assistant", None, []), ("user", None, [])]
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and out[2]["content"] == ""
    tools = harmony.FORMAT.template_tools([WEATHER, CONVERT])
    assert tools[0]["function"]["description"] == "" and tools[1]["function"]["description"] == "Km to miles."
    rendered = tokenizers["harmony"].render_chat(out, tools=tools)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
            '<|start|>assistant to=functions.convert<|channel|>commentary json<|message|>{"km": 5}<|call|>'
            '<|start|>functions.convert to=assistant<|channel|>commentary<|message|>"3.1"<|end|>') in rendered
    assert "type get_weather = (_: {\ncity: string,\n}) => any;" in rendered and "# Instructions\n\nBe brief." in rendered
    assert rendered.endswith("<|start|>user<|message|>Thanks.<|end|><|start|>assistant")


def _calls_of(deltas) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.call is not None:
            entry = calls.setdefault(d.call.index, ["", ""])
            entry[0] += d.call.name or ""
            entry[1] += d.call.arguments
    return [tuple(e) for _, e in sorted(calls.items())]


@pytest.mark.parametrize("reasoning_format", [HarmonyFormat(), None], ids=["harmony-reasoning", "no-reasoning"])
@pytest.mark.parametrize("text", [PARIS, THINK + PARIS + KM, PARIS_FIRST, THINK + ANSWER, ANSWER, PARIS + KM[:-12]])
def test_streamed_call_deltas_add_up_to_the_whole_reply_at_every_split(text, reasoning_format):
    whole = read_whole(harmony.FORMAT, text, "stop", reasoning_format)
    expected_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
    for cut in [None, *range(len(text) + 1)]:
        pieces = list(text) if cut is None else [text[:cut], text[cut:]]
        parser = ReplyParser(harmony.FORMAT, reasoning_format)
        thought, content, deltas = streamed(parser, pieces)
        calls = _calls_of(deltas)
        if whole.tool_calls:
            assert calls == expected_calls and parser.holding and content == "", pieces
            assert [d.call.closed for d in deltas if d.call is not None and d.call.closed] == [True] * len(calls)
        elif text.endswith(KM[:-12]):  # a cut second call: the first streamed, the second named
            assert [n for n, _ in calls] == ["get_weather", "convert"] and calls[0][1] == '{"city": "Paris"}'
            assert whole.content is None and parser.finish("length").tool_calls == []
        else:
            assert not calls
        if reasoning_format is not None:
            assert thought == (whole.reasoning or ""), pieces
            if not parser.holding:  # a plain answer streams as it comes
                assert content == whole.content, pieces
        if parser.holding:  # read whole at the end, as without stream
            assert parser.finish("stop").content == whole.content, pieces
