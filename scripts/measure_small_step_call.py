"""Measure the small steps' eager calls against their earlier forms (not a test): two
PagedCores on the same model, one stream decoding, their steps alternating; step medians and
whether the tokens agree.

`--compare linear`: the small steps' Linear call (small_steps.SmallStepLinear.forward)
against its earlier form, kept below for this comparison, which flattened the input to
[M, K], cast and copied it, and read the copy as module buffers (the current one hands the
input as it comes to textgen's int8 op and reads plain attributes). `--compare norms`:
transformers' RMSNorm forward against `textgen::rms_norm` (fused_norms.py), bfloat16 only.

    .venv/bin/python scripts/measure_small_step_call.py [--compare norms] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from measure_core import load_model
from measure_small_steps import decoding_core
from textgen.service.models.fused_norms import fuse_rms_norms
from textgen.service.models.small_steps import SmallStepLinear, add_small_step_weights


class EarlierSmallStepLinear(SmallStepLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows or x.dtype != self.weight.dtype:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).to(torch.bfloat16).contiguous()
        if self.packed:
            y = torch.ops.textgen.int8_linear(
                flat, self.int8_weight, self.int8_scale, self.out_features
            )
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.int8_weight, self.int8_scale)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--compare", choices=["linear", "norms"], default="linear")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    models = {}
    for name in ("earlier", "current"):
        models[name], _ = load_model(dtype)
        add_small_step_weights(models[name])
    if args.compare == "norms":
        print(f"{fuse_rms_norms(models['current'])} norms fused")
    else:
        for module in models["earlier"].modules():
            if isinstance(module, SmallStepLinear):
                module.__class__ = EarlierSmallStepLinear
    with torch.inference_mode():
        cores = {k: decoding_core(m, 1, args.steps + 50) for k, m in models.items()}
        times = {k: [] for k in cores}
        for _ in range(args.steps):
            for key, (core, _) in cores.items():
                start = time.perf_counter()
                core.step()
                times[key].append(1000 * (time.perf_counter() - start))
    med = {k: statistics.median(v) for k, v in times.items()}
    same = cores["earlier"][1][0].output_ids == cores["current"][1][0].output_ids
    print(
        f"{args.compare}, {args.dtype}, 1 stream, {args.threads} threads: step p50 earlier "
        f"{med['earlier']:.2f} ms, current {med['current']:.2f} ms, earlier / current "
        f"{med['earlier'] / med['current']:.3f}; same tokens: {same}"
    )


if __name__ == "__main__":
    main()
