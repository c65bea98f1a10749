"""A user message with images in a request with tools (api/core/chat.py ChatRequest.template_messages):
every tool format writes the conversation, and the message keeps its parts (text and image, in
order) where the format wrote it; a system message and earlier calls are the format's as before."""
import pytest

from api.core.chat import ChatRequest
from api.core.parsers import registry

PICTURE = "data:image/png;base64,iVBORw0KGgo="  # never decoded here
TOOLS = [{"type": "function", "function": {"name": "describe", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("name", registry.names())
def test_the_image_message_keeps_its_parts_in_every_tool_format(name):
    request = ChatRequest.model_validate({"tools": TOOLS, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": PICTURE}},
                                     {"type": "text", "text": "what colour?"}]},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PICTURE}}]}]})
    request.use_tool_format(registry.get(name))
    written = request.template_messages()
    with_parts = [m for m in written if isinstance(m.get("content"), list)]
    assert [m["content"] for m in with_parts] == [
        [{"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "text", "text": "what colour?"}],
        [{"type": "image"}]]
    assert all(m["role"] == "user" for m in with_parts)
    assert not any("streamq-images" in str(m.get("content")) for m in written)  # no mark left behind
    assert len(request.images()) == 2


def test_without_images_a_tool_format_writes_what_it_wrote_before():
    messages = [{"role": "user", "content": "hi"}]
    request = ChatRequest.model_validate({"tools": TOOLS, "messages": messages})
    plain = registry.get(registry.FALLBACK).template_messages(request.messages, request.tools, None)
    assert request.template_messages() == plain
