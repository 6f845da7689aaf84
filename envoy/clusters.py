"""The upstream cluster of gRPC replicas: one replica's, or the front proxy's with its retries."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from textgen.sdk.keepalive import Keepalive

from .affinity import replica_filters, use_consistent_hashing
from .limits import MAX_CONNECTIONS

CLUSTER = "textgen_grpc"

# Upstream concurrency bounds of the front proxy (Envoy's circuit breakers). Envoy's
# defaults (1024 requests, 3 concurrent retries) would answer 503 (overflow) or skip
# retries long before a few replicas are full: the replicas' own admission
# (--max-concurrent-requests -> 429 overloaded) is the real limit.
MAX_UPSTREAM_CONNECTIONS = 1024
MAX_UPSTREAM_REQUESTS = MAX_CONNECTIONS
MAX_PENDING_REQUESTS = 1024


@dataclass(frozen=True)
class Upstream:
    """One gRPC endpoint: an IP literal, or a DNS name whose every address is a
    replica (e.g. a Kubernetes headless service)."""

    host: str
    port: int

    @property
    def is_ip(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True


def socket_address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


# cluster ----------------------------------------------------------------------------


def replica_cluster(
    upstreams: Sequence[Upstream],
    keepalive: Keepalive,
    health_check: dict | None = None,
    name: str = CLUSTER,
) -> dict:
    ips = all(u.is_ip for u in upstreams)
    cluster = {
        "name": name,
        # IP literals need no resolver; a DNS name stands for all its addresses.
        "type": "STATIC" if ips else "STRICT_DNS",
        "lb_policy": "LEAST_REQUEST",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams."
                "http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        # finds a dead replica on a connection without data (a long
                        # unary generate, an idle pooled connection); the replica
                        # accepts these pings (textgen.sdk.keepalive)
                        "connection_keepalive": keepalive.envoy_connection_keepalive()
                    }
                },
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": socket_address(u.host, u.port)}} for u in upstreams
                    ]
                }
            ],
        },
        # grpc.health.v1 on the server: NOT_SERVING (draining) takes a replica out.
        "health_checks": [
            health_check
            or {
                # Tolerant of a replica whose event loop is busy for a few seconds (a
                # huge prompt): with one replica an ejection means 503s for everyone.
                "timeout": "5s",
                "interval": "2s",
                # Envoy checks idle clusters only every 60 s unless told otherwise.
                "no_traffic_interval": "2s",
                "unhealthy_threshold": 3,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": ""},
            }
        ],
        # Without this, a cluster whose hosts all fail health checks still routes to
        # them ("panic mode"); we'd rather answer 503 at once.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
    }
    if not ips:
        # A Kubernetes headless service (or compose service) name: one host per
        # address, re-resolved every few seconds. A replica that leaves DNS (pod
        # deleted) stays until it fails its health check, so its streams finish.
        cluster["dns_refresh_rate"] = "5s"
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    return cluster


# front proxy: several replicas --------------------------------------------------------

# Health checks of the front proxy (grpc.health.v1, service ""), every second. A
# draining replica answers NOT_SERVING, an explicit failure that Envoy acts on at
# once (threshold or not): out of the rotation at the next check, within 1 s. A dead
# one (kill -9: its port refuses) is a network failure, which counts against
# HEALTH_UNHEALTHY_THRESHOLD: out after two checks, 1-2 s (measured 1.6-1.9 s in
# tests/integration/test_replicas.py). A replica merely busy must miss two whole
# HEALTH_CHECK_TIMEOUTs in a row to be dropped. What Envoy sends a dead or draining
# replica before then fails with connect-failure or UNAVAILABLE and is retried.
HEALTH_CHECK_INTERVAL = "1s"
HEALTH_CHECK_TIMEOUT = "2s"
HEALTH_UNHEALTHY_THRESHOLD = 2
# A replica that comes back (restarted, or SERVING again) takes two passes (~2 s);
# a host Envoy has just learnt of (start, DNS) needs only one.
HEALTH_HEALTHY_THRESHOLD = 2

# Retried (onto another replica) only while no byte of the response has gone out.
RETRY_ON = (
    "connect-failure",  # the replica's port refuses: dead, not yet out of the rotation
    "refused-stream",  # h2 REFUSED_STREAM / GOAWAY: a replica closing its connections
    "reset",  # the connection died before the response began (killed mid-prefill)
    "resource-exhausted",  # gRPC 8 = TGI's 429 `overloaded`: that replica is full
    "unavailable",  # gRPC 14: a draining replica refusing new work
)
# At most four attempts per request; previous_hosts keeps a retry off the replicas
# already tried. TRAP: the predicate only makes the balancer draw again, up to
# HOST_SELECTION_ATTEMPTS more times, after which Envoy takes its last draw, tried or
# not. And least-request favours the replica that just failed: a dead one has no
# stream left (0 active: it wins every power-of-two draw it is in, 3 in 4 with two
# replicas); a full one may look no busier than the rest (its load needn't come
# through this Envoy: 1 in 2). With 5 attempts, 0.75**6 = 18 % of the retries off a
# dead replica went back to it, and 0.18**2 = 3 % of the requests first sent there
# failed after all three tries (off a full one, 0.5**6 = 1.6 % went back and were
# refused again). With 100: 0.75**101 < 1e-12 per retry (three replicas, two tried:
# (8/9)**101 < 1e-5). A draw costs well under a microsecond; only retries repeat it.
# TRAP 2: the prefix-affinity ring's bounded load (affinity.py) undoes all that for
# a dead replica. Its 0 active requests lower the mean, so a live replica with a
# few streams counts as overloaded, and every draw that lands on it overflows to
# the least loaded host: the dead one, on every attempt, until outlier detection
# (two connection failures or resets) has ejected it and Envoy's main thread has
# told the worker threads. That takes microseconds on a quiet machine, but 15 ms
# and more on two busy cores: with 5 ms back-offs all three attempts of a request
# sent right after a kill -9 could fail within that window (1 run in 16 of
# tests/integration/test_replicas.py's kill scenario, measured). So the retries
# span that window instead of racing it: Envoy's default back-off (25 ms base; the
# nth retry waits uniformly [0, 25 * 2**(n-1)) ms, capped at 250 ms) and three of
# them, 87 ms on average. All three fall within 15 ms with odds of 0.5 %. A
# refused request (429, draining) waits 12 ms on average before its retry.
NUM_RETRIES = 3
HOST_SELECTION_ATTEMPTS = 100
RETRY_BACK_OFF = {"base_interval": "0.025s", "max_interval": "0.25s"}
# A metadata call (info, tokenize, health) stuck this long on one replica is tried on
# another; generation routes have none (see retry_policy).
QUICK_PER_TRY_TIMEOUT = "5s"
# Concurrent retries allowed, as a share of the requests in flight (at least
# MIN_RETRY_CONCURRENCY): when every replica is full, retries must not multiply the load.
RETRY_BUDGET_PERCENT = 25.0
MIN_RETRY_CONCURRENCY = 16


def retry_policy(generation: bool) -> dict:
    """Resend a request that a replica refused, or could not take, to another one.

    TRAPS, measured on Envoy 1.40 (tests/integration/test_replicas.py):
    - Envoy retries only until the response starts: once response headers are sent
      downstream, a failure is the client's. A replica that refuses (overloaded,
      draining) must answer trailers-only, before any initial metadata: the servicer
      aborts before it yields or sends metadata. A stream is never retried after
      its first frame.
    - The router sees the upstream gRPC answer *before* the transcoder turns it into
      HTTP: for a transcoded HTTP/1.1 request as for native gRPC, the refusal is an
      HTTP 200 whose grpc-status header says 8 or 14. So the gRPC conditions
      (`resource-exhausted`, `unavailable`) retry both faces, and
      `retriable-status-codes: [429, 503]` retries neither: the 429 only exists
      after the transcoder and the Lua filter, downstream of the router.
    - A request is resent from the router's copy of its body, which it keeps only up
      to the listener's per_connection_buffer_limit_bytes (16 MiB): past that the
      retry is silently abandoned (`retry_or_shadow_abandoned`). Every body we accept
      fits: 2 MB of JSON (buffer filter) or 4 MiB of gRPC (the server's limit).
    - `per_try_timeout` runs until the response *starts* (Envoy ignores it after).
      A unary Generate's response starts when the whole generation is done, and a
      stream's first token may wait in a long queue: a per-try timeout there would
      cut healthy work and run it again elsewhere. Generation routes have none.
    - Envoy's default circuit breaker allows only 3 concurrent retries for the whole
      cluster, so a burst of 429s would mostly reach clients: the retry budget in
      front_cluster replaces it.
    """
    policy: dict = {
        "retry_on": ",".join(RETRY_ON),
        "num_retries": NUM_RETRIES,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host."
                    "previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": HOST_SELECTION_ATTEMPTS,
        "retry_back_off": RETRY_BACK_OFF,
    }
    if not generation:
        policy["per_try_timeout"] = QUICK_PER_TRY_TIMEOUT
    return policy


# A replica that closes a connection (GOAWAY: it restarts, or drops a connection it
# finds abusive) refuses the streams it never started; a request caught that way, or
# by a connection that closed before the request went out, is sent again on a fresh
# connection instead of reaching the client as a 503. Nothing of it ran: safe to resend.
RESEND_ON = "refused-stream,reset-before-request"
RESEND_RETRIES = 2


def resend_policy() -> dict:
    """The one replica's Envoy: resend only what the replica never started."""
    return {"retry_on": RESEND_ON, "num_retries": RESEND_RETRIES}


def front_cluster(upstreams: Sequence[Upstream], keepalive: Keepalive, name: str = CLUSTER) -> dict:
    """The front proxy's cluster of replicas; `name`: one pool's (pools.cluster_name)."""
    cluster = replica_cluster(
        upstreams,
        keepalive,
        name=name,
        health_check={
            "timeout": HEALTH_CHECK_TIMEOUT,
            "interval": HEALTH_CHECK_INTERVAL,
            "no_traffic_interval": HEALTH_CHECK_INTERVAL,
            "unhealthy_threshold": HEALTH_UNHEALTHY_THRESHOLD,
            "healthy_threshold": HEALTH_HEALTHY_THRESHOLD,
            "grpc_health_check": {"service_name": ""},
        },
    )
    cluster["circuit_breakers"] = {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": MAX_UPSTREAM_CONNECTIONS,
                "max_pending_requests": MAX_PENDING_REQUESTS,
                "max_requests": MAX_UPSTREAM_REQUESTS,
                # replaces max_retries, whose default (3 for the whole cluster)
                # would let most of a burst of 429s through to clients
                "retry_budget": {
                    "budget_percent": {"value": RETRY_BUDGET_PERCENT},
                    "min_retry_concurrency": MIN_RETRY_CONCURRENCY,
                },
                "track_remaining": True,  # circuit_breakers.default.remaining_* in /stats
            }
        ]
    }
    # TRAP: Envoy hands health changes (a health-check transition, an outlier
    # ejection) to its worker threads at most once per update_merge_window, 1 s by
    # default: a change less than 1 s after the previous one is held back up to 1 s,
    # while admin's /clusters (the main thread's view) already shows it. A replica
    # shown healthy got no request for that long (16 streams all went to the other
    # one), and a dead or ejected one kept being picked. Merging is meant for clusters
    # of thousands of hosts; a few replicas need every change at once.
    cluster["common_lb_config"]["update_merge_window"] = "0s"
    cluster["outlier_detection"] = _outlier_detection()
    use_consistent_hashing(cluster)  # prefix affinity: affinity.py
    # each replica learns the address it is reached at (stored responses' ids: affinity.py)
    protocol = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    protocol["http_filters"] = replica_filters()
    return cluster


def _outlier_detection() -> dict:
    """Eject a replica that keeps failing requests while its health checks pass.

    Envoy counts a gRPC answer by the HTTP status of its grpc-status: UNAVAILABLE
    503 and DEADLINE_EXCEEDED 504 are gateway errors, INTERNAL 500 a 5xx,
    RESOURCE_EXHAUSTED 429 neither: a full replica is not ejected (retries handle
    it; ejecting it would only shrink the cluster under load).
    """
    return {
        # Connection failures and resets (local origin) count apart from the
        # replica's answers: two in a row and the replica is gone for now.
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 2,
        "enforcing_consecutive_local_origin_failure": 100,
        # 503/504 in a row: a draining replica (UNAVAILABLE) leaves before its health
        # check says so. Five, because clients' own deadlines end as 504 too.
        "consecutive_gateway_failure": 5,
        "enforcing_consecutive_gateway_failure": 100,
        # Any 5xx in a row (INTERNAL: a broken device, say).
        "consecutive_5xx": 10,
        "enforcing_consecutive_5xx": 100,
        # Success-rate ejection needs 5+ hosts with 100+ requests each: off.
        "enforcing_success_rate": 0,
        "enforcing_local_origin_success_rate": 0,
        "interval": "5s",  # ejections are lifted at these sweeps
        "base_ejection_time": "10s",
        "max_ejection_time": "120s",
        # At least one host is always ejectable; never more than half the cluster.
        "max_ejection_percent": 50,
        # TRAP: by default a passing health check lifts an ejection at once, and the
        # replicas this is for pass theirs.
        "successful_active_health_check_uneject_host": False,
    }
