"""The Responses body as the chat request it runs (api/openai/responses/schemas.py)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.openai.responses.schemas import ResponseCreate


@pytest.mark.parametrize("effort", ["minimal", "low", "medium", "high"])
def test_the_reasoning_effort_reaches_the_template_as_the_chat_endpoints(effort):
    body = ResponseCreate.model_validate({"model": "m", "input": "hi", "reasoning": {"effort": effort}})
    chat = body.chat_request(body.input_items())
    assert chat.reasoning_effort == effort
    assert chat.template_kwargs()["reasoning_effort"] == effort


def test_no_reasoning_sets_no_effort():
    body = ResponseCreate.model_validate({"model": "m", "input": "hi", "reasoning": {}})
    assert body.chat_request(body.input_items()).reasoning_effort is None


@pytest.mark.parametrize("reasoning", [{"summary": "auto"}, {"generate_summary": "concise"}, {"effort": "huge"},
                                       {"effort": "low", "budget": 5}])
def test_what_reasoning_cannot_do_here_is_refused(reasoning):
    with pytest.raises(ValidationError):
        ResponseCreate.model_validate({"model": "m", "input": "hi", "reasoning": reasoning})
