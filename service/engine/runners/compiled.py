"""A torch.compile'd decode step on CPU: `CompiledRunner`, a runner strategy around
`ModelRunner` (the CPU counterpart of cuda_graphs.py's GraphedRunner).

PagedCore.step() is the one step function; with `--compile` its runner is a CompiledRunner
(paged_core.py). `run(inputs)` runs a step that keeps every token's logits (decodes, and
decodes verifying proposed tokens, speculation.py), of no more tokens than the largest
bucket, through the compiled model, padded to the smallest bucket that holds it, and hands
every other step (prefill chunks) to the eager ModelRunner. Graph inputs are only the
`[1, T]` token ids and positions, so each bucket compiles once, at warm-up, and steady state
never recompiles. The paged attention stays eager inside the graph as one opaque op
(`textgen::paged_attention`, attention/paged.py), which reads the step's query lengths, block
tables and context lengths from the BatchMetadata bound around the call: one graph of T
tokens serves T decodes as well as one sequence verifying T - 1 proposals, at every context
length. On a step of decodes its CPU kernel (attention/cpu_decode_op.cpp, handed the step's
layout by `in_place_decode_step`) attends each layer with no Python.

Padding rows decode token 0 at position 0 into the pool's scratch block (kv_pool.py), which
no sequence owns; their logits are dropped.

`CompileSettings.cache_dir` is where the warm-up's compiles read and write torch's artifacts
(inductor's cache dir: FX graphs, AOTAutograd entries, kernels) instead of torch's default
under the temp dir, so a new container that mounts the same cache skips the codegen.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ...models.architectures import MROPE_NO_STRATEGY
from ...models.compile_cache import artifacts_in
from ...models.lora_layers import bound_lora
from ..attention.paged import BatchMetadata, bound_metadata, in_place_decode_step
from ..compiling import own_code
from ..speculation import SpeculationSettings
from .model_runner import ModelRunner, StepInputs, StepRunner

log = logging.getLogger("textgen.engine")

# Powers of two: padding wastes at most half a bucket, and 6 compiles cover batches to 32.
DEFAULT_MAX_BUCKET = 32


def decode_buckets(max_tokens: int, max_bucket: int = DEFAULT_MAX_BUCKET) -> tuple[int, ...]:
    """1, 2, 4, ... up to min(max_tokens, max_bucket), that bound itself included."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    top = min(max_tokens, max_bucket)
    buckets = [1 << i for i in range(top.bit_length()) if 1 << i < top]
    return (*buckets, top)


@dataclass(frozen=True)
class CompileSettings:
    buckets: tuple[int, ...]  # decode batch sizes with a compiled graph each
    progress: bool = False  # a tqdm bar over the compiles (the server's start-up)
    cache_dir: Path | None = None  # torch's compile artifacts; None: torch's default (tmp)

    @classmethod
    def for_engine(
        cls, max_batch_size: int, speculation: SpeculationSettings | None = None, **options
    ) -> CompileSettings:
        """Power-of-two buckets up to the most tokens a decode or verification step computes
        (or DEFAULT_MAX_BUCKET): the batch size, or with speculation 1 + N tokens for each
        sequence of a step that speculates, so that (--max-batch-size 1 --speculate 3) one
        stream's verifications have their graph (bucket 4) as well as its decodes."""
        tokens = max_batch_size
        if speculation is not None:
            speculating = min(max_batch_size, speculation.max_batch)
            tokens = max(tokens, (1 + speculation.num_tokens) * speculating)
        return cls(decode_buckets(tokens), **options)

    def __post_init__(self) -> None:
        if not self.buckets or min(self.buckets) <= 0:
            raise ValueError(f"buckets must be positive batch sizes, got {self.buckets}")


@dataclass
class CompileStats:
    compiled_steps: int = 0  # steps run through a compiled graph
    # of those, steps with an entry of several tokens: a sequence verifying proposals (or,
    # rarely, a short prompt chunk whose every row is kept for decoder_input_details)
    compiled_verifications: int = 0
    eager_steps: int = 0  # steps handed to the eager runner
    padded_rows: int = 0  # padding rows computed, summed over compiled steps


class CompiledRunner(StepRunner):
    """The Runner protocol (model_runner.py): decode and verification steps through compiled
    graphs, the rest eagerly."""

    def __init__(self, eager: ModelRunner, settings: CompileSettings) -> None:
        if eager.device.type != "cpu":
            raise ValueError(
                "--compile (the compiled decode step) runs on CPU; on CUDA its counterpart is "
                f"--cuda-graphs: the model is on {eager.device.type}"
            )
        if eager.batch_invariant:
            raise ValueError(
                "--compile with --deterministic is not supported: the compiled decode step "
                "pads batches to its own buckets, outside the batch-invariant layout"
            )
        if eager.rope is not None:
            raise ValueError(MROPE_NO_STRATEGY)
        if eager.pool.scratch_block is None:
            raise ValueError("a compiled decode step needs a KV pool with a scratch block")
        self.eager = eager
        self.settings = settings
        self.buckets = sorted(set(settings.buckets))
        self.stats = CompileStats()
        self.compile_seconds: dict[int, float] = {}  # per bucket, filled by warmup()
        self.cache_hits = 0  # buckets whose compiled code warmup() found in the cache
        # cpp_wrapper: the kernels are called from C++, not from a Python wrapper; and no
        # guards on the model's modules (the engine never changes them after warm-up), only
        # on the inputs: each cuts ~1 ms of a ~25 ms step (docs/performance.md).
        # "max-autotune-no-cudagraphs" measured no faster than the default mode.
        self._compiled = torch.compile(
            # its own code: with no guards on the model (below), another engine's graphs
            # of the same input shapes could otherwise serve this one's model
            own_code(_logits),
            dynamic=False,
            fullgraph=True,
            options={
                "cpp_wrapper": True,
                # no check of every input's shape on each call: ~0.2 ms of a one-stream step
                "size_asserts": False,
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            },
        )
        self._keep = {b: torch.arange(b, device=eager.device) for b in self.buckets}

    @property
    def pool(self):
        return self.eager.pool

    @property
    def batch_invariant(self) -> bool:
        return False

    @torch.inference_mode()
    def warmup(self) -> None:
        """The eager warm-up (allocates the KV pool), then every bucket's compile (a
        padding-only step each), so no request waits for one: on the engine's thread, at
        start-up."""
        self.eager.warmup()
        # one graph per bucket of the same function: dynamo's default limit (8) would
        # otherwise fall back to eager past the eighth bucket, silently
        limit = max(torch._dynamo.config.recompile_limit, len(self.buckets))
        bar = tqdm(
            self.buckets,
            desc="compiling decode step",
            unit="bucket",
            disable=not self.settings.progress,
        )
        hits_before = _cache_hits()
        with (
            torch._dynamo.config.patch(recompile_limit=limit),
            artifacts_in(self.settings.cache_dir),
        ):
            for bucket in bar:
                bar.set_postfix(batch=bucket)
                start = time.perf_counter()
                self._run_padded(StepInputs.empty(), bucket)
                self.compile_seconds[bucket] = time.perf_counter() - start
        self.cache_hits = _cache_hits() - hits_before
        log.info(
            "compiled decode step for batch buckets %s in %.1f s (%d of %d from the compile "
            "cache %s)",
            self.buckets,
            sum(self.compile_seconds.values()),
            self.cache_hits,
            len(self.buckets),
            self.settings.cache_dir or "in the temp dir",
        )

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        bucket = self.bucket_for(inputs)
        if bucket is None:
            self.stats.eager_steps += 1
            return self.eager.run(inputs)
        self.stats.compiled_steps += 1
        self.stats.compiled_verifications += len(inputs.token_ids) > len(inputs.query_lens)
        self.stats.padded_rows += bucket - len(inputs.token_ids)
        self.eager.pool.copy_blocks(inputs.block_copies)
        return self._run_padded(inputs, bucket)

    def bucket_for(self, inputs: StepInputs) -> int | None:
        """The bucket that runs this step, or None when the eager runner must."""
        if not self.compile_seconds:
            return None  # before warmup(), nothing is compiled: a call would compile here
        return token_bucket(inputs, self.buckets)

    def _run_padded(self, inputs: StepInputs, bucket: int) -> torch.Tensor:
        """The entries of `inputs` in the eager layout's order (longest context first: the
        attention may then split them where contexts fall far apart, engine/attention/paged.py's
        `_split_run`), padded to `bucket` tokens with one-token entries."""
        n = len(inputs.token_ids)
        pad = bucket - n
        eager = self.eager
        scratch = eager.pool.scratch_block
        ids = torch.tensor([inputs.token_ids + [0] * pad], dtype=torch.long, device=eager.device)
        positions = torch.tensor(
            [inputs.positions + [0] * pad], dtype=torch.long, device=eager.device
        )
        meta = BatchMetadata.build(
            eager.pool,
            inputs.query_lens + [1] * pad,
            inputs.context_lens + [1] * pad,
            inputs.block_tables + [[scratch]] * pad,
            eager.device,
        )
        # the rows' LoRA adapters, read by the graph's textgen::lora_delta ops (padding
        # rows, past the step's, read none)
        with (
            bound_metadata(meta),
            in_place_decode_step(meta),
            bound_lora(eager.prepare_lora(inputs)),
        ):
            logits = self._compiled(
                eager.model,
                ids,
                positions,
                self._keep[bucket],
            )
        return logits[:n]


def token_bucket(inputs: StepInputs, buckets: list[int]) -> int | None:
    """The smallest of the sorted `buckets` that holds every token of this step when the step
    keeps each token's logits, as decodes and verifications do; None when the eager runner
    must take it (prefill chunks keep at most their last token's; one that keeps every
    token's for its prompt logprobs may carry image features or a span attended both ways,
    which only it merges and masks)."""
    n = len(inputs.token_ids)
    if inputs.images or inputs.key_limits is not None:
        return None
    if not n or len(inputs.keep) != n or inputs.keep[-1] != n - 1:
        return None  # `keep` is ascending and unique: n rows ending at n - 1 are all of them
    return next((b for b in buckets if b >= n), None)


def _cache_hits() -> int:
    """Graphs inductor has loaded from its FX graph cache in this process, so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"]


def _logits(model, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor):
    out = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep)
    return out.logits[0]
