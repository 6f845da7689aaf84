"""OpenAI's chat/completions face: request parsing and byte-exact response and SSE
rendering, on top of the same validation and engine as TGI's routes."""
