"""What preference training (DPO) changes in a plan: the pair of sequences per example and the reference model's
memory and compute. Arithmetic on the model's shape, no torch.

Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290) trains on pairs: a prompt with a chosen and a
rejected answer, and the loss compares the policy's log-probabilities of both with those of a frozen reference model.
As TRL's ``DPOTrainer`` runs it (trl/trainer/dpo_trainer.py, ``concatenated_forward``, the default
``padding_free=False``): the chosen and rejected sequences of a micro-batch of P pairs go through the policy as one
batch of 2P sequences. So the activations of a micro-batch are those of 2P sequences, and the tokens of an optimizer
step are twice those of P sequences (:data:`SEQUENCES_PER_PAIR`). Where the reference comes from is a
:data:`Reference`:

* ``"adapters-off"`` (LoRA/QLoRA): the policy's own frozen base with the adapters disabled (TRL's
  ``null_ref_context``; torchtune's ``disable_adapter`` in ``lora_dpo_distributed.py``): no weights of its own, one
  more forward without gradients over both sequences per micro-batch.
* ``"precomputed"`` (full weights): TRL's ``precompute_ref_log_probs``: before training, a forward-only pass of the
  initial weights over every training pair stores each sequence's log-probability (one fp32 number per sequence,
  in the dataset on the host). No GPU memory and no reference forward during training; the pass takes its own time
  (:func:`finetune_kit.planning.speed.reference_pass`).
* ``"sharded"`` (full weights): a second model in bf16, which TRL prepares as a DeepSpeed engine with the policy's
  ZeRO config (``prepare_deepspeed`` in trl/models/utils.py): under ZeRO-3 partitioned over the GPUs like the
  policy's weights (2 B/param / GPUs) and gathered a layer at a time in its forward; below ZeRO-3 TRL sets its stage
  to 0, a whole copy on every GPU. One more forward per micro-batch.

The reference's forward runs without gradients, after the policy's forward and before its backward: it keeps nothing
for a backward, and its transient tensors (one layer's outputs, its logits) are smaller than the policy's backward
peak that follows (the loss's 12 bytes per token per vocabulary entry, or a recomputed layer with its gradients), so
they add nothing to the peak. The gathered layer of a sharded reference is counted beside the policy's working set:
an upper bound, since the two gathers do not overlap in time.

Memory is in bytes. The plan that adds these terms to the policy's is :mod:`.verdict`; the speed, :mod:`.speed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from finetune_kit.errors import ConfigError
from finetune_kit.models.shapes import Adapter, ModelShape
from finetune_kit.planning.model_states import BF16

Reference = Literal["adapters-off", "precomputed", "sharded"]
REFERENCES: tuple[str, ...] = get_args(Reference)
WITH_ADAPTERS: tuple[str, ...] = ("adapters-off",)  # the references a LoRA/QLoRA run can use
FULL_WEIGHTS: tuple[str, ...] = ("precomputed", "sharded")  # and those a full-weight run can use
SEQUENCES_PER_PAIR = 2  # chosen and rejected, through the policy as one batch


@dataclass(frozen=True)
class Dpo:
    """DPO training: each example a pair of sequences, and where the reference's log-probabilities come from."""

    reference: Reference

    def __post_init__(self) -> None:
        if self.reference not in REFERENCES:
            raise ConfigError(f"DPO reference {self.reference!r}: the reference is one of {', '.join(REFERENCES)}. "
                              "Pass adapters-off with LoRA/QLoRA, precomputed or sharded for a full-weight run.")

    @property
    def reference_forward(self) -> bool:
        """Whether each micro-batch runs the reference's forward (every reference but a precomputed one)."""
        return self.reference != "precomputed"


def default_reference(adapter: Adapter | None) -> Reference:
    """The reference a method uses when none is named: the base with the adapters off, or log-probs precomputed (no
    memory of its own, no forward per step)."""
    return "adapters-off" if adapter is not None else "precomputed"


def check_reference(dpo: Dpo | None, adapter: Adapter | None) -> None:
    """Refuse a reference the method cannot use: with adapters the reference is the base with the adapters off; a
    full-weight run has no adapters to disable and needs its own reference."""
    if dpo is None:
        return
    if adapter is not None and dpo.reference not in WITH_ADAPTERS:
        method = "QLoRA" if adapter.quantized else "LoRA"
        raise ConfigError(f"DPO reference {dpo.reference!r} with {method} adapters: with adapters the reference is "
                          "the frozen base with the adapters disabled, no second model and no precomputed pass. Pass "
                          "--dpo-reference adapters-off, or plan a full-weight run (--peft none).")
    if adapter is None and dpo.reference not in FULL_WEIGHTS:
        raise ConfigError(f"DPO reference {dpo.reference!r} without adapters: a full-weight run trains every weight, "
                          "so there are no adapters to disable for the reference. Pass --dpo-reference precomputed "
                          "(log-probs cached before training) or sharded (a bf16 copy partitioned like the policy), "
                          "or train adapters (--peft lora).")


def sequences_per_example(dpo: Dpo | None) -> int:
    """Sequences each training example puts through the policy: 2 under DPO (chosen and rejected), else 1."""
    return SEQUENCES_PER_PAIR if dpo is not None else 1


def reference_memory(shape: ModelShape, setup) -> tuple[dict[str, tuple[int, int]], int]:
    """({part: (host bytes per node, GPU bytes per GPU)}, GPU bytes that stay through the optimizer step) of the
    reference of ``setup`` (a :class:`finetune_kit.planning.verdict.Setup` with ``dpo``). A reference without
    memory of its own is one part of 0 bytes, so a breakdown names it."""
    reference = setup.dpo.reference
    if reference == "adapters-off":
        return {"DPO reference: the frozen base with the adapters disabled (no memory of its own)": (0, 0)}, 0
    if reference == "precomputed":
        return {"DPO reference: log-probs precomputed before training (no GPU memory)": (0, 0)}, 0
    psi = shape.total_params(setup.num_labels)
    if setup.stage < 3:  # TRL's prepare_deepspeed: stage 0 below ZeRO-3, the whole copy on every GPU
        return {"DPO reference: bf16 weights, whole on every GPU (2 B/param)": (0, BF16 * psi)}, BF16 * psi
    gathered = {"DPO reference: gathered layer in its forward (bf16, 2 B x largest layer)":
                (0, BF16 * shape.largest_layer_params(setup.num_labels))}
    share = BF16 * psi // setup.gpus
    if setup.offload_param:  # the policy's config, offload included: the partitions in host memory
        return {"DPO reference: bf16 weights in host memory (2 B/param / GPUs)": (share * setup.gpus_per_node, 0),
                **gathered}, 0
    return {"DPO reference: bf16 weights, sharded (2 B/param / GPUs)": (0, share), **gathered}, share


def reference_forward_per_token(shape: ModelShape, attention_per_token: float, num_labels: int | None = None
                                ) -> float:
    """FLOPs per token the GPU executes in the reference's forward: 2 x the parameters that multiply a token, and
    causal attention's forward (a third of the 12LHQT ``attention_per_token``, half of it computed)."""
    return 2 * shape.matmul_params(num_labels) + attention_per_token / 3 / 2
