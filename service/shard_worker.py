"""`textgen shard --rank R`: one rank 1..N-1 of a sharded model (shard_processes.py).

It joins the ranks' group, loads its slice of the model, builds the same runner stack as
rank 0 over a KV pool of the size rank 0 decides, and runs whatever steps rank 0 sends
(engine/shards.py, `follow_steps`) until rank 0 says stop or is gone. Exit status 0 after a
stop, 1 when a rank is gone or a step failed.
"""

from __future__ import annotations

import logging

from .app import (
    KV_BLOCK_SIZE,
    cap_cuda_memory,
    compile_settings,
    cuda_graph_settings,
    load_adapters,
    load_options,
    lora_plan,
)
from .config import Settings
from .engine.block_manager import num_blocks_for_tokens
from .engine.kv_pool import KV_CACHE_DTYPES
from .engine.paged_core import build_runner
from .engine.shards import ShardGroup, agree, follow_steps
from .models import load_model
from .models.loader import LoraSetup, ModelShard
from .preflight import device_type
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
        loaded = load_model(
            settings.model_id,
            settings.revision,
            settings.dtype,
            place.device,
            quantize=settings.quantize,
            shard=ModelShard(rank, world_size, groups.model),
            options=load_options(settings),
            lora=LoraSetup(plan.slots, plan.max_rank) if plan else None,
        )
        # the same adapters in the same order as rank 0: the same uids, sliced for this rank
        adapters = load_adapters(settings, loaded, plan) if plan else None
        capacity = agree(0, groups.control)  # rank 0 sizes the pool; every rank the same
        _, max_total = settings.resolved_limits(loaded.max_position_embeddings, capacity)
        runner = build_runner(
            loaded.model,
            num_blocks_for_tokens(capacity, KV_BLOCK_SIZE),
            KV_BLOCK_SIZE,
            cuda_graphs=cuda_graph_settings(settings, loaded, max_total),
            compile=compile_settings(settings, loaded),
            custom_kernels=not settings.disable_custom_kernels,
            lora=loaded.lora,
            adapters=adapters,
            kv_cache_dtype=KV_CACHE_DTYPES.get(settings.kv_cache_dtype),
        )
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
