"""Model FLOPs per token and the peak they are compared with (MFU), one formula for every run.

Full fine-tuning (PaLM, Chowdhery et al. 2022, appendix B; torchtitan ``get_num_flop_per_token``)::

    flops/token = 6 * N + 12 * L * H * Q * T

N: parameters that multiply every token (all but the input embedding lookup: the output
head counts, tied or not; see ``ModelShape.matmul_params``), L layers, H attention heads,
Q head dimension, T sequence length. 6N is forward (2N) plus backward (4N: gradients with
respect to activations and to weights); 12LHQT is the attention scores and their use
(QK^T and AV), forward and backward, which have no weights.

Frozen base (LoRA / QLoRA): a frozen weight needs no weight gradient, so its backward costs
2N instead of 4N::

    flops/token = 4 * N_frozen + 6 * N_trainable + 12 * L * H * Q * T

N_frozen: the base's weights that multiply every token (N above, less a classification head that trains);
N_trainable: the adapter's weights (LoRA's A and B), plus that head.

DPO (preference pairs): each example is a chosen and a rejected sequence, both through the policy, so the
formulas above count per token of either sequence (a pair of two T-token sequences: 2T tokens). A reference
model that runs in the step (the base with the adapters off, or a second copy) adds its forward over the same
tokens: 2N (all weights, none trains) plus the forward third of attention, 4LHQT::

    flops/token += 2 * N + 4 * L * H * Q * T

A reference whose log-probabilities are precomputed before training adds nothing to a step.

These are *model* FLOPs: recomputation from activation checkpointing and 4-bit dequantisation
are not counted, so MFU compares runs by useful work only. Only real (non-padding) tokens are
counted; T is the padded length the attention actually ran at.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune_kit.models.shapes import ModelShape


def device_name() -> str:
    """``torch.cuda.get_device_name()``, or "cpu" without a GPU (its peak: ``planning.hardware.peak_bf16_tflops``)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class FlopCounter:
    """FLOPs per real token for one model and training method.

    ``trainable``: parameters being trained. None means full fine-tuning (all of N trains);
    a number (LoRA weights, plus the head when ``head_trainable``) selects the frozen-base
    formula, where the head then counts as trainable instead of frozen.
    """

    arch: ModelShape
    num_labels: int | None = None  # sequence classification: a num_labels x hidden head
    trainable: int | None = None
    head_trainable: bool = False
    reference_forward: bool = False  # DPO: the reference's forward over the same tokens (2N + 4LHQT per token)

    @property
    def method(self) -> str:
        method = "full: 6N + 12LHQT" if self.trainable is None else "frozen base: 4N_frozen + 6N_trainable + 12LHQT"
        return method + (" + reference forward 2N + 4LHQT" if self.reference_forward else "")

    def per_token(self, seq_len: int) -> float:
        a = self.arch
        n = a.matmul_params(self.num_labels)
        attention = 12 * a.num_hidden_layers * a.num_attention_heads * a.dim_per_head * seq_len
        reference = (2 * n + attention / 3) if self.reference_forward else 0
        if self.trainable is None:
            return 6 * n + attention + reference
        frozen = n - (self.arch.head_params(self.num_labels) if self.head_trainable else 0)
        return 4 * frozen + 6 * self.trainable + attention + reference

    def batch(self, real_tokens: int, seq_len: int) -> float:
        return real_tokens * self.per_token(seq_len)


def mfu_percent(tflop_per_s_per_device: float, peak: float | None) -> float | None:
    return None if not peak else 100.0 * tflop_per_s_per_device / peak
