"""Size and connection bounds shared by the listener, the routes and the clusters."""

from __future__ import annotations

# TGI's --payload-limit default: larger JSON bodies are refused with 413.
REQUEST_BODY_LIMIT = 2_000_000
# A unary answer is buffered whole to transcode it (and the Lua filter buffers the
# non-streamed `POST /` answer to wrap it in [ ]). The server sends at most 4 MiB of
# protobuf; its JSON (details, top_tokens) can be a few times larger.
RESPONSE_BODY_LIMIT = 16 * 1024 * 1024
# Per-stream buffer: must hold the largest body a filter buffers (see above).
STREAM_BUFFER_LIMIT = RESPONSE_BODY_LIMIT

# Open client connections; each holds at most one stream's buffers at a time.
MAX_CONNECTIONS = 10_000
