"""Fetch an image over http(s) under limits, with the SSRF guard on every hop.

Invariants:
- Only ``http`` and ``https``; a redirect to any other scheme is refused.
- Redirects are followed by hand, at most ``media_max_redirects``; every hop's host is
  resolved and vetted by :class:`~mmis.frontend.client.ssrf.SSRFGuard` before connecting.
- The connection goes to a *vetted address*, not to the name: the request URL carries the IP,
  the ``Host`` header the original name, and for https the ``sni_hostname`` extension makes TLS
  use (and verify the certificate against) the original name. DNS rebinding between the check
  and the connect therefore cannot reach another address.
- Connections are never reused (no keep-alive pool): a pooled TLS connection to an IP would
  otherwise be reused for a different host name without verifying its certificate.
- No proxies from the environment (``trust_env=False``): a proxy would resolve the name itself.
- At most ``media_max_bytes`` are read: a larger ``Content-Length`` is refused before the body,
  and the streamed body stops one chunk past the limit. ``Accept-Encoding: identity`` keeps
  compressed bodies from expanding behind the limit's back.
- Timeouts: connect and read per socket operation, plus one wall-clock budget for the whole
  fetch (all hops) so a server trickling bytes cannot hold a request forever.
"""

from __future__ import annotations

import asyncio
import dataclasses

import httpx

from mmis.frontend.client.ssrf import SSRFGuard, VettedHost
from mmis.frontend.config import FrontendConfig
from mmis.frontend.errors import (
    InvalidMediaError,
    MediaFetchError,
    MediaForbiddenError,
    MediaTooLargeError,
)

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclasses.dataclass(frozen=True)
class FetchedMedia:
    data: bytes
    content_type: str | None
    url: str  # the final URL, after redirects


class MediaFetcher:
    """Fetches media URLs; owns an ``httpx.AsyncClient`` unless one is passed in."""

    def __init__(
        self,
        config: FrontendConfig,
        *,
        guard: SSRFGuard | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.config = config
        self.guard = guard or SSRFGuard.from_config(
            config.allow_private_media_urls, config.allowed_media_networks
        )
        self._owns_client = client is None
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=config.media_connect_timeout_s,
                read=config.media_read_timeout_s,
                write=config.media_read_timeout_s,
                pool=config.media_connect_timeout_s,
            ),
            limits=httpx.Limits(max_keepalive_connections=0),
            follow_redirects=False,
            trust_env=False,
        )

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    async def fetch(self, url: str, *, param: str | None = None) -> FetchedMedia:
        try:
            async with asyncio.timeout(self.config.media_fetch_timeout_s):
                return await self._follow(url, param)
        except TimeoutError as exc:
            raise MediaFetchError(
                f"fetching image {url!r} took longer than "
                f"{self.config.media_fetch_timeout_s} s (media_fetch_timeout_s)",
                param=param,
            ) from exc

    async def _follow(self, url: str, param: str | None) -> FetchedMedia:
        current = _parse(url, param)
        for _hop in range(self.config.media_max_redirects + 1):
            host = current.raw_host.decode("ascii")  # IDNA-encoded, IPv6 without brackets
            port = current.port or _DEFAULT_PORTS[current.scheme]
            vetted = await self.guard.vet(host, port)
            response = await self._connect(current, vetted, param)
            try:
                if response.status_code in _REDIRECTS:
                    location = response.headers.get("location")
                    if not location:
                        raise MediaFetchError(
                            f"image URL {str(current)!r} redirected without a Location",
                            param=param,
                        )
                    current = _parse(str(current.join(location)), param)
                    continue
                if response.status_code != 200:
                    raise MediaFetchError(
                        f"fetching image {str(current)!r} returned HTTP {response.status_code}",
                        param=param,
                    )
                data = await self._read_body(response, str(current), param)
                return FetchedMedia(data, response.headers.get("content-type"), str(current))
            finally:
                await response.aclose()
        raise MediaFetchError(
            f"image URL {url!r} redirected more than {self.config.media_max_redirects} times "
            "(media_max_redirects)",
            param=param,
        )

    async def _connect(
        self, url: httpx.URL, vetted: VettedHost, param: str | None
    ) -> httpx.Response:
        """Send the request to the first vetted address that accepts a connection."""
        host_header = url.netloc.decode("ascii")
        errors: list[str] = []
        for ip in vetted.addresses:
            request = self.client.build_request(
                "GET",
                url.copy_with(host=str(ip)),
                headers={
                    "Host": host_header,
                    "Accept": "image/*",
                    "Accept-Encoding": "identity",
                    "User-Agent": "mmis-media-fetcher",
                },
                extensions={"sni_hostname": vetted.host} if url.scheme == "https" else {},
            )
            try:
                return await self.client.send(request, stream=True, follow_redirects=False)
            except httpx.ConnectError as exc:
                errors.append(f"{ip}: {exc}")
            except httpx.TimeoutException as exc:
                raise MediaFetchError(
                    f"fetching image {str(url)!r} timed out ({type(exc).__name__})", param=param
                ) from exc
            except httpx.HTTPError as exc:
                raise MediaFetchError(
                    f"fetching image {str(url)!r} failed: {exc}", param=param
                ) from exc
        raise MediaFetchError(
            f"cannot connect to image host {vetted.host!r}: {'; '.join(errors)}", param=param
        )

    async def _read_body(self, response: httpx.Response, url: str, param: str | None) -> bytes:
        limit = self.config.media_max_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(url, limit, param)
        chunks: list[bytes] = []
        total = 0
        try:
            async for chunk in response.aiter_raw():
                total += len(chunk)
                if total > limit:
                    raise _too_large(url, limit, param)
                chunks.append(chunk)
        except httpx.TimeoutException as exc:
            raise MediaFetchError(f"reading image {url!r} timed out", param=param) from exc
        except httpx.HTTPError as exc:
            raise MediaFetchError(f"reading image {url!r} failed: {exc}", param=param) from exc
        return b"".join(chunks)


def _parse(url: str, param: str | None) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise InvalidMediaError(f"invalid image URL {url!r}: {exc}", param=param) from exc
    if parsed.scheme not in _DEFAULT_PORTS:
        raise MediaForbiddenError(
            f"image URL {url!r}: scheme {parsed.scheme!r} is not allowed for remote fetches "
            "(only http and https, also after redirects)",
            param=param,
        )
    if not parsed.host:
        raise InvalidMediaError(f"image URL {url!r} has no host", param=param)
    return parsed


def _too_large(url: str, limit: int, param: str | None) -> MediaTooLargeError:
    return MediaTooLargeError(
        f"image at {url!r} is larger than the limit of {limit} bytes (media_max_bytes)",
        param=param,
    )
