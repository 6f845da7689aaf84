"""textgen's Python SDK (placeholder until the client lands)."""
