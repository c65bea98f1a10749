"""Property tests (hypothesis): message decoding, the relay's resume logic, detokenization."""
from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.core.relay import _Cursor
from shared.messages import (FinalEvent, FinishReason, RequestStatus, StatusEvent, TokenEvent, Usage, decode_event,
                             encode_event)
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_tokenizer
from worker.engine.detokenizer import Detokenizer

texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


@given(index=st.integers(0, 10**9), token_id=st.integers(0, 2**31), text=texts,
       logprob=st.one_of(st.none(), st.floats(-1e6, 0, allow_nan=False)))
def test_token_events_round_trip(index, token_id, text, logprob):
    event = TokenEvent(index=index, token_id=token_id, text=text, logprob=logprob)
    assert decode_event(encode_event(event)) == event


EVENT_TYPES = {"token": TokenEvent, "status": StatusEvent, "final": FinalEvent}
events = st.one_of(
    st.builds(TokenEvent, index=st.integers(0, 10**9), token_id=st.integers(0, 2**31), text=texts,
              logprob=st.one_of(st.none(), st.floats(-1e6, 0, allow_nan=False)),
              top_logprobs=st.one_of(st.none(), st.lists(st.tuples(st.integers(0, 2**31),
                                                                   st.floats(-1e6, 0, allow_nan=False)), max_size=3))),
    st.builds(StatusEvent, status=st.sampled_from(RequestStatus), worker=st.one_of(st.none(), texts)),
    st.builds(FinalEvent, status=st.sampled_from(RequestStatus), finish_reason=st.sampled_from(FinishReason),
              usage=st.builds(Usage, prompt_tokens=st.integers(0, 10**6), completion_tokens=st.integers(0, 10**6)),
              error=st.one_of(st.none(), texts)),
)


@given(events)
def test_every_event_decodes_to_the_type_it_was_encoded_from(event):
    decoded = decode_event(encode_event(event))
    assert type(decoded) is type(event)
    assert decoded == event


@st.composite
def damaged(draw) -> tuple[bytes, str | None]:
    """A well-formed event with one thing wrong, and the required field it lost (if it lost one)."""
    event = draw(events)
    fields = json.loads(encode_event(event))
    how = draw(st.sampled_from(["drop", "retype", "truncate"]))
    if how == "drop":
        key = draw(st.sampled_from(sorted(fields)))
        del fields[key]
        required = {n for n, f in type(event).model_fields.items() if f.is_required()}
        return json.dumps(fields).encode(), key if key in required else None
    if how == "retype":
        fields["type"] = draw(st.sampled_from(sorted(EVENT_TYPES)))
        return json.dumps(fields).encode(), None
    data = json.dumps(fields).encode()
    return data[:draw(st.integers(0, len(data) - 1))], None


@given(st.one_of(st.tuples(st.binary(max_size=200), st.none()), damaged()))
def test_garbage_is_refused_or_decodes_to_the_type_it_names(case):
    data, lost = case
    try:
        event = decode_event(data)
    except ValueError:
        return
    assert lost is None, f"decoded without its required field {lost!r}"
    assert type(event) is EVENT_TYPES[json.loads(data)["type"]]
    assert decode_event(encode_event(event)) == event


class FakeLog:
    """The token log as RequestStore.events sees it: entry ids in order."""

    def __init__(self):
        self.entries: list[tuple[str, str]] = []

    def append(self, event) -> None:
        self.entries.append((f"{len(self.entries) + 1}-0", encode_event(event)))

    async def events(self, request_id: str, after_entry: str = "-"):
        if after_entry == "-":
            return list(self.entries)
        n = int(after_entry.split("-")[0])
        return self.entries[n:]


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(total=st.integers(1, 30), after=st.integers(-1, 30), data=st.data())
def test_resume_delivers_each_index_after_the_cursor_exactly_once(total, after, data):
    """Whatever reaches the relay live (dropped, repeated, late) and whenever it reads the log,
    the client gets indices after+1 .. total-1, each once, in order, then the final event."""
    after = min(after, total - 1)
    tokens = [TokenEvent(index=i, token_id=i, text=str(i)) for i in range(total)]
    final = FinalEvent(status=RequestStatus.DONE, finish_reason=FinishReason.LENGTH,
                       usage=Usage(prompt_tokens=1, completion_tokens=total))
    log = FakeLog()
    logged_before = data.draw(st.integers(0, total), label="tokens in the log before the client came")
    for t in tokens[:logged_before]:
        log.append(t)
    live = [t for t in tokens[logged_before:]]
    # The channel drops some messages and repeats others; the log always gets every event.
    delivered = []
    for t in live:
        log.append(t)
        copies = data.draw(st.integers(0, 2), label=f"copies of {t.index}")
        delivered += [t] * copies
    log.append(final)
    delivered.append(final)

    async def run():
        cursor = _Cursor(log, "r", after)
        out = list(await cursor.catch_up())
        if not any(isinstance(e, FinalEvent) for e in out):
            for event in delivered:
                got = await cursor.accept(event)
                out += got
                if any(isinstance(e, FinalEvent) for e in got):
                    break
        return out

    out = asyncio.run(run())
    indices = [e.index for e in out if isinstance(e, TokenEvent)]
    assert indices == list(range(after + 1, total))
    assert isinstance(out[-1], FinalEvent) and sum(isinstance(e, FinalEvent) for e in out) == 1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder)
    return Tokenizer(folder)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(5, 399), max_size=40))
def test_deltas_add_up_to_the_decoded_text_for_any_tokens(tokenizer, ids):
    detok = Detokenizer(tokenizer.decode)
    shown = "".join(detok.push(t) for t in ids) + detok.flush()
    assert shown == tokenizer.decode(ids)
