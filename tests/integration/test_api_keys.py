"""API keys in a real Redis: stored hashed, found, listed, revoked."""
from shared import redis_keys
from shared.api_keys import KeyStore


async def test_keys_are_stored_as_digests_only(redis, prefix):
    store = KeyStore(redis, prefix)
    key = await store.create("acme", "ci")
    assert key.startswith("sq-") and len(key) > 30
    stored = await redis.hgetall(redis_keys.api_keys(prefix))
    assert key not in str(stored)  # never the key itself
    assert await store.tenant_for(key) == "acme"
    assert await store.tenant_for(key + "x") is None


async def test_list_and_revoke_by_key_or_hint(redis, prefix):
    store = KeyStore(redis, prefix)
    a, b = await store.create("acme"), await store.create("globex", "ops")
    listed = await store.list()
    assert [e["tenant"] for e in listed] == ["acme", "globex"] and all("sq-" in e["hint"] for e in listed)
    assert await store.revoke(a) == 1 and await store.tenant_for(a) is None
    assert await store.revoke(listed[1]["hint"]) == 1 and await store.tenant_for(b) is None
    assert await store.revoke("nothing-like-it") == 0
