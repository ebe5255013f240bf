"""How this launch runs, decided once before it starts: :class:`LaunchPlan`.

The batch split, activation checkpointing, the loss kernel and compile (as given, or ``--levers auto``'s pick,
:func:`choose`), the GPU memory cap (``FINETUNE_GPU_MEMORY_GIB``, parsed once) and the memory plan of that setting.
The checks make it (``training.input_checks``); the recipe applies its flags in ``check_inputs`` where a reader sees
it (``args = replace(args, **checked.plan.flags)``); the ranks compare its digest before the first collective
(:meth:`LaunchPlan.handshake`); ``training.start`` holds each GPU to its cap; the run record and the card read it.

``--levers auto`` takes the first line of the planner's ranking (:mod:`finetune_kit.planning.levers`, what
``make plan ... BEST=1`` prints) for the launch's engine: the micro-batch with the accumulation that keeps the
sequences per step, checkpointing, the loss kernel where it runs here (Liger: CUDA with liger-kernel) and
torch.compile under FSDP2 on CUDA. It ranks on the GPU's total memory (or the cap), never its free memory, so ranks
with one kind of GPU rank alike, and with the package's calibrated constants (``planning/speed-calibration.json``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass

from finetune_kit.errors import ConfigError
from finetune_kit.launch import env
from finetune_kit.planning import hardware, levers, speed, verdict


@dataclass(frozen=True)
class LaunchPlan:
    """The launch's decided settings; built by the checks, read by the run."""

    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool
    recompute_every: int
    memory: verdict.Plan  # the memory plan of this setting on this rank's GPU, and its verdict
    loss_kernel: str | None = None  # None: the recipe takes no --loss-kernel
    compile: bool | None = None  # None: the recipe takes no --compile
    memory_cap_GiB: float | None = None  # FINETUNE_GPU_MEMORY_GIB: each rank's GPU held to it (training.start)
    levers: str = ""  # --levers auto's line: the setting it chose, on which GPU, with which constants; "" otherwise

    @property
    def flags(self) -> dict:
        """The recipe's flags this plan decides: ``dataclasses.replace(args, **plan.flags)``."""
        out = {"micro_batch_size": self.micro_batch_size, "grad_accum": self.grad_accum,
               "gradient_checkpointing": self.gradient_checkpointing, "recompute_every": self.recompute_every}
        if self.loss_kernel is not None:
            out["loss_kernel"] = self.loss_kernel
        if self.compile is not None:
            out["compile"] = self.compile
        return out

    def digest(self) -> str:
        """What every rank must share: the flags, the cap and the lever line (the memory plan's verdict holds this
        rank's free memory, which ranks may differ in without changing what they run)."""
        text = json.dumps({**self.flags, "memory_cap_GiB": self.memory_cap_GiB, "levers": self.levers},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def summary(self) -> str:
        """The flags, the cap and the lever line in one line: what the handshake names when ranks differ."""
        cap = f"GPU memory held to {self.memory_cap_GiB:g} GiB" if self.memory_cap_GiB else "no memory cap"
        return f"{self.describe()}, {cap}" + (f"; {self.levers}" if self.levers else "")

    def handshake(self, timeout_s: float = 300.0) -> dict:
        """The ranks agree on the job's shape and on this plan (:func:`finetune_kit.launch.multinode.handshake`)
        before the first collective: a disagreement is one line on every rank, never a hang."""
        from finetune_kit.launch import multinode

        return multinode.handshake(timeout_s, plan_digest=self.digest(), plan_summary=self.summary())

    def describe(self) -> str:
        """The decided flags in one line, as the recipe takes them."""
        return levers.flag_line(self.micro_batch_size, self.grad_accum, self.gradient_checkpointing,
                                self.recompute_every, self.loss_kernel, self.compile)


def ranking_gpu(name: str | None, cap_GiB: float | None) -> tuple[hardware.Gpu, float]:
    """The GPU profile to rank for and its memory in GiB: ``--levers-gpu``'s profile, else this machine's GPU at its
    total memory; at most the cap either way."""
    if name:
        gpu = hardware.gpu_profile(name)
        return gpu, gpu.memory_GiB if cap_GiB is None else min(gpu.memory_GiB, cap_GiB)
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--levers auto ranks the settings for a GPU, and this machine has none: name the GPU to rank "
                          f"for with --levers-gpu ({', '.join(hardware.GPUS)}), or drop --levers auto.")
    device = torch.cuda.get_device_name(env.view().local_rank % torch.cuda.device_count())
    gpu = hardware.gpu_for_device(device)
    if gpu is None:
        raise ConfigError(f"--levers auto: no speed profile for {device!r}; pass --levers-gpu with the nearest of "
                          f"{', '.join(hardware.GPUS)}, or drop --levers auto.")
    return gpu, verdict.local_gpu_memory_GiB(cap_GiB, free=False)


def choose(args, model_config, ds_config: dict | None, setup_fields: dict, *, cap_GiB: float | None,
           classifier: bool, compile_ok: bool) -> tuple[dict, str] | None:
    """``--levers auto``'s choice for this launch (``ds_config`` None: FSDP2; ``setup_fields``: its
    :class:`~finetune_kit.planning.verdict.Setup` as launched): the flags it sets and its line, printed on the main
    rank; None with the flags as given. Refused in one line: nothing fits, more than one node without the network,
    ``--levers-gpu`` or ``--levers-network`` without auto."""
    for flag, value, what in (("--levers-gpu", args.levers_gpu, "GPU"),
                              ("--levers-network", args.levers_network, "network between the nodes")):
        if value and args.levers != "auto":
            raise ConfigError(f"{flag} {value} without --levers auto: it names the {what} --levers auto ranks the "
                              f"settings for, and the flags are taken as given. Add --levers auto, or drop {flag}.")
    if args.levers != "auto":
        return None
    gpu, memory = ranking_gpu(args.levers_gpu, cap_GiB)
    base = verdict.setup_for_launch(ds_config, world_size=env.world_size(), **setup_fields, gpu_memory_GiB=memory)
    network = args.levers_network
    if base.nodes > 1 and not network:
        raise ConfigError(f"--levers auto on {base.nodes} nodes ranks with the network between them (ZeRO-3 gathers "
                          "the weights over it once per micro-batch): name it with --levers-network, one of "
                          f"{', '.join(hardware.NETWORKS)} (make plan's NETWORK=), or drop --levers auto.")
    cluster = speed.Cluster(gpu, base.gpus_per_node, base.nodes, hardware.network_profile(network) if network else None)
    efficiency, source = speed.calibrated()
    from finetune_kit.losses import liger_available

    kernels = ("none",) if classifier or not hasattr(args, "loss_kernel") or not base.loss_chunks else \
        ("chunked", "liger") if liger_available() else ("chunked",)  # those a launched run can use here
    found = levers.options(model_config, base, args.grad_accum, cluster, efficiency, loss_kernels=kernels,
                           compile_ok=compile_ok)
    best = levers.rank(found)[0]
    if best.tier() == 2:
        near = levers.nearest(found)
        fix = verdict.suggest(model_config, near.setup)
        raise ConfigError(f"--levers auto: no setting of this launch fits {best.gpus} x {gpu.name} at {memory:g} GiB; "
                          f"the nearest is {near.describe()}. "
                          + (f"Cheapest change that fits: {fix}." if fix else "Nothing the planner tries fits: use a "
                             "smaller model or larger GPUs."))
    j = best.job
    flags = {"micro_batch_size": j.micro_batch, "grad_accum": j.grad_accum,
             "gradient_checkpointing": j.gradient_checkpointing, "recompute_every": j.recompute_every,
             **({"loss_kernel": j.loss_kernel} if j.loss_kernel != "none" else {}), "compile": j.compiled}
    given = levers.flag_line(args.micro_batch_size, args.grad_accum, args.gradient_checkpointing, args.recompute_every,
                             None, None)
    headroom = "" if best.tier() == 0 else (f"; none leaves {100 * levers.HEADROOM:.0f}% of the GPU free, this one "
                                            "fits with less")
    line = (f"levers auto: {best.describe()}, on {best.gpus} x {gpu.name}" + (f" over {network}" if network else "")
            + f"; the global batch kept (was {given}){headroom}; speed constants: {source}")
    if env.is_main_rank():
        print(line, file=sys.stderr)
    return flags, line
