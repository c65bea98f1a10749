"""The batch record's schema, said once (shared/batch_record.py): the typed record round-trips
through its hash, and the hash keeps the names and encodings batches were written with, so a
batch an earlier version wrote reads back."""
import dataclasses
import json
import re

import pytest

from scheduler import batches
from shared.batch_record import BatchEntry, BatchField, BatchRecord, BatchStatus
from shared.messages import RequestPayload
from shared.sampling import SamplingParams

FULL = BatchRecord(status=BatchStatus.COMPLETED, endpoint="/v1/chat/completions", tenant="acme",
                   created_at=1712000000, total=3, completed=2, failed=1, metadata={"run": "nightly"},
                   started_at=1712000001.25, completed_at=1712000042.5)


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
        "completed": "0", "failed": "0", "metadata": '{"a": "\\u00e9"}', "owner": "acme"}
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
    assert not re.search(rf"""['"]({names})['"]""", batches._RECORD_RESULT)
