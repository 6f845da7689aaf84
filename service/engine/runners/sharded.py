"""A step over several ranks (`--num-shard N`): rank 0 drives, the others follow.

Rank 0 holds the scheduler, the engine loop and everything above them; every rank holds a
slice of the model (models/sharding.py) and a KV pool of its own heads, the same number of
blocks each. A step's device side (model_runner.py's `run(StepInputs)`) runs on every rank in
lockstep: rank 0's `ShardedRunner` sends the step's inputs to the others in a fixed layout
(one small header, then one int64 tensor: no pickled objects), every rank runs its runner
stack (eager, compiled or CUDA graphs, the same choice on every rank since it depends only
on the inputs), and the ranks' vocabulary slices of the kept logits are gathered to rank 0,
which samples. Workers loop in `follow_steps()`.

A vision-language model's step carries more: its tokens' key limits (a span attended both
ways: Gemma 3, PaliGemma) and M-RoPE rows (Qwen2.5-VL, Qwen3-VL) go in the int64 tensor
too, and the images it merges (image_encoder.py's ImageSlice: each image's processed
inputs, digest and placeholder positions, the rows the chunk takes) follow as one numpy
`.npz` archive in a uint8 tensor, read back without pickle. Every rank holds the whole
vision tower and projector (the plan splits the language model only) and encodes the
images itself, into its own encoder cache: the same features on every rank with no
collective of the encoder's own, where rank 0 encoding and broadcasting the features would
add a broadcast per image and a second path for cached images.

Control messages go over a gloo group (the inputs are host lists; on CUDA the model's own
group is NCCL); an idle engine sends a heartbeat every HEARTBEAT_S so that a worker waiting
for the next step can tell a quiet rank 0 from a dead one (the groups' timeout).

A rank that dies fails rank 0's step in whatever collective it was in, with the transport's
own words (gloo: `pair.cc:537 Read error ... GLHF!`), which name neither the rank nor what
it means for the requests. Rank 0 asks who is gone (`ShardGroup.exited`: the parent's view
of the local shard processes) and raises `ShardLost` instead, which every request in flight
receives as it is: `incomplete_generation`, naming the rank.
"""

from __future__ import annotations

import enum
import io
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ...errors import ErrorType
from ..types import EngineError, ImageInput
from .image_encoder import ImageSlice
from .model_runner import StepInputs, StepRunner

log = logging.getLogger("textgen.engine")

HEADER_SIZE = 11  # op, _sizes' 7 counts, key limits (0/1), M-RoPE rows, image bytes
HEARTBEAT_S = 5.0  # an idle rank 0 says it is alive this often
# How long a failed step waits for a local shard's exit to show: the dead process's sockets
# close (failing the collective) a moment before its exit status can be read.
EXIT_WAIT_S = 1.0


class Op(enum.IntEnum):
    STEP = 1
    WARMUP = 2
    HEARTBEAT = 3
    STOP = 4


@dataclass(frozen=True)
class ShardGroup:
    """This process's place among the ranks, and the groups they talk over."""

    rank: int
    world_size: int
    control: dist.ProcessGroup  # gloo: headers and step inputs (host tensors)
    model: dist.ProcessGroup  # the model's collectives and the logits gather
    vocab_size: int  # the full vocabulary
    vocab_chunk: int  # rows of it per rank (the last rank's may be fewer)
    device: torch.device
    # rank 0: which local shard process has exited ("shard R (pid P) exited with code C"),
    # waiting up to the seconds given for one to (replica/shard_processes.py); None: none
    exited: Callable[[float], str | None] | None = field(default=None, compare=False)

    def send(self, op: Op, inputs: StepInputs | None = None) -> None:
        """Rank 0: tell the others what to do next."""
        payload = encode(inputs) if inputs is not None else None
        header = torch.zeros(HEADER_SIZE, dtype=torch.long)
        header[0] = op
        images = encode_images(inputs.images) if inputs is not None and inputs.images else None
        if inputs is not None:
            header[1:8] = torch.tensor(_sizes(inputs))
            header[8] = inputs.key_limits is not None
            header[9] = len(inputs.rope_positions)
            header[10] = len(images) if images is not None else 0
        dist.broadcast(header, 0, group=self.control)
        if payload is not None:
            dist.broadcast(payload, 0, group=self.control)
        if images is not None:
            dist.broadcast(images, 0, group=self.control)

    def receive(self) -> tuple[Op, StepInputs | None]:
        """Ranks 1..N-1: the next op from rank 0 (and a step's inputs)."""
        header = torch.zeros(HEADER_SIZE, dtype=torch.long)
        dist.broadcast(header, 0, group=self.control)
        op = Op(int(header[0]))
        if op is not Op.STEP:
            return op, None
        sizes = header[1:8].tolist()
        limits, rope_rows, image_bytes = header[8:11].tolist()
        extra = (limits + rope_rows) * sizes[0]  # [T] key limits, [rows][T] rope positions
        payload = torch.empty(_payload_length(*sizes) + extra, dtype=torch.long)
        dist.broadcast(payload, 0, group=self.control)
        inputs = decode(payload, *sizes)
        tail = payload[len(payload) - extra :].view(-1, sizes[0]).tolist() if extra else []
        inputs.key_limits = tail[0] if limits else None
        inputs.rope_positions = tail[limits:]
        if image_bytes:
            images = torch.empty(image_bytes, dtype=torch.uint8)
            dist.broadcast(images, 0, group=self.control)
            inputs.images = decode_images(images)
        return op, inputs

    def lost(self, error: RuntimeError) -> ShardLost | None:
        """Rank 0: the rank gone, when a step's `error` is a collective failing for it: a
        local shard that has exited is named; a transport failure with none exited here is
        a rank elsewhere (another host's), or one that stopped answering. None: `error` is
        not the group's (the step's own failure, raised as it is)."""
        who = self.exited(EXIT_WAIT_S) if self.exited is not None else None
        if who is None and _transport_failure(error):
            who = f"a shard is gone ({str(error).splitlines()[0][:200]})"
        return ShardLost(who) if who is not None else None

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """Each rank's `[rows, its vocab slice]` -> `[rows, vocab]` on rank 0 (None elsewhere)."""
        if local.shape[-1] < self.vocab_chunk:  # the last rank's shorter slice
            local = torch.nn.functional.pad(local, (0, self.vocab_chunk - local.shape[-1]))
        local = local.contiguous()
        if self.rank != 0:
            dist.gather(local, None, dst=0, group=self.model)
            return None
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.gather(local, parts, dst=0, group=self.model)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


class ShardLost(EngineError):
    """A rank is gone: the step it failed, and every later one, can't run (a half model
    can't answer), so every request in flight ends as an incomplete generation."""

    def __init__(self, who: str) -> None:
        super().__init__(f"{who}: generation can't go on", ErrorType.INCOMPLETE_GENERATION)


def _transport_failure(error: RuntimeError) -> bool:
    """Whether `error` is the process group's transport failing (gloo raises a bare
    RuntimeError with its source file in the text; NCCL and torch's own, DistError)."""
    text = str(error)
    return isinstance(error, dist.DistError) or "gloo" in text or "NCCL" in text


def _sizes(inputs: StepInputs) -> tuple[int, int, int, int, int, int, int]:
    """(tokens, entries, kept rows, block-table entries, block copies, LoRA slot writes,
    state slot copies)."""
    return (
        len(inputs.token_ids),
        len(inputs.query_lens),
        len(inputs.keep),
        sum(len(t) for t in inputs.block_tables),
        len(inputs.block_copies),
        len(inputs.lora_loads),
        len(inputs.state_copies),
    )


def _payload_length(
    tokens: int,
    entries: int,
    kept: int,
    table_entries: int,
    copies: int,
    loads: int,
    state_copies: int,
) -> int:
    return (
        2 * tokens + 5 * entries + kept + table_entries + 2 * copies + 2 * loads + 2 * state_copies
    )


def encode(inputs: StepInputs) -> torch.Tensor:
    """ids | positions | query lens | context lens | table lens | tables | keep | block
    copies (source, destination) | LoRA slots (one per entry, -1: none) | LoRA writes
    (slot, uid) | state slots (one per entry, -1: none) | state copies (source,
    destination) | key limits (when some) | M-RoPE rows (when some): the header says
    which of the last two are there (`receive` reads them)."""
    flat: list[int] = [*inputs.token_ids, *inputs.positions, *inputs.query_lens]
    flat += inputs.context_lens
    flat += [len(t) for t in inputs.block_tables]
    for table in inputs.block_tables:
        flat += table
    flat += inputs.keep
    for source, destination in inputs.block_copies:
        flat += (source, destination)
    flat += inputs.lora_slots or [-1] * len(inputs.query_lens)
    for slot, uid in inputs.lora_loads:
        flat += (slot, uid)
    flat += inputs.state_slots or [-1] * len(inputs.query_lens)
    for source, destination in inputs.state_copies:
        flat += (source, destination)
    flat += inputs.key_limits or []
    for row in inputs.rope_positions:
        flat += row
    return torch.tensor(flat, dtype=torch.long)


def decode(
    payload: torch.Tensor,
    tokens: int,
    entries: int,
    kept: int,
    table_entries: int,
    copies: int,
    loads: int,
    state_copies: int,
) -> StepInputs:
    values = payload.tolist()
    at = 0

    def take(n: int) -> list[int]:
        nonlocal at
        part = values[at : at + n]
        at += n
        return part

    token_ids, positions = take(tokens), take(tokens)
    query_lens, context_lens, table_lens = take(entries), take(entries), take(entries)
    tables = [take(n) for n in table_lens]
    keep, pairs = take(kept), take(2 * copies)
    lora_slots, writes = take(entries), take(2 * loads)
    state_slots, state_pairs = take(entries), take(2 * state_copies)
    return StepInputs(
        token_ids,
        positions,
        query_lens,
        context_lens,
        tables,
        keep,
        block_copies=list(zip(pairs[0::2], pairs[1::2], strict=True)),
        lora_slots=lora_slots,
        lora_loads=list(zip(writes[0::2], writes[1::2], strict=True)),
        state_slots=state_slots,
        state_copies=list(zip(state_pairs[0::2], state_pairs[1::2], strict=True)),
    )


def encode_images(slices: list[ImageSlice]) -> torch.Tensor:
    """A step's ImageSlices as the bytes of one `.npz` archive (arrays only: no pickle):
    per image its digest, placeholder positions and processor inputs; per slice its image,
    first row and targets."""
    arrays: dict[str, np.ndarray] = {}
    index: dict[bytes, int] = {}
    for part in slices:
        image = part.image
        if image.digest in index:
            continue
        k = index[image.digest] = len(index)
        arrays[f"{k}.digest"] = np.frombuffer(image.digest, dtype=np.uint8)
        arrays[f"{k}.positions"] = np.asarray(image.positions, dtype=np.int64)
        arrays[f"{k}.input.pixel_values"] = np.asarray(image.pixel_values)
        for name, value in image.extra.items():
            arrays[f"{k}.input.{name}"] = np.asarray(value)
    arrays["slices"] = np.asarray(
        [(index[p.image.digest], p.first_row, len(p.targets)) for p in slices], dtype=np.int64
    ).reshape(-1, 3)
    arrays["targets"] = np.asarray([t for p in slices for t in p.targets], dtype=np.int64)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode_images(data: torch.Tensor) -> list[ImageSlice]:
    """`encode_images`' archive back as the step's ImageSlices."""
    archive = np.load(io.BytesIO(data.numpy().tobytes()), allow_pickle=False)
    images, inputs = {}, {}
    for key in archive.files:
        k, _, name = key.partition(".")
        if name.startswith("input."):
            inputs.setdefault(int(k), {})[name.removeprefix("input.")] = archive[key]
    for k, given in inputs.items():
        pixels = given.pop("pixel_values")
        images[k] = ImageInput(
            archive[f"{k}.digest"].tobytes(),
            pixels,
            tuple(archive[f"{k}.positions"].tolist()),
            given,
        )
    targets, at, slices = archive["targets"].tolist(), 0, []
    for k, first_row, count in archive["slices"].tolist():
        slices.append(ImageSlice(images[k], first_row, tuple(targets[at : at + count])))
        at += count
    return slices


class ShardedRunner(StepRunner):
    """Rank 0's runner (the Runner protocol, model_runner.py): each step's inputs to every rank,
    the same device side on each, the logits gathered here."""

    def __init__(self, inner, group: ShardGroup) -> None:
        self.inner = inner
        self.group = group
        self._lock = threading.Lock()  # a step and a heartbeat never interleave their messages
        self._last_sent = time.monotonic()
        self._stopped = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, name="textgen-shard-heartbeat", daemon=True
        )

    @property
    def pool(self):
        return self.inner.pool

    @property
    def batch_invariant(self) -> bool:
        return self.inner.batch_invariant

    @property
    def rope(self):  # M-RoPE rows are laid out here, by the host side (execute)
        return self.inner.rope

    @property
    def stats(self):  # the inner strategy's counters (compiled or graph steps)
        return self.inner.stats

    def warmup(self) -> None:
        with self._lock:
            self.group.send(Op.WARMUP)
            self.inner.warmup()
            self._last_sent = time.monotonic()
        self._heartbeat.start()

    def run(self, inputs: StepInputs) -> torch.Tensor:
        with self._lock:
            try:
                self.group.send(Op.STEP, inputs)
                self._last_sent = time.monotonic()
                local = self.inner.run(inputs)
                return self.group.gather_logits(local)
            except torch.OutOfMemoryError:
                raise  # this rank's own (the engine loop decides)
            except RuntimeError as exc:
                if (lost := self.group.lost(exc)) is not None:
                    raise lost from exc
                raise

    def stop(self) -> None:
        """Release the other ranks (they exit); idempotent, best effort."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with self._lock:
            try:
                self.group.send(Op.STOP)
            except RuntimeError as exc:  # a rank is gone already
                log.warning("could not tell the other shards to stop: %s", exc)

    def _beat(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S / 2):
            with self._lock:
                if self._stopped.is_set():
                    return
                if time.monotonic() - self._last_sent < HEARTBEAT_S:
                    continue
                try:
                    self.group.send(Op.HEARTBEAT)
                except RuntimeError as exc:  # the next step fails on it too, visibly
                    log.error("shard heartbeat failed: %s", self.group.lost(exc) or exc)
                    return
                self._last_sent = time.monotonic()


@torch.inference_mode()
def follow_steps(runner, group: ShardGroup) -> None:
    """Ranks 1..N-1: run what rank 0 sends until it says stop (raises if a rank is gone)."""
    while True:
        op, inputs = group.receive()
        if op is Op.STEP:
            group.gather_logits(runner.run(inputs))
        elif op is Op.WARMUP:
            runner.warmup()
        elif op is Op.STOP:
            return


def agree(value: int, group: dist.ProcessGroup) -> int:
    """Rank 0's `value` on every rank (e.g. the KV pool's size, sized by rank 0's memory)."""
    tensor = torch.tensor([value], dtype=torch.long)
    dist.broadcast(tensor, 0, group=group)
    return int(tensor.item())
