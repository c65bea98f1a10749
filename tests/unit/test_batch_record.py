"""The batch record's schema, said once (shared/batch_record.py): the typed record round-trips
through its hash, and the hash keeps the names and encodings batches were written with, so a
batch an earlier version wrote reads back."""
import dataclasses
import json
import re

import pytest
from pydantic import ValidationError

from scheduler.batches import result_line
from shared import scripts
from shared.batch_record import BatchEntry, BatchField, BatchRecord, BatchResult, BatchStatus
from shared.messages import FinishReason, RequestPayload, RequestStatus, UnknownVersion
from shared.request_record import RequestRecord
from shared.sampling import SamplingParams

FULL = BatchRecord(status=BatchStatus.COMPLETED, endpoint="/v1/chat/completions", tenant="acme",
                   created_at=1712000000, total=3, completed=2, failed=1, metadata={"run": "nightly"},
                   started_at=1712000001.25, completed_at=1712000042.5, window="2h", expires_at=1712007200,
                   expired_at=1712007200.5, input_file_id="file-in", output_file_id="file-out",
                   error_file_id="file-err")


def test_every_field_is_named_once_and_every_name_is_a_field():
    assert [f.name for f in dataclasses.fields(BatchRecord)] == [m.name.lower() for m in BatchField]
    assert len({m.value for m in BatchField}) == len(BatchField)


def test_a_record_round_trips_through_its_hash():
    assert BatchRecord.of(FULL.fields()) == FULL
    assert set(FULL.fields()) == {m.value for m in BatchField}


def test_a_new_batch_keeps_the_names_and_values_batches_had():
    # What the api wrote before the record was typed, as redis-py encodes it: byte for byte the same
    record = BatchRecord.created("/v1/completions", "acme", 1712000000, 2, {"a": "é"})
    assert record.fields() == {
        "status": "validating", "endpoint": "/v1/completions", "created_at": "1712000000", "total": "2",
        "completed": "0", "failed": "0", "metadata": '{"a": "\\u00e9"}', "owner": "acme",
        "completion_window": "24h", "expires_at": "1712086400"}
    assert BatchRecord.created("/v1/completions", "", 1712000000, 2, None).fields()["metadata"] == "{}"


def test_a_hash_an_earlier_version_left_reads_back():
    # A finished batch as the api and the scheduler's job left it (counts by HINCRBY, times by now())
    raw = {"status": "completed", "endpoint": "/v1/completions", "created_at": "1712000000", "total": "3",
           "completed": "2", "failed": "1", "metadata": '{"run": "nightly"}', "owner": "",
           "started_at": "1712000001.25", "completed_at": "1712000042.5"}
    record = BatchRecord.of(raw)
    assert (record.status, record.tenant, record.total, record.completed, record.failed) == (
        BatchStatus.COMPLETED, "", 3, 2, 1)
    assert (record.metadata, record.started_at, record.completed_at) == ({"run": "nightly"}, 1712000001.25, 1712000042.5)
    assert record.fields() == raw
    assert (record.completion_window, record.deadline) == ("24h", 1712000000 + 24 * 3600)  # before windows: 24h


def test_a_hash_without_an_owner_or_metadata_reads_as_the_route_read_it():
    record = BatchRecord.of({"status": "in_progress", "endpoint": "/v1/completions", "created_at": "1712000000",
                             "total": "1", "completed": "0", "failed": "0", "started_at": "1712000001.0"})
    assert (record.tenant, record.metadata, record.completed_at) == ("", {}, None)


def test_an_entry_is_written_as_batches_always_were_and_reads_back():
    payload = RequestPayload(id="r1", model="m", params=SamplingParams(max_tokens=4), prompt_token_ids=[1, 2, 3],
                             tenant="acme")
    # What the route wrote for each request before BatchEntry said it once (a batch left queued by it).
    earlier = json.dumps({"custom_id": "q0", "endpoint": "/v1/completions",
                          "payload": json.loads(payload.model_dump_json())})
    entry = BatchEntry(custom_id="q0", endpoint="/v1/completions", payload=payload)
    assert json.loads(entry.encode()) == {"version": 1, **json.loads(earlier)}
    assert BatchEntry.decode(earlier) == entry


@pytest.mark.parametrize("fields", [{}, {"completed": "1"}])
def test_a_hash_without_a_status_is_no_batch(fields):
    # e.g. a result counted after the record expired
    assert BatchRecord.of(fields) is None


def test_the_result_script_is_given_the_count_it_adds_to():
    names = "|".join(re.escape(m.value) for m in BatchField)
    assert not re.search(rf"""['"]({names})['"]""", scripts.text("batch_result"))


def _entry() -> BatchEntry:
    payload = RequestPayload(id="r1", model="m", params=SamplingParams(max_tokens=4), prompt_token_ids=[1, 2, 3],
                             tenant="acme")
    return BatchEntry(custom_id="q0", endpoint="/v1/completions", payload=payload)


def test_an_entry_of_an_unknown_version_is_refused_by_name():
    newer = json.dumps({**json.loads(_entry().encode()), "version": 2})
    with pytest.raises(UnknownVersion, match="BatchEntry version 2"):
        BatchEntry.decode(newer)


def _record(status: str, **more) -> RequestRecord:
    return RequestRecord(status=RequestStatus(status), prompt_tokens=3, created_at=1712000000.5, **more)


def test_a_done_request_is_a_result_line_in_openais_shape_and_reads_back():
    line = result_line("r1", _entry(), _record("done", completion_tokens=2, finish_reason=FinishReason.LENGTH),
                       "hi", "m")
    assert json.loads(line.encode()) == {
        "id": "batch_req_r1", "custom_id": "q0", "error": None, "response": {
            "status_code": 200, "request_id": "r1", "body": {
                "id": "cmpl-r1", "object": "text_completion", "created": 1712000000, "model": "m",
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}],
                "service_tier": "flex"}}}
    assert BatchResult.decode(line.encode()) == line
    # the bytes as the results were always written: json.dumps's spacing, non-ASCII as it is
    assert line.encode() == json.dumps(json.loads(line.encode()), ensure_ascii=False)
    chat = result_line("r1", _entry().model_copy(update={"endpoint": "/v1/chat/completions"}),
                       _record("done", completion_tokens=2, finish_reason=FinishReason.STOP), "hi", "m")
    assert chat.response.body.choices[0].message.content == "hi" and chat.response.body.object == "chat.completion"


def test_a_failed_request_is_an_error_line_and_a_line_has_one_of_the_two():
    line = result_line("r1", _entry(), _record("failed", error="boom"), "", "m")
    assert json.loads(line.encode())["error"] == {"code": "failed", "message": "boom"} and line.response is None
    with pytest.raises(ValidationError, match="a response or an error"):
        BatchResult(id="x", custom_id="q0", response=None, error=None)
