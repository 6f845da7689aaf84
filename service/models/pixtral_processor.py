"""Mistral 3's and Pixtral 12B's processor where torchvision isn't installed: the
torchvision-free equivalent of transformers' `PixtralProcessor`.

transformers 5.24's PixtralProcessor (models/pixtral/processing_pixtral.py) is declared
`@requires(backends=("torchvision", "torch"))`, and its module imports a helper from the
torchvision image processor's module, so it can't even be imported without torchvision; its
image processor has a PIL class (`PixtralImageProcessorPil`), which AutoImageProcessor picks
there. `PixtralProcessorPil` is PixtralProcessor's own logic on ProcessorMixin: the images
processed with the patch size times the spatial merge size, and each image's `[IMG]`
placeholder expanded, from its processed `image_sizes`, into rows of `[IMG]` tokens (one per
merged patch: the projector's feature rows) each ended by `[IMG_BREAK]`, the last by
`[IMG_END]`. It leaves out PixtralProcessor's `_get_num_multimodal_tokens` (a count for
callers that have no image yet), which is the one use of the torchvision module's helper.

models/processors.py loads it where a folder names PixtralProcessor (Mistral 3's, and
Pixtral 12B's, a LLaVA with a Pixtral tower) and it can't be imported (`torchvision_free`):
with torchvision installed, transformers' own class is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from transformers.processing_utils import ProcessorMixin
from transformers.utils import is_torchvision_available


class PixtralProcessorPil(ProcessorMixin):
    """PixtralProcessor's image-token expansion, over `PixtralImageProcessorPil`. (Its name
    holds "PixtralProcessor", so ProcessorMixin.from_pretrained loads the tokenizer as it
    does for PixtralProcessor: TokenizersBackend.)"""

    text_kwargs: ClassVar[dict] = {"return_tensors": "pt"}
    images_kwargs: ClassVar[dict] = {"return_tensors": "pt"}

    def __init__(
        self,
        image_processor=None,
        tokenizer=None,
        patch_size: int = 16,
        spatial_merge_size: int = 1,
        chat_template=None,
        image_token="[IMG]",
        image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]",
        **kwargs,
    ):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.patch_size = patch_size
        self.spatial_merge_size = spatial_merge_size
        self.image_token = image_token
        self.image_break_token = image_break_token
        self.image_end_token = image_end_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        self.image_break_token_id = tokenizer.convert_tokens_to_ids(image_break_token)
        self.image_end_token_id = tokenizer.convert_tokens_to_ids(image_end_token)

    @property
    def image_token_ids(self) -> list[int]:
        return [self.image_token_id, self.image_break_token_id, self.image_end_token_id]

    def _process_images(self, images, **images_kwargs):
        # sizes rounded to whole merged patches: each image's [IMG] rows are the merger's
        images_kwargs["patch_size"] = self.patch_size * self.spatial_merge_size
        return super()._process_images(images, **images_kwargs)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        """The image's tokens: a row of [IMG] per merged patch row, each ended by
        [IMG_BREAK], the last by [IMG_END] instead."""
        merged_patch = self.patch_size * self.spatial_merge_size
        height, width = image_inputs["image_sizes"][image_idx]
        row = self.image_token * (width // merged_patch)
        rows = [row + self.image_break_token] * (height // merged_patch)
        rows[-1] = row + self.image_end_token
        return "".join(rows)

    @property
    def model_input_names(self):
        tokenizer_input_names = self.tokenizer.model_input_names
        image_processor_input_names = self.image_processor.model_input_names
        return tokenizer_input_names + image_processor_input_names + ["image_sizes"]


# the processors transformers can't import without torchvision, and ours in their place
_TORCHVISION_FREE = {"PixtralProcessor": PixtralProcessorPil}


def torchvision_free(path, model_type: str | None) -> type | None:
    """The processor class to load for the folder `path` of family `model_type` in
    transformers' place: this module's equivalent where torchvision isn't installed and the
    processor the folder names needs it (Mistral 3's, Pixtral 12B's PixtralProcessor, the
    latter a LLaVA); None: transformers' own."""
    substitute = _TORCHVISION_FREE.get(named_processor_class(path, model_type))
    return substitute if substitute is not None and not is_torchvision_available() else None


# the files whose "processor_class" AutoProcessor reads, in its order
_NAMING_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def named_processor_class(path, model_type: str | None) -> str | None:
    """The processor class AutoProcessor loads for the folder `path`: the first
    "processor_class" its files name, else the family's (`model_type`'s) own."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    for name in _NAMING_FILES:
        try:
            named = json.loads((Path(path) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(named, dict) and isinstance(named.get("processor_class"), str):
            return named["processor_class"]
    return PROCESSOR_MAPPING_NAMES.get(model_type or "")
