"""The planner's job and cluster of a GPU run record: what the speed model predicts it from."""

from __future__ import annotations

import re

from finetune_kit.metering.run_record import RunRecord
from finetune_kit.models.shapes import Adapter, resolve_model
from finetune_tools.planning.hardware import gpu_for_device
from finetune_tools.planning.speed import Cluster, Job


def job_of(rec: RunRecord) -> tuple[Job, Cluster] | None:
    """The planner's job and cluster of a GPU run record; None for a device without a profile."""
    gpu = gpu_for_device(rec.hardware.device)
    if gpu is None:
        return None
    base = re.sub(r" \(truncated.*\)$", "", rec.model.architecture)
    shape = resolve_model(base)
    if rec.model.truncated:
        shape = shape.truncated(rec.model.layers)
    t = rec.training
    adapter = None if t.method == "full" else Adapter(rank=_lora_rank(shape, rec.model.params_trainable),
                                                      quantized=t.method == "qlora")
    num_labels = 2 if t.method != "full" else None  # the 70B recipe trains a review classifier
    job = Job(shape, seq_len=t.seq_len, micro_batch=t.micro_batch_size, grad_accum=t.grad_accum,
              stage=t.zero_stage, engine=t.engine, offload_optimizer=t.offload != "none", adapter=adapter,
              gradient_checkpointing=t.gradient_checkpointing, num_labels=num_labels)
    return job, Cluster(gpu, gpus_per_node=rec.hardware.devices, nodes=rec.hardware.nodes)


def _lora_rank(shape, trainable: int) -> int:
    """The all-linear LoRA rank whose parameter count (plus a 2-label head) is nearest ``trainable``."""
    return min((1, 2, 4, 8, 16, 32, 64, 128), key=lambda r: abs(shape.lora_params(r) + 2 * shape.hidden_size
                                                                 - trainable))
