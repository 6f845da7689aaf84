"""Random LoRA adapters saved by peft, for the tests (they change the output, not for the
better)."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model


def make_adapter(
    base: torch.nn.Module,
    folder,
    rank: int,
    targets: list[str],
    seed: int,
    *,
    std: float = 0.2,
    alpha: int | None = None,
    **options,
) -> str:
    """An adapter of `rank` on `targets` of a copy of `base`, saved in `folder`: every A and
    B drawn from N(0, std) (B not zero, so it changes the output); lora_alpha 2 * rank
    unless given; `options` go to peft's LoraConfig."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha or 2 * rank,
        target_modules=targets,
        init_lora_weights=False,
        **options,
    )
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, std)
    model.save_pretrained(folder)
    return str(folder)
