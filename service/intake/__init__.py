"""The request path before the engine: the one request type, validation, grammar
compilation, admission."""
