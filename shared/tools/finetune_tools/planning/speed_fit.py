"""The speed model's constants (:class:`finetune_kit.planning.speed.Efficiency`) fitted on runs of known speed, and
each run's held-out error: what ``make results`` writes to ``finetune_kit/planning/speed-calibration.json``."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from finetune_kit.planning import speed
from finetune_kit.planning.speed import (
    Cluster,
    Efficiency,
    Job,
    Prediction,
    family,
    optimizer_kind,
    predict,
)
from finetune_tools.planning.fp8_speed import predict_fp8


@dataclass(frozen=True)
class Observation:
    """A run whose speed is known: its job, its cluster, tokens/s per GPU as measured or published."""

    name: str
    job: Job
    cluster: Cluster
    tokens_per_s_per_gpu: float
    source: str = "published"  # "published" | "measured"
    fitted: bool = True  # False: predicted and compared, kept out of every fit (a source too vague to fit on)
    fp8: str = ""  # torchao float8 scaling of an fp8 run ("tensorwise", "rowwise"); "" for bf16. Never fitted.
    compiled: bool = False  # decoder layers through torch.compile (what fp8's cost depends on)

    def __post_init__(self):
        if self.fp8 and self.fitted:
            raise ValueError(f"{self.name}: an fp8 run is compared, never fitted (the fit is of bf16 compute)")


def predict_observation(obs: Observation, efficiency: Efficiency | None = None) -> Prediction:
    """:func:`predict`, or :func:`predict_fp8` for an fp8 run."""
    if obs.fp8:
        return predict_fp8(obs.job, obs.cluster, efficiency, obs.fp8, obs.compiled)
    return predict(obs.job, obs.cluster, efficiency)


def fit_efficiency(observations: list[Observation], start: Efficiency | None = None) -> Efficiency:
    """The compute shares and step times on the uncompiled fitted runs, then torch.compile's factor on the
    compiled ones (:func:`fit_compiled`)."""
    observations = [o for o in observations if o.fitted]
    eff = _fit([o for o in observations if not o.job.compiled], start)
    return replace(eff, compiled=fit_compiled(observations, eff))


def _fit(observations: list[Observation], start: Efficiency | None = None) -> Efficiency:
    """Weighted least squares on each run's step time (relative errors), the communication and
    offload terms held at the model's values and overlap at the point estimate: per method, one
    compute share per GPU family with two or more runs (the others share the method's) and one
    per-parameter step time per optimizer kind; then CPU Adam's rate from the offloaded runs."""
    import numpy as np

    eff = start or Efficiency()
    compute, per_param = dict(eff.compute), dict(eff.step_s_per_param)
    runs = [o for o in observations if not o.job.offload_optimizer]
    kinds = sorted({optimizer_kind(o.job) for o in runs})
    columns_per_param, rows, targets, groups = [(k, None) for k in kinds], [], [], []
    for method in sorted(compute):
        mine = [o for o in runs if o.job.method == method]
        sizes: dict[str, int] = {}
        for o in mine:
            sizes[family(o.cluster.gpu)] = sizes.get(family(o.cluster.gpu), 0) + 1
        own = [f for f, n in sorted(sizes.items()) if n >= 2] if len(sizes) > 1 else []
        groups += [(method, f) for f in own] + [(method, None)] * bool(set(sizes) - set(own))  # None: the rest
        for o in mine:
            unit = predict(o.job, o.cluster, Efficiency({method: 1.0}, dict.fromkeys(kinds, 0.0),
                                                        eff.adam_params_per_s_per_core, eff.compiled))
            step = unit.tokens_per_step / o.cluster.gpus / o.tokens_per_s_per_gpu
            shard = o.job.trainable() / (o.cluster.gpus if o.job.stage >= 1 else 1)
            group = (method, family(o.cluster.gpu) if family(o.cluster.gpu) in own else None)
            rows.append((group, unit.matmul_s / step, optimizer_kind(o.job), shard / step))
            targets.append((step - unit.communication_s / 2) / step)
    if rows:
        matrix = [[x * (g == group) for group in groups] + [y * (k == kind) for kind, _ in columns_per_param]
                  for g, x, k, y in rows]
        matrix = np.array(matrix)
        scale = np.where(np.abs(matrix).max(axis=0) > 0, np.abs(matrix).max(axis=0), 1.0)  # columns of one size
        solution = np.linalg.lstsq(matrix / scale, np.array(targets), rcond=None)[0] / scale
        inverses, seconds = solution[:len(groups)], solution[len(groups):]
        for (method, fam), inverse in zip(groups, inverses, strict=True):
            if inverse > 1:  # a share of the peak above 1 is no fit: keep the previous value
                compute[method if fam is None else f"{method} on {fam}"] = 1 / float(inverse)
        for (kind, _), value in zip(columns_per_param, seconds, strict=True):
            per_param[kind] = max(0.0, float(value))
        for method in compute.copy():  # a method fitted per family only: its fallback is their mean
            families = [v for k, v in compute.items() if k.startswith(f"{method} on ")]
            if families and (method, None) not in groups and " on " not in method:
                compute[method] = math.exp(sum(map(math.log, families)) / len(families))
    eff = Efficiency(compute, per_param, eff.adam_params_per_s_per_core, eff.compiled)
    rates = []
    for o in observations:
        if not o.job.offload_optimizer:
            continue
        base = predict(o.job, o.cluster, eff)
        step = base.tokens_per_step / o.cluster.gpus / o.tokens_per_s_per_gpu
        adam = step - (base.step_s - base.offload_s) - speed.offload_pcie_s(o.job, o.cluster)
        if adam > 0:  # the rate per core at which CPU Adam takes the rest of the step
            rates.append(o.job.trainable() / o.cluster.nodes / adam / o.cluster.host_cores)
    if rates:
        eff = replace(eff, adam_params_per_s_per_core=math.exp(sum(map(math.log, rates)) / len(rates)))
    return eff


def fit_compiled(observations: list[Observation], efficiency: Efficiency) -> float:
    """``Efficiency.compiled`` from the pairs of fitted runs that differ only in torch.compile (same job otherwise,
    same GPUs): the compiled matmul time over the uncompiled, 1 + (compiled step - uncompiled step) / the uncompiled
    matmul time the model gives; their geometric mean, or 1 without a pair. A pair holds the rest of the step
    equal, so the model's errors elsewhere stay out of this factor."""
    runs = [o for o in observations if o.fitted]
    ratios = []
    for c in (o for o in runs if o.job.compiled):
        for u in (o for o in runs if not o.job.compiled and o.job == replace(c.job, compiled=False)
                  and o.cluster == c.cluster):
            p = predict(u.job, u.cluster, replace(efficiency, compiled=1.0))
            seconds = [p.tokens_per_step / o.cluster.gpus / o.tokens_per_s_per_gpu for o in (c, u)]
            ratio = 1 + (seconds[0] - seconds[1]) / p.matmul_s
            if ratio > 0:
                ratios.append(ratio)
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else 1.0


def held_out_errors(observations: list[Observation], fp8_overhead: dict | None = None) -> dict[str, float]:
    """Each observation predicted by the efficiencies fitted on all the other fitted ones: the relative error
    (predicted / observed - 1) per observation name. fp8 runs take their cost from ``fp8_overhead`` (fitted on
    measured pairs, :attr:`Efficiency.fp8_overhead`)."""
    out = {}
    for i, obs in enumerate(observations):
        fitted = replace(fit_efficiency(observations[:i] + observations[i + 1:]), fp8_overhead=fp8_overhead or {})
        out[obs.name] = predict_observation(obs, fitted).tokens_per_s(obs.cluster.gpus) / obs.tokens_per_s_per_gpu - 1
    return out
