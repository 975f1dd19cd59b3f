"""The registry of encoder kinds this project's model builds (a layout module's `kind:`): what each
kind reads from a sample, its size flags, how many tokens an item puts into the LLM sequence, and
its builder; and the model call's arguments per kind (`input_key`, counts_key, positions_key, and
for native-resolution items grids_key and rows_key; with packing DOCUMENTS_KEY, with M-RoPE
POSITION_IDS_KEY), which the data (data/sample_batch.py) produces and the model
(families/parts.py) reads. Importable without megatron-core (flags are parsed first)."""

from dataclasses import dataclass
from typing import Callable

from megatron_hetero.spec.sizes import ModelSizes


@dataclass(frozen=True)
class EncoderKind:
    name: str
    input_key: str  # the model call's argument (and the batch key) holding this kind's items
    flag_prefix: str  # its size flags: --{prefix}-num-layers, --{prefix}-hidden-size, --{prefix}-num-attention-heads
    tokens_per_item: Callable[[ModelSizes], int]  # rows an item sends into the LLM sequence
    stage_tokens: Callable[[ModelSizes], int]  # tokens an item has between its pipeline stages
    builder: str  # function in megatron_hetero.models.vlm: (sizes, tp, pgs, whole=...) -> a stage
    item_flags: str  # the flags that set an item's tokens (named where the encoder's CP must divide them)

    def size_flags(self, args) -> list[tuple[str, int]]:
        """(flag, value) for the kind's layers, hidden size and attention heads."""
        return [(f"{self.flag_prefix}-{flag}", getattr(args, f"{self.flag_prefix}_{flag.replace('-', '_')}"))
                for flag in ("num-layers", "hidden-size", "num-attention-heads")]

    def hidden_size(self, sizes: ModelSizes) -> int:
        return getattr(sizes, f"{self.flag_prefix}_hidden_size")

    def item_shape(self, sizes: ModelSizes) -> tuple[int, int]:
        """(tokens, width) of an item in the encoder: what its cost is balanced by
        (boundary.assign_items; the data loader assigns the same to decide which images to decode)."""
        return self.stage_tokens(sizes), self.hidden_size(sizes)

    def build(self, *args, **kwargs):
        from megatron_hetero.models import vlm

        return getattr(vlm, self.builder)(*args, **kwargs)


ENCODER_KINDS = {
    # An imported CLIP tower's class token travels between stages, but is not projected into the LLM.
    "vision": EncoderKind("vision", "images", "enc", lambda s: s.patches_per_image,
                          lambda s: s.patches_per_image + int(s.vision_arch.class_token), "build_vision_encoder",
                          "--image-size / --patch-size"),
    "audio": EncoderKind("audio", "audio", "audio", lambda s: s.tokens_per_clip, lambda s: s.tokens_per_clip,
                         "build_audio_encoder", "--audio-frames / 4"),
}


DOCUMENTS_KEY = "document_ids"  # the model call's argument holding a packed batch's documents [B, S]
POSITION_IDS_KEY = "position_ids"  # the model call's argument holding M-RoPE position ids [B, 3, S]


def counts_key(kind: str) -> str:
    """The model call's argument holding a kind's items per sample."""
    return f"{kind}_counts"


def positions_key(kind: str) -> str:
    """The model call's argument holding the sequence positions of a kind's rows."""
    return f"{kind}_positions"


def grids_key(kind: str) -> str:
    """The model call's argument holding a kind's native-resolution items' patch grids [n, 3]."""
    return f"{kind}_grids"


def rows_key(kind: str) -> str:
    """The model call's argument holding the rows each of a kind's items sends into the sequence [n]."""
    return f"{kind}_rows"


class UnknownKindError(ValueError):
    """An encoder whose kind this model does not build; one line naming the fix."""


def encoder_kind(module) -> EncoderKind:
    """The registered kind of an encoder module of a layout."""
    if module.kind not in ENCODER_KINDS:
        raise UnknownKindError(
            f"module {module.name}: kind {module.kind!r} is not an encoder this model builds; set "
            f"kind: to one of {', '.join(ENCODER_KINDS)}")
    return ENCODER_KINDS[module.kind]

