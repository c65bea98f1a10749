"""The Llama 3.x JSON tool format's own parts, without a model (api/core/parsers/llama3_json.py):
which chat templates ask for it, what it reads out of a reply (whole, cut or malformed), what its
grammar lets a model write under each tool_choice, the conversation as Llama 3.1's template reads
it, and its stream's deltas, wherever the reply's text is split."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.core.chat import ChatMessage
from api.core.parsers import llama3_json, registry
from api.core.parsers.base import Delta, read_reply
from api.core.parsers.reply import ReplyParser
from api.core.tools import NamedToolChoice, Tool, chosen
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import CHAT_TEMPLATE, HERMES_TEMPLATE, build_tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
LLAMA_TEMPLATE = (TEMPLATES / "llama3.1_json.jinja").read_text()
# Llama 3.2's other way (vLLM's llama3.2_pythonic, shortened): the same turns, tools rendered, calls in Python
PYTHONIC_TEMPLATE = (
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}You are an expert in composing functions. If you decide to invoke any of the function(s), "
    "you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...)]\n"
    "{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}{% endif %}<|eot_id|>"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}}}}})
CONVERT = Tool.model_validate({"type": "function", "function": {"name": "convert", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["km"],
    "properties": {"km": {"type": "integer", "minimum": 0, "maximum": 1000}}}}})
ADD = Tool.model_validate({"type": "function", "function": {"name": "add", "parameters": {  # open, as users write it
    "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}})
NOW = Tool.model_validate({"type": "function", "function": {"name": "now"}})
NAMED_ADD = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})
PARIS = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
KM = '{"name": "convert", "parameters": {"km": 5}}'
SUM = '{"name": "add", "parameters": {"a": 1, "b": 2}}'


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    """Tiny tokenizers with Llama 3.1's JSON tool template, and with other families' templates."""
    out = {}
    for name, template in (("llama3_json", LLAMA_TEMPLATE), ("hermes", HERMES_TEMPLATE), ("generic", CHAT_TEMPLATE),
                           ("pythonic", PYTHONIC_TEMPLATE)):
        folder = tmp_path_factory.mktemp(name)
        build_tokenizer(folder, chat_template=template)
        out[name] = Tokenizer(folder)
    return out


def test_only_a_template_that_renders_tools_and_asks_for_json_calls_is_llama3_json(tokenizers):
    assert llama3_json.knows(tokenizers["llama3_json"])
    assert not any(llama3_json.knows(tokenizers[name]) for name in ("hermes", "generic", "pythonic"))
    assert registry.choose("auto", "m", tokenizers["llama3_json"]) is llama3_json.FORMAT
    assert registry.choose("auto", "m", tokenizers["pythonic"]).name == registry.FALLBACK


@pytest.mark.parametrize("path", sorted(TEMPLATES.glob("*.jinja")), ids=lambda p: p.stem)
def test_every_stored_template_is_llama3_json_only_where_it_is_a_llama_json_one(tmp_path, path):
    """The real templates kept as test data (other families' too, where they are there)."""
    build_tokenizer(tmp_path, chat_template=path.read_text())
    assert llama3_json.knows(Tokenizer(tmp_path)) is (path.stem.startswith("llama") and "json" in path.stem)


def test_llama3_json_replies_parse_into_openai_tool_calls():
    content, calls = llama3_json.parse(PARIS)
    assert content is None and len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    for parallel in (f"{PARIS}; {KM}", f"{PARIS};{KM}", f"{PARIS} ;\n{KM} "):
        content, calls = llama3_json.parse(parallel)
        assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris"}), ("convert", {"km": 5})], parallel
    # <|python_tag|> may open the calls, as Llama writes them unconstrained
    assert [c["function"]["name"] for c in llama3_json.parse(f"<|python_tag|>{PARIS}; {KM}")[1]] == ["get_weather",
                                                                                                     "convert"]
    assert [c["function"]["name"] for c in llama3_json.parse(f"<|python_tag|> {KM}")[1]] == ["convert"]
    # "arguments" for "parameters", as vLLM's parser takes it too; the arguments as the model wrote them
    assert llama3_json.parse('{"name": "f", "arguments": {"x": "é"}}')[1][0]["function"]["arguments"] == '{"x": "é"}'
    assert llama3_json.parse('{"name": "now", "parameters": {}}')[1][0]["function"]["arguments"] == "{}"


def test_a_reply_that_does_not_open_like_a_call_is_a_plain_answer():
    assert llama3_json.parse("It is sunny.") == ("It is sunny.", [])
    assert llama3_json.parse(f"Let me look. {PARIS}") == (f"Let me look. {PARIS}", [])  # the grammar's answer
    assert llama3_json.parse(f" {PARIS}") == (f" {PARIS}", [])
    assert llama3_json.parse(f"[{PARIS}]") == (f"[{PARIS}]", [])
    assert llama3_json.parse("") == (None, [])


@pytest.mark.parametrize("whole", [PARIS, f"{PARIS}; {KM}", f"<|python_tag|>{SUM}"])
def test_a_cut_reply_has_no_calls_and_no_content_wherever_it_was_cut(whole):
    for end in range(1, len(whole)):
        if whole[:end] == PARIS:
            continue  # a whole call, not a cut
        assert llama3_json.parse(whole[:end]) == (None, []), whole[:end]
    assert llama3_json.parse(f"{PARIS}; ") == (None, []) and llama3_json.parse(f"{PARIS};") == (None, [])


@pytest.mark.parametrize("text", [
    '{"name": "f"}',  # no arguments
    '{"name": 1, "parameters": {}}',
    '{"name": "f", "parameters": "x=1"}',  # arguments that are not an object
    '{"name": "f", "parameters": {}, "arguments": {}}',
    '{"parameters": {}, "name": "f"}',  # not as the template asks
    f"{PARIS} {KM}",  # no separator
    f"{PARIS}\n{KM}",
    f"{PARIS}; It is sunny.",
    "{}",
    "{{",
    "<b>sunny</b>",
    '<|python_tag|>brave_search.call(query="weather")',  # a built-in tool's call: not this format's
    "<|python_tag|>",
])
def test_a_malformed_reply_has_no_calls_and_never_raises(text):
    assert llama3_json.parse(text) == (None, [])


def test_calls_count_only_in_a_reply_that_ended_on_its_own():
    parse = llama3_json.FORMAT.parse
    reply = read_reply(f"{PARIS}; {KM}", "stop", parse)
    assert reply.finish_reason == "tool_calls" and reply.content is None and len(reply.tool_calls) == 2
    assert llama3_json.FORMAT.reply(PARIS, "length") == read_reply("", "length", parse)  # the model had not ended
    assert llama3_json.FORMAT.reply(PARIS[:30], "stop").tool_calls == []  # cut by a stop string
    assert llama3_json.FORMAT.reply("It is", "length").content == "It is"


def _fits(tokenizer: Tokenizer, constraint, text: str) -> bool:
    """Whether a constraint takes `text` whole and may end there."""
    from llguidance import LLMatcher, LLTokenizer

    ll = LLTokenizer(tokenizer.rust_tokenizer().to_str(), n_vocab=tokenizer.vocab_size,
                     eos_token=sorted(tokenizer.eos_token_ids))
    matcher = LLMatcher(ll, constraint.grammar_text(), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("choice, parallel, text, fits", [
    ("required", True, PARIS, True),
    ("required", True, f"{PARIS}; {KM}", True),
    ("required", True, f"{PARIS}; {KM}; {PARIS}", True),
    ("required", False, f"{PARIS}; {KM}", False),  # one call at most
    ("required", False, KM, True),
    ("required", True, f"{PARIS}\n{KM}", False),  # calls are separated by "; "
    ("required", True, f"{PARIS}; ", False),
    ("required", True, "It is sunny.", False),  # calls only
    ("required", True, "", False),
    ("required", True, PARIS.replace('"Paris"', "5"), False),  # the arguments keep the schema
    ("required", True, PARIS.replace("Paris", "Llanfairpwllgwyngyll"), False),  # maxLength
    ("required", True, PARIS.replace("get_weather", "get_news"), False),  # only the tools given
    ("required", True, PARIS.replace("parameters", "arguments"), False),  # as the template asks
    ("required", True, PARIS.replace(": ", ":"), False),  # in one layout
    ("required", True, f"<|python_tag|>{PARIS}", False),  # never written under the grammar
    ("auto", True, "It is sunny.", True),
    ("auto", True, f"It is sunny. {PARIS}", True),
    ("auto", True, PARIS, True),
    ("auto", True, f"{PARIS}; {KM}", True),
    ("auto", False, f"{PARIS}; {KM}", False),
    ("auto", True, '{"answer": "sunny"}', False),  # a plain answer cannot open like a call
    ("auto", True, f" {PARIS}", False),
    ("auto", True, "<b>sunny</b>", False),
    (None, True, "sunny", True),  # no tool_choice: auto
])
def test_the_grammar_takes_calls_and_answers_as_tool_choice_says(tokenizers, choice, parallel, text, fits):
    constraint = llama3_json.constraint([WEATHER, CONVERT], choice, parallel)
    assert _fits(tokenizers["llama3_json"], constraint, text) is fits


@pytest.mark.parametrize("text, fits", [
    (SUM, True),
    (f"{SUM}; {SUM}", False),  # a named function is called exactly once, parallel_tool_calls or not
    (SUM.replace("}}", ', "type": "sum"}}'), False),  # the arguments are closed
    (PARIS, False),  # only the function named
    ("3", False),
])
def test_a_named_function_is_one_closed_call(tokenizers, text, fits):
    constraint = llama3_json.constraint(chosen([WEATHER, ADD], NAMED_ADD), NAMED_ADD, True)  # as the api gives it
    assert _fits(tokenizers["llama3_json"], constraint, text) is fits


def test_a_function_without_parameters_takes_no_arguments(tokenizers):
    constraint = llama3_json.constraint([NOW], "required", True)
    assert _fits(tokenizers["llama3_json"], constraint, '{"name": "now", "parameters": {}}')
    assert not _fits(tokenizers["llama3_json"], constraint, '{"name": "now", "parameters": {"x": 1}}')


HISTORY = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "And Oslo, in km?"},
    {"role": "assistant", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_3", "type": "function", "function": {"name": "convert", "arguments": '{"km": 5}'}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    {"role": "tool", "tool_call_id": "call_3", "content": "8 km"},
]


def test_the_conversation_goes_to_the_template_as_llama_reads_it(tokenizers):
    """An earlier call as the model wrote it (one per turn, as the template takes them; several as
    the text the model wrote), each tool result as an ipython turn, the developer's as the system's."""
    tools = [WEATHER, CONVERT]
    messages = llama3_json.FORMAT.template_messages([ChatMessage.model_validate(m) for m in HISTORY], tools, None)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[2]["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                           "arguments": {"city": "Paris"}}}]
    assert messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert messages[6] == {"role": "assistant", "content": f'{PARIS.replace("Paris", "Oslo")}; {KM}'}
    assert all("tool_calls" not in m for i, m in enumerate(messages) if i != 2)  # the template reads the key's presence
    rendered = tokenizers["llama3_json"].render_chat(messages, tools=llama3_json.FORMAT.template_tools(tools))
    assert rendered.count('"name": "get_weather"') == 3 and '"name": "convert"' in rendered  # the tools, rendered
    assert "<|start_header_id|>system<|end_header_id|>" in rendered and "Be brief.<|eot_id|>" in rendered
    assert f"<|start_header_id|>assistant<|end_header_id|>\n\n{PARIS}<|eot_id|>" in rendered
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "sunny"}<|eot_id|>' in rendered
    assert f'{PARIS.replace("Paris", "Oslo")}; {KM}<|eot_id|>' in rendered
    assert '{"output": "rain"}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n{"output": "8 km"}' in rendered


TRICKY = ('{"name": "search", "parameters": {"q": "a \\"quoted\\" {brace} [x] \\\\", "deep": {"n": [1, {"m": null}]}, '
          '"é": "😀"}}; {"name": "now", "parameters": {}}; {"name": "convert", "parameters": {"km": 5}}')
REPLIES = [PARIS, f"{PARIS}; {KM}", TRICKY, f"<|python_tag|>{SUM}; {KM}"]


def _streamed(pieces: list[str]) -> tuple[list[Delta], dict[int, dict]]:
    stage = llama3_json.FORMAT.stream()
    out = [d for piece in pieces for d in stage.feed(Delta(content=piece))]
    calls: dict[int, dict] = {}
    for delta in (d.call for d in out if d.call is not None):
        if delta.name is not None:  # a call's first delta, in order, before its arguments
            assert delta.index == len(calls) and delta.arguments == ""
            calls[delta.index] = {"id": delta.id, "name": delta.name, "arguments": "", "closed": 0}
        call = calls[delta.index]
        assert not call["closed"]  # nothing after its arguments closed
        call["arguments"] += delta.arguments
        call["closed"] += delta.closed
    assert stage.holding
    return out, calls


@pytest.mark.parametrize("reply", REPLIES, ids=range(len(REPLIES)))
def test_streamed_arguments_add_up_to_the_parsed_ones_wherever_the_reply_is_split(reply):
    parsed = llama3_json.parse(reply)[1]
    assert parsed
    splits = [[reply[:i], reply[i:]] for i in range(len(reply) + 1)] + [list(reply)]
    for pieces in splits:
        out, calls = _streamed(pieces)
        assert all(d.content == "" for d in out), pieces
        assert [(c["name"], c["arguments"], c["closed"]) for _, c in sorted(calls.items())] == [
            (p["function"]["name"], p["function"]["arguments"], 1) for p in parsed], pieces
        assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_cut_call_streams_as_far_as_it_was_written_and_is_never_closed():
    for end in range(len(PARIS) - 1):
        _, calls = _streamed([PARIS[:end]])
        assert not calls or (calls[0]["name"] == "get_weather" and not calls[0]["closed"]
                             and '{"city": "Paris"}'.startswith(calls[0]["arguments"]))
    assert _streamed([PARIS[:len('{"name": "get_weather", "parameters": {')]])[1][0]["arguments"] == "{"


def test_a_plain_answer_streams_as_it_comes():
    stage = llama3_json.FORMAT.stream()
    assert stage.feed(Delta(content="")) == [] and stage.holding  # nothing decided yet
    assert stage.feed(Delta(content="It")) == [Delta(content="It")] and not stage.holding
    assert stage.feed(Delta(content=' is {"name"')) == [Delta(content=' is {"name"')]


def test_the_reply_chain_streams_and_reads_the_calls_alike():
    chain = ReplyParser(llama3_json.FORMAT)
    deltas = [d for i in range(0, len(TRICKY), 7) for d in chain.feed(TRICKY[i:i + 7])]
    reply = chain.finish("stop")
    assert reply.finish_reason == "tool_calls" and chain.calls == len(reply.tool_calls) == 3
    for index, call in enumerate(reply.tool_calls):
        streamed = "".join(d.call.arguments for d in deltas if d.call is not None and d.call.index == index)
        assert streamed == call["function"]["arguments"]
        assert json.loads(streamed) == json.loads(llama3_json.parse(TRICKY)[1][index]["function"]["arguments"])
