"""InternVL's images in conversation data, as transformers' InternVLProcessor prepares them: each image
becomes tiles of the vision tower's size (dynamic tiling: the grid of min..max tiles whose aspect
ratio is closest to the image's, and a thumbnail of the whole image when there is more than one
tile), each tile normalized with the model's mean and std, and its `<image>` tag becomes
`<img>` + `<IMG_CONTEXT>` x (rows per tile x tiles) + `</img>`.

The tiling and pixels are transformers' own (GotOcr2ImageProcessorPil with the model directory's
preprocessor_config.json, cropping to patches as InternVLProcessor asks): the tile count comes from
the image's size alone (every rank, no decoding), the pixels only where a rank encodes the image.
The PIL backend always, so the pixels are the same with or without torchvision installed.
"""

import json
from pathlib import Path

import torch

from megatron_hetero.hf.rules import HFMappingError
from megatron_hetero.models.sizes import ModelSizes

# preprocessor_config.json fields the tiles depend on (the rest are the processor's defaults).
SETTINGS = ("size", "min_patches", "max_patches", "image_mean", "image_std", "resample", "do_rescale",
            "rescale_factor", "do_normalize", "do_convert_rgb")
# InternVLProcessor's images_kwargs: it crops to patches whatever the image processor's file says.
CROP = {"crop_to_patches": True}
START, END = "<img>", "</img>"  # transformers' InternVL tokenizers: start_image_token, end_image_token


def processor_settings(model_dir: str, config) -> dict:
    """The image processor's settings of an InternVL model directory, checked against its vision tower."""
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        raise HFMappingError(f"{model_dir} has no preprocessor_config.json; copy the model's image processor files "
                             f"into it (InternVL's tiles and normalization come from there)")
    values = json.loads(path.read_text())
    settings = {key: values[key] for key in SETTINGS if key in values}
    tile = settings.get("size", {})
    image = config.vision_config.image_size
    image = image if isinstance(image, int) else image[0]
    if (tile.get("height"), tile.get("width")) != (image, image):
        raise HFMappingError(f"{path}: size {tile} is not the vision tower's {image} x {image} tiles")
    return settings


class InternVLImages:
    """The data's image processing for InternVL (data/media.py's ImageProcessing): tiles of
    `sizes.image_size` pixels, each `rows` LLM rows and `1 + patches` encoder tokens (its cost)."""

    def __init__(self, sizes: ModelSizes, settings: dict, hf_config: dict):
        from transformers import GotOcr2ImageProcessorPil

        from megatron_hetero.families.internvl.vision import InternVLVisionArch

        self.processor = GotOcr2ImageProcessorPil(**settings)
        self.size = sizes.image_size
        self.rows = sizes.patches_per_image // InternVLVisionArch.of(sizes).pixel_shuffle**2
        self.encoder_tokens = 1 + sizes.patches_per_image
        self.image_token_id = hf_config["image_token_id"]

    def tiles(self, width: int, height: int) -> int:
        """Tiles (thumbnail included) of an image of this size."""
        return self.processor.get_number_of_image_patches(height, width, CROP)

    def token_ids(self, tokenizer) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
        """(prefix, placeholder, suffix) ids of an `<image>` tag: `<img>`, `<IMG_CONTEXT>` per row, `</img>`."""
        ids = []
        for token in (START, END):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise HFMappingError(f"the tokenizer has no {token} token; use the InternVL model's own tokenizer")
            ids.append(token_id)
        return (ids[0],), self.image_token_id, (ids[1],)

    def pixels(self, image) -> torch.Tensor:
        """[tiles, 3, size, size] of a PIL image, row-major tiles then the thumbnail."""
        return self.processor(image, return_tensors="pt", **CROP)["pixel_values"]
