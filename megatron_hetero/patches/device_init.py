"""Our models' full-size weights drawn on the GPU (megatron-core 0.19
`tensor_parallel.layers._initialize_affine_weight_cpu`).

Our models initialize every weight full-size and keep each TP rank's slice (use_cpu_initialization:
the same model under every layout). Upstream builds that full tensor on the host: a normal draw, a
cast and a concatenation of the slice, single-threaded, 11 ns per weight on an H200 machine's host
against 2.3 on its GPU (docs/runs/h200_one_card/startup/), about 100 s per rank before the first step
for Qwen2.5-Omni-7B. Where the init method is a `models.init.DeviceDrawn` (our models' on a GPU),
upstream's function runs with its tensors on that device instead, the device's generator seeded
from one draw of the default CPU generator per weight: the weights still follow the run's seed and
stay layout-independent, and the slice is copied into the host parameter as before. Other init
methods (Megatron-LM's models, a user's --use-cpu-initialization) are upstream's, bit for bit.
"""

import contextlib

import torch

from megatron_hetero.models.init import DeviceDrawn
from megatron_hetero.patches._patch import replace

SEED_RANGE = 2**62  # a weight's seed: one draw of the CPU generator


def drawing(init_method) -> contextlib.AbstractContextManager:
    """Where upstream's initialization of a weight with `init_method` runs: a DeviceDrawn's on its device,
    from a seed drawn now; any other's as it is."""
    if not isinstance(init_method, DeviceDrawn):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(seeded(init_method.device, int(torch.randint(SEED_RANGE, ()))))
    stack.enter_context(torch.device(init_method.device))
    return stack


@contextlib.contextmanager
def seeded(device: torch.device, seed: int):
    """The default generator of `device` seeded with `seed` inside the block, its state restored after."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type):
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        yield


def _on_device(original):
    def initialize_affine_weight_cpu(weight, output_size, input_size, per_partition_size, partition_dim,
                                     init_method, *args, **kwargs):
        with drawing(init_method):
            return original(weight, output_size, input_size, per_partition_size, partition_dim, init_method,
                            *args, **kwargs)
    return initialize_affine_weight_cpu


def apply() -> None:
    replace("megatron.core.tensor_parallel.layers._initialize_affine_weight_cpu", _on_device,
            params=("weight", "output_size", "input_size", "per_partition_size", "partition_dim", "init_method"))
