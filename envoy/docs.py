"""The API's documents, served by Envoy itself (direct responses: no replica involved).

- GET /api-doc/openapi.json (TGI's path) and GET /openapi.json: envoy/openapi.json,
  inline in the bootstrap, so a config rendered elsewhere (the Kubernetes ConfigMap)
  carries it.
- GET /docs/ (/docs redirects there, so the page's relative URLs also work behind a
  path prefix): a Swagger UI page over that document. Its script and stylesheet come
  from the `swagger-ui-py` package (swagger_ui/static: Swagger UI 5, which reads OpenAPI
  3.1; `swagger-ui-bundle` ships Swagger UI 4, which refuses 3.1), read by Envoy from the
  installed package when it starts: nothing is fetched from a CDN. Where the package
  is not installed beside the renderer, or the config is rendered for another machine
  (the Kubernetes front runs the stock Envoy image: no such files there), /docs is not
  served; the JSON is.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

OPENAPI = Path(__file__).with_name("openapi.json")
OPENAPI_PATHS = ("/api-doc/openapi.json", "/openapi.json")
DOCS = "/docs/"
# Route config's max_direct_response_body_size_bytes (Envoy's default is 4 KiB): the
# largest body served, Swagger UI's script (1.5 MB), fits with room to grow.
DIRECT_RESPONSE_LIMIT = 4 * 2**20
# Swagger UI's files /docs/ serves, with their media types.
ASSETS = {
    "swagger-ui-bundle.js": "application/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>textgen API</title>
<link rel="stylesheet" href="swagger-ui.css">
<link rel="icon" type="image/png" href="favicon-32x32.png" sizes="32x32">
</head>
<body>
<div id="swagger-ui"></div>
<script src="swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({url: "../api-doc/openapi.json", dom_id: "#swagger-ui"});
</script>
</body>
</html>
"""


@dataclass(frozen=True)
class SwaggerUI:
    """The folder of Swagger UI's distribution files."""

    folder: Path


def installed_swagger_ui() -> SwaggerUI | None:
    """swagger-ui-py's static files, when the package is installed (not imported: only
    its files are read, by Envoy)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    if not all((folder / name).is_file() for name in ASSETS):
        return None
    return SwaggerUI(folder)


def doc_routes(swagger_ui: SwaggerUI | None) -> list[dict]:
    """GET routes of the OpenAPI document, and of /docs when `swagger_ui` is given."""
    # one route for both paths: the document (134 kB) is in the bootstrap once
    either = "|".join(re.escape(path) for path in OPENAPI_PATHS)
    routes = [
        direct_get(
            {"safe_regex": {"regex": f"({either})"}}, "application/json", OPENAPI.read_text()
        )
    ]
    if swagger_ui is None:
        return routes
    routes.append(
        {
            "match": {"path": DOCS.rstrip("/"), **_GET},
            "redirect": {"path_redirect": DOCS},
        }
    )
    routes.append(direct_get({"path": DOCS}, "text/html; charset=utf-8", PAGE))
    for name, media_type in ASSETS.items():
        path = swagger_ui.folder / name
        if path.stat().st_size > DIRECT_RESPONSE_LIMIT:
            raise ValueError(f"{path} is larger than {DIRECT_RESPONSE_LIMIT} bytes")
        routes.append(direct_get({"path": DOCS + name}, media_type, path))
    return routes


_GET = {"headers": [{"name": ":method", "string_match": {"exact": "GET"}}]}


def direct_get(match: dict, media_type: str, body: str | Path) -> dict:
    """A GET answered by Envoy: `body` inline (a str) or read from a file (a Path)."""
    source = {"filename": str(body)} if isinstance(body, Path) else {"inline_string": body}
    return {
        "match": {**match, **_GET},
        "direct_response": {"status": 200, "body": source},
        "response_headers_to_add": [
            {
                "header": {"key": "content-type", "value": media_type},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ],
    }
