"""The planner's job and cluster of a GPU run record: what the speed model predicts it from."""

from __future__ import annotations

import re

from finetune_kit.errors import UserInputError
from finetune_kit.metering.run_record import RunRecord
from finetune_kit.models.shapes import Adapter, resolve_model
from finetune_kit.planning.hardware import gpu_for_device
from finetune_kit.planning.speed import Cluster, Job

# Runs whose step metering waited for the device after every micro-batch (their notes say so): a fixed cost per
# micro-batch that today's recipes do not pay, largest at small micro-batches. Kept in results/, out of the fit and of
# the order the ranking is checked against.
SYNCED_PER_MICRO_BATCH = "waited for the device after every micro-batch"


def synced_per_micro_batch(rec: RunRecord) -> bool:
    return SYNCED_PER_MICRO_BATCH in (rec.notes or "")


def plain(rec: RunRecord) -> bool:
    """A run the speed model can describe: none of the levers its Job leaves out (packing, offloaded activations,
    sequence parallelism, the tiled MLP, fp8), padding under 5% (padded slots cost compute that no real token is
    credited with), and metered as the recipes meter today (not :func:`synced_per_micro_batch`)."""
    t = rec.training
    return (not t.packing and not t.offload_activations and not synced_per_micro_batch(rec)
            and (t.sequence_parallel or 1) == 1 and not t.tiled_mlp
            and t.fp8 in (None, "", "none") and (rec.measured.padding_fraction or 0) < 0.05)


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
              gradient_checkpointing=t.gradient_checkpointing, num_labels=num_labels,
              recompute_every=t.recompute_every or 1, compiled=bool(t.compiled),
              loss_kernel=t.loss_kernel if t.loss_kernel == "liger" or (t.loss_kernel == "chunked" and t.loss_chunks)
              else "none")
    return job, Cluster(gpu, gpus_per_node=rec.hardware.devices, nodes=rec.hardware.nodes)


def _lora_rank(shape, trainable: int) -> int:
    """The all-linear LoRA rank whose parameter count (plus a 2-label head) is nearest ``trainable``."""
    return min((1, 2, 4, 8, 16, 32, 64, 128), key=lambda r: abs(shape.lora_params(r) + 2 * shape.hidden_size
                                                                 - trainable))


def one_gpu_records(runs) -> list[tuple[str, RunRecord, Job, Cluster]]:
    """The GPU records under ``runs`` (``results/runs``: its files, ``ablation/``, and each command's ``records/``)
    that the speed model describes: a GPU with a profile, a measured speed, :func:`plain`."""
    from pathlib import Path

    runs = Path(runs)
    paths = sorted(runs.glob("*.json")) + sorted(runs.glob("ablation/*.json")) + sorted(runs.glob("*/records/*/*.json"))
    out = []
    for path in paths:
        rec = RunRecord.read(path)
        try:
            planned = job_of(rec)
        except UserInputError:  # a shape no profile names (the smoke runs' tiny models)
            continue
        if planned is None or not rec.measured.tokens_per_s_per_device or not plain(rec):
            continue
        out.append((str(path.relative_to(runs.parent)), rec, *planned))
    return out


def measured_settings(runs) -> dict[tuple, str]:
    """(GPU family, GPUs, job) of each record of :func:`one_gpu_records`, to the record's path under results/."""
    from finetune_kit.planning.speed import family

    return {(family(cluster.gpu), cluster.gpus, job): name for name, _, job, cluster in one_gpu_records(runs)}
