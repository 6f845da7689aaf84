"""Data that crosses the engine's boundary: what a validated request asks for and
what the engine hands back. Plain dataclasses; nothing here knows gRPC or torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ..errors import ErrorType

_SEEDS = 2**64  # seeds are unsigned 64-bit


class FinishReason(str, enum.Enum):
    """Why a sequence ended; the values are TGI's strings."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    TIME_LIMIT = "time_limit"  # the request's max_time ran out


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request logits processing, already validated (TGI's defaults when unset)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    typical_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int = 0
    top_n_tokens: int = 0
    watermark: bool = False  # green-list watermark (engine/watermark.py)


@dataclass(frozen=True, slots=True)
class StoppingParams:
    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False
    deadline: float | None = None  # monotonic time after which generation ends (max_time)


class BothWays(NamedTuple):
    """Prompt positions first .. last (inclusive), attended to each other both ways."""

    first: int
    last: int


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt: its processed pixels (the processor's `pixel_values` for the
    image alone, a numpy array: a batch of one, or Qwen2.5-VL's patches), the other inputs
    its family's `get_image_features` takes for it (LLaVA-Next's and Mistral 3's
    `image_sizes`, Idefics 3's `pixel_attention_mask`, Qwen2.5-VL's `image_grid_thw`:
    numpy arrays by name, as the processor gave them), their content hash (prefix-cache
    salt, encoder-cache key), and the prompt positions of the placeholder tokens its
    feature rows replace, in order (one run for LLaVA; runs between tile and row markers
    for Idefics 3)."""

    digest: bytes
    pixel_values: object = field(repr=False)  # (a request's repr in a log stays short)
    positions: tuple[int, ...] = field(repr=False)
    extra: dict = field(default_factory=dict, repr=False)  # name -> numpy array

    @property
    def offset(self) -> int:
        """The prompt position of the image's first token."""
        return self.positions[0]

    @property
    def num_tokens(self) -> int:
        """The image's placeholder tokens: its feature rows."""
        return len(self.positions)


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A validated, tokenized request, ready for the scheduler."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stopping: StoppingParams
    decoder_input_details: bool = False  # return the prompt tokens' logprobs
    arrival_time: float = 0.0  # time.monotonic() when the RPC arrived
    # an llguidance grammar the output must follow (engine/grammar.py), None: unconstrained
    grammar: str | None = None
    priority: int = 0  # lower is scheduled sooner (vLLM's convention); ties: arrival order
    # choices sampled from the one prompt (OpenAI's `n`, TGI's `best_of`): the prompt is
    # computed once and its KV blocks shared (engine/paged_core.py forks the sequences)
    n: int = 1

    def choices(self) -> tuple[EngineRequest, ...]:
        """One request per choice: the first is this one; choice i's id is suffixed and
        its seed is this seed + i (so a seeded request's choices are reproducible, and its
        first choice is the one an n=1 request with that seed gets)."""
        if self.n == 1:
            return (self,)
        first = replace(self, n=1)
        return (first,) + tuple(
            replace(
                first,
                request_id=f"{self.request_id}-{i}",
                sampling=replace(self.sampling, seed=(self.sampling.seed + i) % _SEEDS),
            )
            for i in range(1, self.n)
        )

    # the LoRA adapter it runs with (engine/adapters.py): its name, and its uid (0: the base
    # model), which keys its slots and its prefix-cache blocks
    adapter_id: str | None = None
    adapter_uid: int = 0
    # a vision-language model's images, in prompt order (intake/images.py)
    images: tuple[ImageInput, ...] = ()
    # the prompt's spans whose tokens attend to each other both ways (transformers'
    # token_type_ids masks): Gemma 3's images, PaliGemma's whole prompt; a prefill chunk
    # holds a span from the first token it computes to the last (scheduler.py), and those
    # tokens see the span's last (the attention's key_limits)
    both_ways: tuple[BothWays, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenInfo:
    id: int
    text: str
    logprob: float
    special: bool


@dataclass(frozen=True, slots=True)
class PrefillInfo:
    id: int
    text: str
    logprob: float | None  # None for the first prompt token


@dataclass(frozen=True, slots=True)
class FinishInfo:
    reason: FinishReason
    generated_text: str
    generated_tokens: int
    input_length: int
    seed: int
    queue_time: float  # seconds from arrival to the first forward that included it
    inference_time: float  # seconds from that forward to the last token
    prefill_time: float = 0.0  # seconds from that forward to the first token
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token of one request, as the stream sends it."""

    index: int  # 1-based position among the generated tokens
    token: TokenInfo  # token.text: the text this token completes (may be ""); a special
    # token's text includes its own string, as TGI streams it
    text: str = ""  # what this token adds to generated_text (special strings left out):
    # the texts of a stream add up to the final generated_text
    top_tokens: tuple[TokenInfo, ...] = ()
    prefill: tuple[PrefillInfo, ...] = ()  # on the first event when decoder_input_details
    finish: FinishInfo | None = None  # on the last event
    choice: int = 0  # which of the request's n choices (0-based) this token belongs to


class EngineError(Exception):
    """The engine failed a request, with TGI's error type."""

    def __init__(self, message: str, error_type: ErrorType = ErrorType.GENERATION) -> None:
        super().__init__(message)
        self.message = message
        self.error_type = error_type


@dataclass(slots=True)
class EngineStats:
    """A snapshot for Info, metrics and tests."""

    waiting: int = 0
    running: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_block_size: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_queried_tokens: int = 0
    preemptions: int = 0
    # blocks running sequences gave back out of their window (every layer sliding), cumulative
    window_released_blocks: int = 0
    # a hybrid model's state pool (engine/state_pool.py): slots, one per running sequence
    state_slots_total: int = 0
    state_slots_used: int = 0
    steps: int = 0
    prefill_tokens: int = 0  # prompt (and recompute) tokens computed so far, cumulative
    # speculative decoding (engine/speculation.py), cumulative: tokens proposed and verified,
    # those kept, and the verifying decodes (one per sequence per step)
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    # adaptive speculation (engine/speculation_gate.py): the running sequences it keeps from
    # proposing (but to probe) now, and the (sequence, step) pairs kept from proposing so far
    spec_sequences_off: int = 0
    spec_skipped_proposals: int = 0
