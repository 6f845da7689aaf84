"""CUDA graphs for decode steps: `GraphedRunner`, a runner strategy around `ModelRunner`.

PagedCore.step() is the one step function; with `--cuda-graphs` its runner is a GraphedRunner
(paged_core.py). `run(inputs)` replays a captured graph when the step is a pure decode
that fits a bucket, and hands every other step to the eager ModelRunner: steps with a prefill
chunk (or a 1-token chunk that doesn't reach the prompt's end), more sequences than the
largest bucket, or a block table longer than `max_blocks`.

How a graph is fed. A decode step of n sequences runs the model on a `[1, B]` batch, B the
smallest bucket >= n. Everything the forward reads lives in one persistent device buffer,
rewritten before each replay by one host-to-device copy from a pinned staging buffer: input
ids, positions, slot mapping, and every row's block table padded to `max_blocks`. The
attention metadata is built once over those tensors (`BatchMetadata.static_decode`); its
derived tensors (the SDPA group's mask, the Triton kernel's int32 tables) are recomputed at
the start of each forward, inside the graph. The step's one device-to-host copy is then the
sampler's (the sampled tokens and their logprobs).

Padding rows (n < B) are 1-token queries at position 0 of the KV pool's scratch block: they
never touch a sequence's cache, and their logits are dropped.

Attention inside a graph is the Triton kernel on CUDA (it walks each row's keys up to its
position: `max_blocks` only sizes the tables). flash-attn is never captured, even where eager
steps use it (blocks a multiple of 256 tokens): its launch takes the longest context as a
host integer. The SDPA path would gather all `max_blocks` of every row each step, so on CUDA
graphs need triton (`unavailable_reason`); on CPU the SDPA path runs the same static buffers
without a graph (`capture=False`), which is how the buffer logic is tested here.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ...models.architectures import MROPE_NO_STRATEGY
from ...models.lora_layers import LoraStep
from ..attention import paged as attention
from ..attention.paged import BatchMetadata
from .model_runner import ModelRunner, StepInputs, StepRunner, decode_bucket

log = logging.getLogger("textgen.engine")

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16  # buckets past the small ones: every 16 sequences (at most 15 padding rows)


def default_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 16 up to max_batch_size, which is always the last bucket."""
    if max_batch_size <= 0:
        raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
    sizes = {b for b in SMALL_BUCKETS if b < max_batch_size}
    sizes.update(range(BUCKET_STEP, max_batch_size, BUCKET_STEP))
    sizes.add(max_batch_size)
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class GraphSettings:
    buckets: tuple[int, ...]  # decode batch sizes with a graph each
    max_blocks: int  # longest block table a graph takes; longer sequences decode eagerly
    # False: the same static buffers run without a graph (any device; how CPU tests run it)
    capture: bool = True
    progress: bool = False  # a tqdm bar over the captures (the server's start-up)

    @classmethod
    def for_engine(
        cls, max_batch_size: int, max_total_tokens: int, block_size: int, **options
    ) -> GraphSettings:
        """Buckets up to the batch size, tables long enough for the longest request."""
        return cls(
            default_buckets(max_batch_size), math.ceil(max_total_tokens / block_size), **options
        )

    def __post_init__(self) -> None:
        if not self.buckets or min(self.buckets) <= 0:
            raise ValueError(f"buckets must be positive batch sizes, got {self.buckets}")
        if self.max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {self.max_blocks}")


def unavailable_reason(device: torch.device, *, capture: bool = True) -> str | None:
    """Why graphs can't run on `device` (None: they can)."""
    if not capture:
        return None
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; the model is on {device.type}"
    if not attention.triton_available(device):
        return (
            "CUDA graphs replay the Triton paged-attention kernel and triton does not import "
            "here (the SDPA fallback would gather every sequence's whole block table each step)"
        )
    return None


@dataclass
class GraphStats:
    graph_steps: int = 0  # decode steps served by a graph (or the static path, capture=False)
    eager_steps: int = 0  # steps handed to the eager runner
    padded_rows: int = 0  # padding rows computed, summed over graph steps


class _DecodeGraph:
    """Static inputs, and their CUDA graph, for decode batches of up to `batch` rows."""

    def __init__(self, runner: ModelRunner, batch: int, max_blocks: int) -> None:
        self.runner = runner
        self.batch = batch
        self.max_blocks = max_blocks
        self.block_size = runner.pool.block_size
        self.scratch_block = runner.pool.scratch_block
        device = runner.device
        # ids | positions | slots | LoRA slots | block tables: one buffer, one host-to-device
        # copy a step
        size = 4 * batch + batch * max_blocks
        self._inputs = torch.zeros(size, dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=pinned)
        self._host_rows = self._host.numpy()  # writes through to the (pinned) tensor
        self._copied = torch.cuda.Event() if pinned else None
        b = batch
        self.ids = self._inputs[:b].view(1, b)
        self.positions = self._inputs[b : 2 * b]
        self.meta = BatchMetadata.static_decode(
            runner.pool,
            slot_mapping=self._inputs[2 * b : 3 * b],
            positions=self.positions,
            block_tables=self._inputs[4 * b :].view(b, max_blocks),
        )
        # each row's LoRA slot (-1: none), read in place by the LoRA kernels
        self.lora = LoraStep((), self._inputs[3 * b : 4 * b]) if runner.lora else None
        self._keep = torch.arange(b, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output, rewritten by each replay
        # padding everywhere: warm-up and capture only write the scratch block
        self._fill(StepInputs.empty())

    def fits(self, inputs: StepInputs) -> bool:
        return len(inputs.query_lens) <= self.batch and all(
            len(t) <= self.max_blocks for t in inputs.block_tables
        )

    def _fill(self, inputs: StepInputs) -> None:
        """Stage the decode rows (padding past them) and copy them to the device."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the staging buffer
        b, n, bs = self.batch, len(inputs.query_lens), self.block_size
        host = self._host_rows
        ids, positions, slots = host[:b], host[b : 2 * b], host[2 * b : 3 * b]
        lora_slots = host[3 * b : 4 * b]
        tables = host[4 * b :].reshape(b, self.max_blocks)
        ids[n:], positions[n:], slots[n:] = 0, 0, self.scratch_block * bs
        tables[n:] = self.scratch_block
        lora_slots[:] = -1
        lora_slots[: len(inputs.lora_slots)] = inputs.lora_slots
        for row, (token, p, table) in enumerate(
            zip(inputs.token_ids, inputs.positions, inputs.block_tables, strict=True)
        ):
            ids[row] = token
            positions[row] = p
            slots[row] = table[p // bs] * bs + p % bs
            # entries past the table keep stale block ids: never read unmasked (the mask and
            # the kernel stop at the row's position)
            tables[row, : len(table)] = table
        self._inputs.copy_(self._host, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()

    def _forward(self) -> torch.Tensor:
        self.meta.refresh_static()  # inside the graph: replays recompute masks and tables
        return self.runner.forward(
            self.ids, self.positions.view(1, -1), self.meta, self._keep, self.lora
        )

    def capture(self, pool) -> None:
        """Warm up on a side stream, then capture one forward into a CUDA graph."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.logits = self._forward()
        self.graph = graph
        torch.cuda.synchronize()

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits `[rows, vocab]` of one decode step of the rows of `inputs` (a view of the
        graph's output: valid until the next run)."""
        if self.runner.lora is not None:
            self.runner.write_adapters(inputs)
        self._fill(inputs)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self._forward()
        return logits[: len(inputs.query_lens)]


class GraphedRunner(StepRunner):
    """The Runner protocol (model_runner.py): pure decode steps from graphs, the rest eagerly."""

    def __init__(self, eager: ModelRunner, settings: GraphSettings) -> None:
        reason = unavailable_reason(eager.device, capture=settings.capture)
        if reason:
            raise ValueError(reason)
        if eager.batch_invariant:
            raise ValueError("CUDA graphs and batch-invariant execution don't combine")
        if eager.rope is not None:
            raise ValueError(MROPE_NO_STRATEGY)
        if eager.pool.scratch_block is None:
            raise ValueError("graph padding rows need a KV pool with a scratch block")
        self.eager = eager
        self.settings = settings
        self.stats = GraphStats()
        self.graphs: dict[int, _DecodeGraph] = {}  # by bucket, built by warmup()
        self._sizes: list[int] = []

    @property
    def pool(self):
        return self.eager.pool

    @property
    def batch_invariant(self) -> bool:
        return False

    def warmup(self) -> None:
        """The eager warm-up (allocates the KV pool), then `build_graphs()`: on the engine's
        thread, at start-up."""
        self.eager.warmup()
        self.build_graphs()

    def build_graphs(self) -> None:
        """The static buffers of every bucket, captured into graphs when `capture`. Writes
        only the pool's scratch block, so it may run beside live sequences (the device
        check does); the KV pool must be allocated already."""
        buckets = sorted(set(self.settings.buckets), reverse=True)
        mempool = torch.cuda.graph_pool_handle() if self.settings.capture else None
        what = "capturing CUDA graphs" if self.settings.capture else "building decode buffers"
        bar = tqdm(buckets, desc=what, unit="graph", disable=not self.settings.progress)
        # largest first, so the smaller graphs reuse its memory pool
        with torch.inference_mode():
            for batch in bar:
                bar.set_postfix(batch=batch)
                graph = _DecodeGraph(self.eager, batch, self.settings.max_blocks)
                if self.settings.capture:
                    graph.capture(mempool)
                self.graphs[batch] = graph
        self._sizes = sorted(self.graphs)
        log.info("decode graphs ready for batch sizes %s", self._sizes)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        graph = self.graph_for(inputs)
        if graph is None:
            self.stats.eager_steps += 1
            return self.eager.run(inputs)
        self.stats.graph_steps += 1
        self.stats.padded_rows += graph.batch - len(inputs.query_lens)
        self.eager.pool.copy_blocks(inputs.block_copies)
        return graph.run(inputs)

    def graph_for(self, inputs: StepInputs) -> _DecodeGraph | None:
        """The bucket's graph when the step is a pure decode that fits one, else None."""
        size = decode_bucket(inputs, self._sizes)
        if size is None:  # not a pure decode, too wide, or no graphs built yet (no sizes)
            return None
        graph = self.graphs[size]
        return graph if graph.fits(inputs) else None
