import pytest
from pydantic import ValidationError

from shared.messages import (STATUS_OF_FINISH, FinalEvent, FinishReason, RequestPayload, RequestStatus, StatusEvent,
                             TokenEvent, Usage, decode_event, encode_event)
from shared.sampling import SamplingParams


@pytest.mark.parametrize("event", [
    TokenEvent(index=3, token_id=42, text="안녕 😀"),
    StatusEvent(status=RequestStatus.RUNNING, worker="w1"),
    FinalEvent(status=RequestStatus.DONE, finish_reason=FinishReason.LENGTH,
               usage=Usage(prompt_tokens=5, completion_tokens=7)),
    FinalEvent(status=RequestStatus.FAILED, finish_reason=FinishReason.ERROR,
               usage=Usage(prompt_tokens=5, completion_tokens=0), error="boom"),
])
def test_events_round_trip(event):
    data = encode_event(event)
    assert isinstance(data, str)
    assert decode_event(data) == event
    assert decode_event(data.encode()) == event


def test_payload_round_trip():
    payload = RequestPayload(id="x", model="m", prompt_token_ids=[1, 2, 3],
                             params=SamplingParams(temperature=0.5, stop=["\n"], seed=7, max_tokens=9))
    assert RequestPayload.model_validate_json(payload.model_dump_json()) == payload


def test_unknown_event_type_is_rejected():
    with pytest.raises(ValidationError):
        decode_event('{"type": "pickle", "index": 1}')


def test_negative_token_index_is_rejected():
    with pytest.raises(ValidationError):
        decode_event('{"type": "token", "index": -1, "token_id": 1, "text": ""}')


def test_status_order_puts_finished_states_last():
    order = list(RequestStatus)
    finished = [s for s in order if s.finished]
    assert order[-len(finished):] == finished
    assert not RequestStatus.QUEUED.finished and not RequestStatus.RUNNING.finished


def test_every_finish_reason_maps_to_a_finished_status():
    assert set(STATUS_OF_FINISH) == set(FinishReason)
    assert all(status.finished for status in STATUS_OF_FINISH.values())
