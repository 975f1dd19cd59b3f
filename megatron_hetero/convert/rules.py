"""Weight rules: how one tensor of our full (TP1/PP1) state dict is made of Hugging Face tensors,
written once and applied both ways. Every rule moves data only (no arithmetic), so a round trip is
bit-identical."""

from dataclasses import dataclass, replace

import torch


class HFMappingError(ValueError):
    """A Hugging Face model or state dict we cannot map; one line naming the field or key and the fix."""


@dataclass(frozen=True)
class Same:
    """One tensor under another name."""

    ours: str
    hf_name: str

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.hf_name,)

    def join(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (t,)


@dataclass(frozen=True)
class PaddedRows(Same):
    """An embedding (or output layer) whose `vocab` rows we pad with zeros to `rows` (the TP-1 padded
    vocabulary, sizes.padded_vocab_size); the padding is not the model's (models/vocab.py): export
    strips it."""

    vocab: int
    rows: int

    def join(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(self.rows - self.vocab, *x.shape[1:])])

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (t[: self.vocab].clone(),)


@dataclass(frozen=True)
class Flattened(Same):
    """A patch convolution's weight [out, c, p, p] as our linear patch embedding's [out, c*p*p]
    (the (c p q) order PatchEmbedding flattens pixels in)."""

    hf_shape: tuple[int, ...]

    def join(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (t.reshape(self.hf_shape),)


@dataclass(frozen=True)
class Reshaped(Same):
    """One tensor in another shape (the same elements in the same order): e.g. a ViT's class token
    [1, 1, h] as our [h]."""

    hf_shape: tuple[int, ...]
    ours_shape: tuple[int, ...]

    def join(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.ours_shape)

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (t.reshape(self.hf_shape),)


@dataclass(frozen=True)
class Stacked:
    """Tensors stacked along rows: a gated MLP's fc1 is [gate; up] (megatron-core applies the
    activation to the first half)."""

    ours: str
    hf: tuple[str, ...]

    def join(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.cat(xs)

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(part.clone() for part in t.chunk(len(self.hf)))


@dataclass(frozen=True)
class FusedQKV:
    """megatron-core's linear_qkv (weight or bias) from q, k, v projections: rows grouped per query
    group g as [the q heads of g; k_g; v_g], so that a TP rank's contiguous rows hold whole groups."""

    ours: str
    hf: tuple[str, str, str]
    heads: int
    groups: int

    def join(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.unflatten(0, (self.groups, -1)) for x in (q, k, v)], 1).flatten(0, 1)

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        per_group = t.unflatten(0, (self.groups, -1))
        head_dim = per_group.shape[1] // (self.heads // self.groups + 2)
        parts = per_group.split([per_group.shape[1] - 2 * head_dim, head_dim, head_dim], 1)
        return tuple(part.flatten(0, 1).clone() for part in parts)


@dataclass(frozen=True)
class ConcatQKV:
    """megatron-core's linear_qkv (weight or bias) from one Hugging Face tensor [q; k; v] (ViTs'
    fused `qkv`, every head's queries, then keys, then values), regrouped as FusedQKV does."""

    ours: str
    hf_name: str
    heads: int

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.hf_name,)

    def _fused(self) -> FusedQKV:
        return FusedQKV(self.ours, ("q", "k", "v"), self.heads, self.heads)

    def join(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused().join(*x.chunk(3))

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.cat(self._fused().split(t)),)


def _params(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def same_params(ours: str, hf: str, bias: bool = True) -> list[Same]:
    """A layer's weight (and bias) under another name."""
    return [Same(f"{ours}.{p}", f"{hf}.{p}") for p in _params(bias)]


def qkv_rules(ours: str, hf: str, heads: int, groups: int, bias: bool) -> list[FusedQKV]:
    """linear_qkv's weight (and bias) under `ours` from q_proj, k_proj, v_proj under `hf`."""
    return [FusedQKV(f"{ours}.{p}", tuple(f"{hf}.{x}_proj.{p}" for x in "qkv"), heads, groups) for p in _params(bias)]


def with_hf_names(rules: list, rename) -> list:
    """`rules` with every Hugging Face name passed through rename(name) (another spelling of the keys)."""
    return [replace(rule, hf_name=rename(rule.hf_name)) if isinstance(rule, (Same, ConcatQKV))
            else replace(rule, hf=tuple(map(rename, rule.hf))) for rule in rules]


def apply_rules(rules: list, state: dict[str, torch.Tensor], to_hf: bool,
                ignored: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Map `state` (Hugging Face tensors, or ours with `to_hf`) through every rule. Keys no rule reads
    must start with one of `ignored` (tensors without a counterpart on the other side)."""
    side, fix = ("our", "give the whole module's tensors") if to_hf else ("Hugging Face", "is it this family's?")
    out, read = {}, set()
    for rule in rules:
        ours = rule.ours if isinstance(rule.ours, tuple) else (rule.ours,)  # several: SplitExperts
        sources, targets = (ours, rule.hf) if to_hf else (rule.hf, ours)
        missing = [name for name in sources if name not in state]
        if missing:
            raise HFMappingError(f"{missing[0]} is missing from the {side} state dict; {fix}")
        inputs = [state[name] for name in sources]
        results = rule.split(*inputs) if to_hf else rule.join(*inputs)
        out.update(zip(targets, results if isinstance(results, tuple) else (results,)))
        read.update(sources)
    unread = [name for name in state if name not in read and not name.startswith(ignored)]
    if unread:
        raise HFMappingError(f"{unread[0]} in the {side} state dict has no counterpart; {fix}")
    return out


@dataclass(frozen=True)
class SplitExperts:
    """One Hugging Face tensor [experts, ...] holding every expert's weight (Qwen3-VL-MoE's fused
    `experts.gate_up_proj` / `experts.down_proj`) as our experts' tensors, one each (`ours`, in
    expert order); `transposed`: the file holds each expert's weight transposed ([in, out], the
    Hub's published layout) where ours is [out, in]."""

    ours: tuple[str, ...]
    hf_name: str
    transposed: bool = False

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.hf_name,)

    def join(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple((e.T if self.transposed else e).clone() for e in x.unbind(0))

    def split(self, *experts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.stack([e.T if self.transposed else e for e in experts]),)


@dataclass(frozen=True)
class KeylessBias:
    """linear_qkv's bias from the query and value biases of an attention whose key projection has no
    bias (Whisper's): ours holds zeros there (a key bias shifts all of a query's scores alike, which
    softmax ignores), and the export leaves them out."""

    ours: str
    hf: tuple[str, str]
    heads: int

    def _fused(self) -> FusedQKV:
        return FusedQKV(self.ours, ("q", "k", "v"), self.heads, self.heads)

    def join(self, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._fused().join(q, torch.zeros_like(q), v)

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, _, v = self._fused().split(t)
        return q, v
