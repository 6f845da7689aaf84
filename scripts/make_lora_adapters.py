"""Random LoRA adapters made with peft on a model, for benchmarks and tries of
`--lora-adapters` (they change the output, not for the better).

    python scripts/make_lora_adapters.py OUT a=16:q_proj,v_proj b=64:gate_proj,up_proj,down_proj

writes OUT/a and OUT/b (adapter_config.json, adapter_model.safetensors), each of the given
rank on the given layers, with lora_alpha = 2 * rank, on the embedded model unless
--model-id names another folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("adapters", nargs="+", metavar="NAME=RANK:TARGET,TARGET")
    parser.add_argument("--model-id", default=None, help="a model folder (default: embedded)")
    parser.add_argument("--std", type=float, default=0.02, help="B's init (A: 1/sqrt(in))")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from textgen.service.models import resolve_model
    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model_id).path
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for index, spec in enumerate(args.adapters):
        name, _, rest = spec.partition("=")
        rank, _, targets = rest.partition(":")
        torch.manual_seed(args.seed + index)
        config = LoraConfig(
            r=int(rank),
            lora_alpha=2 * int(rank),
            target_modules=targets.split(","),
            init_lora_weights=False,
        )
        model = get_peft_model(base, config)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if ".lora_A." in param_name:
                    param.normal_(0, param.shape[1] ** -0.5)
                elif ".lora_B." in param_name:
                    param.normal_(0, args.std)
        model.save_pretrained(args.out / name)
        base = model.unload()  # the base model again, for the next adapter
        print(args.out / name)


if __name__ == "__main__":
    main()
