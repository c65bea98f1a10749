"""Prefix affinity's pure parts: the prefix hash, and the affinity lanes' names."""
import uuid

import pytest
from pydantic import ValidationError

from shared.messages import RequestPayload
from shared.prefix_affinity import prefix_hash
from shared.queue import affinity_of, lane_of, served_by
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings


def _payload(**fields) -> RequestPayload:
    return RequestPayload(id=str(uuid.uuid4()), model="m", prompt_token_ids=[1, 2], params=SamplingParams(),
                          tenant="acme:eu", **fields)


def test_the_prefix_hash_covers_the_first_tokens_only():
    assert prefix_hash([1, 2, 3, 4, 5], 4) == prefix_hash([1, 2, 3, 4, 9, 9], 4)
    assert prefix_hash([1, 2, 3, 4, 5], 4) != prefix_hash([1, 2, 3, 5, 5], 4)
    assert prefix_hash([1, 2, 3, 4], 4) is None  # its last token is never cached: nothing to share
    assert prefix_hash([12, 3, 4], 2) != prefix_hash([1, 23, 4], 2)


@pytest.mark.parametrize("fields,lane,owner", [
    ({}, "0:acme:eu", None),
    ({"affinity": "w-1"}, "^w-1/0:acme:eu", "w-1"),
    ({"backend": "vllm"}, "@vllm/0:acme:eu", None),
    ({"backend": "vllm", "affinity": "w:1"}, "@vllm/^w:1/0:acme:eu", "w:1"),
])
def test_an_affinity_lane_names_its_worker_after_the_backend(fields, lane, owner):
    payload = _payload(**fields)
    assert lane_of(payload) == lane and affinity_of(lane) == owner
    assert served_by(lane, "vllm") and served_by(lane, "hf") == ("backend" not in fields)


def test_a_worker_name_has_no_slash():
    with pytest.raises(ValidationError):
        WorkerSettings(worker_name="a/b")
    with pytest.raises(ValidationError):
        _payload(affinity="a/b")
