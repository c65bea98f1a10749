"""The hiredis-packed client speaks the same protocol as redis-py's own."""
from redis.asyncio.connection import Connection

from shared.redis_client import FastConnection, connect


def test_packing_is_byte_identical():
    ours, theirs = FastConnection(), Connection()
    for args in [("XADD", "k:{a}:tokens", "*", "e", '{"text": "안녕 😀"}'), ("SET", "k", 3, "PX", 2.5),
                 ("CLIENT SETNAME", "x"), ("HSET", "h", b"\x00\xff", "v")]:
        assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))


async def test_round_trip_through_a_real_redis(redis_url):
    client = connect(redis_url)
    assert isinstance(client.connection_pool.connection_kwargs, dict)
    await client.set("streamq-test:k", "안녕 😀")
    async with client.pipeline(transaction=False) as pipe:
        pipe.xadd("streamq-test:s", {"e": "1"})
        pipe.get("streamq-test:k")
        _, value = await pipe.execute()
    assert value == "안녕 😀"
    await client.delete("streamq-test:k", "streamq-test:s")
    await client.aclose()


def test_arq_reads_the_url_as_redis_py_does():
    from shared.redis_client import arq_settings

    tls = arq_settings("rediss://app:p%40ss%2Fw@db.internal:6380/3?ssl_ca_certs=/etc/ca.pem&ssl_check_hostname=true")
    assert (tls.host, tls.port, tls.database, tls.username, tls.password) == ("db.internal", 6380, 3, "app", "p@ss/w")
    assert tls.ssl and tls.ssl_ca_certs == "/etc/ca.pem" and tls.ssl_check_hostname is True
    plain = arq_settings("redis://127.0.0.1:6379/0")
    assert not plain.ssl and plain.password is None and plain.database == 0
