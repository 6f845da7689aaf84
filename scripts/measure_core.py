"""Measure the paged engine core against plain transformers (not a test).

Decode step time at batch 1, 8, 32 with ~100-token contexts (`--context N`: ~N; medians over
alternating steps; `--long-seqs K --long-context C`: K of each batch's sequences get ~C
tokens instead, a mixed batch):
- raw: `model(...)` on a left-padded batch with a DynamicCache, plus the argmax a greedy
  engine needs (the batched-forward ceiling the engine is held to);
- core: one `PagedCore.step()` with every sequence decoding (schedule + forward + sampling +
  bookkeeping), and its forward alone.
Then end-to-end throughput: 32 prompts x 64 new tokens through the core, from add() to the
last token, prefill included.

Uses the embedded SmolLM2 model if a converted folder is in /root/.cache/textgen/models/,
else a random model of SmolLM2-135M's shape. Run:

    .venv/bin/python scripts/measure_core.py [--dtype bfloat16] [--steps 20] [--batches 1 8 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from textgen.service.engine.config import EngineConfig
from textgen.service.engine.sequence import Sequence
from textgen.service.engine.types import EngineRequest, SamplingParams, StoppingParams
from textgen.service.replica.assembly import build_core
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

MODELS_DIR = Path("/root/.cache/textgen/models")
CONTEXT = 100  # prompt tokens per sequence, by default


def load_model(dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    for config in sorted(MODELS_DIR.glob("**/config.json")) if MODELS_DIR.exists() else []:
        if "smollm2" in str(config.parent).lower():
            model = AutoModelForCausalLM.from_pretrained(config.parent, dtype=dtype)
            return model.eval(), str(config.parent)
    torch.manual_seed(0)
    config = LlamaConfig(  # SmolLM2-135M
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(dtype).eval(), "random SmolLM2-135M-shaped Llama"


def prompts(
    batch: int, vocab: int, seed: int, context: int = CONTEXT, spread: int = 10
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(context - spread, context + spread + 1, (batch,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def make_seq(prompt: list[int], index: int, max_new_tokens: int) -> Sequence:
    request = EngineRequest(
        request_id=str(index),
        prompt_ids=tuple(prompt),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )
    return Sequence(request, frozenset())


class RawDecoder:
    """Plain transformers on a left-padded batch with a DynamicCache: the batched-forward
    ceiling. A step is the forward plus the argmax and host read any greedy engine needs."""

    @torch.inference_mode()
    def __init__(self, model, batch_prompts: list[list[int]]) -> None:
        self.model = model
        width = max(len(p) for p in batch_prompts)
        ids = torch.zeros(len(batch_prompts), width, dtype=torch.long)
        self.mask = torch.zeros_like(ids)
        for row, prompt in enumerate(batch_prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            self.mask[row, width - len(prompt) :] = 1
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = DynamicCache()
        out = model(
            ids,
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            logits_to_keep=1,
        )
        self.next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        self.last_pos = positions[:, -1:]

    @torch.inference_mode()
    def step(self) -> None:
        self.mask = torch.cat([self.mask, torch.ones_like(self.next_ids)], dim=1)
        self.last_pos = self.last_pos + 1
        out = self.model(
            self.next_ids,
            attention_mask=self.mask,
            position_ids=self.last_pos,
            past_key_values=self.cache,
            logits_to_keep=1,
        )
        self.next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        self.next_ids.tolist()


class CoreDecoder:
    """PagedCore with every sequence decoding; records each step's forward time too."""

    def __init__(self, model, batch_prompts: list[list[int]], steps: int) -> None:
        self.core = build_core(
            EngineConfig(
                max_batch_total_tokens=sum(map(len, batch_prompts))
                + len(batch_prompts) * (steps + 48),
                max_batch_prefill_tokens=4096,
                max_batch_size=len(batch_prompts),
            ),
            model,
        )
        self.seqs = [make_seq(p, i, steps + 10) for i, p in enumerate(batch_prompts)]
        for seq in self.seqs:
            self.core.add(seq)
        while any(seq.in_prefill for seq in self.seqs):
            self.core.step()
        self.forward_times: list[float] = []
        execute = self.core.runner.execute

        def timed_execute(batch):
            start = time.perf_counter()
            result = execute(batch)
            self.forward_times.append(time.perf_counter() - start)
            return result

        self.core.runner.execute = timed_execute

    def step(self) -> None:
        self.core.step()

    def close(self) -> None:
        for seq in self.seqs:
            self.core.abort(seq)


def decode_ms(
    raw_model, core_model, batch_prompts: list[list[int]], steps: int
) -> tuple[float, float, float]:
    """Median (raw step, core step, core forward) in ms. Raw and core steps alternate, so
    load from other processes on the shared cores hits both alike."""
    raw = RawDecoder(raw_model, batch_prompts)
    core = CoreDecoder(core_model, batch_prompts, steps)
    raw_times, core_times = [], []
    for _ in range(steps):
        for decoder, times in ((raw, raw_times), (core, core_times)):
            start = time.perf_counter()
            decoder.step()
            times.append(time.perf_counter() - start)
    core.close()
    median_ms = lambda xs: 1000 * statistics.median(xs)
    return median_ms(raw_times), median_ms(core_times), median_ms(core.forward_times)


def end_to_end(model, num_prompts: int, new_tokens: int) -> tuple[float, float]:
    """(seconds, generated tokens/s) for num_prompts ~100-token prompts x new_tokens."""
    core = build_core(
        EngineConfig(
            max_batch_total_tokens=num_prompts * (CONTEXT + 16 + new_tokens + 16),
            max_batch_prefill_tokens=2048,
            max_batch_size=num_prompts,
        ),
        model,
    )
    seqs = [make_seq(p, i, new_tokens) for i, p in enumerate(prompts(num_prompts, 49152, seed=99))]
    start = time.perf_counter()
    for seq in seqs:
        core.add(seq)
    while core.has_work():
        core.step()
    elapsed = time.perf_counter() - start
    return elapsed, sum(s.num_output_tokens for s in seqs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--steps", type=int, default=20, help="decode steps timed per configuration"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--context", type=int, default=CONTEXT, help="prompt tokens a decoding sequence has"
    )
    parser.add_argument(
        "--long-seqs",
        type=int,
        default=0,
        help="this many sequences of each batch get --long-context tokens (a mixed batch)",
    )
    parser.add_argument("--long-context", type=int, default=2000)
    parser.add_argument("--e2e-prompts", type=int, default=32, help="0: no end-to-end run")
    parser.add_argument("--e2e-new-tokens", type=int, default=64)
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    model, source = load_model(dtype)
    print(f"model: {source}, {args.dtype}, torch threads {torch.get_num_threads()}")
    raw_model = model
    # PagedCore switches the attention implementation of the model it gets: keep one each.
    core_model, _ = load_model(dtype)
    core_model.load_state_dict(model.state_dict())

    # speed = raw step time / core step time: 1.0 means the engine runs at the ceiling
    print(f"{'batch':>5} {'raw ms':>8} {'core step ms':>13} {'core fwd ms':>12} {'speed':>7}")
    for batch in args.batches:
        batch_prompts = prompts(batch, model.config.vocab_size, seed=batch, context=args.context)
        long = min(args.long_seqs, batch)
        if long:  # the first `long` sequences get long contexts instead
            vocab = model.config.vocab_size
            batch_prompts[:long] = prompts(long, vocab, seed=-batch, context=args.long_context)
        raw, step, forward = decode_ms(raw_model, core_model, batch_prompts, args.steps)
        print(f"{batch:>5} {raw:>8.1f} {step:>13.1f} {forward:>12.1f} {raw / step:>6.2f}x")

    if not args.e2e_prompts:
        return
    elapsed, rate = end_to_end(core_model, args.e2e_prompts, args.e2e_new_tokens)
    print(
        f"end-to-end: {args.e2e_prompts} prompts x {args.e2e_new_tokens} new tokens "
        f"in {elapsed:.1f} s = {rate:.0f} tokens/s"
    )


if __name__ == "__main__":
    main()
