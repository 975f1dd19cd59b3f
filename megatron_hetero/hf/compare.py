"""`python -m megatron_hetero.hf compare`: a conversion check users can run. transformers' forward (on
rank 0, on the CPU, fp32) and ours (every module under its layout: `--hetero-layout L.yaml` under
torchrun, or one process; fp32) on the same conversation samples (our data path: tokens, pixels,
positions) with the same pixels; per sample both losses (mean cross entropy over the assistant's
tokens) and the largest |logit difference| over the sample's sequence (its padding too: causal
attention, so it changes nothing before), then `max |logit diff| X over N samples`; exit code 1
above --tolerance.

    python -m megatron_hetero.hf compare --model HF_DIR --load CKPT --data-path FILE [--image-root DIR]
        [--seq-length N] [--tolerance T] [--num-samples N] [--hetero-layout L.yaml]

Our logits are gathered over the LLM's TP (its output layer's gather), CP (load-balanced chunks put
back in order) and PP (the last stage holds them) onto rank 0, a global microbatch (one sample per
LLM DP rank) at a time.
"""

import os
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_hetero.convert.rules import HFMappingError

VISION, AUDIO = "vision", "audio"


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="the Hugging Face model directory the checkpoint came from")
    parser.add_argument("--load", required=True, help="a checkpoint of it (imported or trained)")
    parser.add_argument("--data-path", required=True, help="a .json / .jsonl conversation file (LLaVA or ShareGPT "
                                                           "records, images and videos)")
    parser.add_argument("--image-root", help="image and video paths' directory (default: the data file's)")
    parser.add_argument("--seq-length", type=int, default=1024, help="tokens per sequence (longer samples skipped)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="the largest |logit difference| allowed")
    parser.add_argument("--num-samples", type=int, default=16, help="samples compared (the file's first usable ones)")
    parser.add_argument("--hetero-layout", help="the layout to run ours under (torchrun); default: one process")
    parser.add_argument("--model-sizes", help="the model.json of the import (default: the checkpoint's own)")


def _samples(args, description: dict, sizes):
    """The file's first --num-samples usable samples (decoded), their dataset, and the skipped."""
    from megatron_hetero.data.chat import HFChatTokenizer
    from megatron_hetero.data.conversations import ConversationSamples, ConversationSpec, SkipSample
    from megatron_hetero.families import family_named

    images = family_named(sizes.family).media(sizes, description["processor"], description["hf"]["config"])
    spec = ConversationSpec(args.data_path, args.image_root or os.path.dirname(args.data_path), sizes.seq_length,
                            images)
    dataset = ConversationSamples(spec, HFChatTokenizer(args.model, image_token=False), 1)
    samples, skipped = [], []
    for index in range(len(dataset.records)):
        if len(samples) == args.num_samples:
            break
        try:
            samples.append(dataset.encode(index))
        except SkipSample as skip:
            skipped.append(skip.bad)
    if not samples:
        raise HFMappingError(f"--data-path {args.data_path}: no usable sample"
                             + (f" (first problem: {skipped[0].line()})" if skipped else ""))
    return samples, dataset, skipped


def _gathered_logits(run, logits, seq: int) -> list[tuple[int, torch.Tensor]]:
    """(local sample, logits [S, V]) held by this rank: the last LLM stage's TP rank 0, its CP
    parts put back in sequence order (collective over the LLM's CP group)."""
    from megatron_hetero.models.context_parallel import cp_positions

    llm = run.llm
    if not (llm.held and llm.last_stage):
        return []
    layout, pgs = llm.layout, llm.pgs
    parts = [torch.empty_like(logits) for _ in range(layout.cp)]
    dist.all_gather(parts, logits.contiguous(), group=pgs.cp)
    whole = torch.empty(logits.shape[0], seq, logits.shape[-1], dtype=logits.dtype, device=logits.device)
    for cp_rank, part in enumerate(parts):
        whole[:, cp_positions(seq, layout.cp, cp_rank).to(logits.device)] = part
    coords = llm.coords()
    return [] if coords["tp"] or coords["cp"] else [(j, whole[j].float().cpu()) for j in range(len(whole))]


def _our_logits(model, kwargs: dict, seq: int) -> dict[int, torch.Tensor]:
    """Our logits [S, V] of each sample of one global microbatch, on rank 0 (sample -> logits)."""
    from megatron_hetero.schedules.forward_backward import step_context
    from megatron_hetero.schedules.pipeline import run_stage
    from megatron_hetero.schedules.stages import GivenRows, LLMStage
    from megatron_hetero.training.evaluation import logits_step, route_media

    run = model.run
    ctx = step_context(model, logits_step, [kwargs], forward_only=True)
    media = route_media(ctx)
    mine = []
    llm = run.llm
    if llm.held:
        results = run_stage(LLMStage(ctx, GivenRows(media)), 1, ctx.clock)
        share = llm.layout.dp_samples(len(kwargs["input_ids"]), llm.coords()["dp"])
        logits = results.forward[0][0] if llm.last_stage else None
        mine = [(share.start + j, t) for j, t in _gathered_logits(run, logits, seq)]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return dict(sum(gathered, [])) if gathered is not None else {}


def _loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean cross entropy over the loss tokens (nan without any)."""
    losses = F.cross_entropy(logits, labels, reduction="none")
    return float((losses * mask).sum() / mask.sum()) if mask.sum() else float("nan")


def _sample_report(hf_model, images, sample, sources, ours: torch.Tensor, vocab: int) -> tuple[float, float, float]:
    """(transformers' loss, ours, max |logit diff|) of one sample over its whole sequence."""
    ids = sample.input_ids[None]
    vision = [s.items for s in sources if s.kind != AUDIO]
    audio = {"audio": sample.media[AUDIO]} if AUDIO in sample.media else {}  # a family that takes audio
    with torch.no_grad():
        theirs = hf_model(input_ids=ids, **images.hf_inputs(ids, sample.media[VISION], vision, **audio)
                          ).logits[0].float()
    ours = ours[:, :vocab]
    return (_loss(theirs, sample.labels, sample.loss_mask), _loss(ours, sample.labels, sample.loss_mask),
            float((ours - theirs).abs().max()))


def _layout(args):
    """--hetero-layout (checked) on this world, or None: one process holding every module whole."""
    from megatron_hetero.boundary import check_edge_layouts
    from megatron_hetero.spec.layout import load_layout

    if args.hetero_layout is None:
        return None
    layout = load_layout(args.hetero_layout, int(os.environ.get("WORLD_SIZE", 1)))
    for encoder in layout.encoders:
        check_edge_layouts(encoder, layout.llm)
    return layout


def _hf_model(args, family):
    """transformers' model of the family (the part it compares: an omni model's thinker), fp32."""
    import transformers

    architecture = family.compared or family.architecture
    return getattr(transformers, architecture).from_pretrained(args.model, dtype=torch.float32).eval()


def compare(args) -> int:
    """Run the comparison (see the module docstring); 0 within --tolerance, 1 above, 2 on bad input."""
    from megatron_hetero.families import family_named
    from megatron_hetero.hf.checkpoint import loaded_model, read_description
    from megatron_hetero.spec import rules
    from megatron_hetero.spec.sizes import sizes_from_dict

    description, _ = read_description(args.load, args.model_sizes)
    if "family" not in description:
        raise HFMappingError(f"--load {args.load} holds no whole-model import (megatron-hetero hf import "
                             f"--model DIR); compare needs the whole model")
    sizes = replace(sizes_from_dict(description["sizes"]), seq_length=args.seq_length)
    layout = _layout(args)
    if layout is not None:
        rules.check(HFMappingError, rules.sequence_problem(args.seq_length, layout.llm))
    samples, dataset, skipped = _samples(args, description, sizes)
    family = family_named(sizes.family)
    with loaded_model(args.load, sizes, layout) as model:
        dp = model.run.layout.llm.dp
        hf_model = _hf_model(args, family) if dist.get_rank() == 0 else None
        worst = 0.0
        for first in range(0, len(samples), dp):
            group = samples[first : first + dp]
            group += group[:1] * (dp - len(group))  # a whole global microbatch; the repeats are not compared
            kwargs = dataset.collate(group)
            kwargs.pop("skipped")
            ours = _our_logits(model, kwargs, sizes.seq_length)
            for j, (sample, sources) in enumerate(samples[first : first + dp]):
                if hf_model is not None:
                    theirs_loss, our_loss, diff = _sample_report(hf_model, dataset.spec.images, sample, sources,
                                                                 ours[j], sizes.vocab_size)
                    worst = max(worst, diff)
                    print(f"sample {first + j}: loss transformers {theirs_loss:.6f} ours {our_loss:.6f} "
                          f"max |logit diff| {diff:.3e}", flush=True)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        verdict = torch.tensor([worst > args.tolerance], dtype=torch.int, device=device)
        dist.broadcast(verdict, 0)
    if hf_model is not None:
        for bad in skipped:
            print(f"skipped {bad.line()}")
        print(f"max |logit diff| {worst:.3e} over {len(samples)} samples (tolerance {args.tolerance:g})")
    return int(verdict)
