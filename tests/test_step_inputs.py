"""The encoders' first-stage inputs made a pass ahead (schedules/step.py EncoderInputs): each pass's
made once, as the pass before it is launched, and taken by its own pass; on a GPU, on a stream of
their own that the compute stream waits for. (That the step's results are unchanged: the parity
tests, whose steps run this path.)"""

from pathlib import Path
from types import SimpleNamespace

import torch

from megatron_hetero.schedules.step import EncoderInputs

ROOT = Path(__file__).resolve().parents[1]


class _Counting:
    def __init__(self, make):
        self.make, self.made = make, []

    def encoder_inputs(self, module, share):
        self.made.append(share)
        return self.make(share)


def test_a_pass_made_ahead_is_taken_once():
    adapter = _Counting(lambda share: (torch.tensor(share),))
    vision, audio = SimpleNamespace(name="vision"), SimpleNamespace(name="audio")
    inputs = EncoderInputs(adapter, torch.device("cpu"))
    inputs.start(vision, (1, 1), [3])
    inputs.start(vision, (1, 1), [3])  # already begun: not made again
    assert adapter.made == [[3]]
    assert inputs.take(audio, (1, 1), [5])[0].tolist() == [5]  # another encoder's: made now
    assert inputs.take(vision, (1, 2), [4])[0].tolist() == [4]  # another pass (two microbatches): made now
    assert inputs.take(vision, (1, 1), [3])[0].tolist() == [3] and len(adapter.made) == 3
    assert inputs.take(vision, (1, 1), [3])[0].tolist() == [3] and len(adapter.made) == 4  # taken: made again
    assert inputs.ahead == {}
    without = EncoderInputs(SimpleNamespace(), torch.device("cpu"))  # an adapter without encoder_inputs
    without.start(vision, (0, 1), [0])
    assert without.take(vision, (0, 1), [0]) is None and without.take(vision, (1, 1), [1]) is None


def _step_order(rank, world_size):
    """One training step of the Qwen2.5-VL twin (global batch 4, micro batch 1: one ViT pass per
    microbatch): the order in which the adapter made each pass's inputs and ran each pass's forward,
    and what the step left made ahead."""
    from bench import megatron_trainer

    import megatron_hetero.patches
    from megatron_hetero.planner.presets import FAMILY_BENCH_WORKLOADS

    class Recording:
        def __init__(self, adapter, events):
            self.adapter, self.events = adapter, events

        def __getattr__(self, name):
            return getattr(self.adapter, name)

        def encoder_inputs(self, module, share):
            self.events.append(("inputs", share[0][0]))
            return self.adapter.encoder_inputs(module, share)

        def encoder_forward(self, module, share, x):
            self.events.append(("forward", share[0][0]))
            return self.adapter.encoder_forward(module, share, x)

    megatron_hetero.patches.apply()
    events, calls, left = [], [], []
    with megatron_trainer(FAMILY_BENCH_WORKLOADS["qwen2_5_vl_tiny"], str(ROOT / "examples/layouts/single.yaml"),
                          bf16=False) as trainer:
        hetero = trainer.hetero
        hetero.adapter = Recording(hetero.adapter, events)
        import megatron_hetero.schedules.step as step

        prepare, finish = step.StepContext.prepare, step.StepContext.finish

        def prepared(ctx):
            prepare(ctx)
            calls.extend(ctx.calls)

        def finished(ctx):
            left.append(dict(ctx.inputs.ahead))
            finish(ctx)

        step.StepContext.prepare, step.StepContext.finish = prepared, finished
        try:
            trainer.train_step()
        finally:
            step.StepContext.prepare, step.StepContext.finish = prepare, finish
    return [(what, next(i for i, c in enumerate(calls) if c is call)) for what, call in events], left


def test_a_step_makes_each_pass_inputs_once_before_the_pass_ahead_of_it(tmp_path):
    """Pass 0's inputs while the step plans, pass i+1's once pass i's forward is launched, none left at
    the end."""
    from tests.distributed import collect_distributed

    ((events, left),) = collect_distributed(_step_order, 1, tmp_path)
    assert events == [("inputs", 0), ("forward", 0), ("inputs", 1), ("forward", 1), ("inputs", 2),
                      ("forward", 2), ("inputs", 3), ("forward", 3)]
    assert left == [{}]


def test_inputs_made_ahead_are_waited_for_on_a_gpu():
    """Inputs made on their own stream behind a long wait there: the compute stream reads them only
    once made (without its wait it reads them unwritten)."""
    if not torch.cuda.is_available():
        import pytest  # imported here: on a GPU machine this test also runs as a plain function

        pytest.skip("needs a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    host = torch.arange(1 << 24, dtype=torch.float32).pin_memory()

    def make(share):
        torch.cuda._sleep(200_000_000)  # the inputs' stream busy for ~0.1 s before the copy
        return (host.to(device, non_blocking=True) * 2,)

    inputs = EncoderInputs(_Counting(make), device)
    vision = SimpleNamespace(name="vision")
    inputs.start(vision, (0, 1), [0])
    (x,) = inputs.take(vision, (0, 1), [0])
    total = x.double().sum()  # on the compute stream
    assert total.item() == 2 * float(host.double().sum())
