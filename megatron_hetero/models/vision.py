"""Vision encoder: a ViT (patch embedding, learned positions, bidirectional TransformerBlock) + MLP
projector to the LLM hidden size, buildable as a pipeline stage (see encoder.py)."""

import torch
from einops import rearrange
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models.encoder import StageEncoder
from megatron_hetero.spec.sizes import VisionArch


class PatchEmbedding(torch.nn.Linear):
    """images [n, C, H, W] -> [patches, n, hidden]: one linear map of each patch's pixels (a
    convolution with stride = kernel = patch size; its weight flattened in (c p q) order).
    torch's default init (fan-in scaled) keeps the pixel signal above the position embedding's.

    `rescale` maps images in [0, 1] to [-1, 1]; without, pixel values arrive normalized (as Hugging
    Face image processors give them)."""

    def __init__(self, in_channels: int, patch_size: int, hidden: int, bias: bool = True, rescale: bool = True):
        super().__init__(in_channels * patch_size**2, hidden, bias=bias)
        self.patch_size = patch_size
        self.rescale = rescale

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        pixels = images * 2 - 1 if self.rescale else images
        return super().forward(rearrange(pixels, "n c (h p) (w q) -> (h w) n (c p q)", p=p, q=p))


class VisionEncoder(StageEncoder):
    """images [n, C, H, W] -> rows [n * patches_per_image, llm_hidden] on the last stage."""

    def __init__(
        self,
        config: TransformerConfig,
        projector_config: TransformerConfig,
        image_size: int,
        patch_size: int,
        pg_collection: ProcessGroupCollection,
        in_channels: int = 3,
        pre_process: bool = True,
        post_process: bool = True,
        arch: VisionArch = VisionArch(),
    ):
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not a multiple of patch size {patch_size}")
        super().__init__(
            config,
            projector_config,
            (image_size // patch_size) ** 2,
            pg_collection,
            lambda: PatchEmbedding(in_channels, patch_size, config.hidden_size, arch.patch_bias, arch.rescale_pixels),
            pre_process,
            post_process,
            arch.class_token,
            arch.pre_norm,
        )
