"""Vision encoder: ViT (patch embedding, learned positions, bidirectional TransformerBlock) + MLP
projector to the LLM hidden size, all megatron-core modules in the encoder's own TP group."""

import torch
from einops import rearrange
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models.specs import block_spec, encoder_layer_spec


class VisionEncoder(MegatronModule):
    """images [n, C, H, W] -> rows [n * patches_per_image, llm_hidden]: one row per image token."""

    def __init__(
        self,
        config: TransformerConfig,
        projector_config: TransformerConfig,
        image_size: int,
        patch_size: int,
        pg_collection: ProcessGroupCollection,
        in_channels: int = 3,
    ):
        super().__init__(config=config)
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not a multiple of patch size {patch_size}")
        self.patch_size = patch_size
        self.patches_per_image = (image_size // patch_size) ** 2
        hidden = config.hidden_size
        # Replicated over the encoder's TP group: small, and its input is the raw image. torch's
        # default init (fan-in scaled) keeps the pixel signal above the position embedding's.
        self.patch_embedding = torch.nn.Linear(in_channels * patch_size**2, hidden)
        self.position_embedding = torch.nn.Parameter(torch.empty(self.patches_per_image, hidden))
        config.init_method(self.position_embedding)
        self.decoder = TransformerBlock(
            config=config,
            spec=block_spec(encoder_layer_spec(pg_collection), config, pg_collection),
            pre_process=True,
            post_process=True,
            pg_collection=pg_collection,
        )
        self.projector = MultimodalProjector(
            projector_config,
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            projector_type="mlp",
            input_size=hidden,
            pg_collection=pg_collection,
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images in [0, 1], normalized to [-1, 1] here."""
        patches = rearrange(
            images * 2 - 1, "n c (h p) (w q) -> (h w) n (c p q)", p=self.patch_size, q=self.patch_size
        )
        x = self.patch_embedding(patches) + self.position_embedding.unsqueeze(1)
        x = self.decoder(x, attention_mask=None)  # [patches, n, hidden]
        rows = self.projector(x)  # [patches, n, llm_hidden]
        return rearrange(rows, "s n h -> (n s) h")
