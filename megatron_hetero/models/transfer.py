"""Host tensors to the GPU without holding the host.

A blocking host-to-device copy (`tensor.to(device)`) waits for the GPU to finish all the work queued
before it; until the host then queues more, the GPU idles. Per microbatch, the step's inputs (token
ids, labels, loss mask, positions, the encoders' item indices, varlen segment plans) are small and
many: copied one by one, each is such a wait (a profile of W1's step at global batch 16 counted 51
pageable copies, and the GPU idle 160 ms of 7.47 s). `to_device` packs them into one pinned buffer
and copies it once, asynchronously.
"""

import torch


def to_device(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Host tensors (any dtypes) on `device` through one copy: their bytes packed into one buffer
    (each part 16-byte aligned: every dtype's view, and kernels that load 16 bytes at a time, as
    CuTe's may the cu_seqlens, stay aligned), pinned where the device is a GPU
    and copied without blocking the host; the pinned buffer is kept until the copy ends by torch's
    caching host allocator."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    sizes = [-(-p.numel() // 16) * 16 for p in parts]
    device = torch.device(device)
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    for part, start in zip(parts, [0, *torch.tensor(sizes).cumsum(0).tolist()]):
        buffer[start : start + part.numel()] = part
    buffer = buffer.to(device, non_blocking=True)
    chunks = buffer.split(sizes)
    return [c[: p.numel()].view(t.dtype).view(t.shape) for c, p, t in zip(chunks, parts, tensors)]
