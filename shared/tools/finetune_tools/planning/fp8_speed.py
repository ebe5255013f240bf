"""fp8's speed: the speed model (:mod:`finetune_kit.planning.speed`) with torchao's float8 linear layers.

**fp8 matmuls** (``--fp8``, torchao's float8 linear layers; :func:`predict_fp8`): the share of the model
  FLOPs that the converted layers carry (:func:`fp8_share`: 6 x the parameters of the decoder's linear layers,
  not the LM head, not attention's 12LHQT) runs at the GPU's fp8 peak, the rest at the bf16 peak, both at the
  same fitted ``efficiency``; plus the time fp8 adds (:func:`fp8_overhead`), as a fraction of what the covered
  matmuls take in bf16: the casts to fp8 with their amax reductions, and fp8 matmuls reaching less of their
  peak than bf16 ones. Compiled, that fraction is fitted on torchao's published Llama 3 8B pair per scaling
  recipe (:data:`FP8_PUBLISHED`); uncompiled, each cast is its own unfused kernels, an assumption stated at
  :data:`UNFUSED_CASTS`. Communication, the optimizer step and offload stay as in bf16 (the weights are
  gathered in bf16).
"""

from __future__ import annotations

from dataclasses import replace

from finetune_kit.models import fp8
from finetune_kit.models.shapes import resolve_model
from finetune_kit.planning.hardware import GPUS, Gpu
from finetune_kit.planning.speed import Cluster, Efficiency, Job, Prediction, predict

# Published fp8 speed-ups the compiled overhead is fitted on, per scaling recipe: (bf16, fp8) tokens/s per GPU of
# the torchao float8 README's training benchmark (Llama 3 8B, 8 x H100, FSDP2, torch.compile, batch 1 x 8,192
# tokens, torchao 0.10; https://github.com/pytorch/ao/blob/main/torchao/float8/README.md). Its selective
# checkpointing is modelled as full checkpointing, as for every run; its tensorwise run gathered the weights in
# fp8, which the model leaves out: the weight gathers are under 10% of that step.
FP8_PUBLISHED = {"tensorwise": (6150.0, 7689.5), "rowwise": (6150.0, 6768.0)}
FP8_PUBLISHED_SEQ_LEN = 8192

# Assumption: what the casts cost on top when nothing fuses them (no torch.compile), as a fraction of the covered
# matmuls' bf16 time. Unfused, each cast is an amax reduction, a scale and a saturated cast, each its own kernel
# reading and writing the whole bf16 tensor, for every operand of the forward, the recomputed forward and the
# backward. Basis: torchao's float8 FFN at width 4,096 on one H100 (https://github.com/pytorch/ao/issues/685)
# took 1.14x the bf16 time uncompiled and 0.61x compiled, a difference of about half the bf16 time.
UNFUSED_CASTS = 0.5


def fp8_share(job: Job) -> float:
    """Share of the job's model FLOPs per token that fp8 matmuls carry: 6 x the parameters of the decoder's linear
    layers that convert (:func:`finetune_kit.models.fp8.keeps_fp8`: both widths multiples of 16; never the LM head)
    over :meth:`Job.flops_per_token`. The rest, the head and attention's 12LHQT, stays bf16."""
    converted = sum(i * o for i, o in job.shape.linear_shapes().values()
                    if i % fp8.ALIGNMENT == 0 and o % fp8.ALIGNMENT == 0)
    return 6 * job.shape.num_hidden_layers * converted / job.flops_per_token()


def check_fp8(job: Job, gpu: Gpu, recipe: str) -> None:
    """ConfigError where ``--fp8 recipe`` cannot run or cannot gain, as the recipes refuse it
    (:func:`finetune_kit.models.fp8.check`)."""
    from finetune_kit.errors import ConfigError

    if recipe not in FP8_PUBLISHED:
        raise ConfigError(f"--fp8 {recipe}: not one of {', '.join(FP8_PUBLISHED)}.")
    if gpu.peak_fp8_tflops is None:
        raise ConfigError(f"--fp8 {recipe} on {gpu.name}: it has no fp8 tensor cores (its profile has no fp8 peak); "
                          "fp8 matmuls need compute capability 8.9 or above. Use --gpu h100 or h200, or drop --fp8.")
    if job.adapter is not None:
        raise ConfigError(f"--fp8 {recipe} on a LoRA/QLoRA plan: the frozen base computes in bf16 and the LoRA "
                          "matrices are too small for fp8 matmuls to gain. Drop --fp8.")


def _with_fp8(base: Prediction, share: float, gpu: Gpu, overhead: float) -> Prediction:
    covered = base.matmul_s * share  # bf16 seconds of the matmuls that turn fp8
    fp8_matmul = covered * gpu.peak_bf16_tflops / gpu.peak_fp8_tflops
    return replace(base, matmul_s=base.matmul_s - covered + fp8_matmul + overhead * covered)


def fit_fp8_overhead(job: Job, cluster: Cluster, speedup: float, efficiency: Efficiency | None = None) -> float:
    """The overhead (a fraction of the covered matmuls' bf16 time) at which the model predicts ``speedup``, fp8's
    tokens/s over bf16's, for ``job`` on ``cluster``, by bisection; 0 where even no overhead falls short."""
    base = predict(job, cluster, efficiency)
    share = fp8_share(job)

    def predicted(overhead: float) -> float:
        return base.step_s / _with_fp8(base, share, cluster.gpu, overhead).step_s

    low, high = 0.0, 16.0
    if predicted(low) <= speedup:
        return 0.0
    for _ in range(80):
        middle = (low + high) / 2
        low, high = (middle, high) if predicted(middle) > speedup else (low, middle)
    return (low + high) / 2


def fitted_fp8_overhead(recipe: str, efficiency: Efficiency | None = None) -> float:
    """The compiled overhead at which the model reproduces the published speed-up of ``recipe``
    (:data:`FP8_PUBLISHED`: torchao's Llama 3 8B on 8 H100s)."""
    bf16, fp8_speed = FP8_PUBLISHED[recipe]
    job = Job(resolve_model("llama3-8b"), seq_len=FP8_PUBLISHED_SEQ_LEN, micro_batch=1, engine="fsdp2")
    return fit_fp8_overhead(job, Cluster(GPUS["h100"], 8, 1), fp8_speed / bf16, efficiency)


def fp8_key(recipe: str, compiled: bool) -> str:
    """The key of :attr:`Efficiency.fp8_overhead`: ``"tensorwise compiled"``, ``"rowwise uncompiled"``."""
    return f"{recipe} {'compiled' if compiled else 'uncompiled'}"


def fp8_cost(recipe: str, compiled: bool, efficiency: Efficiency | None = None) -> tuple[float, str]:
    """What fp8 adds, as a fraction of the covered matmuls' bf16 time, and where that figure comes from:

    * fitted on a measured pair of this scaling and compile setting (``efficiency.fp8_overhead``);
    * uncompiled, with this scaling measured compiled and another scaling measured both ways: this scaling's
      compiled cost plus the unfused casts' measured cost of the other (predicted);
    * else the compiled cost fitted on torchao's published pair (:data:`FP8_PUBLISHED`), plus
      :data:`UNFUSED_CASTS` (an assumption) when not compiled (predicted)."""
    measured = (efficiency or Efficiency()).fp8_overhead
    key = fp8_key(recipe, compiled)
    if key in measured:
        return measured[key], "fitted on a measured pair"
    both = [r for r in FP8_PUBLISHED if fp8_key(r, True) in measured and fp8_key(r, False) in measured]
    if not compiled and fp8_key(recipe, True) in measured and both:
        casts = measured[fp8_key(both[0], False)] - measured[fp8_key(both[0], True)]
        return (measured[fp8_key(recipe, True)] + casts,
                f"predicted: its measured compiled cost plus {both[0]}'s measured unfused casts")
    return (fitted_fp8_overhead(recipe, efficiency) + (0.0 if compiled else UNFUSED_CASTS),
            "predicted: torchao's published pair" + ("" if compiled else " plus assumed unfused casts"))


def fp8_overhead(recipe: str, compiled: bool, efficiency: Efficiency | None = None) -> float:
    """What fp8 adds, as a fraction of the covered matmuls' bf16 time (:func:`fp8_cost`)."""
    return fp8_cost(recipe, compiled, efficiency)[0]


def predict_fp8(job: Job, cluster: Cluster, efficiency: Efficiency | None = None, recipe: str = "tensorwise",
                compiled: bool = False) -> Prediction:
    """:func:`predict` with the decoder's linear layers in fp8 (torchao float8, ``recipe`` scaling), each decoder
    layer through torch.compile or not."""
    check_fp8(job, cluster.gpu, recipe)
    base = predict(job, cluster, efficiency)
    return _with_fp8(base, fp8_share(job), cluster.gpu, fp8_overhead(recipe, compiled, efficiency))
