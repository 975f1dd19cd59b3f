"""The LLM's fused loss on quack's cross entropy where the kernel policy runs it (megatron-core 0.19:
`LanguageModule.compute_language_model_loss`, which GPTModel and the families' LLMs call with the
labels [b, s] and the logits [s, b, vocabulary / TP]).

Under --cross-entropy-loss-fusion (native implementation) with the whole vocabulary on one rank, the
loss runs models/loss_kernels.py's one-pass kernels instead of megatron-core's five compiled ones over
fp32 copies of the logits; everywhere else (the flag off, Transformer Engine's implementation, TP,
CPUs, GPUs where the check has not passed) upstream's function runs unchanged.
"""

from megatron_hetero.models import loss_kernels
from megatron_hetero.patches._patch import replace


def _loss(original):
    def compute_language_model_loss(self, labels, logits):
        if loss_kernels.fused_loss_choice(self.config, self.pg_collection.tp.size()).kernel != loss_kernels.QUACK:
            return original(self, labels, logits)
        # upstream's layout: labels [b, s] against logits [s, b, V]; the loss back as [b, s]
        loss = loss_kernels.cross_entropy(logits, labels.transpose(0, 1), loss_kernels.load_quack_cross_entropy()[0])
        return loss.transpose(0, 1).contiguous()
    return compute_language_model_loss


def apply() -> None:
    replace("megatron.core.models.common.language_module.language_module.LanguageModule.compute_language_model_loss",
            _loss, params=("self", "labels", "logits"))
