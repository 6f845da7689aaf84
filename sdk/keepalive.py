"""The keepalive policy of every gRPC hop, in one place: SDK -> server, Envoy -> replica,
front proxy -> replicas.

A client pings a connection that carries no data every `interval` seconds (so a dead
peer is found during a long unary call or on an idle pooled connection) and drops it
when an ack takes longer than `timeout`. The server accepts pings `interval / 3` apart
or more, whatever the connection carries. grpc-core's defaults would not: it allows
a ping without data once per 5 minutes and none on a connection without calls, and
after two strikes answers GOAWAY `too_many_pings`. Envoy's 30 s pings then broke every
non-streamed generation longer than ~2 minutes, and idle pooled connections, with a 503.

The server's floor is the documented minimum for other clients: with the default
interval, a client may ping every 10 s.
"""

from __future__ import annotations

from dataclasses import dataclass

# Strikes grpc-core allows a client that pings more often than the floor (its default).
MAX_PING_STRIKES = 2


@dataclass(frozen=True)
class Keepalive:
    interval: float = 30.0  # seconds between a client's pings on a connection without data
    timeout: float = 10.0  # seconds a ping may wait for its ack before the connection is dropped

    def __post_init__(self) -> None:
        if not self.interval > 0 or not self.timeout > 0:
            raise ValueError(f"keepalive interval and timeout must be positive, got {self}")

    @property
    def min_ping_interval(self) -> float:
        """The closest two pings may come for the server to accept them: a third of the
        interval, so that no timer skew ever makes a well-behaved client strike out."""
        return self.interval / 3

    def server_options(self) -> list[tuple[str, int]]:
        """grpc-core server arguments that accept this policy's pings."""
        return [
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", _ms(self.min_ping_interval)),
            ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        ]

    def channel_options(self) -> list[tuple[str, int]]:
        """grpc-core channel arguments that ping at this policy's interval."""
        return [
            ("grpc.keepalive_time_ms", _ms(self.interval)),
            ("grpc.keepalive_timeout_ms", _ms(self.timeout)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging a long unary call
        ]

    def envoy_connection_keepalive(self) -> dict[str, str]:
        """Envoy's `http2_protocol_options.connection_keepalive` for an upstream cluster.
        Envoy adds up to 15 % jitter to the interval: its pings only come later."""
        return {"interval": _duration(self.interval), "timeout": _duration(self.timeout)}


DEFAULT_KEEPALIVE = Keepalive()


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _duration(seconds: float) -> str:
    return f"{round(seconds, 3):g}s"
