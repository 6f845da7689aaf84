"""The validator's limits for unit tests: a 64-token context, TGI's other defaults."""

from textgen.service.intake.validation import Limits

LIMITS = Limits(
    max_input_tokens=63,
    max_total_tokens=64,
    max_best_of=2,
    max_stop_sequences=4,
    max_top_n_tokens=5,
    vocab_size=400,  # the tiny tokenizer's (tests/support/tiny_model.py)
)
