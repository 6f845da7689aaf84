"""`textgen serve --deterministic` on the embedded model: greedy and seeded requests sent
together (staggered arrivals, mixed prompt lengths, most longer than one prefill chunk, some
contexts longer than one attention key chunk, shared prefixes) give the same tokens as the
same requests sent one at a time. In the default dtype (bfloat16 on a CPU with native bf16;
without the flag 10-19 of these 48 outputs differed there) every request is checked alone;
in float32 every third (16 of them, each truncation kind among them): a lone request costs
a whole 32-row step there, 2.7 s, and on an Intel Xeon with AMX none of the 48 differed
even without the flag."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import pytest
import torch
from support.serve_process import textgen_serve
from support.tiers import server_fixture
from textgen.sdk import Client
from textgen.service.models.loader import select_dtype

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PREFILL_CHUNK = 48  # tokens per step's prefill: the longer prompts take several chunks
NUM_GREEDY = 32
NUM_SEEDED = 16
MAX_NEW_TOKENS = 16
STAGGER_S = 0.04  # between arrivals: requests join while others prefill and decode
# which requests are sent again alone, by the dtype the server runs in
ALONE_EVERY = {torch.bfloat16: 1, torch.float32: 3}
# the default dtype (what `textgen serve` runs) and float32: one server where they are the
# same (a CPU without native bfloat16), where the second would only repeat the first
AUTO = select_dtype("auto", torch.device("cpu"))
DTYPES = ["auto"] if AUTO == torch.float32 else ["auto", "float32"]

TOPICS = ["the sea", "Paris", "a robot", "autumn", "Python", "the moon", "bread", "music"]


def _prompt(i: int) -> str:
    # 1 to 23 repeats: 12 to 145 tokens, up to 4 prefill chunks; prompts on one topic share
    # a prefix (prefix cache hits)
    return ("Tell me about " + TOPICS[i % 8] + ". ") * (1 + (i * 5) % 23) + f"Question {i}: why?"


def _options(i: int) -> dict:
    options = {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "details": True}
    if i >= NUM_GREEDY:  # seeded: a temperature and one truncation or another
        options |= {"do_sample": True, "seed": 1000 + i, "temperature": 0.9}
        options |= [{"top_p": 0.9}, {"top_k": 40}, {}, {"typical_p": 0.95}][i % 4]
    return options


def _generate(target: str, i: int, delay: float = 0.0) -> list[int]:
    time.sleep(delay)
    with Client(target, timeout=300) as client:
        out = client.generate(_prompt(i), **_options(i))
    return [t.id for t in out.details.tokens]


@server_fixture(scope="module", params=DTYPES)
def server(request):
    dtype = request.param
    args = [
        "--no-envoy",
        "--grpc-port",
        "0",
        "--dtype",
        dtype,
        "--max-batch-total-tokens",
        "16384",
        "--max-batch-prefill-tokens",
        str(PREFILL_CHUNK),
        "--deterministic",
    ]
    with textgen_serve(*args) as served:
        if not served.grpc_target:
            pytest.fail("textgen serve did not become ready:\n" + served.log[-3000:])
        served.drain_log()
        yield served.grpc_target, ALONE_EVERY[select_dtype(dtype, torch.device("cpu"))]
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(60)


def test_requests_together_equal_requests_alone(server):
    target, alone_every = server
    with Client(target, timeout=60) as client:
        assert client.info().deterministic
    num = NUM_GREEDY + NUM_SEEDED
    # arrivals interleave greedy and seeded, short and long prompts
    order = sorted(range(num), key=lambda i: (i * 7) % num)
    with cf.ThreadPoolExecutor(num) as pool:
        futures = {i: pool.submit(_generate, target, i, k * STAGGER_S) for k, i in enumerate(order)}
        together = [futures[i].result(timeout=600) for i in range(num)]
    checked = range(0, num, alone_every)
    alone = {i: _generate(target, i) for i in checked}
    differing = [i for i in checked if together[i] != alone[i]]
    assert not differing, f"{len(differing)} of {len(checked)} outputs differ: requests {differing}"
    assert all(len(tokens) == MAX_NEW_TOKENS for tokens in alone.values())
