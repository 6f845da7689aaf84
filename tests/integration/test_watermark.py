"""`watermark: true` through a real server behind a real Envoy (TGI's /generate): transformers'
`WatermarkDetector`, given the server's gamma and delta and the model's config, flags the
200-token outputs of watermarked requests (z-score above its threshold) and not those of the
same requests unwatermarked; a server started with other --watermark-gamma/--watermark-delta
writes what a detector of those values flags. TGI's client sends `watermark` as it is."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
import torch
from support.http_client import PROMPT, Http
from support.servers import ServerThread, tiny_settings
from transformers import AutoConfig, WatermarkDetector, WatermarkingConfig

pytestmark = pytest.mark.timeout(120)

Z_THRESHOLD = 3.0  # WatermarkDetector's default
TOKENS = 200
SEEDS = (1, 2, 3)


def generated_ids(url: str, seed: int, watermark: bool) -> list[int]:
    status, _, body = Http(url).call(
        "POST",
        "/generate",
        {
            "inputs": PROMPT,
            "parameters": {
                "max_new_tokens": TOKENS,
                "do_sample": True,
                "seed": seed,
                "ignore_eos": True,  # 200 tokens whatever the tiny random model says
                "details": True,
                "watermark": watermark,
            },
        },
    )
    assert status == 200, body
    tokens = json.loads(body)["details"]["tokens"]
    assert len(tokens) == TOKENS
    return [t["id"] for t in tokens]


def detector(model_dir, gamma: float, delta: float) -> WatermarkDetector:
    config = WatermarkingConfig(greenlist_ratio=gamma, bias=delta)
    return WatermarkDetector(AutoConfig.from_pretrained(model_dir), "cpu", config)


def z_scores(detect: WatermarkDetector, outputs: list[list[int]]) -> list[float]:
    result = detect(torch.tensor(outputs), z_threshold=Z_THRESHOLD, return_dict=True)
    return [float(z) for z in result.z_score]


def test_the_detector_flags_watermarked_outputs_only(http_server, tiny_model_dir):
    detect = detector(tiny_model_dir, 0.5, 2.0)  # TGI's defaults, the server's
    marked = [generated_ids(http_server.http_url, seed, True) for seed in SEEDS]
    plain = [generated_ids(http_server.http_url, seed, False) for seed in SEEDS]
    assert marked != plain
    marked_z, plain_z = z_scores(detect, marked), z_scores(detect, plain)
    print(f"z-scores watermarked {marked_z}, not {plain_z}")
    assert all(z > Z_THRESHOLD for z in marked_z), marked_z
    assert all(z < Z_THRESHOLD for z in plain_z), plain_z


@pytest.mark.server
def test_the_servers_gamma_and_delta_are_the_detectors(tiny_model_dir):
    server = ServerThread(
        tiny_settings(tiny_model_dir, watermark_gamma=0.25, watermark_delta=3.0), http=True
    ).start()
    try:
        marked = [generated_ids(server.http_url, seed, True) for seed in SEEDS]
    finally:
        server.stop()
    result = detector(tiny_model_dir, 0.25, 3.0)(torch.tensor(marked), return_dict=True)
    print(f"gamma 0.25, delta 3: z-scores {result.z_score}, green {result.green_fraction}")
    assert all(result.prediction), result.z_score
    # a quarter of the vocabulary holds ~87 % of the tokens at delta 3 (e^3 / (e^3 + 3)); had
    # the server drawn half of it green (whose first half is this quarter), ~48 %
    assert all(result.green_fraction > 0.75), result.green_fraction


def test_tgis_client_sends_watermark(http_server):
    client = huggingface_hub.InferenceClient(base_url=http_server.http_url)
    out = client.text_generation(
        PROMPT, max_new_tokens=16, do_sample=True, seed=5, watermark=True, details=True
    )
    plain = client.text_generation(PROMPT, max_new_tokens=16, do_sample=True, seed=5, details=True)
    assert [t.id for t in out.details.tokens] != [t.id for t in plain.details.tokens]
