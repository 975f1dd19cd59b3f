"""Hugging Face model directories (config.json, *.safetensors, preprocessor_config.json) into our full
state dict and back."""

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from megatron_hetero.convert.family import Family
from megatron_hetero.convert.progress import Progress, quiet, read_safetensors
from megatron_hetero.convert.registry import family_of
from megatron_hetero.convert.rules import HFMappingError
from megatron_hetero.spec.sizes import ModelSizes

PROCESSOR_FILE = "preprocessor_config.json"


@dataclass
class Imported:
    """family; config: the family's Hugging Face config (an export's base_config); sizes: `base` with
    the family's module set from it (a vision tower's pixel normalization its image processor's);
    state: our module's full (TP1/PP1) state dict, in the files' dtype; untrained: the files' tensors
    our module does not hold, written back unchanged by export_hf; prefix: where the files keep our
    keys; processor: the image processor's config (vision), written back on export."""

    family: Family
    config: object
    sizes: ModelSizes
    state: dict[str, torch.Tensor]
    untrained: dict[str, torch.Tensor] = field(default_factory=dict)
    prefix: str = ""
    processor: dict | None = None


def pixel_normalization(family: Family, processor: dict | None) -> tuple:
    """(mean, std) of a vision tower's inputs in [0, 1]: its image processor config's, else the
    family's default processor's."""
    if processor is None:
        return family.pixels
    if not processor.get("do_rescale", True) or abs(processor.get("rescale_factor", 1 / 255) - 1 / 255) > 1e-12:
        raise HFMappingError(f"{PROCESSOR_FILE}: only pixels rescaled by 1/255 map onto our data (do_rescale, "
                             f"rescale_factor); save the model's processor with its defaults")
    if not processor.get("do_normalize", True):
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    mean, std = processor.get("image_mean"), processor.get("image_std")
    default_mean, default_std = family.pixels
    return tuple(mean or default_mean), tuple(std or default_std)


def import_hf(path: str | Path, base: ModelSizes = ModelSizes(), progress: Progress | None = None) -> Imported:
    """Read a Hugging Face model directory (several *.safetensors shards allowed), each tensor read
    advancing `progress`."""
    from transformers import AutoConfig

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise HFMappingError(f"{path} holds no *.safetensors file; save the model with save_pretrained "
                             f"(safetensors is its default)")
    top = AutoConfig.from_pretrained(path)
    family, config = family_of(top)
    sizes = family.sizes(config, base)
    processor = None
    if family.module == "vision":
        processor_file = Path(path) / PROCESSOR_FILE
        processor = json.loads(processor_file.read_text()) if processor_file.is_file() else None
        arch = replace(sizes.vision_arch, pixel_normalization=pixel_normalization(family, processor))
        sizes = replace(sizes, vision_arch=arch)
    hf_state = read_safetensors(files, progress or quiet())
    # A text + vision checkpoint (config is its vision part): the vision tower alone is the model.
    untrained = family.untrained(hf_state, whole_file=config is top)
    return Imported(family, config, sizes, family.to_ours(hf_state, sizes), untrained, family.prefix(hf_state),
                    processor)


def export_hf(path: str | Path, family: Family, sizes: ModelSizes, state: dict[str, torch.Tensor],
              base_config=None, untrained: dict[str, torch.Tensor] | None = None, prefix: str = "",
              processor: dict | None = None) -> None:
    """Write our module's full state dict as a Hugging Face directory (config.json + model.safetensors
    [+ preprocessor_config.json]) that transformers' from_pretrained loads; base_config: see
    Family.config; untrained, prefix, processor: an import's (Imported), so that nothing it read is
    lost."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    family.config(sizes, base_config).save_pretrained(path)
    tensors = {**family.to_hf(state, sizes, prefix), **(untrained or {})}
    save_file({name: t.contiguous() for name, t in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    if processor is not None:
        (path / PROCESSOR_FILE).write_text(json.dumps(processor, indent=2))
