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

from megatron_hetero.convert.rules import HFMappingError
from megatron_hetero.data.chat import TokenizerError
from megatron_hetero.data.images import ImageSpec, open_rgb
from megatron_hetero.data.media import ImageItems, ImageTokens, TileImages
from megatron_hetero.data.sample_batch import Media
from megatron_hetero.spec.sizes import ModelSizes

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


class InternVLImages(TileImages):
    """data/media.py's ImageProcessing for InternVL: tiles of `sizes.image_size` pixels, each sending
    `rows` rows into the LLM (its patches after the pixel shuffle) and running `1 + patches` tokens
    (the class token) through the encoder. settings: model.json's "processor"; config: its Hugging
    Face config."""

    def __init__(self, sizes: ModelSizes, settings: dict, config: dict):
        from transformers import GotOcr2ImageProcessorPil

        from megatron_hetero.families.internvl.vision import InternVLVisionArch

        rows = sizes.patches_per_image // InternVLVisionArch.of(sizes).pixel_shuffle**2
        super().__init__(ImageSpec(sizes.image_size), rows, 1 + sizes.patches_per_image)
        self.processor = GotOcr2ImageProcessorPil(**settings)
        self.image_token_id = config["image_token_id"]

    def items(self, width: int, height: int) -> ImageItems:
        tiles = self.processor.get_number_of_image_patches(height, width, CROP)
        return ImageItems((self.rows_per_item,) * tiles, (self.tokens_per_item,) * tiles)

    def tokens(self, tokenizer) -> ImageTokens:
        """`<img>`, `<IMG_CONTEXT>` per row, `</img>` (the tokenizer's ids of the two tags)."""
        start, end = (tokenizer.token_id(token) for token in (START, END))
        if start is None or end is None:
            raise TokenizerError(f"the tokenizer in {tokenizer.directory} has no {START if start is None else END} "
                                 f"token; use the InternVL model's own tokenizer (--tokenizer-model HF_DIR)")
        return ImageTokens((start,), self.image_token_id, (end,))

    def media(self, images: list[ImageItems], positions: torch.Tensor) -> Media:
        media = super().media(images, positions)
        media.rows = torch.full((len(media.items),), self.rows_per_item, dtype=torch.long)
        return media

    def pixels(self, source) -> torch.Tensor:
        """[tiles, 3, size, size] of an image file, row-major tiles then the thumbnail; raises ImageError."""
        return self.processor(open_rgb(source), return_tensors="pt", **CROP)["pixel_values"]

    def hf_inputs(self, input_ids: torch.Tensor, media: Media, items: list[ImageItems]) -> dict:
        """transformers' forward arguments beside input_ids for a sample's decoded media (hf compare)."""
        return {"pixel_values": media.items} if len(media.items) else {}


def build_media(sizes: ModelSizes, settings: dict, config: dict) -> InternVLImages:
    return InternVLImages(sizes, settings, config)
