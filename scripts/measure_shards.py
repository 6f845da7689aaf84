"""The cost of a sharded decode step, per variant, on this machine (docs/performance.md,
"Shards").

N ranks (torch.multiprocessing, gloo) each load their slice of the model and time decode
steps of the paged runner at the given batch sizes (contexts of --context tokens):
- `library`: the layers as transformers' tensor-parallel loader leaves them (DTensor
  parameters, made local around each Linear call; lm_head's slices all-gathered);
- `plain`: what textgen serves (models/sharding.py: plain tensors, one all-reduce per
  row-parallel layer, the logits' slices gathered to rank 0);
- `plain, no collectives`: the same step with every all-reduce skipped (wrong numbers, the
  same compute): `plain` minus this is the collectives' cost per step.
With --num-shard 1 it times the unsharded model as served, for the ratio.

    python scripts/measure_shards.py --num-shard 3 --batch 1 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=None, help="default: the embedded model")
    parser.add_argument("--num-shard", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=0, help="per rank (0: cores / ranks)")
    args = parser.parse_args()
    port = _free_port()
    if args.num_shard == 1:
        _rank(0, args, port)
        return
    mp.start_processes(_rank, args=(args, port), nprocs=args.num_shard, start_method="spawn")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, args, port: int) -> None:
    from textgen.service.processes.cpus import available_cpus

    world = args.num_shard
    threads = args.threads or max(1, available_cpus() // world)
    torch.set_num_threads(threads)
    if world > 1:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]} if threads == 1 else set(cpus))
        dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for variant in ("library", "plain", "plain, no collectives") if world > 1 else ("one",):
        model, gather = _load(args, rank, world, variant)
        for batch in args.batch:
            rows.append((variant, batch, _time_steps(model, gather, batch, args)))
        del model
    if rank == 0:
        print(f"{world} shard(s), {args.dtype}, {threads} thread(s) each, context {args.context}")
        for variant, batch, (median, low, high) in rows:
            print(f"  {variant:24s} batch {batch:3d}: {median:7.1f} ms ({low:.1f}-{high:.1f})")
    if world > 1:
        dist.destroy_process_group()


def _load(args, rank: int, world: int, variant: str):
    from textgen.service.models import load_model, resolve_model, select_dtype, sharding
    from textgen.service.models.loader import ModelShard
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if variant == "one":
        return load_model(args.model_id, dtype=args.dtype, device="cpu").model, None
    if variant == "library":
        model = AutoModelForCausalLM.from_pretrained(
            resolve_model(args.model_id).path,
            dtype=select_dtype(args.dtype, torch.device("cpu")),
            distributed_config=DistributedConfig(tp_size=world),
        )
        return model.eval(), None  # its lm_head all-gathers the logits on every rank
    loaded = load_model(
        args.model_id,
        dtype=args.dtype,
        device="cpu",
        shard=ModelShard(rank, world, dist.group.WORLD),
    )
    if variant == "plain, no collectives":
        sharding.all_reduce = lambda x: x  # the hooks look it up at each call
    else:
        sharding.all_reduce = torch.ops.textgen.all_reduce
    vocab = loaded.vocab

    def gather(logits: torch.Tensor) -> None:
        local = torch.nn.functional.pad(logits, (0, vocab.chunk - logits.shape[-1]))
        parts = [torch.empty_like(local) for _ in range(world)] if rank == 0 else None
        if variant != "plain, no collectives":
            dist.gather(local.contiguous(), parts, dst=0)

    return loaded.model, gather


@torch.inference_mode()
def _time_steps(model, gather, batch: int, args) -> tuple[float, float, float]:
    from textgen.service.engine.kv_pool import KVCachePool
    from textgen.service.engine.runners.model_runner import ModelRunner, StepInputs

    per_seq = -(-(args.context + args.steps + 2) // BLOCK)
    runner = ModelRunner(model, KVCachePool(batch * per_seq, BLOCK, scratch_blocks=1))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    context = args.context
    prefill = StepInputs(
        [7] * (batch * context),
        list(range(context)) * batch,
        [context] * batch,
        [context] * batch,
        tables,
        [(i + 1) * context - 1 for i in range(batch)],
    )
    _run(runner, gather, prefill)
    times = []
    for step in range(args.steps):
        position = context + step
        decode = StepInputs(
            [11] * batch,
            [position] * batch,
            [1] * batch,
            [position + 1] * batch,
            tables,
            list(range(batch)),
        )
        if dist.is_initialized():
            dist.barrier()
        started = time.perf_counter()
        _run(runner, gather, decode)
        times.append(1000 * (time.perf_counter() - started))
    times = times[2:]
    return statistics.median(times), min(times), max(times)


def _run(runner, gather, inputs) -> None:
    logits = runner.run(inputs)
    if gather is not None:
        gather(logits)


if __name__ == "__main__":
    main()
