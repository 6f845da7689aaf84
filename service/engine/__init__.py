"""The generation engine: sequences, scheduling, KV cache, model runner, sampling,
detokenization and stopping, run on a thread of its own (see loop.py)."""
