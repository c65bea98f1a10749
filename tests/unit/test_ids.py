"""The api's ids: each maker's ids are in its form, and no other spelling of an id is."""
from __future__ import annotations

import uuid

import pytest

from shared import ids

FORMS = [(ids.request_id, ids.is_request_id), (ids.response_id, ids.is_response_id), (ids.batch_id, ids.is_batch_id)]


@pytest.mark.parametrize("make, holds", FORMS)
def test_every_id_made_is_in_its_form_and_no_other(make, holds):
    made = [make() for _ in range(200)]
    assert all(holds(i) for i in made) and len(set(made)) == 200
    assert not any(other(i) for _, other in FORMS if other is not holds for i in made)


@pytest.mark.parametrize("make, holds", FORMS)
def test_another_spelling_of_a_real_id_is_not_an_id(make, holds):
    real = make()
    head, _, tail = real.rpartition("_")
    spellings = [real.upper(), f"{head}_{tail.upper()}" if head else real[:-1] + "A", f" {real}", f"{real} ",
                 f"{real}\n", f"{real}\t", f"{{{real}}}", f"urn:uuid:{real}", real[:-1], real + "0", "", real * 2,
                 real.replace("-", ""), real.replace("_", "-")]
    assert holds(real) and not any(holds(s) for s in spellings if s != real), [s for s in spellings if holds(s)]


def test_a_request_id_is_a_uuid4_as_str_writes_it():
    assert ids.is_request_id(str(uuid.uuid4()))
    assert not ids.is_request_id(str(uuid.uuid1()))  # not a UUID4: never made here
    assert not ids.is_request_id(uuid.uuid4().hex)
    assert not ids.is_request_id(f"resp_{uuid.uuid4().hex}") and not ids.is_response_id(str(uuid.uuid4()))
