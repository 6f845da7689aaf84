"""Optional CUDA-graph replay of pure-decode steps for a PagedCore.

Not wired into the server: `scripts/device_check.py` uses it to time decode steps with and
without graphs and to check that graph replay gives the same greedy tokens as the eager
engine. It plugs into the core's runner as its `decode_step` (runner.py), the hook the CPU's
compiled decode step (compiled_decode.py) uses too.

How it works. A decode-only step of n sequences runs the model on a `[1, B]` batch, B the
smallest captured bucket >= n. Everything the forward reads lives in static tensors that are
rewritten before each replay:

- input ids and positions `[1, B]`, the slot mapping `[B]`, the logits rows to keep `[B]`;
- one decode `AttentionGroup` (attention.py) whose block index is `[B * max_blocks]`, every
  sequence's block table padded to `max_blocks` with a scratch block, and whose query
  positions are `[B, 1]`. The group's additive mask is built from those positions *inside*
  the graph (its cache is emptied before capture), so replays recompute it.

Padding rows (n < B) are queries at position 0 whose K/V go to, and are read from, a block
reserved for them at construction: they never touch a real sequence's cache, and their
logits are dropped. The keys a real row gathers beyond its context (padding blocks) are
masked by the causal test `key_pos <= query_pos`, as in the eager path.

Steps with any prefill chunk, more sequences than the largest bucket, a block table longer
than `max_blocks`, or a request asking for prompt logprobs run eagerly through the core's own
runner. `capture=False` runs the same static-buffer forward without a graph: that is how the
buffer logic is checked on a machine without CUDA.

Only the SDPA attention path is captured: with `flash_attn` installed the eager engine would
use flash-attn and the comparison would be between two kernels, so construction refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import attention
from .attention import AttentionGroup, BatchMetadata
from .paged_core import PagedCore
from .runner import RunnerOutput, _wants_prompt_logprobs
from .scheduler import SchedulerOutput
from .sequence import Sequence
from .types import EngineRequest, SamplingParams, StoppingParams


@dataclass
class GraphStats:
    graph_steps: int = 0  # decode steps served by a graph (or the static path, capture=False)
    eager_steps: int = 0  # steps run by the core's runner
    padded_rows: int = 0  # padding rows computed, summed over graph steps


class _DecodeGraph:
    """Static buffers, and their CUDA graph, for decode batches of up to `batch` rows."""

    def __init__(self, core: PagedCore, batch: int, max_blocks: int, scratch_block: int) -> None:
        runner = core.runner
        self.runner = runner
        self.batch = batch
        self.max_blocks = max_blocks
        self.block_size = runner.pool.block_size
        self.scratch_block = scratch_block
        device = runner.device
        long = {"dtype": torch.long, "device": device}
        self.ids = torch.zeros(1, batch, **long)
        self.positions = torch.zeros(1, batch, **long)
        self.slots = torch.zeros(batch, **long)
        self.keep = torch.arange(batch, **long)
        self.block_index = torch.zeros(batch * max_blocks, **long)
        self.query_pos = torch.zeros(batch, 1, **long)
        self.group = AttentionGroup(
            token_start=0,
            token_end=batch,
            num_seqs=batch,
            max_query_len=1,
            max_blocks=max_blocks,
            block_size=self.block_size,
            block_index=self.block_index,
            query_pos=self.query_pos,
            is_real_query=torch.ones(batch, 1, dtype=torch.bool, device=device),
            query_index=None,
            output_index=None,
        )
        self.meta = BatchMetadata(
            pool=runner.pool,
            slot_mapping=self.slots,
            query_lens=[1] * batch,
            context_lens=[1] * batch,  # unused: the groups are prebuilt
            block_tables=[[scratch_block]] * batch,  # unused likewise
            device=device,
            use_flash=False,
            _groups=[self.group],
        )
        pin = device.type == "cuda"
        # host staging: ids, positions, slots, query positions, then the block index
        self._host = torch.zeros(4 * batch + batch * max_blocks, dtype=torch.long, pin_memory=pin)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self._fill([])  # padding everywhere: a warm-up or capture only writes the scratch block

    def fits(self, seqs: list[Sequence]) -> bool:
        return len(seqs) <= self.batch and all(len(s.block_table) <= self.max_blocks for s in seqs)

    def _fill(self, seqs: list[Sequence]) -> None:
        b, nb, bs = self.batch, self.max_blocks, self.block_size
        ids, pos, slots, qpos = [0] * b, [0] * b, [self.scratch_block * bs] * b, [0] * b
        blocks = [self.scratch_block] * (b * nb)
        for row, seq in enumerate(seqs):
            p = seq.num_computed_tokens  # the one new token's position
            table = seq.block_table
            ids[row] = seq.token_ids[p]
            pos[row] = qpos[row] = p
            slots[row] = table[p // bs] * bs + p % bs
            blocks[row * nb : row * nb + len(table)] = table
        host = self._host
        host[: 4 * b] = torch.tensor(ids + pos + slots + qpos, dtype=torch.long)
        host[4 * b :] = torch.tensor(blocks, dtype=torch.long)
        non_blocking = host.is_pinned()
        self.ids.view(-1).copy_(host[:b], non_blocking=non_blocking)
        self.positions.view(-1).copy_(host[b : 2 * b], non_blocking=non_blocking)
        self.slots.copy_(host[2 * b : 3 * b], non_blocking=non_blocking)
        self.query_pos.view(-1).copy_(host[3 * b : 4 * b], non_blocking=non_blocking)
        self.block_index.copy_(host[4 * b :], non_blocking=non_blocking)

    def _forward(self) -> torch.Tensor:
        return self.runner._forward(self.ids, self.positions, self.meta, self.keep)

    def capture(self, pool=None) -> None:
        """Warm up on a side stream, then capture one forward into a CUDA graph."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.group._masks.clear()
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # an empty mask cache: the mask is then computed inside the graph from query_pos
        self.group._masks.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.logits = self._forward()
        self.graph = graph
        torch.cuda.synchronize()

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits `[len(seqs), vocab]` of one decode step of `seqs`."""
        # The host staging buffer is reused each step: wait until the previous copies from it
        # are done (they are, in practice: the sampler's .tolist() synchronized the stream).
        if self._host.is_pinned():
            torch.cuda.current_stream().synchronize()
        self._fill(seqs)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            self.group._masks.clear()  # positions changed: rebuild the mask
            logits = self._forward()
        return logits[: len(seqs)]


class DecodeGraphs:
    """Decode steps of `core` through captured graphs; everything else through the core.

    From construction to close() it is the core's runner's `decode_step` (runner.py), like
    compiled_decode.py's compiled graphs: `core.step()` (or `step()`) then replays a graph
    for the steps it takes.
    """

    def __init__(
        self,
        core: PagedCore,
        buckets: list[int],
        max_blocks: int,
        *,
        capture: bool | None = None,
    ) -> None:
        device = core.runner.device
        if capture is None:
            capture = device.type == "cuda"
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if attention._flash_available(device):
            raise NotImplementedError(
                "graph capture covers the SDPA attention path only; flash_attn is installed, "
                "so the eager engine would use another kernel"
            )
        if not buckets or min(buckets) <= 0:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        if core.runner.decode_step is not None:
            raise ValueError("the core's runner already has a decode step")
        self.core = core
        self.capture = capture
        self.stats = GraphStats()
        self._scratch = _reserve_block(core)
        scratch_block = self._scratch.block_table[0]
        self.graphs: dict[int, _DecodeGraph] = {}
        mempool = torch.cuda.graph_pool_handle() if capture else None
        # largest first, so the smaller graphs reuse its memory pool
        with torch.inference_mode():
            for batch in sorted(set(buckets), reverse=True):
                graph = _DecodeGraph(core, batch, max_blocks, scratch_block)
                if capture:
                    graph.capture(mempool)
                self.graphs[batch] = graph
        self._sizes = sorted(self.graphs)
        core.runner.decode_step = self

    def close(self) -> None:
        """Give the scratch block back, drop the graphs and leave the runner eager."""
        if self.core.runner.decode_step is self:
            self.core.runner.decode_step = None
        if self._scratch is not None:
            self.core.block_manager.free(self._scratch)
            self._scratch = None
        self.graphs.clear()

    def graph_for(self, batch: SchedulerOutput) -> _DecodeGraph | None:
        if any(n != 1 for _, n in batch.scheduled):
            return None
        seqs = [s for s, _ in batch.scheduled]
        if any(_wants_prompt_logprobs(s) for s in seqs):
            return None
        for size in self._sizes:
            if size >= len(seqs):
                graph = self.graphs[size]
                return graph if graph.fits(seqs) else None
        return None

    # the runner's DecodeStep ----------------------------------------------------------

    def run(self, batch: SchedulerOutput) -> RunnerOutput | None:
        graph = self.graph_for(batch)
        if graph is None:
            self.stats.eager_steps += 1
            return None
        seqs = [s for s, _ in batch.scheduled]
        self.stats.graph_steps += 1
        self.stats.padded_rows += graph.batch - len(seqs)
        return RunnerOutput(seqs, graph.run(seqs))

    def warm_up(self) -> None:
        """Nothing: the graphs were captured at construction."""

    def step(self):
        return self.core.step()


def _reserve_block(core: PagedCore) -> Sequence:
    """Hold one KV block for the padding rows (a placeholder sequence owns it)."""
    request = EngineRequest(
        request_id="__cuda_graph_padding__",
        prompt_ids=(0,),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=1),
    )
    seq = Sequence(request, frozenset())
    bm = core.block_manager
    if bm.num_free_blocks < 1:
        raise RuntimeError("no free KV block to reserve for graph padding")
    bm.allocate(seq)
    bm.append_slots(seq, 1)
    return seq
