"""Each tenant's cached prefixes are its own: block hashes, prefix-affinity hashes and the engine's
prefix cache chain from a per-tenant root, unless the tenants are named to share."""
from __future__ import annotations

import uuid

import pytest
import torch
from pydantic import ValidationError

from shared.messages import RequestPayload
from shared.prefix_affinity import prefix_hash
from shared.prefix_scope import PrefixScope, tenant_root
from shared.sampling import SamplingParams
from shared.settings import ApiSettings, WorkerSettings
from shared.tokenizer import Tokenizer
from worker.backends.vllm_backend import prompt_fields
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.engine.sequence import Sequence
from worker.model import kernels
from worker.model.model_loader import load_model
from worker.model.model_runner import PagedRunner

TOKENS = list(range(1, 40))  # 9 full blocks of 4 and a partial one
OWN = PrefixScope()


def cached(blocks: BlockManager, root: int | None, tokens: list[int] = TOKENS) -> int:
    """Tokens a new request of chain root `root` takes from the cache (its table is freed again)."""
    seq_id = uuid.uuid4().hex
    computed = blocks.allocate_prefix(seq_id, tokens, root)
    blocks.free(seq_id)
    return computed


def filled(root: int | None, tokens: list[int] = TOKENS) -> BlockManager:
    """A cache that ran one request of `tokens` under chain root `root`."""
    blocks = BlockManager(64, 4)
    blocks.allocate_prefix("first", tokens, root)
    blocks.append_slots("first", len(tokens))
    blocks.register("first", tokens, len(tokens))
    blocks.free("first")
    return blocks


def test_two_tenants_chain_the_same_tokens_to_different_blocks():
    a, b = OWN.root("acme"), OWN.root("globex")
    assert a is not None and b is not None and a != b
    assert OWN.root("acme") == a == tenant_root("acme")  # the same in every process: no per-process salt
    blocks = filled(a)
    assert cached(blocks, b) == 0  # tenant B learns nothing of tenant A's prompt
    assert cached(blocks, None) == 0  # nor does a request without a tenant
    assert cached(blocks, a) == 36  # tenant A's own repeat hits, as before: all but the last partial block


def test_named_tenants_share_one_space_and_the_others_keep_their_own():
    scope = PrefixScope.parse("acme, globex")
    assert scope.root("acme") is None and scope.root("globex") is None
    assert scope.root("initech") == OWN.root("initech") is not None
    blocks = filled(scope.root("acme"))
    assert cached(blocks, scope.root("globex")) == 36
    assert cached(blocks, scope.root("initech")) == 0
    everyone = PrefixScope.parse("*")
    assert everyone.root("acme") is None and everyone.root("initech") is None


def test_requests_without_a_tenant_keep_the_one_shared_space():
    assert OWN.root("") is None  # auth off: the hashes of a cache keyed by tokens alone
    assert cached(filled(OWN.root("")), OWN.root("")) == 36


def test_a_tenants_adapter_chains_apart_from_its_base_model_and_other_tenants():
    adapter = 12345
    assert OWN.root("", adapter) == adapter  # without a tenant an adapter keeps its own root
    rooted = {OWN.root("acme", adapter), OWN.root("globex", adapter), OWN.root("acme"), adapter}
    assert len(rooted) == 4
    assert PrefixScope.parse("*").root("acme", adapter) == adapter


def test_the_prefix_affinity_hash_is_taken_in_the_tenants_space():
    ids = list(range(20))
    a, b = OWN.root("acme"), OWN.root("globex")
    assert prefix_hash(ids, 8, a) == prefix_hash(ids + [99], 8, a)  # within a tenant: the same prefix
    assert prefix_hash(ids, 8, a) != prefix_hash(ids, 8, b)
    assert prefix_hash(ids, 8, a) != prefix_hash(ids, 8)
    assert prefix_hash(ids, 8, PrefixScope.parse("*").root("acme")) == prefix_hash(ids, 8)
    assert prefix_hash(ids[:8], 8, a) is None


@pytest.mark.parametrize("value", ["", "*", "acme", "acme:eu,globex", " acme , globex "])
def test_the_shared_tenants_setting_takes_names_or_a_star(value):
    assert WorkerSettings(shared_prefix_tenants=value).shared_prefix_tenants == value
    assert ApiSettings(shared_prefix_tenants=value).shared_prefix_tenants == value


@pytest.mark.parametrize("value", ["acme,,globex", ",acme", "acme,", "ac me"])
def test_a_malformed_shared_tenants_setting_is_refused(value):
    with pytest.raises(ValidationError, match="shared_prefix_tenants"):
        WorkerSettings(shared_prefix_tenants=value)


def _payload(tenant: str, ids: list[int]) -> RequestPayload:
    return RequestPayload(id=str(uuid.uuid4()), model="m", prompt_token_ids=ids, tenant=tenant,
                          params=SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))


def _reused(engine: Engine, payload: RequestPayload) -> int:
    """The prompt tokens the engine took from its cache for `payload`, run to its end."""
    seq = engine.add(payload)
    while engine.has_work():
        engine.step()
    assert seq.finished and seq.error is None, seq.error
    return seq.reused_tokens


def test_the_engine_reuses_a_prefix_for_its_own_tenant_only(tiny_llama):
    model = load_model(tiny_llama, torch.device("cpu"), torch.float32)
    runner = PagedRunner(model, torch.device("cpu"), 128, 4, kernels.load())
    engine = Engine(runner, Tokenizer(tiny_llama), Batcher(BlockManager(128, 4), 8, 64))
    ids = Tokenizer(tiny_llama).encode("the capital of France is Paris and streams batches caches " * 3)
    full = (len(ids) - 1) // 4 * 4
    assert _reused(engine, _payload("acme", ids)) == 0
    assert _reused(engine, _payload("globex", ids)) == 0  # another tenant: computed again
    assert _reused(engine, _payload("acme", ids)) == full
    assert _reused(engine, _payload("globex", ids)) == full  # its own copy now
    shared = Engine(runner, Tokenizer(tiny_llama), Batcher(BlockManager(128, 4), 8, 64), scope=PrefixScope.parse("*"))
    assert _reused(shared, _payload("acme", ids)) == 0
    assert _reused(shared, _payload("globex", ids)) == full


def test_vllm_prompts_are_salted_by_tenant_where_their_prefixes_are_their_own():
    def seq(tenant: str) -> Sequence:
        return Sequence.of(_payload(tenant, [1, 2, 3]), detokenizer=None)

    acme, globex = prompt_fields(seq("acme"), OWN), prompt_fields(seq("globex"), OWN)
    assert acme["prompt_token_ids"] == [1, 2, 3] and acme["cache_salt"] != globex["cache_salt"]
    assert prompt_fields(seq("acme"), OWN) == acme
    assert "cache_salt" not in prompt_fields(seq(""), OWN)
    assert "cache_salt" not in prompt_fields(seq("acme"), PrefixScope.parse("acme"))
