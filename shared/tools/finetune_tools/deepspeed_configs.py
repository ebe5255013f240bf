"""DeepSpeed configs from a few typed choices, instead of hand-edited JSON.

``DeepSpeedSetup`` holds the choices that matter (ZeRO stage, precision and fp16 loss scaling, where
the optimizer state and the parameters live, bucket sizes, Adam's betas and eps); ``build()`` turns
it into the JSON DeepSpeed reads, with ``"auto"`` wherever accelerate or the HF Trainer fills the
value from the launch (batch sizes, learning rate, weight decay). Contradictions are refused before
anything starts, each naming the value, the rule and the fix. The recipes' shipped JSON files are
exactly what ``SHIPPED`` builds (``write(root)`` rewrites them; the unit tests check ``stale(root)``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from finetune_kit.errors import ConfigError
from finetune_kit.launch import deepspeed_keys, nvme

Auto = Literal["auto"]
Device = Literal["none", "cpu", "nvme"]


class LossScaling(BaseModel):
    """fp16's dynamic loss scaling: start at 2**initial_scale_power, halve on overflow (after
    ``hysteresis`` overflows), double after ``window`` clean steps, never below ``min_scale``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    initial_scale_power: int = 16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1


class AsyncIO(BaseModel):
    """DeepSpeed's async I/O to NVMe (libaio): request size, requests in flight per thread, threads."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    block_size: int = 1048576  # bytes per read/write request: 1 MiB suits NVMe SSDs
    queue_depth: int = 8  # requests in flight per thread: deeper keeps a fast SSD busy
    thread_count: int = 1  # I/O threads per rank
    single_submit: bool = False  # submit requests together (False) or one by one
    overlap_events: bool = True  # overlap submitting with waiting for completions


class DeepSpeedSetup(BaseModel):
    """The choices behind one DeepSpeed config."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    stage: Literal[0, 1, 2, 3]
    precision: Literal["bf16", "fp16"] = "bf16"
    loss_scaling: LossScaling = LossScaling()  # fp16 only
    offload_optimizer: Device = "none"  # Adam's fp32 state and step: GPU, CPU memory (CPU Adam) or NVMe
    offload_param: Device | None = None  # stage 3 only; None leaves the key out
    nvme_path: str | None = None  # a fast local disk, for either offload to "nvme"
    aio: AsyncIO = AsyncIO()  # used only with "nvme"
    # parameters swapped in from NVMe pass through buffer_count pinned buffers of this many elements;
    # one must hold the largest parameter (Llama 3 8B's embedding: 128,256 x 4,096 = 5.25e8)
    nvme_param_buffers: tuple[int, float] = nvme.PARAM_BUFFERS
    betas: tuple[float, float] | Auto = "auto"
    eps: float | Auto = "auto"
    # stage 1-2: the gradient buckets' size in elements (bigger: fewer, larger collectives; more memory)
    bucket_size: float = 2e8
    # stage 3: live and prefetched parameters, in elements (caps on the gathered copies)
    max_live_parameters: float = 1e9
    gradient_clipping: float = 1.0
    extra: dict = Field(default_factory=dict)  # more top-level DeepSpeed keys, merged last

    @model_validator(mode="after")
    def _consistent(self) -> DeepSpeedSetup:
        if self.offload_param not in (None, "none") and self.stage != 3:
            raise ValueError(f"offload_param={self.offload_param!r} needs ZeRO stage 3 (stage is {self.stage}): "
                             "only stage 3 partitions the parameters. Use stage=3, or offload_param=None")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError(f"offload_optimizer={self.offload_optimizer!r} needs ZeRO stage 1-3 (stage is 0)")
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise ValueError("offload to 'nvme' needs nvme_path: a folder on a fast local NVMe disk")
        for precision in ("bf16", "fp16"):
            if precision != self.precision and (self.extra.get(precision) or {}).get("enabled"):
                raise ValueError(f"extra turns {precision} on while precision={self.precision!r}: choose one "
                                 f"with precision=")
        return self


def build(setup: DeepSpeedSetup) -> dict:
    """The DeepSpeed config of ``setup``; every key is one DeepSpeed knows (checked)."""
    config: dict = {}
    if setup.precision == "fp16":
        scaling = setup.loss_scaling
        config["fp16"] = {"enabled": True, "loss_scale": 0, "loss_scale_window": scaling.window,
                          "initial_scale_power": scaling.initial_scale_power, "hysteresis": scaling.hysteresis,
                          "min_loss_scale": scaling.min_scale}
        config["bf16"] = {"enabled": False}
    else:
        config["bf16"] = {"enabled": True}
    betas = list(setup.betas) if setup.betas != "auto" else "auto"
    config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": betas, "eps": setup.eps,
                                                       "weight_decay": "auto"}}
    zero: dict = {"stage": setup.stage}
    if setup.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(setup.offload_optimizer, setup.nvme_path)
    if setup.offload_param is not None:
        zero["offload_param"] = _offload(setup.offload_param, setup.nvme_path)
        if setup.offload_param == "nvme":
            count, size = setup.nvme_param_buffers
            zero["offload_param"] |= {"buffer_count": count, "buffer_size": size}
    if setup.stage in (1, 2):
        zero |= {"allgather_partitions": True, "allgather_bucket_size": setup.bucket_size, "overlap_comm": True,
                 "reduce_scatter": True, "reduce_bucket_size": setup.bucket_size, "contiguous_gradients": True}
    elif setup.stage == 3:
        zero |= {"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
                 "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                 "sub_group_size": 1e9, "stage3_max_live_parameters": setup.max_live_parameters,
                 "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}
    config["zero_optimization"] = zero
    if "nvme" in (setup.offload_optimizer, setup.offload_param):
        config["aio"] = setup.aio.model_dump()
    config |= {"gradient_clipping": setup.gradient_clipping, "gradient_accumulation_steps": "auto",
               "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
               "steps_per_print": 1000000, "wall_clock_breakdown": False}
    config |= setup.extra
    deepspeed_keys.check_keys(config, "the built DeepSpeed config")
    return config


def _offload(device: str, nvme_path: str | None) -> dict:
    if device == "nvme":
        return {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}
    return {"device": device, "pin_memory": True}


def setup_from(**choices) -> DeepSpeedSetup:
    """``DeepSpeedSetup(**choices)``, with a contradiction as a ConfigError naming it."""
    from pydantic import ValidationError

    try:
        return DeepSpeedSetup(**choices)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"DeepSpeed setup{' ' + where if where else ''}: {first['msg']}") from None


# Every DeepSpeed JSON file the recipes ship, and the choices it is built from.
SHIPPED: dict[str, DeepSpeedSetup] = {
    "recipes/llama3-8b-zero3/configs/zero3.json": DeepSpeedSetup(stage=3, betas=(0.9, 0.95), eps=1e-8),
    "recipes/llama3-8b-zero3/configs/zero3-offload.json": DeepSpeedSetup(
        stage=3, betas=(0.9, 0.95), eps=1e-8, offload_optimizer="cpu", offload_param="none"),
    "recipes/llama3-8b-zero3/configs/zero3-nvme.json": DeepSpeedSetup(
        stage=3, betas=(0.9, 0.95), eps=1e-8, offload_optimizer="nvme", offload_param="nvme",
        nvme_path="/local_nvme/deepspeed"),
    # the DPO recipe under the HF Trainer: Adam's betas and eps from its flags ("auto")
    "recipes/llama3-8b-dpo/configs/zero3.json": DeepSpeedSetup(stage=3),
    "recipes/llama3-8b-dpo/configs/zero3-offload.json": DeepSpeedSetup(stage=3, offload_optimizer="cpu",
                                                                        offload_param="none"),
    "recipes/llama2-13b-zero2/configs/zero2.json": DeepSpeedSetup(stage=2),
    "recipes/llama2-13b-zero2/configs/zero2-offload.json": DeepSpeedSetup(stage=2, offload_optimizer="cpu"),
    "recipes/llama2-13b-zero2/configs/zero2-fp16.json": DeepSpeedSetup(stage=2, precision="fp16"),
    "recipes/llama3-70b-qlora/configs/zero3.json": DeepSpeedSetup(stage=3, betas=(0.9, 0.999), eps=1e-8),
    # the chat recipe runs the classifier's job: the same file
    "recipes/llama3-70b-qlora-chat/configs/zero3.json": DeepSpeedSetup(stage=3, betas=(0.9, 0.999), eps=1e-8),
}


def stale(root: Path) -> list[str]:
    """Shipped files that differ from what their setup builds."""
    return [path for path, setup in SHIPPED.items()
            if json.loads((root / path).read_text()) != build(setup)]


def write(root: Path) -> list[str]:
    """Rewrite the shipped files that differ from what their setup builds; returns them."""
    changed = stale(root)
    for path in changed:
        (root / path).write_text(json.dumps(build(SHIPPED[path]), indent=2) + "\n")
    return changed
