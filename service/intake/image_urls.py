"""An image named by an http(s) URL, fetched by the server within bounds.

A request's URL is the client's, not the operator's: fetching it must not let a client
reach what only the server can (a loopback admin port, the cloud's metadata address
169.254.169.254, the cluster's private services), nor hold a worker for long or fill its
memory. So:

- http and https only; every address the host resolves to must be public (not private,
  loopback, link-local, multicast, reserved or unspecified) unless the operator allows
  it (`allow_private`: all, or a list of networks);
- the connection goes to the address that was checked (no second lookup that a DNS
  rebinding could answer differently); https still verifies the certificate for the host;
- redirects are followed by hand, each hop checked the same way, at most `max_redirects`;
- one deadline bounds the whole fetch (connects, redirects, reading), and the body is read
  in pieces up to `max_bytes` (a larger one is refused, whatever Content-Length says).

Blocking: call it from a worker thread. Every failure is an ImageFetchError whose message
names the URL and what went wrong, for the face's 4xx.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_REDIRECTS = 3
_CHUNK = 64 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)


class ImageFetchError(ValueError):
    """The URL's image could not be fetched; the message names the URL and why."""


@dataclass(frozen=True)
class FetchLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_redirects: int = DEFAULT_MAX_REDIRECTS
    # True: any address; a tuple: these networks besides the public ones
    allow_private: bool | tuple[Network, ...] = field(default=())


def parse_allow_private(text: str | None) -> bool | tuple[Network, ...]:
    """--allow-private-image-urls: "true" (any address), "false"/"" (public only) or a
    comma-separated list of networks (10.0.0.0/8,fd00::/8) or addresses."""
    value = (text or "").strip()
    if value.lower() in ("", "false", "0", "no"):
        return ()
    if value.lower() in ("true", "1", "yes"):
        return True
    try:
        return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in value.split(","))
    except ValueError as exc:
        raise ValueError(f"expected true, false or a list of networks: {exc}") from None


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def fetch_image(url: str, limits: FetchLimits = FetchLimits()) -> bytes:
    """The body behind `url` (following redirects), or ImageFetchError."""
    deadline = time.monotonic() + limits.timeout_s
    current = url
    for _ in range(limits.max_redirects + 1):
        status, location, body = _get(current, limits, deadline)
        if status in _REDIRECTS:
            if not location:
                raise ImageFetchError(f"{url}: a redirect ({status}) without a Location")
            current = urljoin(current, location)
            continue
        if status != 200:
            raise ImageFetchError(f"{url}: the server answered HTTP {status}")
        return body
    raise ImageFetchError(f"{url}: more than {limits.max_redirects} redirects")


def _get(url: str, limits: FetchLimits, deadline: float) -> tuple[int, str | None, bytes]:
    """One GET, no redirect followed: (status, Location, body if 200)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ImageFetchError(f"{url}: only http, https and data: URLs name an image")
    if not parts.hostname:
        raise ImageFetchError(f"{url}: the URL names no host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ImageFetchError(f"{url}: the port is not a number in 0-65535") from None
    address = _allowed_address(url, parts.hostname, port, limits)
    sock = _connect(url, address, port, deadline)
    try:
        if parts.scheme == "https":
            context = ssl.create_default_context()
            sock = context.wrap_socket(sock, server_hostname=parts.hostname)
        conn = http.client.HTTPConnection(parts.hostname, port)
        conn.sock = sock  # the checked address, not a second lookup
        sock.settimeout(_left(url, deadline))
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Accept": "image/*", "User-Agent": "textgen"})
        response = conn.getresponse()
        if response.status != 200:
            return response.status, response.getheader("Location"), b""
        return 200, None, _read_bounded(url, response, limits.max_bytes, sock, deadline)
    except ImageFetchError:
        raise
    except ssl.SSLError as exc:
        raise ImageFetchError(f"{url}: TLS failed ({exc.reason or exc})") from None
    except TimeoutError:
        raise ImageFetchError(f"{url}: no answer within {limits.timeout_s:g} s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise ImageFetchError(f"{url}: the fetch failed ({exc or type(exc).__name__})") from None
    finally:
        sock.close()


def _allowed_address(url: str, host: str, port: int, limits: FetchLimits) -> str:
    """The first address `host` resolves to, once every one of them is allowed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise ImageFetchError(f"{url}: the host {host!r} does not resolve") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    for address in addresses:
        if not _allowed(address, limits.allow_private):
            raise ImageFetchError(
                f"{url}: {host} is a private, loopback or link-local address ({address}), "
                "which the server does not fetch (--allow-private-image-urls)"
            )
    return str(addresses[0])


def _allowed(address, allow: bool | tuple[Network, ...]) -> bool:
    if allow is True or is_public(address):
        return True
    return any(address in network for network in allow or ())


def _connect(url: str, address: str, port: int, deadline: float) -> socket.socket:
    try:
        return socket.create_connection((address, port), timeout=_left(url, deadline))
    except TimeoutError:
        raise ImageFetchError(f"{url}: the connection timed out") from None
    except OSError as exc:
        raise ImageFetchError(f"{url}: the connection failed ({exc.strerror or exc})") from None


def _left(url: str, deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ImageFetchError(f"{url}: the fetch ran past its time limit")
    return left


def _read_bounded(
    url: str, response: http.client.HTTPResponse, max_bytes: int, sock, deadline: float
) -> bytes:
    length = response.getheader("Content-Length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise ImageFetchError(f"{url}: the image is {length} bytes, over the {max_bytes} limit")
    body = bytearray()
    while True:
        sock.settimeout(_left(url, deadline))
        piece = response.read1(_CHUNK) if hasattr(response, "read1") else response.read(_CHUNK)
        if not piece:
            return bytes(body)
        body += piece
        if len(body) > max_bytes:
            raise ImageFetchError(f"{url}: the image is over the {max_bytes}-byte limit")
