"""megatron-core 0.19's all-to-all token dispatcher without a host sync where no host value is needed:
dropless routing (no capacity factor, no padding for quantization) with one rank in the experts'
EP x expert-TP group, as on one GPU, where every expert is local.

There upstream still copies the token counts to the host (on a side stream, after the router) and
waits for the copy at the end of each MoE layer's dispatch, which stalls the host until the GPU has
routed that layer's tokens, in every layer of every microbatch; the counts serve only the experts'
split of their tokens and a sort of the tokens by local expert, which with one rank is the identity
(a copy of every routed token into the same order, split by those host-side counts). Here the counts
stay on the GPU and the identity sort returns its input: GroupedExperts (models/experts.py) reads
the counts there; SequentialMLP's `tokens_per_expert.tolist()` waits for them at the experts instead
(the same wait, later).

The host waits that remain in an MoE layer (megatron-core 0.19, no Transformer Engine):
- EP or expert TP over more than one rank: NCCL's all-to-all takes its split sizes from the host;
  upstream copies them right after the router and waits once per layer's forward, before the
  dispatch's all-to-all (the backward's all-to-alls reuse them); upstream's path runs unchanged;
- token dropping or padding (--moe-expert-capacity-factor, padding for quantization): the permuted
  length depends on the routing, a wait before the permutation;
- --moe-token-dispatcher-type allgather: its counts `.cpu()` and `.item()` in every layer (alltoall,
  the default here, has neither);
- SequentialMLP's experts (off Hopper, or MEGATRON_HETERO_EXPERTS_KERNEL=sequential): `.tolist()`
  of the counts where they are on the GPU.
The router (top-k, the load-balancing and z-losses) has none; its losses reach the host once per
step, for the log.
"""

import torch

from megatron_hetero.patches._patch import replace

DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def needs_host_counts(dispatcher) -> bool:
    """Whether an all-to-all dispatcher needs its token counts on the host (see the module docstring)."""
    config = dispatcher.config
    dropping = (dispatcher.drop_and_pad or config.moe_expert_capacity_factor is not None
                or config.moe_router_padding_for_quantization)
    return dropping or dispatcher.ep_size * dispatcher.tp_size > 1


def _counts_on_device(original):
    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if needs_host_counts(self):
            return original(self, point, tokens_per_expert)
        return tokens_per_expert
    return _maybe_dtoh_and_synchronize


def _identity_sort(original):
    def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
        # Unfused, the dispatcher keeps its chunk orders on the host: comparing them costs no sync.
        identity = (not fused and sorted_idxs.device.type == "cpu"
                    and torch.equal(sorted_idxs, torch.arange(len(sorted_idxs), dtype=sorted_idxs.dtype)))
        return (input, probs) if identity else original(input, split_sizes, sorted_idxs, probs, fused)
    return sort_chunks_by_idxs


def apply() -> None:
    replace(f"{DISPATCHER}.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", _counts_on_device,
            params=("self", "point", "tokens_per_expert"))
    replace(f"{DISPATCHER}.sort_chunks_by_idxs", _identity_sort,
            params=("input", "split_sizes", "sorted_idxs", "probs", "fused"))
