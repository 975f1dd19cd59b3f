"""The GPU kernel checks behind `megatron-hetero kernels check` (cli/kernels.py): each kernel the
layers may choose against fp32 at the workloads' shapes on this GPU. attention.py: flash-attn-4 per
head dim and our dispatched attention; cp_chunks.py: context parallelism's merged-chunk cuDNN
attention; norms.py and mlp.py: quack's norms and the MLP's fused GEMMs; common.py: what they share."""
