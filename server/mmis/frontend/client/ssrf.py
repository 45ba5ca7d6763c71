"""SSRF guard: decide which addresses a user-supplied media URL may reach.

Invariants:
- A host is vetted by resolving it to *all* its addresses; if any one of them is forbidden the
  whole host is refused (an attacker controls which address a client would pick).
- Forbidden: every address that is not globally routable — private, loopback, link-local,
  multicast, reserved, unspecified, shared (CGNAT), site-local — and IPv6 forms that embed
  such an IPv4 address (IPv4-mapped ``::ffff:a.b.c.d``, IPv4-compatible ``::a.b.c.d``,
  6to4 ``2002::/16``, NAT64 ``64:ff9b::/96``, Teredo ``2001::/32``).
- ``allow_private=True`` turns the address check off (tests fetching from a local server,
  labs); schemes and everything else are still enforced by the fetcher. ``allowed_networks``
  exempts only the listed networks (an internal media server) and keeps vetting the rest.
- The caller connects to the vetted addresses themselves (:class:`VettedHost`), never to the
  name again, so a DNS answer that changes between check and connect (rebinding) cannot
  redirect the connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
from collections.abc import Awaitable, Callable

from mmis.frontend.errors import MediaFetchError, MediaForbiddenError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


async def system_resolver(host: str, port: int) -> list[str]:
    """All addresses the system resolver returns for ``host`` (TCP)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]  # the client address
    if ip in _NAT64 or (ip in _IPV4_COMPATIBLE and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def forbidden_reason(ip: IPAddress) -> str | None:
    """Why ``ip`` must not be reached from a user-supplied URL, or ``None`` if it may."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_ipv4(ip)
        if inner is not None:
            reason = forbidden_reason(inner)
            if reason is not None:
                return f"an IPv6 address embedding {inner}, which is {reason}"
    checks = (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("private", ip.is_private),
        ("reserved", ip.is_reserved),
        ("site-local", isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local),
        ("not globally routable", not ip.is_global),
    )
    for name, hit in checks:
        if hit:
            return f"a {name} address"
    return None


@dataclasses.dataclass(frozen=True)
class VettedHost:
    """A host name and the addresses it resolved to, all of them allowed."""

    host: str
    addresses: tuple[IPAddress, ...]


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclasses.dataclass(frozen=True)
class SSRFGuard:
    allow_private: bool = False
    allowed_networks: tuple[Network, ...] = ()
    resolver: Resolver = system_resolver

    @classmethod
    def from_config(cls, allow_private: bool, allowed_networks: tuple[str, ...] = ()) -> SSRFGuard:
        networks = tuple(ipaddress.ip_network(n, strict=False) for n in allowed_networks)
        return cls(allow_private=allow_private, allowed_networks=networks)

    def check_address(self, ip: IPAddress, host: str) -> None:
        if self.allow_private or any(ip in net for net in self.allowed_networks):
            return
        reason = forbidden_reason(ip)
        if reason is not None:
            shown = host if host == str(ip) else f"{host} ({ip})"
            raise MediaForbiddenError(
                f"refusing to fetch media from {shown}: it is {reason}; "
                "only publicly routable addresses are allowed"
            )

    async def vet(self, host: str, port: int) -> VettedHost:
        """Resolve ``host`` and check every address; raise unless all are allowed."""
        literal = _parse_ip(host)
        if literal is not None:
            addresses: list[IPAddress] = [literal]
        else:
            try:
                raw = await self.resolver(host, port)
            except (OSError, UnicodeError) as exc:
                raise MediaFetchError(f"cannot resolve media host {host!r}: {exc}") from exc
            addresses = []
            for text in raw:
                ip = _parse_ip(text)
                if ip is None:
                    raise MediaFetchError(f"resolver returned a non-address {text!r} for {host!r}")
                if ip not in addresses:
                    addresses.append(ip)
        if not addresses:
            raise MediaFetchError(f"media host {host!r} has no address")
        for ip in addresses:
            self.check_address(ip, host)
        return VettedHost(host=host, addresses=tuple(addresses))


def _parse_ip(text: str) -> IPAddress | None:
    candidate = text.strip("[]").split("%", 1)[0]  # drop brackets and an IPv6 zone id
    try:
        return ipaddress.ip_address(candidate)
    except ValueError:
        return None
