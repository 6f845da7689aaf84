"""Mistral 3's (and Pixtral 12B's) processor without torchvision
(models/pixtral_processor.py) gives what transformers' own PixtralProcessor gives on the
same folder (support/tiny_vlm.py runs that class here from its own source): the same token
ids, pixels and image sizes for images of four sizes (one of a single patch row), alone and
together, and at Mistral Small 3.1's settings; each image written as rows of [IMG] per
merged patch row, [IMG_BREAK] after each row, [IMG_END] after the last. Where torchvision is
installed, transformers' own class is the one loaded; the class a folder names decides
(Pixtral 12B's LLaVA)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from support.tiny_vlm import (
    MISTRAL3_MERGE,
    PATCH,
    build_tiny_llava,
    build_tiny_llava_pixtral,
    build_tiny_mistral3,
    png,
    transformers_pixtral_processor,
    transformers_processor,
)
from textgen.service.models import pixtral_processor
from textgen.service.models.pixtral_processor import PixtralProcessorPil
from textgen.service.models.processors import load_processor

# (width, height): no resize, the longest edge brought to 32 (both ways), and a small one
SIZES = [(20, 24), (40, 16), (16, 40), (5, 3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_mistral3(tmp_path_factory.mktemp("mistral3"))


def picture(size, color=(200, 30, 30)):
    from PIL import Image

    return Image.open(io.BytesIO(png(color, size, stripes=True))).convert("RGB")


def test_without_torchvision_ours_is_loaded(folder):
    from transformers.utils import is_torchvision_available

    processor = load_processor(folder, "mistral3")
    if is_torchvision_available():
        assert type(processor).__name__ == "PixtralProcessor"
    else:
        assert isinstance(processor, PixtralProcessorPil)
        assert type(processor.image_processor).__name__ == "PixtralImageProcessorPil"


def test_with_torchvision_transformers_own_is_asked_for(folder, monkeypatch):
    """Where torchvision is installed, AutoProcessor loads PixtralProcessor (here, without
    it, that is transformers' refusal naming torchvision)."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        assert type(load_processor(folder, "mistral3")).__name__ == "PixtralProcessor"
        return
    monkeypatch.setattr(pixtral_processor, "is_torchvision_available", lambda: True)
    with pytest.raises(ImportError, match="Torchvision"):
        load_processor(folder, "mistral3")


def test_other_families_load_transformers_own(tmp_path):
    processor = load_processor(build_tiny_llava(tmp_path / "llava"), "llava")
    assert type(processor).__name__ == "LlavaProcessor"


def test_a_llava_folder_naming_pixtral_processor_loads_it(tmp_path):
    """Pixtral 12B is a LLaVA whose folder names PixtralProcessor: the class the folder
    names decides (ours without torchvision), not the family's LlavaProcessor."""
    from transformers.utils import is_torchvision_available

    folder = build_tiny_llava_pixtral(tmp_path / "pixtral")
    assert pixtral_processor.named_processor_class(folder, "llava") == "PixtralProcessor"
    assert pixtral_processor.named_processor_class(tmp_path, "llava") == "LlavaProcessor"
    processor = load_processor(folder, "llava")
    if is_torchvision_available():
        assert type(processor).__name__ == "PixtralProcessor"
        return
    assert isinstance(processor, PixtralProcessorPil)
    theirs, images = transformers_processor(folder), [picture((20, 24))]
    expected = theirs(images=images, text="[IMG]", return_tensors="np")
    got = processor(images=images, text="[IMG]", return_tensors="np")
    assert sorted(got.keys()) == sorted(expected.keys())
    for name in expected:  # every 4-pixel patch a token: 6 rows of 5 [IMG]
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    img = processor.tokenizer.convert_tokens_to_ids("[IMG]")
    assert (got["input_ids"] == img).sum() == 30


@pytest.mark.parametrize("sizes", [[s] for s in SIZES] + [SIZES], ids=str)
def test_equals_transformers_pixtral_processor(folder, sizes):
    ours, theirs = PixtralProcessorPil.from_pretrained(folder), transformers_processor(folder)
    assert type(theirs).__name__ == "PixtralProcessor"
    text = "".join(f"image {k}: [IMG]\n" for k in range(len(sizes)))
    images = [picture(size) for size in sizes]
    expected = theirs(images=images, text=text, return_tensors="np")
    got = ours(images=images, text=text, return_tensors="np")
    assert sorted(got.keys()) == sorted(expected.keys())
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_an_image_is_rows_of_img_tokens(folder):
    """An image resized to 24 x 24 pixels: 3 x 3 merged patches of 8 pixels, so three rows
    of three [IMG], the first two ended by [IMG_BREAK], the last by [IMG_END]."""
    processor = PixtralProcessorPil.from_pretrained(folder)
    out = processor(images=[picture((20, 24))], text="[IMG]", return_tensors="np")
    assert out["image_sizes"].tolist() == [[24, 24]]
    cell = PATCH * MISTRAL3_MERGE
    assert 24 // cell == 3
    row = "[IMG]" * 3
    expected = f"{row}[IMG_BREAK]{row}[IMG_BREAK]{row}[IMG_END]"
    assert processor.tokenizer.decode(out["input_ids"][0]) == expected


def test_equals_transformers_at_mistral_small_settings(folder):
    """Mistral Small 3.1's processor settings (14-pixel patches merged 2 x 2, longest edge
    1540): a photo-sized image and a wide one, alone and together."""
    from transformers import PixtralImageProcessorPil

    tokenizer = PixtralProcessorPil.from_pretrained(folder).tokenizer
    settings = {"patch_size": 14, "spatial_merge_size": 2}

    def images():
        return PixtralImageProcessorPil(
            size={"longest_edge": 1540}, patch_size={"height": 14, "width": 14}
        )

    ours = PixtralProcessorPil(images(), tokenizer, **settings)
    theirs = transformers_pixtral_processor()(images(), tokenizer, **settings)
    pictures = [picture((800, 600)), picture((2000, 300))]
    for shown in ([pictures[0]], [pictures[1]], pictures):
        text = "look: " + "[IMG]" * len(shown)
        expected = theirs(images=shown, text=text, return_tensors="np")
        got = ours(images=shown, text=text, return_tensors="np")
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
