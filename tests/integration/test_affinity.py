"""Prefix affinity through `textgen proxy` (a real Envoy) over real replicas of the
embedded model: 4 multi-turn chats over 2 replicas find as much of their prompts in the
prefix caches as on 1 replica (the replicas' own textgen_prefix_cache_* counters), keyed
on the prompt's leading bytes or on `prompt_cache_key`; and one hot key stays within the
bounded load."""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import random

import openai
import pytest
from support.replica_processes import Proxy, Replica, free_port
from support.tiers import server_fixture
from textgen.service.processes.envoy import MAX_WORKERS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHATS, TURNS = 4, 4
HASH_BALANCE_FACTOR = 1.25  # envoy/affinity.py's 125 %
ENVOY_WORKERS = min(MAX_WORKERS, os.cpu_count() or 1)  # the proxy's (service/processes/envoy.py)
REPLICA_FLAGS = ("--max-batch-total-tokens", "16384", "--torch-threads", "1")
WORDS = [
    "river", "stone", "lantern", "harbor", "meadow", "copper", "violet", "thunder",
    "orchard", "glacier", "canvas", "compass", "ember", "willow", "falcon", "marble",
    "saffron", "quarry", "beacon", "tundra", "velvet", "cinder", "prairie", "anchor",
    "juniper", "mosaic", "summit", "cobalt", "lagoon", "timber",
]  # fmt: skip


def system_prompt(seed: int) -> str:
    """A distinct ~200-token system prompt."""
    rng = random.Random(seed)
    story = " ".join(rng.choice(WORDS) for _ in range(150))
    return f"You are assistant number {seed}. Keep this story in mind: {story}."


@server_fixture(scope="module")
def replicas(tmp_path_factory):
    """One replica behind its own proxy (the baseline), and two behind another."""
    logs = tmp_path_factory.mktemp("affinity")
    started = [Replica(None, free_port(), logs / f"r{i}.log", *REPLICA_FLAGS) for i in range(3)]
    try:
        for replica in started:
            replica.wait_serving()
        one = Proxy([started[0].port], logs / "one.log")
        two = Proxy([started[1].port, started[2].port], logs / "two.log")
        yield started[:1], one, started[1:], two
        two.stop()
        one.stop()
    finally:
        for replica in started:
            replica.stop()


def cache_counters(replicas: list[Replica]) -> tuple[float, float]:
    hits = sum(r.counter("textgen_prefix_cache_hit_tokens") for r in replicas)
    queried = sum(r.counter("textgen_prefix_cache_queried_tokens") for r in replicas)
    return hits, queried


# Chats of a turn in flight together. Two at most: Envoy's bounded load (hash_balance_factor)
# moves a request off its hashed replica when that one has more than its share of the
# requests in flight, so a burst of eight could spill by arrival order alone (on a loaded
# machine, 0.62 instead of 0.77); the spill itself is test_one_hot_key_stays_within_...
IN_FLIGHT = 2


def run_chats(proxy: Proxy, first_seed: int, with_key: bool) -> None:
    """CHATS conversations of TURNS turns, IN_FLIGHT of a turn's chats at a time."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{proxy.http_port}/v1", api_key="-", timeout=300, max_retries=0
    )
    histories = [
        [{"role": "system", "content": system_prompt(first_seed + i)}] for i in range(CHATS)
    ]

    def turn(i: int, t: int) -> None:
        histories[i].append({"role": "user", "content": f"Question {t}: name a word of it."})
        extra = {"prompt_cache_key": f"chat-{first_seed + i}"} if with_key else {}
        out = client.chat.completions.create(
            model="tgi", messages=histories[i], max_tokens=8, temperature=0, extra_body=extra
        )
        histories[i].append({"role": "assistant", "content": out.choices[0].message.content})

    with cf.ThreadPoolExecutor(IN_FLIGHT) as pool:
        for t in range(TURNS):
            list(pool.map(turn, range(CHATS), [t] * CHATS))


def hit_ratio(proxy: Proxy, replicas: list[Replica], first_seed: int, with_key: bool) -> float:
    hits, queried = cache_counters(replicas)
    run_chats(proxy, first_seed, with_key)
    hits_after, queried_after = cache_counters(replicas)
    return (hits_after - hits) / (queried_after - queried)


@pytest.mark.parametrize("with_key", [False, True], ids=["prompt-prefix", "prompt_cache_key"])
def test_two_replicas_keep_the_prefix_cache_hits_of_one(replicas, with_key):
    baseline, one, pair, two = replicas
    seed = 100 if with_key else 0  # each case its own chats: nothing cached from before
    ratio_one = hit_ratio(one, baseline, seed, with_key)
    ratio_two = hit_ratio(two, pair, seed, with_key)
    print(f"prefix-cache hit ratio: one replica {ratio_one:.3f}, two {ratio_two:.3f}")
    assert ratio_one > 0.5  # turns 2-4 find their history cached
    assert ratio_two >= 0.9 * ratio_one


def test_one_hot_key_stays_within_the_bounded_load(replicas):
    """Every request with the same key, all in flight together: no replica takes more
    than 1.25x the mean. Envoy's two worker threads each pick from the same load counts,
    so two requests arriving at once may both take the last free place: one over."""
    _, _, pair, two = replicas
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{two.http_port}/v1", api_key="-", timeout=300, max_retries=0
    )
    before = [r.counter("tgi_request_count") for r in pair]
    requests = 8

    def ask(i: int) -> str:
        out = client.chat.completions.create(
            model="tgi",
            messages=[{"role": "user", "content": f"Count to fifty, {i}."}],
            max_tokens=96,  # long enough that all eight are in flight together
            temperature=0,
            extra_body={"prompt_cache_key": "everyone", "ignore_eos": True},
        )
        return out.choices[0].finish_reason

    with cf.ThreadPoolExecutor(requests) as pool:
        assert list(pool.map(ask, range(requests))) == ["length"] * requests
    served = [r.counter("tgi_request_count") - b for r, b in zip(pair, before)]
    assert sum(served) == requests, served
    bound = math.ceil(HASH_BALANCE_FACTOR * requests / len(pair)) + ENVOY_WORKERS - 1
    assert max(served) <= bound, served
    assert min(served) >= 1, f"the hot key never overflowed: {served}"
