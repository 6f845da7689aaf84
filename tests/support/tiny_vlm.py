"""Tiny random vision-language models, one per served family (LLaVA, LLaVA-Next, Idefics 3,
SmolVLM, Gemma 3, Mistral 3, PaliGemma, Qwen2-VL, Qwen2.5-VL, Qwen3-VL: a vision tower, a
projector, a language model; and Pixtral 12B's LLaVA) with their processors (each image
processor's PIL/numpy class, no torchvision; Qwen's and SmolVLM's without their video
processor), built at test time and saved as normal Hugging Face folders; transformers' own
processor of such a folder (the tests' reference); and small PNGs as data: URIs."""

from __future__ import annotations

import base64
import importlib.machinery
import io
import operator
from pathlib import Path

from .tiny_model import build_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 16  # pixels a side after the processor
PATCH = 4  # -> (16 / 4)^2 = 16 image tokens per image
# the vision towers' sizes (CLIP, SigLIP, Idefics 3's, Pixtral's config classes all take them)
TOWER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH,
}
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

    return CLIPVisionConfig(**TOWER, projection_dim=32)


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
    import transformers

    return _build_idefics3_layout(path, seed, "Idefics3", transformers.Idefics3Processor)


# SmolVLM: Idefics 3's model and tiles under its own classes; its processor writes an
# image alone (no tiles) as <fake_token_around_image><global-img> + its tokens, and its
# class takes a video processor (torchvision): built here without one, as Qwen's
def build_tiny_smolvlm(path: Path, *, seed: int = 0) -> Path:
    """A tiny random SmolVLM (SigLIP-like tower, pixel-shuffle connector, Llama) with its
    processor (SmolVLMImageProcessorPil), images only."""
    import transformers
    from textgen.service.models.processors import images_only

    return _build_idefics3_layout(path, seed, "SmolVLM", images_only(transformers.SmolVLMProcessor))


def _build_idefics3_layout(path: Path, seed: int, family: str, processor_class) -> Path:
    """Idefics 3's layout under `family`'s classes (Idefics3Config, ...), its processor
    `processor_class`."""
    import torch
    import transformers

    def named(suffix: str):
        return getattr(transformers, family + suffix)

    tokenizer = _tokenizer(IMAGE_TOKEN, *IDEFICS3_TOKENS)
    config = named("Config")(
        vision_config=named("VisionConfig")(**TOWER),
        text_config=_llama(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=SCALE,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = named("ForConditionalGeneration")(config)
    images = named("ImageProcessorPil")(
        size={"longest_edge": TILES_EDGE}, max_image_size={"longest_edge": IMAGE_SIZE}
    )
    processor = processor_class(
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
    vision = SiglipVisionConfig(**TOWER)
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


# Mistral 3: a Pixtral tower's 4-pixel patches merged 2 x 2, so an image is resized to
# whole 8-pixel cells, its longest edge at most MISTRAL3_EDGE, and written as a row of [IMG]
# per cell row, each ended by [IMG_BREAK], the last by [IMG_END]
MISTRAL3_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
MISTRAL3_MERGE = 2
MISTRAL3_EDGE = 32


def build_tiny_mistral3(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Mistral 3 (Pixtral tower, patch merger, Mistral text) with its
    processor: PixtralProcessor's files (models/pixtral_processor.py's equivalent writes
    them here, where torchvision is missing), its image processor PixtralImageProcessorPil."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = {"spatial_merge_size": MISTRAL3_MERGE}
    classes = (Mistral3Config, Mistral3ForConditionalGeneration)
    return _build_pixtral_like(path, seed, *classes, MISTRAL3_MERGE, **config)


def build_tiny_llava_pixtral(path: Path, *, seed: int = 0) -> Path:
    """A tiny random LLaVA with a Pixtral tower, Pixtral 12B's layout
    (mistral-community/pixtral-12b: model_type llava, every patch a token, no merger, the
    "full" feature strategy) and its PixtralProcessor's files, as Mistral 3's."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = {
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
    }
    classes = (LlavaConfig, LlavaForConditionalGeneration)
    return _build_pixtral_like(path, seed, *classes, 1, **config)


def _build_pixtral_like(
    path: Path, seed: int, config_class, model_class, merge: int, **config
) -> Path:
    """A tiny model over a Pixtral tower (Mistral text beneath, `merge` x `merge` patches a
    token) and PixtralProcessor's files."""
    import torch
    from textgen.service.models.pixtral_processor import PixtralProcessorPil
    from transformers import MistralConfig, PixtralImageProcessorPil, PixtralVisionConfig

    tokenizer = _tokenizer(*MISTRAL3_TOKENS)
    vision = PixtralVisionConfig(**{**TOWER, "image_size": MISTRAL3_EDGE}, head_dim=16)
    text = MistralConfig(**{**_llama(tokenizer).to_dict(), "sliding_window": None})
    model_config = config_class(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids(MISTRAL3_TOKENS[0]),
        tie_word_embeddings=False,
        **config,
    )
    torch.manual_seed(seed)
    model = model_class(model_config)
    images = PixtralImageProcessorPil(
        size={"longest_edge": MISTRAL3_EDGE}, patch_size={"height": PATCH, "width": PATCH}
    )
    processor = PixtralProcessorPil(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=PATCH,
        spatial_merge_size=merge,
        chat_template=tokenizer.chat_template,
    )
    return _name_pixtral_processor(_save(path, model, processor, tokenizer))


def _name_pixtral_processor(path: Path) -> Path:
    """The folder's processor_config.json naming PixtralProcessor, as Mistral's own folders
    do, so that transformers' AutoProcessor loads it where torchvision is installed."""
    import json

    processor_config = path / "processor_config.json"
    saved = json.loads(processor_config.read_text())
    processor_config.write_text(json.dumps({**saved, "processor_class": "PixtralProcessor"}))
    return path


# PaliGemma: "<image>" x 16 (no pooling), then bos, the prompt and "\n", the processor's
# layout; no chat template, as most checkpoints have none. The whole prompt attends to
# itself both ways (its prefix-LM)
PALIGEMMA_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2


def build_tiny_paligemma(path: Path, *, seed: int = 0) -> Path:
    """A tiny random PaliGemma (SigLIP tower, linear projector, Gemma) with its processor
    (SiglipImageProcessorPil), which adds its <image>, <locNNNN> and <segNNN> tokens to the
    tokenizer before the model's vocabulary is sized."""
    import torch
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    images = SiglipImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_seq_length=PALIGEMMA_IMAGE_TOKENS
    )
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)
    text = GemmaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.2,  # sharper attention: the prefix's both ways show in the answer
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    vision = SiglipVisionConfig(**TOWER)
    config = PaliGemmaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=processor.image_token_id,
        vocab_size=len(tokenizer),
        projection_dim=text.hidden_size,
        hidden_size=text.hidden_size,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = PaliGemmaForConditionalGeneration(config)
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


def _qwen_tokenizer():
    tokenizer = _tokenizer(*QWEN_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        IMAGE_TOKEN, "<|vision_start|><|image_pad|><|vision_end|>"
    )
    return tokenizer


def _qwen_ids(tokenizer) -> dict:
    """The config's ids of Qwen's image, video and vision start and end tokens."""
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in QWEN_TOKENS}
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def _qwen_image_processor():
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=QWEN_PATCH,
        merge_size=QWEN_MERGE,
        temporal_patch_size=2,
        min_pixels=QWEN_MIN_PIXELS,
        max_pixels=QWEN_MAX_PIXELS,
    )


def build_tiny_qwen2_vl(path: Path, *, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL (vision tower of full attention, patch merger, Qwen2 text
    with M-RoPE) with its processor, images only: Qwen2.5-VL's layout and processor."""
    import torch
    from textgen.service.models.processors import images_only
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    tokenizer = _qwen_tokenizer()
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            # head_dim 16: 8 frequencies, 2 for time, 3 each for height and width
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
            "initializer_range": 0.1,  # sharper: the decodes' rotary positions move the answer
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,  # the merger's output: the text model's hidden size
            "mlp_ratio": 2,
            "num_heads": 2,
            "patch_size": QWEN_PATCH,
            "spatial_merge_size": QWEN_MERGE,
            "temporal_patch_size": 2,
        },
        **_qwen_ids(tokenizer),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    processor = images_only(Qwen2VLProcessor)(
        image_processor=_qwen_image_processor(),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    return _save(path, model, processor, tokenizer, projector="visual.merger")


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
    )

    tokenizer = _qwen_tokenizer()
    ids = _qwen_ids(tokenizer)
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
        **ids,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    images = _qwen_image_processor()
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
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
    )

    tokenizer = _qwen_tokenizer()
    ids = _qwen_ids(tokenizer)
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
        **ids,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    with torch.no_grad():  # deepstack features that move the answer
        for p in model.model.visual.deepstack_merger_list.parameters():
            p.mul_(4.0)
    images = _qwen_image_processor()
    processor = images_only(Qwen3VLProcessor)(
        image_processor=images, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )
    return _save(path, model, processor, tokenizer, projector="visual.merger")


BUILDERS = {
    "llava": build_tiny_llava,
    "llava_next": build_tiny_llava_next,
    "idefics3": build_tiny_idefics3,
    "smolvlm": build_tiny_smolvlm,
    "gemma3": build_tiny_gemma3,
    "mistral3": build_tiny_mistral3,
    "llava_pixtral": build_tiny_llava_pixtral,
    "paligemma": build_tiny_paligemma,
    "qwen2_vl": build_tiny_qwen2_vl,
    "qwen2_5_vl": build_tiny_qwen2_5_vl,
    "qwen3_vl": build_tiny_qwen3_vl,
}


def transformers_processor(path: Path):
    """transformers' own processor of a model folder, the tests' reference: AutoProcessor's,
    but transformers' PixtralProcessor where the folder names it (Mistral 3, Pixtral 12B) and
    torchvision isn't installed, and Qwen's and SmolVLM's own class without the video
    processor that needs it."""
    import json

    from textgen.service.models.architectures import IMAGES_ONLY_PROCESSORS
    from textgen.service.models.processors import load_processor
    from transformers import AutoConfig, AutoProcessor

    model_type = AutoConfig.from_pretrained(path).model_type
    named = json.loads((Path(path) / "processor_config.json").read_text()).get("processor_class")
    if named == "PixtralProcessor":
        return transformers_pixtral_processor().from_pretrained(path)
    if model_type in IMAGES_ONLY_PROCESSORS:
        return load_processor(path, model_type)
    return AutoProcessor.from_pretrained(path)


def transformers_pixtral_processor():
    """transformers' PixtralProcessor class; where torchvision isn't installed, its module
    run from its own source with its one torchvision import (a helper only
    `_get_num_multimodal_tokens` calls) read from the PIL image processor's module, which
    has the same helper."""
    import importlib.util
    import sys

    from transformers.models import pixtral
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        from transformers import PixtralProcessor

        return PixtralProcessor
    name = "transformers.models.pixtral.processing_pixtral_reference"
    if name not in sys.modules:
        source = str(Path(pixtral.__path__[0]) / "processing_pixtral.py")
        spec = importlib.util.spec_from_file_location(name, source, loader=_PilImport(name, source))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # (auto_docstring reads the class's module)
        spec.loader.exec_module(module)
    return sys.modules[name].PixtralProcessor


class _PilImport(importlib.machinery.SourceFileLoader):
    """transformers' processing_pixtral.py, its one torchvision import read from the PIL
    image processor's module."""

    TORCHVISION = b"from .image_processing_pixtral import get_resize_output_image_size"
    PIL = TORCHVISION.replace(b"image_processing_", b"image_processing_pil_")

    def get_data(self, path):
        source = super().get_data(path)
        assert source.count(self.TORCHVISION) == 1, "transformers' processing_pixtral.py changed"
        return source.replace(self.TORCHVISION, self.PIL)

    def path_stats(self, path):
        raise OSError("no stats: never the unchanged file's cached bytecode")


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
