"""textgen server: engine, gRPC servicers, CLI."""
