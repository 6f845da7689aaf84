"""gRPC face: servicers, error mapping, server assembly (health, reflection)."""
