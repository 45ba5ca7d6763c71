"""SSRF guard: every address a host resolves to is vetted; private ones are refused."""

from __future__ import annotations

import ipaddress

import pytest

from mmis.frontend.client.ssrf import SSRFGuard, forbidden_reason
from mmis.frontend.errors import MediaFetchError, MediaForbiddenError

FORBIDDEN = [
    "127.0.0.1",
    "127.8.9.10",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata
    "100.64.0.1",  # shared address space (CGNAT)
    "0.0.0.0",
    "224.0.0.1",
    "240.0.0.1",
    "255.255.255.255",
    "::1",
    "::",
    "fe80::1",
    "fc00::1",
    "fec0::1",
    "ff02::1",
    "::ffff:127.0.0.1",  # IPv4-mapped loopback
    "::ffff:169.254.169.254",
    "::127.0.0.1",  # IPv4-compatible
    "2002:7f00:1::",  # 6to4 wrapping 127.0.0.1
    "64:ff9b::a00:1",  # NAT64 wrapping 10.0.0.1
    "2001:db8::1",  # documentation
]
ALLOWED = ["93.184.216.34", "8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"]


@pytest.mark.parametrize("address", FORBIDDEN)
def test_forbidden_addresses(address: str) -> None:
    assert forbidden_reason(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ALLOWED)
def test_public_addresses(address: str) -> None:
    assert forbidden_reason(ipaddress.ip_address(address)) is None


def test_mapped_reason_names_the_embedded_address() -> None:
    reason = forbidden_reason(ipaddress.ip_address("::ffff:127.0.0.1"))
    assert reason is not None
    assert "127.0.0.1" in reason and "loopback" in reason


def fixed(answers: dict[str, list[str]]) -> SSRFGuard:
    async def resolver(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError(f"no such host {host}")
        return answers[host]

    return SSRFGuard(resolver=resolver)


async def test_literal_private_address_is_refused_without_dns() -> None:
    guard = fixed({})  # any DNS lookup would raise
    with pytest.raises(MediaForbiddenError, match="loopback") as info:
        await guard.vet("127.0.0.1", 80)
    assert info.value.status == 403
    with pytest.raises(MediaForbiddenError):
        await guard.vet("::1", 80)


async def test_name_resolving_to_private_is_refused_naming_both() -> None:
    guard = fixed({"internal.example": ["10.0.0.7"]})
    with pytest.raises(MediaForbiddenError, match=r"internal\.example \(10\.0\.0\.7\)"):
        await guard.vet("internal.example", 443)


async def test_one_private_address_among_public_ones_refuses_the_host() -> None:
    guard = fixed({"mixed.example": ["93.184.216.34", "127.0.0.1"]})
    with pytest.raises(MediaForbiddenError):
        await guard.vet("mixed.example", 80)


async def test_public_host_is_vetted_with_all_addresses() -> None:
    guard = fixed({"cdn.example": ["93.184.216.34", "2606:4700:4700::1111", "93.184.216.34"]})
    vetted = await guard.vet("cdn.example", 80)
    assert vetted.host == "cdn.example"
    assert [str(a) for a in vetted.addresses] == ["93.184.216.34", "2606:4700:4700::1111"]


async def test_unresolvable_host_is_a_fetch_error() -> None:
    with pytest.raises(MediaFetchError, match="cannot resolve"):
        await fixed({}).vet("nowhere.example", 80)


async def test_allow_private_turns_the_check_off() -> None:
    guard = SSRFGuard(allow_private=True, resolver=fixed({"l": ["127.0.0.1"]}).resolver)
    assert [str(a) for a in (await guard.vet("l", 80)).addresses] == ["127.0.0.1"]


async def test_allowed_networks_exempt_only_themselves() -> None:
    guard = SSRFGuard.from_config(False, ("10.20.0.0/16",))
    assert (await guard.vet("10.20.3.4", 80)).addresses
    with pytest.raises(MediaForbiddenError):
        await guard.vet("10.21.0.1", 80)
    with pytest.raises(MediaForbiddenError):
        await guard.vet("169.254.169.254", 80)


async def test_system_resolver_refuses_localhost() -> None:
    with pytest.raises(MediaForbiddenError):
        await SSRFGuard().vet("localhost", 80)
