"""Hugging Face model directories (config.json + *.safetensors) into our full state dict and back."""

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_hetero.hf.family import Family
from megatron_hetero.hf.registry import family_of
from megatron_hetero.hf.rules import HFMappingError
from megatron_hetero.models.sizes import ModelSizes


@dataclass
class Imported:
    """family; config: the family's Hugging Face config (an export's base_config); sizes: `base` with
    the family's module set from it; state: our module's full (TP1/PP1) state dict, in the files' dtype."""

    family: Family
    config: object
    sizes: ModelSizes
    state: dict[str, torch.Tensor]


def import_hf(path: str | Path, base: ModelSizes = ModelSizes()) -> Imported:
    """Read a Hugging Face model directory (several *.safetensors shards allowed)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise HFMappingError(f"{path} holds no *.safetensors file; save the model with save_pretrained "
                             f"(safetensors is its default)")
    family, config = family_of(AutoConfig.from_pretrained(path))
    sizes = family.sizes(config, base)
    hf_state = {}
    for file in files:
        hf_state.update(load_file(file))
    return Imported(family, config, sizes, family.to_ours(hf_state, sizes))


def export_hf(path: str | Path, family: Family, sizes: ModelSizes, state: dict[str, torch.Tensor],
              base_config=None) -> None:
    """Write our module's full state dict as a Hugging Face directory (config.json + model.safetensors)
    that transformers' from_pretrained loads; base_config: see Family.config."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    family.config(sizes, base_config).save_pretrained(path)
    tensors = {name: t.contiguous() for name, t in family.to_hf(state, sizes).items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
