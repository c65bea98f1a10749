"""The request record's schema, said once (shared/request_record.py): the typed record round-trips
through its hash, the hash keeps the names records were written with, and no Lua script or
playground list spells a field or a status of its own."""
import dataclasses
import json
import re
from pathlib import Path

import pytest

from api.openai.responses.events import FINAL_STATUS
from shared import scripts
from shared.messages import FINISHED, FinishReason, RequestPayload, RequestStatus
from shared.request_record import LUA_NAMES, RecordField, RequestRecord
from shared.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]

FULL = RequestRecord(
    status=RequestStatus.DONE, model="m", tenant="acme", params=SamplingParams(max_tokens=4).model_dump_json(),
    prompt_tokens=3, created_at=1712000000.125, expires_at=1712000060.5, worker="w1", started_at=1712000000.25,
    scheduled_at=1712000000.375, first_token_at=1712000000.5, finish_reason=FinishReason.LENGTH,
    completion_tokens=4, finished_at=1712000001.0, text="a b c d", reused_tokens=2, error="none really",
    cancel_requested=True, attempts=1, requeued_from="1712000000123-0", requeue_outcome="requeued")


def test_every_field_is_named_once_and_every_name_is_a_field():
    assert [f.name for f in dataclasses.fields(RequestRecord)] == [m.name.lower() for m in RecordField]
    assert len({m.value for m in RecordField}) == len(RecordField)


def test_a_record_round_trips_through_its_hash():
    assert RequestRecord.of(FULL.fields()) == FULL
    assert set(FULL.fields()) == {m.value for m in RecordField}


def test_a_hash_as_the_writers_leave_it_reads_back_the_same():
    # What the api, a claim, the publisher and a requeue write, as redis-py encodes it (repr of numbers)
    raw = {"status": "running", "model": "m", "owner": "", "params": "{}", "prompt_tokens": "3",
           "created_at": "1712000000.125", "worker": "", "started_at": "1712000000.25",
           "first_token_at": "1712000000.5", "attempts": "1", "requeued_from": "1-0", "requeue_outcome": "requeued"}
    record = RequestRecord.of(raw)
    assert (record.status, record.tenant, record.worker, record.attempts) == (RequestStatus.RUNNING, "", "", 1)
    assert record.finished_at is None and record.finish_reason is None and not record.cancel_requested
    assert record.fields() == raw


def test_the_queued_record_keeps_the_names_and_values_records_had():
    payload = RequestPayload(id="r", model="m", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4),
                             created_at=1712000000.125, tenant="acme")
    assert RequestRecord.queued(payload).fields() == {
        "status": "queued", "model": "m", "owner": "acme", "params": payload.params.model_dump_json(),
        "prompt_tokens": "3", "created_at": "1712000000.125"}
    with_timeout = payload.model_copy(update={"expires_at": 1712000060.5})
    assert RequestRecord.queued(with_timeout).fields()["expires_at"] == "1712000060.5"


def test_the_queue_entry_calls_the_tenant_owner_as_before():
    payload = RequestPayload(id="r", model="m", prompt_token_ids=[1], params=SamplingParams(), tenant="acme")
    wire = json.loads(payload.model_dump_json())
    assert wire["owner"] == "acme" and "tenant" not in wire
    assert RequestPayload.model_validate(wire).tenant == "acme"  # an entry queued by the previous version


@pytest.mark.parametrize("fields", [{}, {"first_token_at": "1712000000.5"}])
def test_a_hash_without_a_status_is_no_record(fields):
    # e.g. the publisher's first-token write landing after the record expired
    assert RequestRecord.of(fields) is None


def _lua_sources() -> dict[str, str]:
    """Every Lua script and library (shared/lua/), by file."""
    return {f"shared/lua/{name}.lua": scripts.text(name) for name in scripts.names()}


def test_no_lua_script_spells_a_record_field():
    names = "|".join(re.escape(m.value) for m in RecordField)
    quoted = re.compile(rf"""['"]({names})['"]""")
    sources = _lua_sources()
    assert len(sources) >= 5, sorted(sources)
    spelled = {where: quoted.findall(src) for where, src in sources.items() if quoted.search(src)}
    assert not spelled, f"scripts name record fields themselves (use LUA_NAMES' F): {spelled}"


def test_no_lua_script_spells_a_status_or_finish_reason():
    values = {s.value for s in RequestStatus} | {r.value for r in FinishReason}
    quoted = re.compile(r"""(?<!outcome = )['"](%s)['"]""" % "|".join(map(re.escape, sorted(values))))
    spelled = {where: quoted.findall(src) for where, src in _lua_sources().items() if quoted.search(src)}
    assert not spelled, f"scripts name statuses themselves (use LUA_NAMES' S and R): {spelled}"


def test_the_record_scripts_begin_with_the_names():
    for name in ("store_claim", "store_cancel", "store_end_queued", "requeue_decide"):
        assert scripts.source(name).startswith(LUA_NAMES)
    assert "tenant = 'owner'" in LUA_NAMES and "finished_at = 'finished_at'" in LUA_NAMES


def _js_set(path: str, name: str) -> set[str]:
    source = (ROOT / "api/static" / path).read_text()
    match = re.search(rf"const {name} = new Set\(\[([^\]]*)\]\)", source)
    assert match, f"no {name} set in {path}"
    return set(re.findall(r'"([^"]+)"', match.group(1)))


def test_the_playground_knows_the_finished_statuses():
    assert _js_set("playground.js", "FINISHED") == {s.value for s in FINISHED}
    assert _js_set("playground-responses.js", "ENDED") == set(FINAL_STATUS.values())
