"""`textgen shard --rank R`: one rank 1..N-1 of a sharded model (shard_processes.py).

It joins the ranks' group, loads its slice of the model, builds the same runner stack as
rank 0 over a KV pool of the size rank 0 decides, and runs whatever steps rank 0 sends
(engine/runners/sharded.py, `follow_steps`) until rank 0 says stop or is gone. Exit status 0 after a
stop, 1 when a rank is gone or a step failed.
"""

from __future__ import annotations

import logging

from ..engine.paged_core import build_runner
from ..engine.runners.sharded import ShardGroup, agree, follow_steps
from ..models.loader import ModelShard
from ..settings.preflight import device_type
from ..settings.table import Settings
from .assembly import cap_cuda_memory, engine_config, load_adapters, load_served, lora_plan
from .shard_processes import join, leave, pin, placement

log = logging.getLogger("textgen.shards")


def run_shard(settings: Settings, rank: int, world_size: int, local_rank: int = 0) -> int:
    """Rank `rank` of `world_size`, the `local_rank`-th of this host's (its GPU, its cores)."""
    kind = device_type(settings)
    place = placement(settings, local_rank, world_size, kind)
    pin(place)
    groups = join(rank, world_size, settings.master_addr, settings.master_port, kind)
    try:
        cap_cuda_memory(settings, str(place.device))
        plan = lora_plan(settings)
        loaded = load_served(
            settings, place.device, ModelShard(rank, world_size, groups.model), plan
        )
        # the same adapters in the same order as rank 0: the same uids, sliced for this rank
        adapters = load_adapters(settings, loaded, plan) if plan else None
        capacity = agree(0, groups.control)  # rank 0 sizes the pool; every rank the same
        _, max_total = settings.resolved_limits(loaded.max_position_embeddings, capacity)
        config = engine_config(settings, loaded, capacity, max_total)  # rank 0's, as it built
        runner = build_runner(loaded.model, config, loaded.lora, adapters)
        group = ShardGroup(
            rank,
            world_size,
            groups.control,
            groups.model,
            loaded.vocab.vocab_size,
            loaded.vocab.chunk,
            loaded.device,
        )
        log.info(
            "shard %d of %d ready on %s (KV cache %s)",
            rank,
            world_size,
            loaded.device,
            str(runner.pool.dtype or loaded.dtype).removeprefix("torch."),
        )
        follow_steps(runner, group)
    except Exception:
        log.exception("shard %d failed", rank)
        return 1
    finally:
        leave()
    log.info("shard %d stopped", rank)
    return 0
