"""What `textgen bench` compares the served engine with, on the same prompts, measured
in the same run after the served load (nothing else running):

- the engine core alone (`--core`): the same requests through `PagedCore.step()` in this
  process, the engine built from the server's own settings: no gRPC, no event loop, no
  thread handoff. served / core is what the serving path costs; the core's decode step is what
  one stream's inter-token latency can be at best;
- plain transformers (`--baseline`): a left-padded batched prefill, then greedy decode
  steps with a DynamicCache, in the served dtype (the loop anyone writes first), and
  naive sequential `model.generate`.

Every request of a run, served or not, warm-up included, gets a prompt no other request
has (`distinct_prompts`), so what each measures includes its prompt's prefill.
"""

from __future__ import annotations

import inspect
import itertools
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from textgen.service.settings.table import Settings

# New tokens per stream of the warm-up load before every measured one (served and
# core alone alike): allocations, caches, a connection's flow-control windows.
WARM_UP_TOKENS = 16

_request_numbers = itertools.count(1)


def distinct_prompts(prompts: list[str], count: int) -> list[str]:
    """`count` requests' prompts, cycling through `prompts`, each behind a number no other
    request of this process has. No two requests then share a first KV block, so none is
    served from the prefix cache another one filled (the plain loop has no cache), and
    every prefill is paid, as for different users' requests."""
    return [f"({next(_request_numbers)}) {prompts[i % len(prompts)]}" for i in range(count)]


# the engine core alone --------------------------------------------------------------


class CoreAlone:
    """The served engine in this process, built from the server's settings as the server
    builds it (replica/assembly.py's `standalone_engine`: model, quantization, KV pool and
    its dtype, runner strategy, speculation, adapters): load once, then `run()` the served
    load through it as often as needed."""

    def __init__(self, settings: Settings, prompts: list[str], sampling: dict) -> None:
        """sampling: the served requests' SamplingParams fields ({} for greedy)."""
        from textgen.service.replica.assembly import standalone_engine

        self.settings = settings
        self.prompts = prompts
        self.sampling = sampling
        loaded, self.core = standalone_engine(settings)
        self.core.warm_up()  # as the engine loop does: a --compile core compiles here
        self.dtype = str(loaded.dtype).removeprefix("torch.")
        if loaded.small_step_rows:
            self.dtype += f" + int8 for steps <= {loaded.small_step_rows}"
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self._requests = 0

    def run(
        self, *, concurrency: int, requests: int, max_new_tokens: int, ignore_eos: bool
    ) -> dict:
        """The served load (`requests` requests, `concurrency` at a time, each worker
        taking the next prompt when its request ends): tokens/s, and the median time of
        the steps that only decoded (for one stream, its best inter-token latency)."""
        import torch

        with torch.inference_mode():
            self._load(concurrency, concurrency, WARM_UP_TOKENS, True)  # as the served load
            elapsed, tokens, decode_steps = self._load(
                concurrency, requests, max_new_tokens, ignore_eos
            )
        return {
            "dtype": self.dtype,
            "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / elapsed, 2),
            "decode_step_p50_ms": round(1000 * statistics.median(decode_steps), 2)
            if decode_steps
            else None,
            "torch_threads": torch.get_num_threads(),
        }

    def _load(
        self, concurrency: int, count: int, new_tokens: int, ignore_eos: bool
    ) -> tuple[float, int, list[float]]:
        # tokenized as validation does, before the clock starts
        prompt_ids = [
            self.tokenizer(text, add_special_tokens=True)["input_ids"]
            for text in distinct_prompts(self.prompts, count)
        ]
        pending = [self._sequence(ids, new_tokens, ignore_eos) for ids in prompt_ids]
        running = []
        decode_steps: list[float] = []
        tokens = 0
        start = time.perf_counter()
        while pending or running:
            while pending and len(running) < concurrency:
                running.append(pending.pop(0))
                self.core.add(running[-1])
            decoding = all(not s.in_prefill for s in running)
            step_start = time.perf_counter()
            outputs = self.core.step()
            if decoding and outputs:
                decode_steps.append(time.perf_counter() - step_start)
            tokens += len(outputs)
            running = [s for s in running if not s.is_finished]
        return time.perf_counter() - start, tokens, decode_steps

    def _sequence(self, prompt_ids: list[int], new_tokens: int, ignore_eos: bool):
        from textgen.service.engine.sequence import Sequence
        from textgen.service.engine.types import EngineRequest, SamplingParams, StoppingParams

        self._requests += 1
        request = EngineRequest(
            request_id=f"core-{self._requests}",
            prompt_ids=tuple(prompt_ids),
            sampling=SamplingParams(**self.sampling),
            stopping=StoppingParams(max_new_tokens=new_tokens, ignore_eos=ignore_eos),
        )
        return Sequence(request, self.eos_token_ids)


# plain transformers -----------------------------------------------------------------


class PlainLoop:
    """Plain transformers on the same model, in the served dtype: load once, then
    `run()` the batched greedy loop on the served load's prompts as often as needed."""

    def __init__(self, settings: Settings) -> None:
        from textgen.service.models import load_model

        self.loaded = load_model(settings.model_id, dtype=settings.dtype, device="auto")
        self.dtype = str(self.loaded.dtype).removeprefix("torch.")

    def run(self, prompts: list[str], batch: int, max_new_tokens: int) -> dict:
        """The greedy loop on `batch` prompts (the served load's first ones, numbered as
        the served requests are)."""
        batch_prompts = distinct_prompts(prompts, batch)
        loaded = self.loaded
        return {
            "dtype": self.dtype,
            "loop_tokens_per_s": round(
                _greedy_loop(loaded.model, loaded.tokenizer, batch_prompts, max_new_tokens), 2
            ),
        }

    def naive_generate(self, prompts: list[str], max_new_tokens: int) -> float:
        """Sequential `model.generate` on two prompts: tokens/s."""
        loaded = self.loaded
        return round(
            _naive_generate(loaded.model, loaded.tokenizer, prompts[:2], max_new_tokens), 2
        )


def _greedy_loop(model, tokenizer, prompts: list[str], max_new_tokens: int) -> float:
    """Left-padded prefill, then greedy decode steps with a DynamicCache: no sampling
    logic, no stopping, no scheduling: what the model's forward pass allows."""
    import torch

    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.inference_mode():
        _loop_run(model, ids, mask, 2)  # warm-up
        start = time.perf_counter()
        _loop_run(model, ids, mask, max_new_tokens)
        elapsed = time.perf_counter() - start
    return len(prompts) * max_new_tokens / elapsed


def _loop_run(model, ids, mask, steps: int) -> None:
    import torch
    from transformers import DynamicCache

    # transformers 5.x renamed past_key_values to cache (the old name warns until 5.40)
    cache_arg = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else ("past_key_values")
    )
    cache = {cache_arg: DynamicCache()}
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **cache,
    )
    for _ in range(steps - 1):
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=next_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **cache,
        )
    out.logits[:, -1].argmax(-1).tolist()


def _naive_generate(model, tokenizer, prompts: list[str], max_new_tokens: int) -> float:
    import torch

    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(model.device)
            out = model.generate(
                ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
            )
            tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - start)
