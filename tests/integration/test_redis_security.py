"""REDIS_URL with a password and TLS, through shared.redis_client.connect, against a real redis-server.

The server (tests/redis_tls.py) requires a random password, speaks TLS on one port with a
certificate from a CA made for this module, and plain text on another.
"""
import asyncio
import uuid
from urllib.parse import quote

import pytest
from redis.exceptions import AuthenticationError, ConnectionError

from shared.pubsub import ShardPubSub
from shared.redis_client import FastConnection, FastSSLConnection, connect
from tests.redis_tls import SecureRedis, make_certs


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("redis-tls")
    running = SecureRedis(folder / "redis", make_certs(folder / "certs"), plain=True).start()
    yield running
    running.stop()


@pytest.fixture
async def tls(server):
    client = connect(server.tls_url())
    yield client
    await client.aclose()


def _ca(server) -> str:
    return quote(str(server.certs.ca))


@pytest.mark.parametrize("query", [
    "ssl_ca_certs={ca}",
    "ssl_cert_reqs=required&ssl_ca_certs={ca}",
    "ssl_ca_certs={ca}&ssl_check_hostname=true",  # the certificate names 127.0.0.1 and localhost
])
async def test_rediss_with_a_password_and_the_ca_answers(server, query):
    client = connect(server.tls_url(query=query.format(ca=_ca(server))))
    assert await client.ping() is True
    await client.aclose()


def test_rediss_gets_the_hiredis_packing_connection(server):
    assert connect(server.tls_url()).connection_pool.connection_class is FastSSLConnection


async def test_streams_over_tls(tls):
    stream, group = f"tls-test:{uuid.uuid4().hex}", "g"
    await tls.xgroup_create(stream, group, id="0", mkstream=True)
    entry = await tls.xadd(stream, {"e": "안녕 😀"})
    [[name, entries]] = await tls.xreadgroup(group, "c1", {stream: ">"}, count=10, block=1000)
    assert name == stream and entries == [(entry, {"e": "안녕 😀"})]
    assert await tls.xack(stream, group, entry) == 1
    await tls.delete(stream)


async def test_pubsub_over_tls(tls, server):
    channel = f"tls-test:{uuid.uuid4().hex}"
    pubsub = ShardPubSub(tls.connection_pool)  # sharded, as every streamq channel
    await pubsub.subscribe(channel)
    async with asyncio.timeout(10):
        assert (await pubsub.get_message(timeout=10))["type"] == "ssubscribe"
        publisher = connect(server.tls_url())
        # Our subscriber, over its own TLS connection:
        assert await publisher.execute_command("SPUBLISH", channel, "token") == 1
        await publisher.aclose()
        message = await pubsub.get_message(timeout=10)
    assert message["type"] == "smessage" and message["data"] == "token"
    await pubsub.aclose()


@pytest.mark.parametrize("url", ["tls", "plain"])
async def test_a_wrong_or_missing_password_is_an_authentication_error(server, url):
    make = server.tls_url if url == "tls" else server.plain_url
    for password, message in [("not-the-password", "invalid username-password pair"),
                              ("", "Authentication required")]:
        client = connect(make(password=password))
        with pytest.raises(AuthenticationError, match=message):
            await client.ping()
        await client.aclose()


async def test_plain_text_to_the_tls_port_fails(server):
    client = connect(server.plain_url(port=server.tls_port) + "?socket_timeout=10")
    with pytest.raises(ConnectionError) as failure:
        await client.ping()
    assert not isinstance(failure.value, AuthenticationError)  # the TLS port never read a command
    await client.aclose()


async def test_tls_without_the_ca_does_not_trust_the_server(server):
    client = connect(server.tls_url(query=""))
    with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        await client.ping()
    await client.aclose()


async def test_a_password_over_plain_redis(server):
    client = connect(server.plain_url())
    assert client.connection_pool.connection_class is FastConnection
    assert await client.ping() is True
    await client.aclose()


async def test_an_acl_user_whose_password_needs_percent_encoding(tls, server):
    user, password = f"streamq-{uuid.uuid4().hex[:8]}", "p@ss/w:rd%#?&"
    await tls.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"],
                          commands=["+@all"])
    client = connect(f"rediss://{user}:{quote(password, safe='')}@127.0.0.1:{server.tls_port}/0"
                     f"?ssl_ca_certs={_ca(server)}")
    assert await client.acl_whoami() == user
    await client.aclose()
    await tls.acl_deluser(user)
