"""The reasoning stage: a thought between <think> and </think> comes out apart from the answer,
whole and streamed, however the stream splits a tag (every split point of recorded replies)."""
import pytest

from api.core.generation import Generation
from api.core.parsers import reasoning, registry
from api.core.parsers.reasoning import ThinkFormat
from api.core.parsers.reply import ReplyParser, read_whole
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_model

# (reply as the model writes it, whether the template opened the thought, thought, answer)
RECORDED = [
    ("<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", False,
     "\nThe user greets me.\n", "\n\nHello! How can I help?"),
    ("  <think>a < b and </thinking> is no tag</think>Answer: <b>yes</b>", False,
     "a < b and </thinking> is no tag", "Answer: <b>yes</b>"),
    ("Plain answer with <think> inside it.", False, None, "Plain answer with <think> inside it."),
    ("<thin", False, None, "<thin"),
    ("", False, None, ""),
    ("Let me think: 2 + 2 = 4.\n</think>\n\n4", True, "Let me think: 2 + 2 = 4.\n", "\n\n4"),
    ("<think>written again</think>ok", True, "written again", "ok"),
    ("cut by max_tokens in the thought </thi", True, "cut by max_tokens in the thought </thi", ""),
    ("<think>never closed", False, "never closed", ""),
]


def streamed(parser: ReplyParser, pieces: list[str]) -> tuple[str, str]:
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.flush()
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize("text, opened, thought, answer", RECORDED)
def test_a_whole_reply_is_split_into_its_thought_and_answer(text, opened, thought, answer):
    assert ThinkFormat(opened).split(text) == (thought, answer)
    reply = read_whole(None, text, "stop", ThinkFormat(opened))
    assert reply.reasoning == thought and reply.content == (answer or (None if thought is not None else answer))


@pytest.mark.parametrize("text, opened, thought, answer", RECORDED)
def test_a_streamed_reply_gives_the_same_at_every_split(text, opened, thought, answer):
    fmt = ThinkFormat(opened)
    assert streamed(ReplyParser(None, fmt), list(text)) == (thought or "", answer)  # a character at a time
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1):
            pieces = [text[:cut], text[cut:second], text[second:]]
            assert streamed(ReplyParser(None, fmt), pieces) == (thought or "", answer), pieces


def test_no_piece_of_a_tag_is_ever_content():
    text = "<think>x</think>y"
    for cut in range(1, len(text)):
        parser = ReplyParser(None, ThinkFormat())
        contents = [d.content for piece in (text[:cut], text[cut:]) for d in parser.feed(piece)]
        contents += [d.content for d in parser.flush()]
        assert "".join(contents) == "y" and all("<" not in c and ">" not in c for c in contents)


def test_a_thought_then_tool_calls_in_the_hermes_format():
    text = '<think>I need the weather.</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    hermes = registry.get("hermes")
    reply = read_whole(hermes, text, "stop", ThinkFormat())
    assert reply.reasoning == "I need the weather." and reply.finish_reason == "tool_calls"
    assert reply.tool_calls[0]["function"]["name"] == "get_weather" and reply.content is None
    parser = ReplyParser(hermes, ThinkFormat())
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.flush()
    assert "".join(d.reasoning for d in deltas) == "I need the weather." and not any(d.content for d in deltas)
    assert [c["function"] for c in parser.finish("stop").tool_calls] == [c["function"] for c in reply.tool_calls]


THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if '</think>' in message['content'] %}{{ message['content'].split('</think>')[-1] }}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}{{ opening }}{% endif %}"
    "{% endif %}")


@pytest.mark.parametrize("opening, opened", [("", False), ("<think>\n", True)])
def test_auto_chooses_think_for_a_template_that_writes_it(tmp_path, opening, opened):
    template = THINKING_TEMPLATE.replace("{{ opening }}", opening)
    tokenizer = Tokenizer(build_model(tmp_path, "llama", chat_template=template))
    assert reasoning.choose("auto", "m", tokenizer) == ThinkFormat()
    assert reasoning.choose("none", "m", tokenizer) is None
    assert reasoning.choose("other=none", "m", tokenizer) == ThinkFormat()
    assert reasoning.choose("m=none", "m", tokenizer) is None
    # Whether the reply starts inside the thought, by the chat's own prompt: the template's opening,
    # unless its kwargs close the thought in the prompt.
    generation = Generation(None, None, tokenizer, "m", default_max_tokens=1, reasoning=ThinkFormat())
    ask = [{"role": "user", "content": "Hi"}]
    assert generation.reasoning_of(tokenizer.encode_chat(ask)) == ThinkFormat(opened)
    closed = tokenizer.encode_chat(ask, extra={"enable_thinking": False})
    assert generation.reasoning_of(closed) == ThinkFormat(False)


def test_a_template_without_it_gets_none_unless_named(tiny_llama):
    tokenizer = Tokenizer(tiny_llama)
    assert reasoning.choose("auto", "m", tokenizer) is None
    assert reasoning.choose("think", "m", tokenizer) == ThinkFormat(False)


def test_an_unknown_parser_name_is_refused_naming_the_known_ones():
    reasoning.check("auto")
    reasoning.check("a=think,b=none")
    with pytest.raises(ValueError, match="known: auto, none, think"):
        reasoning.check("deepseek_r2")


def test_the_thoughts_tokens_are_counted():
    def counted(fmt, texts):
        parser = ReplyParser(None, fmt)
        for text in texts:
            parser.feed(text)
        return parser.thought_tokens

    assert counted(ThinkFormat(), ["<think>", "a", "b", "</think>", "x"]) == 3
    assert counted(ThinkFormat(True), ["a", "", "b", "</", "think>", "x", "y"]) == 4
    assert counted(ThinkFormat(), ["x", "y"]) == 0 and counted(None, ["x"]) == 0
