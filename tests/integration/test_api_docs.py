"""The API's documents, served by Envoy itself (envoy/docs.py), through a real Envoy:
the OpenAPI description at TGI's /api-doc/openapi.json (and /openapi.json) is valid
OpenAPI 3.1 and is envoy/openapi.json byte for byte; /docs is a Swagger UI page whose
script and stylesheet are the swagger-ui-py package's files, nothing from a CDN."""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

import pytest
import requests
from openapi_spec_validator import validate
from textgen.envoy import config
from textgen.envoy.docs import ASSETS, installed_swagger_ui

pytestmark = pytest.mark.timeout(60)

OPENAPI = Path(str(importlib.resources.files("textgen.envoy") / "openapi.json"))
REPO_OPENAPI = Path(__file__).resolve().parents[2] / "envoy" / "openapi.json"


def get(http_server, path: str) -> requests.Response:
    return requests.get(f"{http_server.http_url}{path}", timeout=30, allow_redirects=False)


@pytest.mark.parametrize("path", ["/api-doc/openapi.json", "/openapi.json"])
def test_openapi_document_is_served_valid_and_the_generated_file(http_server, path):
    resp = get(http_server, path)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.content == REPO_OPENAPI.read_bytes() == OPENAPI.read_bytes()
    validate(resp.json())  # openapi-spec-validator: raises on an invalid description
    assert resp.json()["openapi"] == "3.1.0"
    assert get(http_server, path.replace(".json", ".yaml")).status_code == 404
    wrong = requests.post(f"{http_server.http_url}{path}", timeout=30)
    assert wrong.status_code == 404


def test_docs_is_swagger_ui_from_the_package(http_server):
    swagger_ui = installed_swagger_ui()
    assert swagger_ui is not None, "swagger-ui-py (textgen[server]) is not installed"
    redirect = get(http_server, "/docs")
    assert redirect.status_code == 301 and redirect.headers["location"].endswith("/docs/")
    page = get(http_server, "/docs/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "SwaggerUIBundle" in page.text and "../api-doc/openapi.json" in page.text
    # every asset is relative (served here), none from a CDN
    urls = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert urls and all(not u.startswith(("http:", "https:", "//")) for u in urls)
    for name, media_type in ASSETS.items():
        asset = get(http_server, f"/docs/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"] == media_type
        assert asset.content == (swagger_ui.folder / name).read_bytes()
    assert "swagger-ui-bundle.js" in urls and "swagger-ui.css" in urls


def test_without_the_package_only_the_document_is_served():
    """A config rendered for another machine (the Kubernetes ConfigMap) has no /docs."""
    bootstrap = config.render([config.Upstream("127.0.0.1", 1)], front=True)
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    routes = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    paths = {
        r["match"].get("path") or r["match"].get("safe_regex", {}).get("regex", "") for r in routes
    }
    assert any("openapi" in p for p in paths)
    assert not any(p.startswith("/docs") for p in paths)
