"""The prefill cost of one image (not a test): a tiny LLaVA (tests/support/tiny_vlm.py,
unless --model-id names a LLaVA folder) through the engine core, one request at a time:
the vision tower + projector for one image (ImageEncoder.features, its cache cleared)
against the prefill of the same prompt's tokens (the step that computes them, the image's
features merged from the cache), and a text-only prompt of as many tokens. Times are the
median of --runs runs, after one warm-up.

    .venv/bin/python scripts/measure_image_prefill.py [--model-id DIR] [--runs 20]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", help="a LLaVA folder (default: a tiny random one)")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    from PIL import Image
    from support.tiny_vlm import build_tiny_llava, png
    from textgen.service.engine.config import EngineConfig
    from textgen.service.engine.paged_core import PagedCore
    from textgen.service.engine.sequence import Sequence
    from textgen.service.engine.types import EngineRequest, SamplingParams, StoppingParams
    from textgen.service.intake.images import ImagePrompts, decode_image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = Path(args.model_id or build_tiny_llava(Path(tempfile.mkdtemp()) / "llava"))
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    config = EngineConfig(
        max_batch_total_tokens=8192,
        max_batch_prefill_tokens=4096,
        max_batch_size=8,
        enable_prefix_caching=False,
    )
    core = PagedCore(model, config)
    encoder = core.runner.images
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    out = io.BytesIO()
    Image.new("RGB", (640, 480), (200, 30, 30)).save(out, format="PNG")
    part = decode_image(out.getvalue() if args.model_id else png((200, 30, 30)), "image")
    ids, images = ImagePrompts(processor).tokenize(prompt, (part,), "inputs")

    def prefill(prompt_ids, images) -> float:
        request = EngineRequest(
            request_id="m",
            prompt_ids=tuple(prompt_ids),
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=1, ignore_eos=True),
            images=images,
        )
        core.add(Sequence(request, frozenset()))
        started = time.perf_counter()
        while core.has_work():
            core.step()
        return time.perf_counter() - started

    def encode() -> float:
        encoder.cache.clear()
        started = time.perf_counter()
        with torch.inference_mode():
            encoder.features(images[0])
        return time.perf_counter() - started

    # as many tokens, no image: each placeholder replaced by the prompt's first token
    text_ids = [ids[0] if t == processor.image_token_id else t for t in ids]
    results = {}
    for name, run in (
        ("encoder (one image)", encode),
        ("prefill with the image (features cached)", lambda: prefill(ids, images)),
        ("prefill of a text prompt as long", lambda: prefill(text_ids, ())),
    ):
        run()  # warm-up
        results[name] = statistics.median(run() for _ in range(args.runs)) * 1000
    print(f"{folder.name}: {len(ids)} prompt tokens, {images[0].num_tokens} of them the image's")
    for name, ms in results.items():
        print(f"  {name:<42} {ms:8.2f} ms (median of {args.runs})")


if __name__ == "__main__":
    main()
