"""The SDK's retry of refused calls, by grpc-core itself (a channel's service config).

A call the server refuses before answering anything (RESOURCE_EXHAUSTED: `overloaded`,
its concurrency limit; UNAVAILABLE: draining, or not reachable) is sent again, `retries`
times at most, after an exponential backoff with jitter (grpc picks a random delay up to
the current backoff). The server says when to come back: its `grpc-retry-pushback-ms`
trailer, from its queue state, replaces the backoff for that attempt. Once the first
response message has arrived nothing is retried (grpc commits the call), so a retry never
repeats tokens. `retries=0` turns it off; a `RetryPolicy` sets every figure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SERVICE = "textgen.v1.TextGenerationService"
# grpc-core caps a retry policy at 5 attempts (4 retries)
MAX_RETRIES = 4


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 2  # attempts after the first
    initial_backoff: float = 0.5  # seconds, before jitter
    max_backoff: float = 10.0
    backoff_multiplier: float = 2.0
    codes: tuple[str, ...] = ("RESOURCE_EXHAUSTED", "UNAVAILABLE")

    def __post_init__(self) -> None:
        if not 0 <= self.retries <= MAX_RETRIES:
            raise ValueError(f"retries must be 0..{MAX_RETRIES} (grpc's cap), got {self.retries}")
        if not (0 < self.initial_backoff <= self.max_backoff and self.backoff_multiplier > 0):
            raise ValueError(f"backoffs must be positive and initial <= max, got {self}")

    def channel_options(self) -> list[tuple[str, object]]:
        """The grpc channel arguments that carry this policy (none when it retries nothing)."""
        if self.retries == 0:
            return [("grpc.enable_retries", 0)]
        config = {
            "methodConfig": [
                {
                    "name": [{"service": SERVICE}],
                    "retryPolicy": {
                        "maxAttempts": self.retries + 1,
                        "initialBackoff": f"{self.initial_backoff}s",
                        "maxBackoff": f"{self.max_backoff}s",
                        "backoffMultiplier": self.backoff_multiplier,
                        "retryableStatusCodes": list(self.codes),
                    },
                }
            ]
        }
        return [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]


DEFAULT_RETRY = RetryPolicy()


def retry_policy(retries: int | RetryPolicy) -> RetryPolicy:
    return retries if isinstance(retries, RetryPolicy) else RetryPolicy(retries=retries)
