"""Tiny random vision-language models, one per served family (LLaVA, LLaVA-Next, Idefics 3:
a vision tower, a projector, a Llama language model; Gemma 3; Qwen2.5-VL and Qwen3-VL,
their own towers and M-RoPE text models) with their processors (each image processor's
PIL/numpy class, no torchvision; Qwen's without its video processor), built at test
time and saved as normal Hugging Face folders; and small PNGs as data: URIs."""

from __future__ import annotations

import base64
import io
import operator
from pathlib import Path

from .tiny_model import build_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 16  # pixels a side after the processor
PATCH = 4  # -> (16 / 4)^2 = 16 image tokens per image
# the template writes an image part as <image>, as LLaVA's own templates do
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(*tokens: str):
    """The tiny tokenizer with `tokens`, the first the image placeholder its template writes."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    tokenizer.chat_template = CHAT_TEMPLATE.replace(IMAGE_TOKEN, tokens[0])
    return tokenizer


def _llama(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def _clip():
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=32,
    )


def _save(path: Path, model, processor, tokenizer, projector: str = "multi_modal_projector"):
    """Sharper logits and image features that move them (the model's `projector`); then
    the folder."""
    import torch
    from transformers import GenerationConfig

    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for p in operator.attrgetter(projector)(model.model).parameters():
            p.mul_(4.0)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_llava(path: Path, *, seed: int = 0) -> Path:
    """Save a tiny random LLaVA (float32) with its processor into `path`."""
    from transformers import (
        CLIPImageProcessorPil,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    classes = (LlavaConfig, LlavaForConditionalGeneration, CLIPImageProcessorPil, LlavaProcessor)
    return _build_llava_like(path, seed, *classes)


# LLaVA-Next's tiles: an image is resized to the pinpoint nearest its aspect, cut into
# tiles of IMAGE_SIZE, plus the whole image at IMAGE_SIZE: its tokens depend on its size
PINPOINTS = [[16, 32], [32, 16], [32, 32]]


def build_tiny_llava_next(path: Path, *, seed: int = 0) -> Path:
    """A tiny random LLaVA-Next ("anyres" tiles, `image_sizes`) with its processor."""
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )

    classes = (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )
    return _build_llava_like(path, seed, *classes, image_grid_pinpoints=PINPOINTS)


def _build_llava_like(
    path: Path, seed: int, config_class, model_class, images_class, processor_class, **tiles
) -> Path:
    """A tiny LLaVA-layout model (CLIP tower, projector, Llama) and its processor; `tiles`:
    LLaVA-Next's image_grid_pinpoints, for its config and its image processor."""
    import torch

    tokenizer = _tokenizer(IMAGE_TOKEN)
    config = config_class(
        vision_config=_clip(),
        text_config=_llama(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        **tiles,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    images = images_class(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        **tiles,
    )
    processor = processor_class(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )
    return _save(path, model, processor, tokenizer)


# Idefics 3's tiles: an image's longest edge is resized to at most TILES_EDGE, cut into
# tiles of IMAGE_SIZE (up to 2 x 2) plus a global view, each tile's 16 patches merged 2 x 2
# into 4 tokens, between <fake_token_around_image> and a <row_r_col_c> marker
TILES_EDGE = 32
SCALE = 2
IDEFICS3_TOKENS = [
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]


def build_tiny_idefics3(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Idefics 3 (SigLIP-like tower, pixel-shuffle connector, Llama)."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
    )

    tokenizer = _tokenizer(IMAGE_TOKEN, *IDEFICS3_TOKENS)
    vision = Idefics3VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
    )
    config = Idefics3Config(
        vision_config=vision,
        text_config=_llama(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=SCALE,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": TILES_EDGE}, max_image_size={"longest_edge": IMAGE_SIZE}
    )
    processor = Idefics3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_len=(IMAGE_SIZE // PATCH) ** 2 // SCALE**2,
        chat_template=tokenizer.chat_template,
    )
    return _save(path, model, processor, tokenizer, projector="connector")


# Gemma 3: the prompt's <start_of_image> becomes "\n\n<start_of_image>" + the image's
# soft tokens + "<end_of_image>\n\n"; 16 soft tokens (no pooling), more than the text
# model's sliding window (8), and they attend to each other both ways
GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
GEMMA3_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2


def build_tiny_gemma3(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Gemma 3 (SigLIP tower, Gemma 3 text with sliding and global layers)
    with its processor (Gemma3ImageProcessorPil)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    from .families import family_config

    named = _tokenizer(*GEMMA3_TOKENS.values())
    path.mkdir(parents=True, exist_ok=True)
    named.save_pretrained(path)  # reloaded with its named tokens, as Gemma 3's processor reads
    tokenizer = AutoTokenizer.from_pretrained(path, extra_special_tokens=GEMMA3_TOKENS)
    text = Gemma3TextConfig(**family_config("gemma3_text", tokenizer).to_dict())
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
    )
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in GEMMA3_TOKENS.items()}
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers starts the projection at zero: images would be blank
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 1.0)
    images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_length=GEMMA3_IMAGE_TOKENS,
        chat_template=tokenizer.chat_template,
    )
    return _save(path, model, processor, tokenizer)


# Qwen2.5-VL: an image is resized (a multiple of PATCH x MERGE a side, its pixels within
# QWEN_MIN_PIXELS .. QWEN_MAX_PIXELS) and cut into PATCH-pixel patches, each 2 x 2 of them
# merged into one token: a few dozen tokens, as many as its aspect gives. The template
# writes an image part as <|vision_start|><|image_pad|><|vision_end|>, as Qwen's own does
QWEN_TOKENS = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
QWEN_PATCH = 4
QWEN_MERGE = 2
QWEN_MIN_PIXELS = 40 * 40
QWEN_MAX_PIXELS = 56 * 56


def build_tiny_qwen2_5_vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL (windowed vision tower, patch merger, Qwen2 text with
    M-RoPE) with its processor: the PIL image processor, no video processor (it needs
    torchvision), saved under the family's class name as the checkpoints' are."""
    import torch
    from textgen.service.models.processors import images_only
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessorPil,
    )

    tokenizer = _tokenizer(*QWEN_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        IMAGE_TOKEN, "<|vision_start|><|image_pad|><|vision_end|>"
    )
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in QWEN_TOKENS}
    llama = _llama(tokenizer).to_dict()
    text = {k: llama[k] for k in ("vocab_size", "hidden_size", "intermediate_size")}
    text |= {k: llama[k] for k in ("num_hidden_layers", "num_attention_heads")}
    config = Qwen2_5_VLConfig(
        text_config={
            **text,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            # head_dim 16: 8 frequencies, 2 for time, 3 each for height and width
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": QWEN_PATCH,
            "spatial_merge_size": QWEN_MERGE,
            "temporal_patch_size": 2,
            "window_size": 2 * QWEN_PATCH * QWEN_MERGE,  # windows of 2 x 2 merged patches
            "fullatt_block_indexes": [1],
            "out_hidden_size": 64,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    images = Qwen2VLImageProcessorPil(
        patch_size=QWEN_PATCH,
        merge_size=QWEN_MERGE,
        temporal_patch_size=2,
        min_pixels=QWEN_MIN_PIXELS,
        max_pixels=QWEN_MAX_PIXELS,
    )
    processor = images_only(Qwen2_5_VLProcessor)(
        image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
    return _save(path, model, processor, tokenizer, projector="visual.merger")


def build_tiny_qwen3_vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Qwen3-VL (vision tower with deepstack mergers after its first and
    second blocks, Qwen3 text with interleaved M-RoPE) with its processor, images only."""
    import torch
    from textgen.service.models.processors import images_only
    from transformers import (
        Qwen2VLImageProcessorPil,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
    )

    tokenizer = _tokenizer(*QWEN_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        IMAGE_TOKEN, "<|vision_start|><|image_pad|><|vision_end|>"
    )
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in QWEN_TOKENS}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 1024,
            # 8 frequencies: time, height and width interleaved
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": QWEN_PATCH,
            "spatial_merge_size": QWEN_MERGE,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,  # an 8 x 8 grid, interpolated to the image's
            "deepstack_visual_indexes": [0, 1],
            "out_hidden_size": 64,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    with torch.no_grad():  # deepstack features that move the answer
        for p in model.model.visual.deepstack_merger_list.parameters():
            p.mul_(4.0)
    images = Qwen2VLImageProcessorPil(
        patch_size=QWEN_PATCH,
        merge_size=QWEN_MERGE,
        temporal_patch_size=2,
        min_pixels=QWEN_MIN_PIXELS,
        max_pixels=QWEN_MAX_PIXELS,
    )
    processor = images_only(Qwen3VLProcessor)(
        image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
    return _save(path, model, processor, tokenizer, projector="visual.merger")


BUILDERS = {
    "llava": build_tiny_llava,
    "llava_next": build_tiny_llava_next,
    "idefics3": build_tiny_idefics3,
    "gemma3": build_tiny_gemma3,
    "qwen2_5_vl": build_tiny_qwen2_5_vl,
    "qwen3_vl": build_tiny_qwen3_vl,
}


def png(color: tuple[int, int, int], size: tuple[int, int] = (20, 24), *, stripes=False) -> bytes:
    """A small PNG of one colour (or with stripes of another)."""
    from PIL import Image

    image = Image.new("RGB", size, color)
    if stripes:
        for x in range(0, size[0], 3):
            for y in range(size[1]):
                image.putpixel((x, y), (255 - color[0], 255 - color[1], 255 - color[2]))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
