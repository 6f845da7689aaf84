"""Image URLs are fetched within bounds: public addresses only unless allowed, every
redirect hop checked, a size cap whatever the headers say, one deadline. The server is an
in-process http.server on loopback (allowed explicitly where a fetch should succeed)."""

from __future__ import annotations

import ipaddress
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from textgen.service.intake.image_urls import (
    FetchLimits,
    ImageFetchError,
    fetch_image,
    is_public,
    parse_allow_private,
)

pytestmark = pytest.mark.timeout(60)

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8  # 2,056 bytes; the bytes are not checked
LOOPBACK = (ipaddress.ip_network("127.0.0.1/32"),)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # http.server calls it by this name
        port = self.server.server_address[1]
        if self.path == "/image.png":
            self._answer(200, PNG, length=True)
        elif self.path == "/no-length.png":
            self._answer(200, PNG, length=False)
        elif self.path == "/redirect":
            self._redirect("/image.png")
        elif self.path == "/redirect-elsewhere":
            self._redirect(f"http://127.0.0.2:{port}/image.png")
        elif self.path == "/loop":
            self._redirect("/loop")
        elif self.path == "/slow":
            time.sleep(3)
            self._answer(200, PNG, length=True)
        else:
            self._answer(404, b"not here", length=True)

    def _answer(self, status: int, body: bytes, *, length: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        if length:
            self.send_header("Content-Length", str(len(body)))
        else:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def base():
    server = ThreadingHTTPServer(("0.0.0.0", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_allowed_address_is_fetched(base):
    assert fetch_image(f"{base}/image.png", FetchLimits(allow_private=LOOPBACK)) == PNG
    assert fetch_image(f"{base}/image.png", FetchLimits(allow_private=True)) == PNG


def test_loopback_is_refused_unless_allowed(base):
    with pytest.raises(ImageFetchError, match=r"private, loopback or link-local.*127\.0\.0\.1"):
        fetch_image(f"{base}/image.png")


def test_a_redirect_is_followed_and_each_hop_checked(base):
    limits = FetchLimits(allow_private=LOOPBACK)
    assert fetch_image(f"{base}/redirect", limits) == PNG
    with pytest.raises(ImageFetchError, match=r"127\.0\.0\.2"):
        fetch_image(f"{base}/redirect-elsewhere", limits)
    with pytest.raises(ImageFetchError, match="more than 3 redirects"):
        fetch_image(f"{base}/loop", limits)


def test_the_size_is_capped_with_or_without_a_length(base):
    limits = FetchLimits(allow_private=True, max_bytes=1000)
    with pytest.raises(ImageFetchError, match="2056 bytes, over the 1000 limit"):
        fetch_image(f"{base}/image.png", limits)
    with pytest.raises(ImageFetchError, match="over the 1000-byte limit"):
        fetch_image(f"{base}/no-length.png", limits)
    assert fetch_image(f"{base}/no-length.png", FetchLimits(allow_private=True)) == PNG


def test_a_slow_server_meets_the_deadline(base):
    with pytest.raises(ImageFetchError, match=r"/slow: no answer within 0\.5 s"):
        fetch_image(f"{base}/slow", FetchLimits(allow_private=True, timeout_s=0.5))


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("/missing.png", "HTTP 404"),
        ("ftp://example.com/a.png", "only http, https and data: URLs"),
        ("http:///a.png", "names no host"),
        ("http://no.such.host.invalid/a.png", "does not resolve"),
    ],
)
def test_failures_name_the_url_and_why(base, url, words):
    url = base + url if url.startswith("/") else url
    with pytest.raises(ImageFetchError) as error:
        fetch_image(url, FetchLimits(allow_private=True))
    assert str(error.value).startswith(url) and words in str(error.value)


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2001:4860:4860::8888", True),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("127.0.0.1", False),
        ("169.254.169.254", False),  # the cloud's metadata address
        ("0.0.0.0", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),  # loopback spelled as IPv6
        ("224.0.0.1", False),
    ],
)
def test_what_is_public(address, public):
    assert is_public(ipaddress.ip_address(address)) is public


def test_the_setting_reads_true_false_or_networks():
    assert parse_allow_private("true") is True
    assert parse_allow_private("false") == () == parse_allow_private(None)
    assert parse_allow_private("10.0.0.0/8, fd00::/8") == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("fd00::/8"),
    )
    with pytest.raises(ValueError, match="list of networks"):
        parse_allow_private("intranet")
