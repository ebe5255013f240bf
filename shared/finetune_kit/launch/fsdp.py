"""PyTorch FSDP2 as the launch selects it: what ``accelerate launch`` passed, checked before anything loads.

An accelerate YAML with ``distributed_type: FSDP`` turns a recipe's ``train.py`` into an FSDP2
run with no change to its code: accelerate exports the YAML's ``fsdp_config`` as ``FSDP_*``
environment variables, and :func:`read` collects them. What the recipes support, and
:func:`check` enforces (with the line of the YAML to change):

* ``fsdp_version: 2`` (``fully_shard``: every parameter a DTensor sharded over all ranks);
* ``fsdp_reshard_after_forward: true`` (full sharding, ZeRO-3's equivalent: weights are gathered
  per decoder layer for its forward and again for its backward);
* ``fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP`` with the model's decoder layer class: one
  FSDP unit (one all-gather, one reduce-scatter) per decoder layer;
* ``fsdp_state_dict_type: SHARDED_STATE_DICT``: every rank writes its own shard of the
  checkpoint (torch.distributed.checkpoint), which also loads on another number of ranks;
* no parameter offload (``fsdp_offload_params: false``): the CPU-offload setup of these recipes
  is DeepSpeed's (``configs/zero3-offload.yaml``);
* activation checkpointing once: the script's own (``--gradient-checkpointing``, every decoder
  layer, non-reentrant) *or* ``fsdp_activation_checkpointing``, not both.

Precision: parameters are kept in fp32 (sharded; they are the master weights the optimizer
updates), cast to bf16 for forward and backward, and gradients are reduce-scattered in fp32
(:func:`mixed_precision_policy`). accelerate's own default for ``mixed_precision: bf16`` reduces in
bf16, and its YAML has no key for the reduction dtype, so :func:`plugin` sets it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from finetune_kit.errors import ConfigError

ENGINE = "fsdp2"


@dataclass(frozen=True)
class FsdpLaunch:
    """The FSDP settings of this launch, as accelerate exported them from the YAML."""

    version: int
    reshard_after_forward: bool
    auto_wrap_policy: str
    layer_classes: tuple[str, ...]
    state_dict_type: str
    offload_params: bool
    activation_checkpointing: bool
    cpu_ram_efficient_loading: bool
    mixed_precision: str  # "bf16" | "fp16" | "no"

    def as_dict(self) -> dict:
        return {**asdict(self), "layer_classes": list(self.layer_classes)}


def launched() -> bool:
    """True when ``accelerate launch`` ran this process with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _flag(name: str, default: str = "false") -> bool:
    return os.environ.get(f"FSDP_{name}", default).lower() in ("1", "true", "yes")


def read() -> FsdpLaunch:
    """This launch's FSDP settings (accelerate's ``FSDP_*`` variables, with accelerate's defaults)."""
    classes = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
    return FsdpLaunch(
        version=int(os.environ.get("FSDP_VERSION", "1")),
        reshard_after_forward=reshard in ("1", "true", "yes", "full_shard"),
        auto_wrap_policy=os.environ.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP"),
        layer_classes=tuple(c.strip() for c in classes.split(",") if c.strip()),
        state_dict_type=os.environ.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"),
        offload_params=_flag("OFFLOAD_PARAMS"),
        activation_checkpointing=_flag("ACTIVATION_CHECKPOINTING"),
        cpu_ram_efficient_loading=_flag("CPU_RAM_EFFICIENT_LOADING"),
        mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower(),
    )


def check_settings(launch: FsdpLaunch, *, model_config, gradient_checkpointing: bool,
                   source: str = "the accelerate YAML",
                   checkpointing_flag: str = "--no-gradient-checkpointing") -> None:
    """ConfigError naming the setting, the rule and the fix for what the recipes do not support."""
    layer = decoder_layer_class(model_config)
    problems = []
    if launch.version != 2:
        problems.append(f"fsdp_version is {launch.version}; these recipes run FSDP2: set fsdp_version: 2")
    if not launch.reshard_after_forward:
        problems.append("fsdp_reshard_after_forward is false (every rank would keep all weights after the forward, "
                        "ZeRO-2's memory); set fsdp_reshard_after_forward: true")
    if launch.auto_wrap_policy != "TRANSFORMER_BASED_WRAP" or (layer and layer not in launch.layer_classes):
        problems.append(f"fsdp_auto_wrap_policy is {launch.auto_wrap_policy} with layer classes "
                        f"{list(launch.layer_classes) or 'none'}; one FSDP unit per decoder layer needs "
                        f"fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP and fsdp_transformer_layer_cls_to_wrap: "
                        f"{layer or 'the decoder layer class'}")
    if launch.state_dict_type != "SHARDED_STATE_DICT":
        problems.append(f"fsdp_state_dict_type is {launch.state_dict_type}; resumable checkpoints are sharded: set "
                        "fsdp_state_dict_type: SHARDED_STATE_DICT (the consolidated model is written at the end "
                        "anyway)")
    if launch.offload_params:
        problems.append("fsdp_offload_params is true; offload is supported with DeepSpeed here: launch "
                        "configs/zero3-offload.yaml, or set fsdp_offload_params: false")
    if launch.mixed_precision != "bf16":
        problems.append(f"mixed_precision is {launch.mixed_precision}; these recipes train in bf16: set "
                        "mixed_precision: bf16")
    if launch.activation_checkpointing and gradient_checkpointing:
        problems.append(f"fsdp_activation_checkpointing is true and the script checkpoints every decoder layer "
                        f"too (--gradient-checkpointing, the default), which would recompute each layer twice; "
                        f"set fsdp_activation_checkpointing: false, or pass {checkpointing_flag}")
    if problems:
        raise ConfigError(f"FSDP settings of {source} that this recipe does not run: " + "; ".join(problems) + ".")


def decoder_layer_class(model_config) -> str | None:
    """The decoder layer class name of a transformers config (``LlamaDecoderLayer``), if known."""
    names = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer"}
    return names.get(getattr(model_config, "model_type", None))


def mixed_precision_policy():
    """bf16 weights in forward and backward, fp32 gradient reduction; outputs left as the model makes
    them (the loss in fp32, as transformers computes it from upcast logits, and as under DeepSpeed)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def plugin():
    """accelerate's FSDP plugin for this launch (settings from the YAML) with :func:`mixed_precision_policy`."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=mixed_precision_policy())


# The optimizer under FSDP2: torch's AdamW with the betas and eps of the shipped ZeRO configs (the
# recipes' DeepSpeed JSONs; a unit test keeps them equal), and the JSONs' gradient clipping.
ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8}
MAX_GRAD_NORM = 1.0
