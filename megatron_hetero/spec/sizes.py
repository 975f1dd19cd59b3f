"""Model sizes and architecture choices, importable without megatron-core (flag parsing happens
before any heavy import)."""

import math
from dataclasses import asdict, dataclass, field, fields

from megatron_hetero.spec.json_file import load_json

# The audio front end's two stride-2 convolutions: one token per 4 spectrogram frames.
AUDIO_FRAMES_PER_TOKEN = 4

# The activations a transformer may use, by Hugging Face's hidden_act names (models/vlm.py builds each).
ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "quick_gelu", "silu")

# Under MEGATRON_HETERO_MLP_KERNEL=auto an MLP call runs on quack's GEMM epilogues (models/mlp.py) when
# fc1's GEMM on its rank is at least this many multiply-adds: tokens in the GEMM (gathered under
# sequence parallelism) x hidden x fc1's output width on the rank (quack_kernels.py: why). W1's ViT
# at micro batch 2 (23,328 x 1152 x 4304, 2^36.8) and the workloads' LLMs run quack; W1's ViT at
# micro batch 1 (2^35.8) and the loss model's LLM (8,192 x 1024 x 4096, 2^35) torch. Here so that the
# planner (pure, below models) counts the same calls fused.
MLP_MIN_MACS = (2**36, "multiply-adds")

# Under MEGATRON_HETERO_EXPERTS_KERNEL=auto an MoE layer's experts run on torch's grouped GEMMs
# (models/experts.py) on Hopper GPUs (sm90; on sm100 it has given experts without tokens nonzero
# weight gradients, pytorch/pytorch#172439) in bf16 with per-rank GEMM widths that are multiples of 8
# elements (torch's grouped GEMM reads 16-byte-aligned rows). Here so that the planner (pure, below
# models) counts their memory where they run.
GROUPED_EXPERTS_ARCH_MAJOR = 9
GROUPED_EXPERTS_ALIGNMENT = 8


def grouped_experts_problem(arch_major: int, bf16: bool, widths: tuple[int, ...]) -> str | None:
    """Why auto does not run an MoE layer's experts on torch's grouped GEMMs on a GPU of this compute
    capability major, in bf16 weights or not, with these per-rank GEMM widths; None where it does."""
    if arch_major != GROUPED_EXPERTS_ARCH_MAJOR:
        return f"torch's grouped GEMM is checked on sm{GROUPED_EXPERTS_ARCH_MAJOR}0 GPUs"
    if not bf16:
        return "torch's grouped GEMM runs bf16"
    if any(width % GROUPED_EXPERTS_ALIGNMENT for width in widths):
        return f"per-rank widths {widths} not multiples of {GROUPED_EXPERTS_ALIGNMENT}"
    return None


@dataclass(frozen=True)
class TransformerArch:
    """How a transformer computes, beyond its sizes; the defaults are the demo's."""

    ffn_hidden_size: int | None = None  # None: 4 * hidden size
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_eps: float = 1e-5
    activation: str = "gelu"  # one of ACTIVATIONS
    linear_bias: bool = False  # biases in linear_qkv, linear_proj, fc1, fc2
    gated_linear_unit: bool = False  # fc1 = [gate; up], activation(gate) * up (SwiGLU with silu)


@dataclass(frozen=True)
class MoEArch:
    """Mixture-of-experts MLPs (megatron-core MoELayer in every LLM layer), from Megatron's flags
    --num-experts, --moe-router-topk, --moe-ffn-hidden-size, --moe-aux-loss-coeff, --moe-z-loss-coeff,
    --moe-token-dispatcher-type."""

    num_experts: int
    topk: int = 2
    ffn_hidden_size: int | None = None  # per expert; None: the dense ffn size
    aux_loss_coeff: float = 0.0  # load-balancing loss ("aux_loss": per microbatch)
    z_loss_coeff: float | None = None
    dispatcher: str = "alltoall"


@dataclass(frozen=True)
class LLMArch(TransformerArch):
    num_query_groups: int | None = None  # None: one per attention head
    head_dim: int | None = None  # None: hidden size / attention heads
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    qk_norm: bool = False  # a norm over each query and key head before RoPE (Qwen3's q_norm, k_norm)
    tied_embeddings: bool = False  # the output layer is the input embedding
    moe: MoEArch | None = None  # None: dense MLPs
    # M-RoPE (Qwen2-VL and later): the rotary channels of each head split into (temporal, height,
    # width) sections, each rotated by its own position id (models/mrope.py); None: 1D RoPE.
    mrope_section: tuple[int, ...] | None = None
    # Qwen3-VL's interleaved M-RoPE: rotary frequency i follows height (i % 3 == 1) or width
    # (i % 3 == 2) within 3 x that section, else the temporal position (models/mrope.py).
    mrope_interleaved: bool = False

    def __post_init__(self):  # JSON and Hugging Face configs give lists
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(self.mrope_section))


@dataclass(frozen=True)
class VisionArch(TransformerArch):
    patch_bias: bool = True
    class_token: bool = False  # a learned token before the patches: attended to, not emitted
    pre_norm: bool = False  # a norm between the embeddings and the first layer
    rescale_pixels: bool = True  # images in [0, 1] mapped to [-1, 1]; False: they arrive normalized
    # ((mean), (std)) per channel that pixels in [0, 1] are normalized with before this encoder: its
    # image processor's, recorded at import (the data applies it); None: none (pixels in [0, 1]).
    pixel_normalization: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    def __post_init__(self):  # JSON gives lists
        if self.pixel_normalization is not None:
            object.__setattr__(self, "pixel_normalization", tuple(tuple(v) for v in self.pixel_normalization))


@dataclass(frozen=True)
class ModelSizes:
    """Model-size flags (the int fields) and architecture choices; the defaults make the CPU demo fast."""

    image_size: int = 32
    patch_size: int = 8
    enc_hidden_size: int = 64
    enc_num_layers: int = 2
    enc_num_attention_heads: int = 4
    audio_mel_bins: int = 16
    audio_frames: int = 32
    audio_hidden_size: int = 32
    audio_num_layers: int = 2
    audio_num_attention_heads: int = 4
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    seq_length: int = 32
    vocab_size: int = 22
    # The vocabulary is padded to a multiple of this (Megatron's --make-vocab-size-divisible-by) that
    # the LLM's TP size divides: padded_vocab_size.
    vocab_multiple: int = 128
    llm_arch: LLMArch = field(default_factory=LLMArch)
    vision_arch: VisionArch = field(default_factory=VisionArch)
    # A Hugging Face VLM family (megatron_hetero/families: "qwen2_5_vl", ...) whose vision module and
    # data this model is; "" is this project's reference model. family_arch: the family's own vision
    # (and audio) settings (plain JSON values, read by the family), beyond the enc_* (audio_*) sizes.
    family: str = ""
    family_arch: dict = field(default_factory=dict, hash=False)

    @property
    def patches_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_clip(self) -> int:
        return self.audio_frames // AUDIO_FRAMES_PER_TOKEN


def stride2_sizes(size: int, convolutions: int) -> list[int]:
    """`size` after each of `convolutions` stride-2 convolutions of kernel 3 and padding 1 (an
    audio front end's mel bins or frames, e.g. Qwen3-Omni's three)."""
    sizes = []
    for _ in range(convolutions):
        size = (size + 1) // 2
        sizes.append(size)
    return sizes


def padded_vocab_size(sizes: ModelSizes, tp: int = 1) -> int:
    """Rows of the LLM's embedding and output layer under TP size `tp`: the vocabulary rounded up to a
    multiple of lcm(vocab_multiple, tp) (every TP rank holds whole rows). The rows past the
    vocabulary are not the model's (models/vlm.py: vocab_padding), so the model is the same for every
    TP size; `tp=1` gives the layout-independent ("whole") size checkpoints and exports use."""
    multiple = math.lcm(sizes.vocab_multiple, tp)
    return -(-sizes.vocab_size // multiple) * multiple


def sizes_to_dict(sizes: ModelSizes) -> dict:
    """Plain values (JSON) of `sizes`, architectures included; sizes_from_dict's inverse."""
    return asdict(sizes)


def sizes_from_dict(values: dict) -> ModelSizes:
    known = {f.name for f in fields(ModelSizes)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown model size fields {', '.join(unknown)}")
    llm = dict(values.get("llm_arch", {}))
    if llm.get("moe") is not None:
        llm["moe"] = MoEArch(**llm["moe"])
    vision = VisionArch(**values.get("vision_arch", {}))
    return ModelSizes(**{**values, "llm_arch": LLMArch(**llm), "vision_arch": vision})


def read_model_description(path: str, label: str) -> dict:
    """A model.json as `megatron-hetero hf import` writes it, its `sizes` read by sizes_from_dict
    (a ValueError starting with `label` says what is wrong with the file)."""

    def checked(description):
        if not isinstance(description, dict) or not isinstance(description.get("sizes"), dict):
            raise ValueError("it holds no `sizes` object")
        try:
            sizes_from_dict(description["sizes"])
        except (TypeError, AttributeError) as error:
            raise ValueError(f"sizes: {error}") from None
        return description

    return load_json(path, "it", checked, label)
