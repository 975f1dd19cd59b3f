"""Bring your own model: a 1-D convolutional sensor encoder into a megatron-core GPT, each module in
its own parallel layout, trained by megatron.training's loop. It uses megatron-hetero's public
extension point only (docs/guides/bring-your-own-model.md): the model provider returns `ModelParts`,
this rank's stage of each module, and an `Adapter` that says how the script's `model(...)` call maps
onto them; the boundary, the schedules, DDP per module and the optimizers are megatron-hetero's.

    torchrun --nproc-per-node 2 examples/byom/pretrain_sensor_gpt.py \\
        --hetero-layout examples/byom/sensor_vdp2_llm_dp2.yaml --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 \\
        --global-batch-size 8 --train-iters 50 --lr 1e-3

The task: each sample is a clip of `--sensor-channels` signals whose frequency is one of
`--sensor-classes`; the encoder's rows take the first positions of the sequence and the GPT predicts
the class token after them. The encoder (a kind megatron-hetero does not build: `kind: sensor` in the
layout) runs in data parallelism only (tp 1, pp 1); the GPT in any TP/DP, pp 1.
"""

import sys
from functools import partial

import megatron_hetero.patches

megatron_hetero.patches.apply()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.training import get_args, pretrain  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args  # noqa: E402

from megatron_hetero.boundary import BoundaryBatch, assign_items, input_rows, write_rows  # noqa: E402
from megatron_hetero.models.init import build_stage  # noqa: E402
from megatron_hetero.runtime.model import ModelCall, ModelParts  # noqa: E402

STRIDE = 4  # the convolution's stride: a clip of T samples sends T / STRIDE rows into the sequence


def add_sensor_args(parser):
    group = parser.add_argument_group("sensor example")
    group.add_argument("--sensor-channels", type=int, default=3, help="signals per clip (default 3)")
    group.add_argument("--sensor-length", type=int, default=32, help="samples per clip, a multiple of 4 (default 32)")
    group.add_argument("--sensor-hidden", type=int, default=32, help="the encoder's width (default 32)")
    group.add_argument("--sensor-classes", type=int, default=4, help="frequency classes (default 4)")
    return parser


class SensorEncoder(torch.nn.Module):
    """Clips [n, channels, length] -> rows [n * length / STRIDE, llm hidden]: a strided 1-D
    convolution, GELU, and a projection into the LLM's width."""

    def __init__(self, channels: int, hidden: int, llm_hidden: int, per_token_loss: bool):
        super().__init__()
        # megatron-core's DDP reads its module's config: with the loss summed over tokens it sums
        # the data-parallel gradients (the step divides by the tokens), else it averages them.
        self.config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1,
                                        calculate_per_token_loss=per_token_loss)
        self.conv = torch.nn.Conv1d(channels, hidden, kernel_size=STRIDE, stride=STRIDE)
        self.proj = torch.nn.Linear(hidden, llm_hidden)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        rows = self.proj(torch.nn.functional.gelu(self.conv(clips)).transpose(1, 2))  # [n, rows, h]
        return rows.reshape(-1, rows.shape[-1])


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class SensorAdapter:
    """The script calls `model(input_ids=, labels=, loss_mask=, sensor=, sensor_positions=)` on a
    global microbatch (every LLM data-parallel rank's samples): one clip per sample, its rows at
    `sensor_positions` [b, rows] of the sequence."""

    def __init__(self, run, args):
        self.run, self.args, self.rows = run, args, args.sensor_length // STRIDE

    def batch_size(self, call: ModelCall) -> int:
        return call.kwargs["input_ids"].shape[0]

    def boundary_like(self) -> torch.Tensor:
        return torch.zeros(0, self.args.hidden_size, dtype=self.args.params_dtype, device=_device())

    def stage_hidden_like(self, module, call: ModelCall, share, stage=None) -> torch.Tensor:
        if module.layout.role == "llm":
            shape = (self.args.seq_length, share.stop - share.start, self.args.hidden_size)
        else:
            shape = (self.rows, len(share), self.args.sensor_hidden)
        return torch.empty(shape, dtype=self.args.params_dtype, device=_device())

    def boundary_batches(self, name: str, calls: list[ModelCall]) -> list[BoundaryBatch]:
        """Every clip alike: the clips of the calls go round robin to the encoder's DP ranks."""
        counts = [self.batch_size(call) for call in calls]
        item_dp = assign_items(np.full(sum(counts), self.rows), self.args.sensor_hidden,
                               self.run.layout.module(name).dp)
        return [BoundaryBatch(np.full(n, self.rows), call.kwargs["sensor_positions"].reshape(-1).numpy(),
                              call.kwargs["input_ids"].shape[1], item_dp=dp)
                for call, n, dp in zip(calls, counts, np.split(item_dp, np.cumsum(counts)[:-1]))]

    def encoder_forward(self, module, share, hidden):
        clips = torch.cat([call.kwargs["sensor"][items] for call, items in share])
        return module.part(clips.to(_device(), self.args.params_dtype))

    def llm_forward(self, module, call: ModelCall, share: slice, media: dict, hidden):
        gpt, device = module.part, _device()
        ids, labels, mask = (call.kwargs[key][share].to(device) for key in ("input_ids", "labels", "loss_mask"))
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
        embedding = gpt.embedding(input_ids=ids, position_ids=positions)  # [s, b, h]
        for rows in media.values():  # the boundary's rows for this rank, in place of their tokens
            embedding = write_rows(embedding, rows.rows, input_rows(rows.plan, ids.shape[0], device))
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=device).triu(1)[None, None]
        losses = gpt(input_ids=None, position_ids=positions, attention_mask=causal, decoder_input=embedding,
                     labels=labels)
        return losses, mask


def model_provider(pre_process=True, post_process=True, config=None, pg_collection=None, **_):
    args = get_args()
    run = args.hetero_run
    parts = {}
    for index, module in enumerate(run.modules.values()):
        if not module.held:
            continue
        if module.layout.pp > 1 or (module.layout.role == "encoder" and module.layout.tp > 1):
            raise ValueError(f"module {module.name}: this example runs the encoder at tp 1 and every module "
                             f"at pp 1; set them so")
        if module.layout.role == "llm":
            def build(whole, module=module):
                return GPTModel(core_transformer_config_from_args(args), get_gpt_layer_local_spec(),
                                args.padded_vocab_size, args.max_position_embeddings, pg_collection=module.pgs)
        else:
            def build(whole):
                return SensorEncoder(args.sensor_channels, args.sensor_hidden, args.hidden_size,
                                     args.calculate_per_token_loss)
        parts[module.name] = build_stage(build, args.seed + index, module.layout.pp)
    return ModelParts(parts, SensorAdapter(run, args))


class SensorClips(torch.utils.data.Dataset):
    """Sample i: a clip whose signals share one of the classes' frequencies (plus noise), and the
    sequence [rows..., class token, end]; the loss is on predicting the class token."""

    def __init__(self, args, num_samples: int):
        self.args, self.num_samples, self.rows = args, num_samples, args.sensor_length // STRIDE

    def __len__(self):
        return self.num_samples

    def __getitem__(self, i):
        a = self.args
        gen = torch.Generator().manual_seed(a.seed * 100003 + i)
        label = int(torch.randint(a.sensor_classes, (), generator=gen))
        phase = torch.rand(a.sensor_channels, 1, generator=gen) * 6.283
        t = torch.arange(a.sensor_length) / a.sensor_length
        clip = torch.sin(6.283 * (label + 1) * t + phase) + 0.1 * torch.randn(a.sensor_channels, a.sensor_length,
                                                                                generator=gen)
        ids = torch.zeros(a.seq_length, dtype=torch.long)  # token 0 is padding (and the rows' placeholder)
        ids[self.rows], ids[self.rows + 1] = 1 + label, 1 + a.sensor_classes  # class, end
        labels, loss_mask = torch.roll(ids, -1), torch.zeros(a.seq_length)
        loss_mask[self.rows - 1] = 1.0  # the last row predicts the class
        return dict(input_ids=ids, labels=labels, loss_mask=loss_mask, sensor=clip,
                    sensor_positions=torch.arange(self.rows))


def datasets_provider(num_samples):
    return SensorClips(get_args(), num_samples[0]), None, None


datasets_provider.is_distributed = True  # every rank reads its global microbatches itself


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    mask = loss_mask.float()
    loss = (output.float() * mask).sum()
    return loss, mask.sum().to(torch.int), {"lm loss": torch.stack([loss.detach(), mask.sum()])}


def forward_step(data_iterator, model):
    output, loss_mask = model(**next(data_iterator))
    return output, partial(loss_func, loss_mask)


# The script's defaults, before the command line's flags (a later flag wins): a token vocabulary of its
# own, the loss summed over tokens, megatron-core's local layers, weights drawn on the CPU from the
# seed whatever the layout, and no data files.
DEFAULT_FLAGS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "16", "--calculate-per-token-loss",
                 "--transformer-impl", "local", "--use-cpu-initialization", "--mock-data"]

if __name__ == "__main__":
    sys.argv[1:1] = DEFAULT_FLAGS
    args = parse_and_validate_args(extra_args_provider=add_sensor_args)
    pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider)
    sys.exit(0)
