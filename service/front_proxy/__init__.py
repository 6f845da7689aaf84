"""`textgen proxy`: Envoy in front of several replicas."""
