"""A vision-language model's processor for images only. Qwen2-VL's, Qwen2.5-VL's,
Qwen3-VL's and SmolVLM's processor classes take a video processor too, whose class needs
torchvision (not a dependency of textgen), and AutoProcessor loads it for them. So for
those families (architectures.py, IMAGES_ONLY_PROCESSORS) the processor is the family's
own class, rebuilt without that argument: it loads the folder's image processor (the PIL
class where torchvision is missing), tokenizer and the class's own settings (SmolVLM's
`image_seq_len`), and turns prompts and images into ids and pixels as the family's class
does. A video part stays refused where the faces parse it. PixtralProcessor (Mistral 3's,
Pixtral 12B's) can't be imported at all without torchvision: where a folder names it,
textgen's equivalent is loaded (pixtral_processor.py)."""

from __future__ import annotations

import functools

from .architectures import IMAGES_ONLY_PROCESSORS


@functools.cache
def images_only(processor_class: type) -> type:
    """`processor_class` without its video processor: the same name (as its folders'
    processor_config.json name it) and everything else."""
    from transformers import ProcessorMixin

    def __init__(
        self, image_processor=None, tokenizer=None, chat_template=None, image_seq_len=None, **kwargs
    ):
        # from_pretrained passes on only the saved parameters this code names (SmolVLM's
        # image_seq_len); one not given keeps the family's default
        if image_seq_len is not None:
            kwargs["image_seq_len"] = image_seq_len
        processor_class.__init__(
            self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs
        )

    # SmolVLM's apply_chat_template only adds a video's defaults, reading the video
    # processor it hasn't: the template is applied as ProcessorMixin's (Qwen's classes
    # keep that one)
    body = {"__init__": __init__, "apply_chat_template": ProcessorMixin.apply_chat_template}
    return type(processor_class.__name__, (processor_class,), body)


def load_processor(path, model_type: str | None, **kwargs):
    """The processor of the vision-language model in folder `path`, from its own files
    (from_pretrained's `kwargs`): the family's class images only where it takes a video
    processor, our torchvision-free equivalent where transformers' needs torchvision, else
    AutoProcessor's."""
    import transformers

    from .pixtral_processor import torchvision_free

    if class_name := IMAGES_ONLY_PROCESSORS.get(model_type):
        return images_only(getattr(transformers, class_name)).from_pretrained(path, **kwargs)
    if (substitute := torchvision_free(path, model_type)) is not None:
        return substitute.from_pretrained(path, local_files_only=True)
    return transformers.AutoProcessor.from_pretrained(path, **kwargs)
