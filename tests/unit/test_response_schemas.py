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


def test_every_input_item_kind_gets_an_id_a_reasoning_item_too():
    """An input's items without ids are given ones; a reasoning item sent back without its id was
    a KeyError, a 500 (found by tests/e2e/test_fuzz.py)."""
    from api.openai.responses.record import with_ids

    body = ResponseCreate.model_validate({"input": [
        {"type": "function_call_output", "call_id": "c", "output": ""}, {"type": "reasoning"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"role": "user", "content": "hi"}]})
    items = with_ids("resp_abc", body.input_items())
    assert [i.id for i in items] == ["fco_abc_in0", "rs_abc_in1", "fc_abc_in2", "msg_abc_in3"]
    assert all(i.status == "completed" for i in items)
