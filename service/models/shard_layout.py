"""How a model's attention splits over shards, from its config.json alone (no torch: the
settings' checks read it before anything loads; sharding.py applies it)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ModelError


class ShardingError(ModelError):
    """The model can't be split over the asked number of shards."""


@dataclass(frozen=True)
class ShardLayout:
    """How the attention of a model splits over `world_size` ranks."""

    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def kv_replicated(self) -> bool:
        """Fewer KV heads than ranks: every rank keeps the one its query heads read."""
        return self.num_kv_heads < self.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        return 1 if self.kv_replicated else self.num_kv_heads // self.world_size

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world_size

    def kv_heads_of(self, rank: int) -> range:
        """The KV heads rank `rank` keeps: its share, or (replicated) the one its query
        heads read."""
        if self.kv_replicated:
            head = self.kv_head_of(rank)
            return range(head, head + 1)
        return range(rank * self.kv_heads_per_rank, (rank + 1) * self.kv_heads_per_rank)

    def kv_head_of(self, rank: int) -> int:
        """The KV head rank `rank`'s query heads read, when KV heads are replicated."""
        heads_per_rank = self.num_heads // self.world_size
        group = self.num_heads // self.num_kv_heads  # query heads per KV head
        return rank * heads_per_rank // group


def shard_layout(config: dict, world_size: int) -> ShardLayout:
    """Check that a config.json's attention splits over `world_size` ranks; raises
    ShardingError naming the counts that don't."""
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        raise ShardingError("the model config states no num_attention_heads to shard")
    kv_heads = text.get("num_key_value_heads") or heads
    if text.get("kv_lora_rank"):  # MLA: kv_b_proj expands the latent into every head's K/V
        kv_heads = heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    if heads % world_size:
        raise ShardingError(
            f"{heads} attention heads do not split evenly over {world_size} shards "
            f"(use a --num-shard that divides {heads})"
        )
    if kv_heads % world_size and world_size % kv_heads:
        raise ShardingError(
            f"{kv_heads} KV heads do not split over {world_size} shards, nor does {world_size} "
            f"divide into copies of them (use a --num-shard that divides {kv_heads} or that "
            f"{kv_heads} divides)"
        )
    for key, kind in (("linear_num_key_heads", "key"), ("linear_num_value_heads", "value")):
        count = text.get(key)  # a Gated DeltaNet's heads (Qwen3-Next, Qwen3.5)
        if count and count % world_size:
            raise ShardingError(
                f"{count} linear-attention {kind} heads do not split evenly over {world_size} "
                f"shards (use a --num-shard that divides {count})"
            )
    return ShardLayout(world_size, heads, kv_heads, head_dim)
