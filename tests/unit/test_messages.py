import json

import pytest
from pydantic import ValidationError

from shared.messages import (STATUS_OF_FINISH, Cancel, FinalEvent, FinishReason, RequestPayload, RequestStatus,
                             StatusEvent, TokenEvent, UnknownVersion, Usage, decode_event, encode_event)
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


def _payload(**more) -> RequestPayload:
    return RequestPayload(id="x", model="m", prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=3),
                          tenant="acme", created_at=1712000000.5, **more)


def test_a_payload_says_its_version_and_keeps_its_keys():
    wire = json.loads(_payload().encode())
    assert wire["version"] == 1 and wire["type"] == "request" and wire["owner"] == "acme"
    assert RequestPayload.decode(_payload().encode()) == _payload()


def test_a_payload_written_before_versions_reads_as_version_1():
    earlier = {k: v for k, v in json.loads(_payload().encode()).items() if k != "version"}
    assert RequestPayload.decode(json.dumps(earlier)) == _payload()


def test_a_payload_of_an_unknown_version_is_refused_by_name():
    newer = json.dumps({**json.loads(_payload().encode()), "version": 2})
    with pytest.raises(UnknownVersion, match="RequestPayload version 2: this process reads version 1"):
        RequestPayload.decode(newer)
    # The worker validates an entry's payload as a whole: the reason reaches the request's client.
    with pytest.raises(ValidationError, match="RequestPayload version 2"):
        RequestPayload.model_validate_json(newer)


def test_a_cancel_round_trips_and_names_its_type_and_version():
    cancel = Cancel(request_id="r1")
    assert json.loads(cancel.encode()) == {"version": 1, "type": "cancel", "request_id": "r1"}
    assert Cancel.decode(cancel.encode()) == cancel
    assert Cancel.decode(cancel.encode().encode()) == cancel


def test_a_cancel_as_a_previous_api_published_it_is_the_bare_request_id():
    assert Cancel.decode("3f1c2a8e-1111-4222-8333-444455556666") == Cancel(
        request_id="3f1c2a8e-1111-4222-8333-444455556666")
    assert Cancel.decode(b"abc") == Cancel(request_id="abc")


def test_a_cancel_of_an_unknown_version_or_type_is_refused():
    with pytest.raises(UnknownVersion, match="Cancel version 3"):
        Cancel.decode('{"version": 3, "type": "cancel", "request_id": "r1"}')
    with pytest.raises(ValidationError):
        Cancel.decode('{"version": 1, "type": "pause", "request_id": "r1"}')
    with pytest.raises(ValidationError):
        Cancel.decode('{"version": 1, "type": "cancel", "request_id": ""}')


def test_a_run_time_adapter_entry_and_a_keys_record_read_back_and_refuse_a_newer_version():
    from shared.api_keys import KeyMeta
    from shared.lora_registry import AdapterEntry

    entry = AdapterEntry(path="/adapters/sql", tenants=("acme",))
    assert AdapterEntry.decode(entry.encode()) == entry
    assert AdapterEntry.decode('{"path": "/adapters/sql", "tenants": null}') == AdapterEntry(path="/adapters/sql")
    meta = KeyMeta(tenant="acme", name="ci", created_at=1712000000.5, hint="sq-abcdefg")
    assert KeyMeta.decode(meta.encode()) == meta
    with pytest.raises(UnknownVersion, match="AdapterEntry version 2"):
        AdapterEntry.decode('{"version": 2, "path": "/x"}')


def test_a_kept_response_is_the_json_list_members_always_were():
    from shared.messages import KeptResponse

    kept = KeptResponse(tenant="t", response_id="resp_1", request_id="r1")
    assert kept.encode() == json.dumps(["t", "resp_1", "r1"])
    assert KeptResponse.decode(kept.encode()) == kept
