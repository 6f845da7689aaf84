"""A torch.compile'd decode step, one graph per batch bucket (the CPU counterpart of the CUDA
graphs in cuda_graphs.py), plugged into the ModelRunner as its `decode_step`.

A pure-decode step (every sequence adds one token, none asks for prompt logprobs, no more
sequences than the largest bucket) is padded to the smallest bucket that holds it and runs
through the compiled model; anything else returns None and the runner's eager forward runs
it. Graph inputs are only the `[1, B]` token ids and positions, so each bucket compiles once,
at warm-up, and steady state never recompiles. The paged attention stays eager inside the
graph as one opaque op (attention.paged_attention_op), which reads the step's block tables
and context lengths from the BatchMetadata bound around the call: the graph is the same for
every context length.

Padding rows decode token 0 at position 0 into the pool's scratch block (kv_pool.py), which
no sequence owns; their logits are dropped.
"""

from __future__ import annotations

import logging
import time
import types

import torch
from tqdm import tqdm

from .attention import BatchMetadata, bound_metadata
from .runner import ModelRunner, RunnerOutput, _wants_prompt_logprobs
from .scheduler import SchedulerOutput

log = logging.getLogger("textgen.engine")

# Powers of two: padding wastes at most half a bucket, and 6 compiles cover batches to 32.
DEFAULT_MAX_BUCKET = 32


def decode_buckets(max_batch_size: int, max_bucket: int = DEFAULT_MAX_BUCKET) -> list[int]:
    """1, 2, 4, ... up to min(max_batch_size, max_bucket), that bound itself included."""
    top = min(max_batch_size, max_bucket)
    buckets = [1 << i for i in range(top.bit_length()) if 1 << i < top]
    return [*buckets, top]


class CompiledDecode:
    def __init__(self, runner: ModelRunner, buckets: list[int]) -> None:
        if not buckets or min(buckets) <= 0:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        if runner.device.type != "cpu":
            raise ValueError(
                "the compiled decode step runs on CPU; on CUDA its counterpart is the decode "
                f"step's CUDA graphs (cuda_graphs.py), not served yet: got {runner.device}"
            )
        if runner.pool.scratch_block is None:
            raise ValueError("a compiled decode step needs a KV pool with a scratch block")
        self.runner = runner
        self.buckets = sorted(set(buckets))
        self.compile_seconds: dict[int, float] = {}  # per bucket, filled by warm_up()
        self.steps = 0  # decode steps run through a compiled graph
        self.padded_rows = 0  # padding rows computed in those
        # cpp_wrapper: the kernels are called from C++, not from a Python wrapper; and no
        # guards on the model's modules (the engine never changes them after warm-up), only
        # on the inputs: each cuts ~1 ms of a ~25 ms step (docs/performance.md).
        # "max-autotune-no-cudagraphs" measured no faster than the default mode.
        self._compiled = torch.compile(
            _own_copy(_logits),
            dynamic=False,
            fullgraph=True,
            options={
                "cpp_wrapper": True,
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            },
        )
        self._keep = {b: torch.arange(b, device=runner.device) for b in self.buckets}

    def bucket_for(self, batch: SchedulerOutput) -> int | None:
        """The bucket that runs this step, or None when the eager forward must."""
        n = len(batch.scheduled)
        if n > self.buckets[-1] or any(k != 1 for _, k in batch.scheduled):
            return None
        if any(_wants_prompt_logprobs(s) for s, _ in batch.scheduled):
            return None
        return next(b for b in self.buckets if b >= n)

    def run(self, batch: SchedulerOutput) -> RunnerOutput | None:
        """The step's logits through the compiled graph, or None (not a bucketed decode)."""
        bucket = self.bucket_for(batch)
        if bucket is None:
            return None
        seqs = [s for s, _ in batch.scheduled]
        self.steps += 1
        self.padded_rows += bucket - len(seqs)
        return RunnerOutput(seqs, self._run_padded(seqs, bucket))

    def _run_padded(self, seqs: list, bucket: int) -> torch.Tensor:
        pad = bucket - len(seqs)
        positions = [s.num_computed_tokens for s in seqs] + [0] * pad
        ids = [s.token_ids[p] for s, p in zip(seqs, positions, strict=False)] + [0] * pad
        runner = self.runner
        meta = BatchMetadata.build(
            runner.pool,
            [1] * bucket,
            [p + 1 for p in positions],
            [s.block_table for s in seqs] + [[runner.pool.scratch_block]] * pad,
            runner.device,
        )
        with bound_metadata(meta):
            logits = self._compiled(
                runner.model, runner._tensor([ids]), runner._tensor([positions]), self._keep[bucket]
            )
        return logits[: len(seqs)]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every bucket now (a padding-only step each), so no request waits for it."""
        # one graph per bucket of the same function: dynamo's default limit (8) would
        # otherwise fall back to eager past the eighth bucket, silently
        limit = max(torch._dynamo.config.recompile_limit, len(self.buckets))
        with torch._dynamo.config.patch(recompile_limit=limit):
            for bucket in tqdm(self.buckets, desc="Compiling decode step", unit="bucket"):
                start = time.perf_counter()
                self._run_padded([], bucket)
                self.compile_seconds[bucket] = time.perf_counter() - start
        log.info(
            "compiled decode step for batch buckets %s in %.1f s",
            self.buckets,
            sum(self.compile_seconds.values()),
        )


def _logits(model, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor):
    out = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep)
    return out.logits[0]


def _own_copy(fn):
    """fn with a code object of its own. Dynamo keeps compiled graphs per code object, and
    without guards on the model (above) one engine's graphs could otherwise serve another
    model of the same input shapes in this process."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
