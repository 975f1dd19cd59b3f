"""Encoders as pipeline stages: an input embedding with learned positions (first stage), a
bidirectional TransformerBlock of this stage's layers, and an MLP projector to the LLM hidden size
(last stage), all megatron-core modules in the encoder's own TP group. Encoders differ only in their
input embedding (vision.py, audio.py).

With context parallelism (`pg_collection.cp` of size cp > 1) each CP rank holds the r-th of cp
contiguous parts of every item's tokens (class token included: it is the first), embedded whole and
cut after the positions are added; attention gathers keys and values over the CP group
(attention.py), every other layer is per token. Its rows are its part's, item by item: the
boundary's encoder CP layout (boundary/plan.py).

Which layers a stage holds is megatron-core's rule: TransformerBlock builds
`config.num_layers / config.pipeline_model_parallel_size` layers at the offset of
`pg_collection.pp`'s rank, each layer knowing its global 1-based `layer_number`.
"""

from collections.abc import Callable

import torch
from einops import rearrange
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models.context_parallel import contiguous_part
from megatron_hetero.models.norm import SequenceParallelNorm
from megatron_hetero.models.specs import block_spec, encoder_layer_spec, encoder_uses_te


class StageEncoder(MegatronModule):
    """One pipeline stage of an encoder whose items (images, clips) have `tokens_per_item` tokens.

    forward(x): on the first stage (`pre_process`) x is the raw input of n items, which the module
    built by `input_embedding()` maps to [tokens, n, hidden]; on a later stage x is the previous stage's
    output, passed as the argument (no set_input_tensor state). A non-last stage returns hidden
    states [(class_tokens + tokens) / cp, n, hidden]; the last (`post_process`) returns projected rows
    [n * tokens, llm_hidden], item by item (row i*tokens + t is token t of item i; with CP the
    rank's part of each item's tokens).

    `class_token` puts a learned token before each item's tokens (CLIP): the others attend to it,
    it is not projected. `pre_norm` normalizes the embeddings before the first layer (CLIP).
    `block`: the TransformerBlock's spec (default: block_spec of encoder_layer_spec); `final_norm`:
    a norm after the last layer; `projector`: builds the projector, a module from [tokens, n, hidden]
    to [rows, n, llm_hidden] (default: Megatron's MLP projector from `projector_config`).
    """

    # No word embedding to share between pipeline ends (megatron-core's finalize_model_grads asks).
    share_embeddings_and_output_weights = False

    def __init__(
        self,
        config: TransformerConfig,
        projector_config: TransformerConfig,
        tokens_per_item: int,
        pg_collection: ProcessGroupCollection,
        input_embedding: Callable[[], torch.nn.Module],
        pre_process: bool = True,
        post_process: bool = True,
        class_token: bool = False,
        pre_norm: bool = False,
        block: ModuleSpec | TransformerBlockSubmodules | None = None,
        final_norm: bool = True,
        projector: Callable[[], torch.nn.Module] | None = None,
    ):
        super().__init__(config=config)
        self.tokens_per_item = tokens_per_item
        self.class_tokens = int(class_token)
        self.pre_process, self.post_process = pre_process, post_process
        self.cp_group = pg_collection.cp
        self.cp = 1 if self.cp_group is None else self.cp_group.size()
        if (self.class_tokens + tokens_per_item) % self.cp:
            raise ValueError(f"an item's {self.class_tokens + tokens_per_item} encoder tokens do not split into "
                             f"cp={self.cp} equal parts")
        hidden = config.hidden_size
        if pre_process:
            # Replicated over the encoder's TP group: small, and its input is the raw item.
            self.input_embedding = input_embedding()
            if class_token:
                self.class_embedding = torch.nn.Parameter(torch.empty(hidden))
                config.init_method(self.class_embedding)
            self.position_embedding = torch.nn.Parameter(torch.empty(self.class_tokens + tokens_per_item, hidden))
            config.init_method(self.position_embedding)
            self.pre_norm = SequenceParallelNorm(config, hidden, config.layernorm_epsilon) if pre_norm else None
        te = encoder_uses_te(config, pg_collection)
        self.decoder = TransformerBlock(
            config=config,
            spec=block or block_spec(encoder_layer_spec(pg_collection, te), config, pg_collection, te),
            # The block reads forward's argument only when pre_process is set: every stage's input
            # arrives as forward's argument here, so the block never needs set_input_tensor.
            pre_process=True,
            post_process=post_process,  # the final layernorm lives on the last stage
            post_layer_norm=final_norm,
            pg_collection=pg_collection,
        )
        if post_process:
            self.projector = projector() if projector is not None else MultimodalProjector(
                projector_config,
                MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                projector_type="mlp",
                input_size=hidden,
                pg_collection=pg_collection,
            )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's hidden states [(class_tokens + tokens) / cp, n, hidden] (after the final norm on the
        last stage): forward without the projector."""
        if self.pre_process:
            x = self.input_embedding(x)
            if self.class_tokens:
                x = torch.cat([self.class_embedding.expand(1, x.shape[1], -1), x])
            x = x + self.position_embedding.unsqueeze(1)
            if self.cp > 1:
                x = contiguous_part(x, 0, self.cp, self.cp_group.rank())
            if self.pre_norm is not None:
                x = self.pre_norm(x)
        return self.decoder(x, attention_mask=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encode(x)
        if not self.post_process:
            return x
        class_tokens = self.class_tokens if self.cp == 1 or self.cp_group.rank() == 0 else 0  # the first part's
        return rearrange(self.projector(x[class_tokens:]), "s n h -> (n s) h")
