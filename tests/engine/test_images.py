"""Vision-language models (a tiny LLaVA; LLaVA-Next, Idefics 3, SmolVLM, Gemma 3,
Mistral 3, PaliGemma, Qwen2-VL, Qwen2.5-VL and Qwen3-VL too) through the engine core: the
images' features merged at prefill equal transformers' own merge token for token, through
prefill chunks that cut an image, and the prefix cache never shares an image's blocks
with a request of another image (block hashes salted with the images' content hashes), nor
a span attended both ways with a request of another span (PaliGemma's prompt); Qwen2-VL's,
Qwen2.5-VL's and Qwen3-VL's multimodal rotary positions through chunks, decodes, the
prefix cache and preemption, and Qwen3-VL's deepstack rows."""

from __future__ import annotations

import io

import pytest
import torch
from support.tiny_vlm import BUILDERS, build_tiny_llava, png, transformers_processor
from textgen.service.engine.sequence import Sequence
from textgen.service.engine.types import EngineRequest, SamplingParams, StoppingParams
from textgen.service.intake.images import ImagePrompts, decode_image
from textgen.service.models.processors import load_processor
from textgen.service.replica.lifecycle import image_prompts

from .factories import make_core, run_to_completion

MAX_NEW = 8
TEXT = "What is in the picture?"


def load(path):
    """The model and its processor, as the server's loader builds it (Qwen2.5-VL's without
    its video processor: models/processors.py)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, load_processor(path, model.config.model_type)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return load(build_tiny_llava(tmp_path_factory.mktemp("llava")))


# the families past LLaVA, each with its own way of laying an image out in tokens
# and the image tokens each gives the three sizes of test_family_images_... (the third
# prompt's second image the first's size, other pixels)
TOKENS = {
    "llava_next": [[72], [52], [56, 72]],
    "idefics3": [[20], [12], [12, 20]],
    "smolvlm": [[20], [12], [12, 20]],  # Idefics 3's tiles
    "gemma3": [[16], [16], [16, 16]],
    # [IMG] per 8-pixel cell: 24 x 24 (20 x 24 rounded up), 12 x 32 (40 x 16 at an edge of
    # 32) padded to 16 x 32, 32 x 16; the [IMG_BREAK] and [IMG_END] among them are no rows
    "mistral3": [[9], [8], [8, 9]],
    # Pixtral 12B's layout (a LLaVA): [IMG] per 4-pixel patch, no merger: 6 x 5, 3 x 8, 8 x 3
    "llava_pixtral": [[30], [24], [24, 30]],
    "paligemma": [[16], [16], [16, 16]],
    # 20 x 24 pixels resized to 40 x 48, 10 x 12 patches, merged 2 x 2: 30 tokens
    "qwen2_vl": [[30], [32], [32, 30]],
    "qwen2_5_vl": [[30], [32], [32, 30]],
    "qwen3_vl": [[30], [32], [32, 30]],  # the same image processor; deepstack rows too
}
# the small prefill budget: 7 cuts every image; Gemma 3's 16 tokens attend to each other
# both ways and take one chunk, so 20 cuts the prompt around them; PaliGemma's whole
# prompt attends to itself both ways (33 tokens with one image, 49 with two): 49 takes
# one prompt a step, the next waiting for a budget that holds all of it
SMALL_CHUNK = {"gemma3": 20, "paligemma": 49}


@pytest.fixture(scope="module", params=sorted(TOKENS))
def family_name(request):
    return request.param


@pytest.fixture(scope="module")
def family(family_name, tmp_path_factory):
    return load(BUILDERS[family_name](tmp_path_factory.mktemp(family_name)))


def prompt(processor, images: int = 1, text: str = TEXT) -> str:
    """The chat template's prompt; without one (PaliGemma), the placeholders and the text,
    as the processor's own layout puts them."""
    if processor.chat_template is None:
        return processor.image_token * images + text
    parts = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": parts}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


def picture(color, stripes=True, size=(20, 24)):
    from PIL import Image

    return Image.open(io.BytesIO(png(color, size, stripes=stripes))).convert("RGB")


@torch.inference_mode()
def reference(model, processor, text: str, images, max_new: int = MAX_NEW) -> list[int]:
    inputs = processor(images=images, text=text, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def sequence(
    processor, text: str, images, request_id: str, max_new: int = MAX_NEW, config=None
) -> Sequence:
    parts = tuple(decode_image(png_bytes(i), f"image{k}") for k, i in enumerate(images))
    # as the server's validation applies the processor (replica/lifecycle.py)
    prompts = image_prompts(processor, config) if config else ImagePrompts(processor)
    ids, inputs, both_ways = prompts.tokenize(text, parts, "inputs")
    request = EngineRequest(
        request_id=request_id,
        prompt_ids=tuple(ids),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new, ignore_eos=True),
        images=inputs,
        both_ways=both_ways,
    )
    return Sequence(request, frozenset())


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


RED, BLUE, GREEN = (200, 30, 30), (30, 30, 200), (30, 200, 30)


@pytest.mark.parametrize("prefill_tokens", [512, 8, 5])
def test_one_image_equals_generate(llava, prefill_tokens):
    """Chunks of 8 and 5 tokens cut the image's 16 placeholders: each chunk merges its rows."""
    model, processor = llava
    text = prompt(processor)
    core = make_core(model, prefill_tokens=prefill_tokens, block_size=4)
    seqs = [sequence(processor, text, [picture(c)], c.__repr__()) for c in (RED, BLUE)]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    outputs = [seq.output_ids for seq in seqs]
    assert outputs[0] == reference(model, processor, text, [picture(RED)])
    assert outputs[1] == reference(model, processor, text, [picture(BLUE)])
    assert outputs[0] != outputs[1]  # the image reaches the answer
    runner = core.runner
    assert runner.images.encoded == 2  # once per image, whatever the chunks


def test_one_step_encodes_its_images_in_one_batch(llava):
    """Two requests' images of one size, prefilled in one step: one forward of the vision
    tower for both, their features those of each image encoded alone, and each answer
    generate's; the same image again in a later step comes from the cache."""
    from textgen.service.engine.runners.image_encoder import ImageEncoder

    model, processor = llava
    text = prompt(processor)
    core = make_core(model, prefill_tokens=512, block_size=4)
    seqs = [sequence(processor, text, [picture(c)], str(c)) for c in (RED, BLUE)]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    encoder = core.runner.images
    assert (encoder.encoded, encoder.batches) == (2, 1)
    for seq, color in zip(seqs, (RED, BLUE), strict=True):
        assert seq.output_ids == reference(model, processor, text, [picture(color)])
        image = seq.request.images[0]
        alone = ImageEncoder(model).features(image)
        torch.testing.assert_close(encoder.cache[image.digest][0], alone)
    again = sequence(processor, text, [picture(RED)], "again")
    core.add(again)
    run_to_completion(core)
    assert (encoder.encoded, encoder.batches) == (2, 1)
    assert again.output_ids == seqs[0].output_ids


def test_two_images_in_one_prompt(llava):
    model, processor = llava
    text = prompt(processor, images=2)
    core = make_core(model, prefill_tokens=12, block_size=4)
    seq = sequence(processor, text, [picture(RED), picture(BLUE, stripes=False)], "two")
    core.add(seq)
    run_to_completion(core)
    assert seq.output_ids == reference(
        model, processor, text, [picture(RED), picture(BLUE, stripes=False)]
    )


def test_prefix_cache_keeps_images_apart(llava):
    """Same text, other image: only the blocks before the first image token are shared; a
    repeat of the same image and text is served from the cache and still equals generate."""
    model, processor = llava
    text = prompt(processor)
    core = make_core(model, block_size=4, enable_prefix_caching=True)
    first = sequence(processor, text, [picture(RED)], "red")
    core.add(first)
    run_to_completion(core)
    other = sequence(processor, text, [picture(BLUE)], "blue")
    same = sequence(processor, text, [picture(RED)], "red-again")
    core.add(other)
    core.add(same)
    run_to_completion(core)
    image_start = first.request.images[0].offset
    assert other.num_cached_prompt_tokens <= image_start  # only the text before the image
    assert same.num_cached_prompt_tokens > image_start  # the image's blocks too
    assert other.output_ids == reference(model, processor, text, [picture(BLUE)])
    assert same.output_ids == first.output_ids == reference(model, processor, text, [picture(RED)])


@pytest.mark.parametrize(("encoder_cache", "prefix_caching"), [(32, True), (0, False)])
def test_preempted_image_requests_recompute_their_images(llava, encoder_cache, prefix_caching):
    """12 blocks of 8 tokens: each request (33 prompt tokens + 24) fits alone, three
    together don't. A preempted request recomputes what the prefix cache lost of it, its
    image's features from the encoder cache, or encoded again (a cache that keeps none)."""
    model, processor = llava
    text = prompt(processor)
    core = make_core(
        model,
        total_tokens=96,
        prefill_tokens=64,
        block_size=8,
        enable_prefix_caching=prefix_caching,
    )
    core.runner.images.capacity = encoder_cache
    colors = (RED, BLUE, GREEN)
    seqs = [sequence(processor, text, [picture(c)], str(c), max_new=24) for c in colors]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert core.stats().preemptions > 0
    for seq, color in zip(seqs, colors, strict=True):
        assert seq.output_ids == reference(model, processor, text, [picture(color)], 24)
    if encoder_cache == 0:
        assert core.runner.images.encoded > len(colors)


def test_salt_depends_on_the_image_only(llava):
    """Equal pixels give equal digests (the encoder cache's key); other pixels don't."""
    _, processor = llava
    text = prompt(processor)
    a = sequence(processor, text, [picture(RED)], "a").request.images[0]
    b = sequence(processor, text, [picture(RED)], "b").request.images[0]
    c = sequence(processor, text, [picture(BLUE)], "c").request.images[0]
    assert a.digest == b.digest != c.digest
    assert a.num_tokens == len(a.positions) == 16


@pytest.mark.parametrize("small", [False, True])
def test_family_images_of_other_sizes_equal_generate(family, family_name, small):
    """Images of three sizes (LLaVA-Next: 72, 52 and 56 tokens; Idefics 3: tiles between
    row markers), alone and two in one prompt, through chunks of 7 that cut them."""
    model, processor = family
    one, two = prompt(processor), prompt(processor, images=2)
    cases = [
        (one, [picture(RED)]),
        (one, [picture(BLUE, size=(40, 16))]),
        (two, [picture(GREEN, size=(16, 40)), picture(RED, stripes=False)]),
    ]
    prefill_tokens = SMALL_CHUNK.get(family_name, 7) if small else 512
    core = make_core(model, prefill_tokens=prefill_tokens, block_size=4)
    seqs = [
        sequence(processor, text, images, str(k), config=model.config)
        for k, (text, images) in enumerate(cases)
    ]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    own = transformers_processor(model.name_or_path)  # (Mistral 3's: transformers' own class)
    for seq, (text, images) in zip(seqs, cases, strict=True):
        assert seq.output_ids == reference(model, own, text, images)
    assert [[i.num_tokens for i in s.request.images] for s in seqs] == TOKENS[family_name]
    assert seqs[0].output_ids != seqs[1].output_ids  # the image reaches the answer
    assert core.runner.images.encoded == 4


def test_image_attended_both_ways_must_fit_one_chunk(tmp_path):
    """Gemma 3's 16 image tokens take one prefill chunk: a budget of 15 refuses the image,
    naming the part; 16 takes it."""
    from textgen.service.intake.validation import ValidationError

    model, processor = load(BUILDERS["gemma3"](tmp_path / "gemma3"))
    text = prompt(processor)
    part = decode_image(png(RED), "messages[0].content[0].image_url")
    with pytest.raises(ValidationError, match="16 image tokens attend to each other") as refused:
        image_prompts(processor, model.config, max_chunk=15).tokenize(text, (part,), "inputs")
    assert refused.value.param == "messages[0].content[0].image_url"
    _, images, both_ways = image_prompts(processor, model.config, max_chunk=16).tokenize(
        text, (part,), "inputs"
    )
    assert both_ways == ((images[0].offset, images[0].positions[-1]),)
    assert images[0].num_tokens == 16


def test_chunks_end_outside_images_attended_both_ways():
    """The scheduler's cut: a chunk that would end inside such an image ends before it, or
    takes nothing where it starts inside it; other images are cut anywhere."""
    from textgen.service.engine.scheduler import whole_images
    from textgen.service.engine.types import BothWays, ImageInput

    def seq(both_ways: bool) -> Sequence:
        image = ImageInput(b"d", None, tuple(range(8, 24)), {})
        request = EngineRequest(
            request_id="r",
            prompt_ids=tuple(range(40)),
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=1),
            images=(image,),
            both_ways=(BothWays(8, 23),) if both_ways else (),
        )
        return Sequence(request, frozenset())

    assert whole_images(seq(True), 20, start=0) == 8  # ends before the image
    assert whole_images(seq(True), 24, start=0) == 24  # takes all of it
    assert whole_images(seq(True), 10, start=8) == 0  # starts in it: waits for room
    assert whole_images(seq(True), 16, start=8) == 16
    assert whole_images(seq(True), 5, start=24) == 5  # after it
    assert whole_images(seq(False), 20, start=0) == 20


def test_prefix_hit_inside_an_image_attended_both_ways(tmp_path):
    """Same text and image, other text after it: the prefix cache's hit ends inside the
    Gemma 3 image (blocks of 16), whose cached tokens saw all of it when first computed;
    the rest of it is computed in one chunk, seeing the whole image, and equals generate."""
    model, processor = load(BUILDERS["gemma3"](tmp_path / "gemma3"))
    first, second = prompt(processor), prompt(processor).replace(TEXT, "Describe it, please.")
    core = make_core(model, block_size=16, prefill_tokens=40, enable_prefix_caching=True)
    a = sequence(processor, first, [picture(RED)], "a", config=model.config)
    core.add(a)
    run_to_completion(core)
    b = sequence(processor, second, [picture(RED)], "b", config=model.config)
    core.add(b)
    run_to_completion(core)
    image = b.request.images[0]
    assert image.offset < b.num_cached_prompt_tokens <= image.positions[-1]  # inside it
    assert a.output_ids == reference(model, processor, first, [picture(RED)])
    assert b.output_ids == reference(model, processor, second, [picture(RED)])


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory):
    return load(BUILDERS["paligemma"](tmp_path_factory.mktemp("paligemma")))


def test_prefix_cache_shares_a_prompt_attended_both_ways_only_whole(paligemma):
    """PaliGemma's prompt attends to itself both ways, so its early tokens' K/V depend on
    its last: the same image and a common start with another ending share no block (the
    span's tokens salt its first block); the same prompt again shares all but its last
    tokens, and the rest, computed in one chunk, sees the whole prompt: both equal generate."""
    model, processor = paligemma
    first, other = prompt(processor), prompt(processor, text=TEXT + " Say it in a word.")
    core = make_core(model, block_size=4, prefill_tokens=64, enable_prefix_caching=True)
    a = sequence(processor, first, [picture(RED)], "a", config=model.config)
    core.add(a)
    run_to_completion(core)
    b = sequence(processor, other, [picture(RED)], "b", config=model.config)
    same = sequence(processor, first, [picture(RED)], "same", config=model.config)
    core.add(b)
    core.add(same)
    run_to_completion(core)
    assert b.request.both_ways == ((0, b.num_prompt_tokens - 1),)
    assert b.num_cached_prompt_tokens == 0
    assert same.num_cached_prompt_tokens >= same.num_prompt_tokens - 4
    assert a.output_ids == same.output_ids == reference(model, processor, first, [picture(RED)])
    assert b.output_ids == reference(model, processor, other, [picture(RED)])


def test_prompt_attended_both_ways_must_fit_one_chunk(paligemma):
    """PaliGemma's 33-token prompt (16 image tokens, bos, the text, "\n") takes one
    prefill chunk: a budget of 32 refuses it, naming the prompt; 33 takes it."""
    from textgen.service.intake.validation import ValidationError

    model, processor = paligemma
    part = decode_image(png(RED), "inputs (image 1)")
    text = prompt(processor)
    with pytest.raises(ValidationError, match="its 33 tokens, its images' and its text's,"):
        image_prompts(processor, model.config, max_chunk=32).tokenize(text, (part,), "inputs")
    ids, _, both_ways = image_prompts(processor, model.config, max_chunk=33).tokenize(
        text, (part,), "inputs"
    )
    assert both_ways == ((0, 32),) and len(ids) == 33


def test_prompt_without_image_is_refused_by_paligemmas_processor(paligemma):
    """PaliGemma's processor takes no prompt without an image (transformers' refusal): a
    422 naming the prompt, not a prompt attended otherwise than the model's."""
    from textgen.service.intake.validation import ValidationError

    model, processor = paligemma
    with pytest.raises(ValidationError, match="processor refused `inputs`") as refused:
        image_prompts(processor, model.config).tokenize(TEXT, (), "inputs")
    assert refused.value.param == "inputs"


# the families with multimodal rotary positions (M-RoPE)
MROPE = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module", params=MROPE)
def mrope_family(request, tmp_path_factory):
    return load(BUILDERS[request.param](tmp_path_factory.mktemp(request.param)))


def test_mrope_positions_equal_get_rope_index(mrope_family):
    """The rotary positions laid out per chunk (engine/runners/mrope.py: each image's rows
    and span, from get_rope_index on it alone) equal the model's get_rope_index on the
    whole prompt, for any cut of it; past the prompt, index + the prompt's rope delta."""
    from textgen.service.engine.runners.mrope import MRope

    model, processor = mrope_family
    images = [picture(GREEN, size=(16, 40)), picture(RED, stripes=False)]
    seq = sequence(processor, prompt(processor, images=2), images, "r", config=model.config)
    ids = torch.tensor([seq.request.prompt_ids])
    grids = torch.cat([torch.from_numpy(i.extra["image_grid_thw"]) for i in seq.request.images])
    mask = (ids == model.config.image_token_id).int()
    expected, delta = model.model.get_rope_index(ids, mm_token_type_ids=mask, image_grid_thw=grids)
    rope, n = MRope(model), ids.shape[1]
    assert rope.positions(seq.request.images, 0, n) == expected[:, 0].tolist()
    for start in range(0, n, 7):  # chunks of 7 cut both images
        count = min(7, n - start)
        assert (
            rope.positions(seq.request.images, start, count)
            == expected[:, 0, start : start + count].tolist()
        )
    assert delta.item() < 0  # 62 image tokens span 16 + 10 positions
    assert rope.positions(seq.request.images, n + 5, 1) == [[n + 5 + delta.item()]] * 3


@pytest.mark.parametrize("prefill_tokens", [512, 7])
def test_mrope_decodes_at_index_plus_delta(mrope_family, prefill_tokens):
    """Two images, text after them, 24 tokens generated: a decode at its index (not index
    plus the images' rope delta, -48 here) changes the tokens; so do positions of a chunk
    that cuts an image (7), or of a request whose prefix (the images) is cached."""
    model, processor = mrope_family
    images = [picture(GREEN, size=(16, 40)), picture(RED, stripes=False)]
    text = prompt(processor, images=2)
    core = make_core(model, prefill_tokens=prefill_tokens, block_size=4, enable_prefix_caching=True)
    first = sequence(processor, text, images, "first", max_new=24, config=model.config)
    core.add(first)
    run_to_completion(core)
    again = sequence(processor, text, images, "again", max_new=24, config=model.config)
    core.add(again)
    run_to_completion(core)
    assert again.num_cached_prompt_tokens > again.request.images[-1].positions[-1]
    assert first.output_ids == again.output_ids == reference(model, processor, text, images, 24)


def test_deepstack_rows_reach_the_answer(tmp_path):
    """Qwen3-VL's deepstack levels, added after its first decoder layers at the chunk's
    image tokens: without them (the hooks removed) the tokens differ from generate."""
    model, processor = load(BUILDERS["qwen3_vl"](tmp_path / "qwen3_vl"))
    text, image = prompt(processor), picture(BLUE, size=(40, 16))
    core = make_core(model, prefill_tokens=7, block_size=4)
    served = sequence(processor, text, [image], "served", config=model.config)
    core.add(served)
    run_to_completion(core)
    assert served.output_ids == reference(model, processor, text, [image])
    core = make_core(model, prefill_tokens=7, block_size=4)
    for layer in core.runner.model.model.language_model.layers:
        layer._forward_hooks.clear()
    unstacked = sequence(processor, text, [image], "unstacked", config=model.config)
    core.add(unstacked)
    run_to_completion(core)
    assert unstacked.output_ids != served.output_ids


def test_mrope_preempted_requests_recompute_at_their_positions(mrope_family):
    """16 blocks of 8: two requests (50 prompt tokens + 24) are admitted, and one is
    preempted as they grow; recomputed, it lays out the same rotary positions again."""
    model, processor = mrope_family
    text = prompt(processor)
    core = make_core(model, total_tokens=128, prefill_tokens=64, block_size=8)
    colors = (RED, BLUE, GREEN)
    seqs = [
        sequence(processor, text, [picture(c)], str(c), max_new=24, config=model.config)
        for c in colors
    ]
    for seq in seqs:
        core.add(seq)
    run_to_completion(core)
    assert core.stats().preemptions > 0
    for seq, color in zip(seqs, colors, strict=True):
        assert seq.output_ids == reference(model, processor, text, [picture(color)], 24)


def test_decode_graphs_refuse_mrope(mrope_family):
    """The compiled decode step takes token indices as positions: an M-RoPE model's
    eager runner is refused by it, naming why (preflight refuses --compile before)."""
    from textgen.service.engine.runners.compiled import CompiledRunner, CompileSettings

    model, _ = mrope_family
    core = make_core(model, block_size=4)
    with pytest.raises(ValueError, match="M-RoPE"):
        CompiledRunner(core.runner, CompileSettings((1,)))


def test_qwen_processor_from_a_checkpoint_layout(qwen_folder, tmp_path):
    """A checkpoint's folder: the image processor in preprocessor_config.json under the
    torchvision class's name, a video_preprocessor_config.json beside it: the processor
    loads images only (the PIL class) and tokenizes as the test folder's does."""
    import json
    import shutil

    folder = shutil.copytree(qwen_folder, tmp_path / "checkpoint")
    saved = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").unlink()
    images = {**saved["image_processor"], "image_processor_type": "Qwen2VLImageProcessor"}
    images["processor_class"] = "Qwen2_5_VLProcessor"
    (folder / "preprocessor_config.json").write_text(json.dumps(images))
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 4}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    processor = load_processor(folder, "qwen2_5_vl")
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert not hasattr(processor, "video_processor")
    expected = load_processor(qwen_folder, "qwen2_5_vl")
    text = prompt(expected)
    ids = [p(images=[picture(RED)], text=text)["input_ids"] for p in (processor, expected)]
    assert ids[0] == ids[1]


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return BUILDERS["qwen2_5_vl"](tmp_path_factory.mktemp("qwen_folder"))


def test_smolvlm_processor_from_a_checkpoint_layout(tmp_path):
    """SmolVLM's checkpoints: the image processor in preprocessor_config.json under the
    torchvision class's name, `image_seq_len` alone in processor_config.json, a video
    processor beside them: the processor loads images only (the PIL class) with the
    folder's image_seq_len, applies the chat template without a video processor, and
    tokenizes as the test folder's does."""
    import json
    import shutil

    built = BUILDERS["smolvlm"](tmp_path / "built")
    folder = shutil.copytree(built, tmp_path / "checkpoint")
    saved = json.loads((folder / "processor_config.json").read_text())
    images = {**saved["image_processor"], "image_processor_type": "SmolVLMImageProcessor"}
    images["processor_class"] = "SmolVLMProcessor"
    (folder / "preprocessor_config.json").write_text(json.dumps(images))
    own = {"image_seq_len": saved["image_seq_len"], "processor_class": "SmolVLMProcessor"}
    (folder / "processor_config.json").write_text(json.dumps(own))
    video = {"video_processor_type": "SmolVLMVideoProcessor"}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video))
    processor = load_processor(folder, "smolvlm")
    assert type(processor.image_processor).__name__ == "SmolVLMImageProcessorPil"
    assert not hasattr(processor, "video_processor")
    assert processor.image_seq_len == saved["image_seq_len"] != 169  # (the class's default)
    expected = load_processor(built, "smolvlm")
    text = prompt(processor)
    assert text == prompt(expected)
    ids = [p(images=[picture(RED)], text=text)["input_ids"] for p in (processor, expected)]
    assert ids[0] == ids[1]


def test_a_sharded_step_sends_its_images_rope_rows_and_key_limits(monkeypatch):
    """What rank 0 sends of a step (runners/sharded.py) is what the other ranks receive:
    its images (each one's inputs in their dtypes, digest and positions; the rows each slice
    takes), M-RoPE rows and key limits, beside the plain inputs."""
    import numpy as np
    import torch.distributed as dist
    from textgen.service.engine.runners.image_encoder import ImageSlice
    from textgen.service.engine.runners.model_runner import StepInputs
    from textgen.service.engine.runners.sharded import Op, ShardGroup
    from textgen.service.engine.types import ImageInput

    sent: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group: sent.append(t.clone()))
    image = ImageInput(
        b"\x01" * 32,
        np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4),
        (3, 4, 5, 6, 9, 10),
        {"image_grid_thw": np.array([[1, 2, 3]]), "pixel_attention_mask": np.ones((2, 4), bool)},
    )
    other = ImageInput(b"\x02" * 32, np.zeros((1, 3, 4, 4), np.float32), (0, 1))
    inputs = StepInputs(
        [7, 8, 9, 10],
        [3, 4, 5, 0],
        [3, 1],
        [6, 1],
        [[0, 1], [2]],
        [2, 3],
        lora_slots=[-1, -1],
        state_slots=[-1, -1],
        images=[ImageSlice(image, 0, (0, 1, 2)), ImageSlice(other, 1, (3,))],
        key_limits=[5, 5, 5, 0],
        rope_positions=[[3, 3, 3, 9], [3, 4, 4, 9], [3, 4, 5, 9]],
    )
    group = ShardGroup(0, 2, None, None, 10, 5, torch.device("cpu"))
    group.send(Op.STEP, inputs)
    replay = iter(sent)
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group: t.copy_(next(replay)))
    op, received = ShardGroup(1, 2, None, None, 10, 5, torch.device("cpu")).receive()
    assert op is Op.STEP
    slices = received.images
    received.images = inputs.images
    assert received == inputs
    assert [(s.first_row, s.targets) for s in slices] == [(0, (0, 1, 2)), (1, (3,))]
    for got, want in zip(slices, inputs.images, strict=True):
        assert (got.image.digest, got.image.positions) == (want.image.digest, want.image.positions)
        assert np.array_equal(got.image.pixel_values, want.image.pixel_values)
        assert got.image.extra.keys() == want.image.extra.keys()
        for name, value in want.image.extra.items():
            assert got.image.extra[name].dtype == value.dtype
            assert np.array_equal(got.image.extra[name], value)
