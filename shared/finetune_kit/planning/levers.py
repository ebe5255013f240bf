"""Which settings train fastest on given hardware: every combination of the levers a recipe changes without changing
the model's math, each with its memory plan (:mod:`.verdict`) and predicted speed (:mod:`.speed`), ranked.

The levers: the micro-batch, with the accumulation that keeps the sequences per optimizer step (the global batch);
activation checkpointing (off, or every 1st, 2nd or 4th decoder layer); the loss kernel (the chunked loss in plain
torch, or Liger's fused linear cross-entropy); torch.compile of the decoder layers (FSDP2 only, as the recipes
allow), for the engine the setup names. None of them changes what is computed: the loss of a step is the same
however its sequences are split into micro-batches, and recomputation, the loss kernel and compilation change how
it is computed, not what. (``make plan BEST=1`` also ranks the engines: ``finetune_tools.planning.cli``.)

LoRA and QLoRA (a setup with an ``Adapter``) rank the same levers with the adapter's memory terms and the frozen
base's FLOPs, under DeepSpeed ZeRO, the only engine the recipes train adapters with: FSDP2, and so torch.compile, is
for full fine-tunes.

:func:`rank` orders them in three tiers, fastest first in each: those whose predicted memory leaves ``headroom`` of
the GPU free (and fits the host), those that fit with less, those that do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune_kit.errors import ConfigError
from finetune_kit.planning.speed import Cluster, Efficiency, Job, Prediction, job_for, predict
from finetune_kit.planning.verdict import GiB, Plan, Setup, plan

HEADROOM = 0.10  # the share of the GPU's memory the first choice leaves free: the memory model's error is within it
RECOMPUTE = (0, 1, 2, 4)  # 0: no checkpointing; N: every N-th decoder layer recomputed


@dataclass(frozen=True)
class Option:
    """One setting: its memory plan, its predicted speed, and whether it was measured."""

    setup: Setup
    job: Job
    plan: Plan
    prediction: Prediction
    gpus: int
    measured: str = ""  # the GPU record measured at exactly this setting, "" where predicted only

    @property
    def tokens_per_s(self) -> float:
        """Per GPU."""
        return self.prediction.tokens_per_s(self.gpus)

    def fits(self, headroom: float = HEADROOM) -> bool:
        """Predicted GPU memory within (1 - headroom) of the GPU, and the host's memory not short."""
        cap = self.setup.gpu_memory_GiB
        return (cap is None or self.plan.gpu_bytes <= (1 - headroom) * cap * GiB) and self.plan.fits is not False

    def tier(self, headroom: float = HEADROOM) -> int:
        """0: fits with ``headroom`` of the GPU free; 1: fits with less; 2: does not fit."""
        return 0 if self.fits(headroom) else 1 if self.fits(0.0) else 2

    @property
    def engine(self) -> str:
        if self.job.engine == "fsdp2":
            return "FSDP2"
        return f"ZeRO-{self.job.stage}" + (" + optimizer offload" if self.job.offload_optimizer else "")

    def flags(self) -> str:
        """The recipe's flags for this setting (the engine is the launch config's: :attr:`engine`)."""
        j = self.job
        return flag_line(j.micro_batch, j.grad_accum, j.gradient_checkpointing, j.recompute_every,
                         j.loss_kernel if j.loss_kernel in ("chunked", "liger") else None, j.compiled)

    def describe(self) -> str:
        """One line: the setting, its memory and speed, and where they come from."""
        cap = self.setup.gpu_memory_GiB
        return (f"{self.engine}, {self.flags()}: {self.plan.gpu_bytes / GiB:.1f}"
                f"{f' of {cap:g}' if cap else ''} GiB per GPU, {self.tokens_per_s:,.0f} tokens/s per GPU "
                + (f"(measured on a GPU: {self.measured}; the figures are the model's)" if self.measured
                   else "(predicted)"))


def flag_line(micro_batch: int, grad_accum: int, checkpointing: bool, recompute_every: int, loss_kernel: str | None,
              compiled: bool | None) -> str:
    """A setting as the recipes' flags; ``loss_kernel`` None: not one of them."""
    out = [f"--micro-batch-size {micro_batch}", f"--grad-accum {grad_accum}",
           f"--recompute-every {recompute_every}" if checkpointing else "--no-gradient-checkpointing"]
    out += ([f"--loss-kernel {loss_kernel}"] if loss_kernel else []) + (["--compile"] if compiled else [])
    return " ".join(out)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def options(model, base: Setup, grad_accum: int, cluster: Cluster, efficiency: Efficiency | None = None, *,
            loss_kernels: tuple[str, ...] = ("chunked", "liger"), compile_ok: bool = True,
            measured=None) -> list[Option]:
    """Every combination of the levers for ``base`` (its model, method, sequence length, engine) at
    ``base.micro_batch x grad_accum`` sequences per GPU per optimizer step, on ``cluster``.

    ``loss_kernels``: those the run can use ("none" for a classifier, or the loss whole); ``compile_ok``: whether
    compiled layers can run here (under FSDP2 only, so never with an adapter). ``measured(job, cluster)``: the name
    of a GPU record of exactly that setting, or "". Sequence-parallel runs keep their micro-batch (one sequence).
    """
    if base.adapter is not None and base.engine == "fsdp2":
        raise ConfigError("LoRA/QLoRA under FSDP2: the recipes train adapters under DeepSpeed ZeRO only (FSDP2 and "
                          "torch.compile are for full fine-tunes); rank the adapter's settings under ZeRO-3 "
                          "(engine \"deepspeed\"), or plan a full fine-tune (no adapter) for FSDP2.")
    shape = plan(model, base).model
    per_gpu = base.micro_batch * grad_accum
    micro = [base.micro_batch] if base.sequence_parallel > 1 else _divisors(per_gpu)
    recompute = [r for r in RECOMPUTE if r <= shape.num_hidden_layers]
    out = []
    for m in micro:
        for r in recompute:
            setup = replace(base, micro_batch=m, gradient_checkpointing=r > 0, recompute_every=max(r, 1))
            memory = plan(model, setup)
            for kernel in loss_kernels:
                for compiled in (False, True) if compile_ok and setup.engine == "fsdp2" else (False,):
                    job = replace(job_for(shape, setup, per_gpu // m), loss_kernel=kernel, compiled=compiled)
                    out.append(Option(setup, job, memory, predict(job, cluster, efficiency), cluster.gpus,
                                      measured(job, cluster) if measured else ""))
    return out


def rank(found: list[Option], headroom: float = HEADROOM) -> list[Option]:
    """By :meth:`Option.tier` (fits with ``headroom``, fits, does not fit), fastest first within a tier. A tie
    (micro-batches of one global batch on one GPU, where the model has no cost per micro-batch: the runs measured
    here resolve none) goes to the larger micro-batch: fewer, larger kernels, and under ZeRO-3 fewer weight gathers
    per token."""
    return sorted(found, key=lambda o: (o.tier(headroom), -round(o.tokens_per_s, 6), -o.job.micro_batch))


def nearest(found: list[Option]) -> Option:
    """The option that needs the least GPU memory: the one nearest to fitting when none does."""
    return min(found, key=lambda o: (o.plan.gpu_bytes, o.plan.host_bytes, -o.tokens_per_s))
