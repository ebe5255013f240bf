"""``--levers auto``: before launch, the fastest settings that fit this launch's GPUs, applied to the arguments.

The ranking is the planner's (:mod:`finetune_kit.planning.levers`, what ``make plan ... BEST=1`` prints), held to
what a launched run can change: the micro-batch with the accumulation that keeps the sequences per optimizer step,
activation checkpointing, the loss kernel where it runs here (Liger: CUDA with liger-kernel installed) and
torch.compile under an FSDP2 launch on CUDA. The engine, its offload, the sequence length and the global batch stay
as launched: nothing that changes the model's math moves.
"""

from __future__ import annotations

import sys
from pathlib import Path

from finetune_kit.errors import ConfigError
from finetune_kit.launch import env
from finetune_kit.planning import hardware, levers, speed, verdict

CALIBRATION = Path(__file__).resolve().parents[3] / "results" / speed.CALIBRATION_FILE  # in a clone of the repo


def _gpu(name: str | None) -> tuple[hardware.Gpu, float | None]:
    """The GPU profile to rank for and its memory in GiB: ``--levers-gpu``'s, else this machine's GPU."""
    if name:
        gpu = hardware.gpu_profile(name)
        return gpu, gpu.memory_GiB
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--levers auto ranks the settings for a GPU, and this machine has none: name the GPU to rank "
                          f"for with --levers-gpu ({', '.join(hardware.GPUS)}), or drop --levers auto.")
    device = torch.cuda.get_device_name(env.view().local_rank % torch.cuda.device_count())
    gpu = hardware.gpu_for_device(device)
    if gpu is None:
        raise ConfigError(f"--levers auto: no speed profile for {device!r}; pass --levers-gpu with the nearest of "
                          f"{', '.join(hardware.GPUS)}, or drop --levers auto.")
    return gpu, verdict.local_gpu_memory_GiB()


def choose(args, model_config, ds_config: dict | None, *, memory_kwargs: dict, loss_kernels: tuple[str, ...],
           compile_ok: bool) -> tuple[levers.Option, hardware.Gpu]:
    """The first line of the ranking for this launch (``ds_config`` None: FSDP2), the global batch kept, and the
    GPU it was ranked for."""
    gpu, memory = _gpu(getattr(args, "levers_gpu", None))
    world = env.world_size()
    per_node = max(1, min(env.view().local_world_size if env.launched() else world, world))
    nodes = max(1, world // per_node)
    fields = dict(memory_kwargs, nodes=nodes, gpus_per_node=per_node, gpu_memory_GiB=memory)
    fields.pop("skip", None)
    base = verdict.setup_for_fsdp2(**fields) if ds_config is None else verdict.setup_from_deepspeed(ds_config, **fields)
    network = hardware.NETWORKS["ib400"] if nodes > 1 else None  # the same for every option: the engine is fixed
    cluster = speed.Cluster(gpu, per_node, nodes, network)
    efficiency, _ = speed.calibrated(CALIBRATION)
    ranked = levers.rank(levers.options(model_config, base, args.grad_accum, cluster, efficiency,
                                        loss_kernels=loss_kernels, compile_ok=compile_ok, engines=False))
    return ranked[0], gpu


def apply(args, model_config, ds_config: dict | None, *, memory_kwargs: dict, loss_kernels: tuple[str, ...],
          compile_ok: bool) -> str:
    """Sets ``args``' micro-batch, accumulation, checkpointing, loss kernel and compile to :func:`choose`'s, prints
    the choice in one line on the main rank, and returns that line (the run record keeps it)."""
    best, gpu = choose(args, model_config, ds_config, memory_kwargs=memory_kwargs, loss_kernels=loss_kernels,
                  compile_ok=compile_ok)
    j = best.job
    before = (f"--micro-batch-size {args.micro_batch_size} --grad-accum {args.grad_accum}"
              + ("" if args.gradient_checkpointing else " --no-gradient-checkpointing"))
    args.micro_batch_size, args.grad_accum = j.micro_batch, j.grad_accum
    args.gradient_checkpointing, args.recompute_every = j.gradient_checkpointing, j.recompute_every
    if j.loss_kernel in ("chunked", "liger") and hasattr(args, "loss_kernel"):
        args.loss_kernel = j.loss_kernel
    if hasattr(args, "compile"):
        args.compile = j.compiled
    _, source = speed.calibrated(CALIBRATION)
    line = (f"levers auto: {best.describe()}, on {best.gpus} x {gpu.name}; the global batch kept (was {before}); "
            f"speed constants: {source}")
    if env.is_main_rank():
        print(line, file=sys.stderr)
    return line


def loss_kernels_here(args, *, classifier: bool) -> tuple[str, ...]:
    """The loss kernels a launched run can use: none for a classifier or the loss whole (--loss-chunks 0); else the
    chunked loss, and Liger's where it runs here."""
    if classifier or not hasattr(args, "loss_kernel") or not getattr(args, "loss_chunks", 0):
        return ("none",)
    from finetune_kit import losses

    return ("chunked", "liger") if losses.liger_available() else ("chunked",)

