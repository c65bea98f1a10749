"""The strict JSON parser of request bodies: what it refuses, where it says it is, and (hypothesis)
that any body either parses to what json would give or is refused with a validation error."""
from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st

from api.core.json_body import MAX_DEPTH, loads


def refused(body: bytes) -> dict:
    with pytest.raises(RequestValidationError) as info:
        loads(body)
    error = info.value.errors()[0]
    json.dumps(info.value.errors(), allow_nan=False).encode()  # the 422 that echoes it can be sent
    return error


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" * 400 + b".0"])
def test_non_finite_numbers_are_refused_where_they_are(number):
    error = refused(b'{"prompt": "hi", "logit_bias": {"3": ' + number + b"}}")
    assert error["type"] == "finite_number" and error["loc"] == ("body", "logit_bias", "3")


def test_lone_surrogates_are_refused_in_values_and_keys():
    assert refused(rb'{"messages": [{"content": "x\ud800y"}]}')["loc"] == ("body", "messages", 0, "content")
    assert refused(rb'{"a": {"\uDFFF": 1}}')["loc"] == ("body", "a", "\\udfff")


def test_deep_nesting_and_huge_integers_are_refused():
    assert refused(b"[" * 10_000 + b"]" * 10_000)["type"] == "json_invalid"
    assert "levels" in refused(b"[" * (MAX_DEPTH + 2) + b"]" * (MAX_DEPTH + 2))["msg"]
    assert refused(b'{"seed": ' + b"9" * 5000 + b"}")["type"] == "json_invalid"
    assert refused(b'{"prompt": "\xff"}')["type"] == "json_invalid"


def test_what_is_fine_passes_unchanged():
    body = b'{"p": "caf\\u00e9 \\ud83d\\ude00", "t": 0.5, "big": 18446744073709551616, "l": [[[1]]]}'
    assert loads(body) == json.loads(body)
    assert loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) == json.loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)


scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8))
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(documents)
def test_any_document_parses_as_json_would_or_is_refused(doc):
    body = json.dumps(doc).encode()  # NaN, Infinity and lone surrogates (escaped) included
    try:
        value = loads(body)
    except RequestValidationError as exc:
        json.dumps(exc.errors(), allow_nan=False).encode()
        return
    sent = json.dumps(value, allow_nan=False, ensure_ascii=False).encode()  # no lone surrogate got through
    assert sent == json.dumps(json.loads(body), ensure_ascii=False).encode()
