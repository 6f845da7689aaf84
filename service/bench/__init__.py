"""`textgen bench`: the load generator, its loads and what it compares the served engine with."""
