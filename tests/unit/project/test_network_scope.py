"""The unit tier's network scope (tests/conftest.py): loopback resolves, nothing else does."""

import socket

import pytest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "host", ["deb.debian.org", "nodeforge-test.invalid", "10.9.0.2", "::ffff:8.8.8.8"]
)
def test_names_and_addresses_beyond_loopback_do_not_resolve(host):
    with pytest.raises(socket.gaierror, match="no network beyond loopback"):
        socket.getaddrinfo(host, 80)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_loopback_resolves(host):
    assert socket.getaddrinfo(host, 80, type=socket.SOCK_STREAM)
