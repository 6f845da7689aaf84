"""int8 weights on a CPU with AVX512-BF16: textgen's int8 kernel (models/int8_avx512.py)
against torch's (`_weight_int8pack_mm`, quantize.Int8Linear) and the bfloat16 weights' own
matmul, alternating in one process (not a test).

Every Linear layer of the embedded SmolLM2-135M (the 211 of them, lm_head included), each
quantized per row as `--quantize int8` and the small steps' int8 copies do (the same
integers and scales for both kernels); then, medians over the rounds, every layer's product
once for M input rows (each weight read from memory, not cache), each kernel called through
its op as a compiled graph does. The bytes read per second at 1 row are printed too.

    .venv/bin/python scripts/measure_int8.py --rows 1 2 4 8 16 32 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from textgen.service.models import avx512_bf16, int8_avx512, load_model
from textgen.service.models.quantize import int8_per_row


def layers_of(model: torch.nn.Module) -> list[dict]:
    layers = []
    for linear in (m for m in model.modules() if isinstance(m, torch.nn.Linear)):
        weight = linear.weight.detach()
        ints, scale = int8_per_row(weight, torch.bfloat16)
        packed, scales = int8_avx512.pack(ints, scale)
        layers.append(
            {"wide": weight, "ints": ints, "scale": scale, "packed": packed, "scales": scales}
        )
    return layers


def products_ms(layers: list[dict], kernel: str, inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer in layers:
        n, k = layer["wide"].shape
        x = inputs[k]
        if kernel == "textgen":
            int8_avx512.product(x, layer["packed"], layer["scales"], n)
        elif kernel == "torch":
            torch.ops.aten._weight_int8pack_mm(x, layer["ints"], layer["scale"])
        else:
            torch.nn.functional.linear(x, layer["wide"])
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if not avx512_bf16.cpu_supports():
        raise SystemExit("this CPU lacks AVX512-BF16: int8 layers use torch's kernel only")
    if not int8_avx512.available():
        raise SystemExit("textgen's int8 kernel did not compile here (see the warning)")
    torch.manual_seed(0)
    layers = layers_of(load_model(None, dtype="bfloat16", device="cpu").model)
    weights = sum(layer["ints"].numel() for layer in layers)
    print(f"{len(layers)} layers, {weights / 1e6:.1f} M weights ({weights / 2**20:.0f} MiB int8)")
    kernels = ("textgen", "torch", "bfloat16")
    with torch.inference_mode():
        for rows in args.rows:
            ks = {layer["wide"].shape[1] for layer in layers}
            inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in ks}
            times = {kernel: [] for kernel in kernels}
            for _ in range(args.rounds):  # alternating, a round each
                for kernel in kernels:
                    times[kernel].append(products_ms(layers, kernel, inputs))
            ours, theirs, wide = (statistics.median(times[k]) for k in kernels)
            rate = f", {weights / ours / 1e6:.1f} GB/s" if rows == 1 else ""
            print(
                f"{rows:4d} rows: textgen {ours:.2f} ms{rate}, torch's int8 {theirs:.2f} ms "
                f"(x{theirs / ours:.2f}), bfloat16 {wide:.2f} ms (x{wide / ours:.2f})"
            )


if __name__ == "__main__":
    main()
