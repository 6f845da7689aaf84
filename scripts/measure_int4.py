"""`--quantize int4` on a CPU with AVX512-BF16: textgen's int4 kernel (models/int4_avx512.py)
against torch's (`_weight_int4pack_mm_for_cpu`, quantize.Int4Linear), alternating in one
process (not a test).

The embedded SmolLM2-135M loaded twice with `--quantize int4`, once per kernel (the same
torchao integers, scales and zeros); then, medians over the rounds:

1. every int4 layer's product once (the model's 210, each weight read from memory, not
   cache), for M input rows, each kernel called through its op as a compiled graph does;
2. a prefill: the whole model's forward over the first N tokens of the test chapter, the
   last token's logits only (as the engine's prefill chunks); beside them the unquantized
   bfloat16 model's.

    .venv/bin/python scripts/measure_int4.py --rows 1 4 32 --prefill 128 1024
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from textgen.service.models import avx512_bf16, int4_avx512, load_model
from textgen.service.models.int4_avx512 import Int4Avx512Linear
from textgen.service.models.quantize import Int4Linear

CHAPTER = Path(__file__).parent.parent / "tests" / "data" / "pride-and-prejudice-ch1.txt"


def load(ours: bool):
    int4_avx512.ENABLED = ours
    loaded = load_model(None, dtype="bfloat16", device="cpu", quantize="int4")
    kind = Int4Avx512Linear if ours else Int4Linear
    layers = [m for m in loaded.model.modules() if type(m) is kind]
    assert layers, f"no {kind.__name__} layers: is this CPU's kernel available?"
    return loaded, layers


def product(layer, x: torch.Tensor) -> torch.Tensor:
    if type(layer) is Int4Avx512Linear:
        return torch.ops.textgen.int4_linear(
            x, layer.weight_packed, layer.scales, layer.zeros, layer.out_features
        )
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, layer.qdata, layer.group_size, layer.scale_and_zero
    )


def products_ms(layers, rows: int, rounds: int) -> list[float]:
    inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {m.in_features for m in layers}}
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for layer in layers:
            product(layer, inputs[layer.in_features])
        times.append(1000 * (time.perf_counter() - start))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--prefill", type=int, nargs="*", default=[128, 1024])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if not avx512_bf16.cpu_supports():
        raise SystemExit("this CPU lacks AVX512-BF16: int4 layers use torch's kernel only")
    models = {"textgen": load(True), "torch": load(False)}
    dense = load_model(None, dtype="bfloat16", device="cpu")
    ids = models["textgen"][0].tokenizer(CHAPTER.read_text(), return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        for rows in args.rows:
            times = {name: [] for name in models}
            for _ in range(args.rounds):  # alternating, a round each
                for name, (_, layers) in models.items():
                    times[name] += products_ms(layers, rows, 1)
            ours, theirs = (statistics.median(times[n]) for n in ("textgen", "torch"))
            print(
                f"{rows:4d} rows: {len(models['torch'][1])} products {theirs:.2f} ms torch, "
                f"{ours:.2f} ms textgen: x{theirs / ours:.2f}"
            )
        for tokens in args.prefill:
            forwards = {name: loaded.model for name, (loaded, _) in models.items()}
            forwards["bfloat16"] = dense.model
            times = {name: [] for name in forwards}
            for _ in range(3):
                for name, model in forwards.items():
                    start = time.perf_counter()
                    model(ids[:, :tokens], logits_to_keep=1)
                    times[name].append(time.perf_counter() - start)
            ours, theirs, wide = (statistics.median(times[n]) for n in forwards)
            print(
                f"prefill {tokens} tokens: {theirs:.3f} s torch, {ours:.3f} s textgen: "
                f"x{theirs / ours:.2f} (unquantized bfloat16: {wide:.3f} s)"
            )


if __name__ == "__main__":
    main()
