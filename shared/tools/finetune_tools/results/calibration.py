"""The speed model (:mod:`finetune_kit.planning.speed`) against every run of known speed in results/.

Observations: the rows of ``results/published.csv`` (their setups as the sources state them; what a
source leaves out is assumed in :data:`ASSUMED`, each with its reason) and the GPU run records in
``results/runs/*.json`` (measured here, on one H100). Each one is predicted by the efficiencies
fitted on all the others (leave one out): that relative error is the held-out error the results
page shows. The measured rows are one GPU each, so they calibrate compute and CPU offload only;
multi-GPU communication is calibrated by the published rows until GPU-measured multi-GPU runs exist.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

from finetune_kit.metering import keys
from finetune_kit.metering.run_record import RunRecord
from finetune_kit.models.shapes import Adapter, resolve_model
from finetune_kit.planning.hardware import GPUS, gpu_for_device
from finetune_kit.planning.speed import CALIBRATION_FILE, HOST_CORES, Cluster, Efficiency, Job
from finetune_tools.planning import breakdown
from finetune_tools.planning.fp8_speed import fp8_cost
from finetune_tools.planning.gpu_records import job_of, plain
from finetune_tools.planning.speed_fit import Observation, fit_efficiency, held_out_errors, predict_observation
from finetune_tools.results import fp8_pairs
from finetune_tools.results.adapter_memory import TORCHTUNE_8B_LORA, TORCHTUNE_8B_QLORA, TORCHTUNE_70B_LORA

# What each published row's source does not state, assumed (job fields) and why.
ASSUMED = {
    "seed-llama-7b-zero2": ({"stage": 2, "micro_batch": 4}, "micro-batch not stated: 4 assumed"),
    "seed-llama-13b-zero2": ({"stage": 2, "micro_batch": 4}, "micro-batch not stated: 4 assumed"),
    "seed-llama-30b-zero3": ({"stage": 3, "micro_batch": 4}, "micro-batch not stated: 4 assumed"),
    "seed-llama-65b-zero3-offload": ({"stage": 3, "micro_batch": 4, "offload_optimizer": True},
                                     "micro-batch not stated: 4 assumed; only the optimizer's offload is modelled"),
    "torchtitan-llama3.1-8b": ({"engine": "fsdp2", "micro_batch": 2}, "local batch 2 as stated"),
    "torchtitan-llama3.1-8b-compile": ({"engine": "fsdp2", "micro_batch": 2, "compiled": True},
                                       "local batch 2 as stated"),
    "llm-foundry-mpt-7b": ({"engine": "fsdp2", "micro_batch": 8}, "micro-batch not in the table: 8 assumed"),
    "answerai-fsdp-qlora-llama2-70b": ({"engine": "fsdp2", "micro_batch": 8,
                                        "adapter": Adapter(rank=64, targets="all-linear", quantized=True)},
                                       "micro-batch and LoRA rank not stated: 8 and 64 assumed"),
    "torchtune-llama3.1-70b-lora": ({"engine": "fsdp2", "micro_batch": 2, "adapter": TORCHTUNE_70B_LORA},
                                    "A100 80 GB assumed; LoRA rank 16 on q_proj, k_proj and v_proj and checkpointing "
                                    "as its config (llama3_1/70B_lora.yaml at the table's commit)"),
    "torchtune-llama3.1-70b-full-offload": ({"engine": "fsdp2", "micro_batch": 2, "offload_optimizer": True},
                                            "A100 80 GB and checkpointing assumed; the optimizer fused into the "
                                            "backward is modelled as CPU Adam after it"),
    "torchtune-llama3.2-3b-packed-compile": ({"stage": 0, "engine": "torch", "micro_batch": 2, "compiled": True,
                                              "gradient_checkpointing": False},
                                             "A100 80 GB assumed; one GPU, nothing to communicate"),
    "torchtune-llama3.2-3b-packed-compile-ckpt": ({"stage": 0, "engine": "torch", "micro_batch": 2, "compiled": True,
                                                   "loss_kernel": "chunked"},
                                                  "A100 80 GB assumed; one GPU, nothing to communicate; its chunked "
                                                  "loss modelled as this stack's"),
}


# Rows added to test the model on figures it was never fitted on: predicted and compared, never fitted.
_TORCHAO = ({"engine": "fsdp2", "micro_batch": 1, "compiled": True},
            "batch 1 as stated; per-op selective checkpointing modelled as full checkpointing")
_TORCHTUNE = ({"engine": "fsdp2", "micro_batch": 4, "grad_accum": 8, "compiled": True, "gpu": "h100"},
              "the GPU not stated: H100 assumed (fp8 needs compute capability 8.9); batch 4 and accumulation 8 as "
              "its config")
_ULYSSES = ({"stage": 3, "offload_optimizer": True, "micro_batch": 1, "grad_accum": 8},
            "micro-batch 1 (a global batch of 8 micro-batches) and bf16 assumed")
# torchtune's single-GPU LoRA and QLoRA (its README's table: batch 2 packed to 2,048 tokens, no accumulation, compiled;
# the configs at the table's commit: checkpointing, the loss in 8 chunks), with a frozen base: 4N_frozen +
# 6N_trainable + 12LHQT model FLOPs, the frozen weights' backward without their weight gradient.
_TORCHTUNE_1GPU = {"stage": 0, "engine": "torch", "micro_batch": 2, "grad_accum": 1, "compiled": True,
                   "loss_kernel": "chunked"}
_TORCHTUNE_1GPU_WHY = "one GPU, nothing to communicate; LoRA rank 8 on q_proj and v_proj as its config"
HELD_OUT = {
    "torchao-llama3-8b-bf16": _TORCHAO,
    "torchao-llama3-8b-fp8-tensorwise": ({**_TORCHAO[0], "fp8": "tensorwise"},
                                         f"{_TORCHAO[1]}; its float8 all-gather not modelled (weights gathered in "
                                         "bf16)"),
    "torchao-llama3-8b-fp8-rowwise": ({**_TORCHAO[0], "fp8": "rowwise"}, _TORCHAO[1]),
    "torchtune-llama3.2-3b-bf16": _TORCHTUNE,
    "torchtune-llama3.2-3b-fp8-tensorwise": ({**_TORCHTUNE[0], "fp8": "tensorwise"}, _TORCHTUNE[1]),
    "torchtune-llama3.2-3b-fp8-rowwise-gw-hp": ({**_TORCHTUNE[0], "fp8": "rowwise"},
                                                f"{_TORCHTUNE[1]}; predicted as rowwise (weight gradients in high "
                                                "precision are not a planner setting)"),
    "hf-ulysses-qwen3-4b-1gpu-8k": _ULYSSES,
    **{f"hf-ulysses-qwen3-4b-sp4-{k}": ({**_ULYSSES[0], "sequence_parallel": 4}, _ULYSSES[1])
       for k in ("8k", "32k", "64k")},
    "automodel-llama3.1-8b-lora": ({"engine": "fsdp2", "micro_batch": 2, "grad_accum": 16,
                                    "gradient_checkpointing": False, "adapter": Adapter(rank=16)},
                                   "no activation checkpointing in its config; its TE and Triton kernels modelled as "
                                   "this stack's"),
    "torchtune-llama3.1-8b-lora-4090": ({**_TORCHTUNE_1GPU, "adapter": TORCHTUNE_8B_LORA}, _TORCHTUNE_1GPU_WHY),
    "torchtune-llama3.1-8b-lora-a6000": ({**_TORCHTUNE_1GPU, "adapter": TORCHTUNE_8B_LORA,
                                          "gradient_checkpointing": False},
                                         f"{_TORCHTUNE_1GPU_WHY}; activation checkpointing assumed off, as its 14 GiB "
                                         "over the 4090 row's peak says (finetune_tools.results.adapter_memory)"),
    "torchtune-llama3.1-8b-qlora-4090": ({**_TORCHTUNE_1GPU, "adapter": TORCHTUNE_8B_QLORA},
                                         "one GPU, nothing to communicate; QLoRA rank 8 on every linear layer as its "
                                         "config; the nf4 weights' dequantisation before each matmul not modelled"),
}
ASSUMED.update(HELD_OUT)

# Rows shown as published but neither fitted nor predicted, and why: a setup no recipe here can express, or a
# GPU the source does not name.
REFERENCE = {
    **dict.fromkeys(("te-llama3-8b-hf-bf16", "te-llama3-8b-te-bf16", "te-llama3-8b-te-fp8"),
                    "the GPU not stated (and Transformer Engine's layers in two of three)"),
    **dict.fromkeys(("torchtune-llama3.2-3b-bf16", "torchtune-llama3.2-3b-fp8-tensorwise",
                     "torchtune-llama3.2-3b-fp8-rowwise-gw-hp"),
                    "the GPU not stated: only the fp8 speed-up is compared, on an assumed H100"),
    **dict.fromkeys(("automodel-llama3.3-70b-lora-8gpu", "automodel-llama3.3-70b-lora-16gpu"),
                    "tensor parallel 2: no recipe here splits a layer across GPUs"),
    **dict.fromkeys([f"nemo-24.07-llama2-{size}-{task}" for task in ("sft", "lora") for size in ("7b", "13b", "70b")],
                    "Megatron with tensor and pipeline parallelism and Transformer Engine's fp8: no recipe here"),
}

# Rows predicted and compared but kept out of the fit, and why.
NOT_FITTED = {
    **dict.fromkeys(("seed-llama-7b-zero2", "seed-llama-13b-zero2", "seed-llama-30b-zero3",
                     "seed-llama-65b-zero3-offload"),
                    "not fitted: rounded figures with neither batch nor sequence length stated"),
    "torchtune-llama3.1-70b-full-offload": "not fitted: FSDP's CPU offload also moves the weights over PCIe for "
                                           "every micro-batch, which the model does not count",
    **dict.fromkeys(HELD_OUT, "held out: compared, never fitted"),
}


def published_observations(path: Path, reference: bool = False) -> list[tuple[Observation, str]]:
    """The rows of known speed with a GPU profile (stated, or assumed in :data:`ASSUMED`), without the
    :data:`REFERENCE` rows unless ``reference``."""
    out = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            fields, why = ASSUMED.get(r["id"], ({}, "as stated"))
            fields = dict(fields)
            fp8, compiled = fields.pop("fp8", ""), fields.get("compiled", False)
            gpu = gpu_for_device(r["hardware"]) or GPUS.get(fields.pop("gpu", ""))
            if r["id"] in REFERENCE and not reference:
                continue
            if gpu is None or not any(r[k].strip() for k in (keys.TOKENS_PER_S.key, keys.TOKENS_PER_S_PER_DEVICE.key,
                                                              "samples")):
                continue  # no GPU profile, or no speed stated (a longest-context row)
            gpus, seq_len = int(r["gpus"]), int(r["seq_len"])
            per_gpu = r[keys.TOKENS_PER_S_PER_DEVICE.key].strip()
            total = r[keys.TOKENS_PER_S.key].strip()
            if per_gpu:
                speed = float(per_gpu)
            elif total:
                speed = float(total) / gpus
            else:
                speed = float(r["samples"]) * seq_len / float(r["seconds"]) / gpus
            job = Job(resolve_model(r["architecture"]), seq_len=seq_len, **fields)
            cluster = Cluster(gpu, gpus_per_node=gpus, nodes=1)
            fitted = r["id"] not in NOT_FITTED and r["id"] not in REFERENCE
            out.append((Observation(r["id"], job, cluster, speed, "published", fitted, fp8, compiled),
                        why if r["id"] not in NOT_FITTED else f"{why}; {NOT_FITTED[r['id']]}"))
    return out


def measured_observations(folder: Path, pattern: str = "*.json", only_plain: bool = False, unlike: Path | None = None,
                          qualified: bool = False) -> list[tuple[Observation, str]]:
    """The records of ``folder`` (``pattern``) with a GPU profile and a measured speed; ``only_plain``: only those
    :func:`plain` describes; ``unlike``: none whose measured speed a record of that folder already holds (a run
    published there too); ``qualified``: each named by its folder and file ("2026-11-27-h100-1/8b-zero3-bf16"),
    where one command's records share their names with another's."""
    seen = {RunRecord.read(p).measured.tokens_per_s_per_device for p in unlike.glob("*.json")} if unlike else set()
    out = []
    for path in sorted(folder.glob(pattern)):
        rec = RunRecord.read(path)
        if rec.measured.tokens_per_s_per_device in seen:
            continue
        planned = job_of(rec)
        if planned is None or not rec.measured.tokens_per_s_per_device or (only_plain and not plain(rec)):
            continue
        job, cluster = planned
        name = f"{path.parent.name}/{path.stem}" if qualified else path.stem
        out.append((Observation(name, job, cluster, rec.measured.tokens_per_s_per_device, "measured",
                                compiled=job.compiled),
                    f"measured, {rec.hardware.device}"))
    return out


FILE = CALIBRATION_FILE
# package data of the runtime (finetune_kit.planning), so that --levers auto ranks with it wherever the package is
# installed; make results writes it in a checkout, and make plan reads it from the package
PACKAGED = Path("shared/finetune_kit/planning") / CALIBRATION_FILE


def observations(results: Path) -> list[tuple[Observation, str]]:
    """Published rows, the GPU runs of ``runs/``, and the one-GPU lever runs (``runs/ablation/``, not those
    ``runs/`` holds too; ``runs/mfu/``; the bf16 runs of ``runs/fp8/``) that change nothing the speed model leaves
    out."""
    return (published_observations(results / "published.csv") + measured_observations(results / "runs")
            + measured_observations(results / "runs/ablation", only_plain=True, unlike=results / "runs")
            + measured_observations(results / "runs/mfu/records", "*/*.json", only_plain=True)
            + measured_observations(results / "runs/fp8/records", "*/*.json", only_plain=True, qualified=True))


def fitted_efficiency(results: Path) -> Efficiency:
    """The constants fitted on every run of known speed in ``results`` (no fp8 cost: :mod:`.fp8_pairs` fits it)."""
    return fit_efficiency([o for o, _ in observations(results)])


def fitted_json(results: Path) -> str:
    """The constants fitted on every run of known speed in ``results``, for the planner."""
    import json

    eff = fitted_efficiency(results)
    return json.dumps({"note": "generated by `make results` from published.csv, runs/, runs/mfu/ and runs/fp8/ "
                               "(finetune_tools.results.calibration); read by finetune_kit.planning.speed",
                       "compute": {k: _digits(v) for k, v in eff.compute.items()},
                       "step_s_per_param": {k: _digits(v) for k, v in eff.step_s_per_param.items()},
                       "adam_params_per_s_per_core": _digits(eff.adam_params_per_s_per_core),
                       "compiled": _digits(eff.compiled),
                       "fp8_overhead": {k: _digits(v) for k, v in
                                        fp8_pairs.fitted(fp8_pairs.pairs(results), eff).items()}}, indent=2) + "\n"


def _digits(value: float) -> float:
    """Four significant digits: the least-squares solve differs in its last ~8 digits between CPUs
    (LAPACK picks kernels per instruction set), and the fit is good to a few per cent, not to 16 digits."""
    return float(f"{value:.4g}")


GOAL_MEDIAN, GOAL_WORST = 0.10, 0.25  # what the speed model aims for on the published rows it never saw


def goal_verdict(median: float, worst: float) -> str:
    """Whether the never-fitted rows' median and largest absolute errors meet :data:`GOAL_MEDIAN` and
    :data:`GOAL_WORST`, in words."""
    misses = [f"the {what} is {100 * value:.0f}%" for what, value, goal in (("median", median, GOAL_MEDIAN),
                                                                              ("largest", worst, GOAL_WORST))
              if value > goal]
    return "met" if not misses else "not met: " + " and ".join(misses)


def table(results: Path) -> list[str]:
    """Markdown: every observation, predicted by the efficiencies fitted on the others."""
    rows = observations(results)
    runs = [o for o, _ in rows]
    if len(runs) < 2:
        return ["Not enough runs of known speed to calibrate the speed model."]
    fitted = fit_efficiency(runs)
    fp8_cost = fp8_pairs.fitted(fp8_pairs.pairs(results), fitted)
    errors = held_out_errors(runs, fp8_cost)
    fitted = replace(fitted, fp8_overhead=fp8_cost)
    lines = ["| Run | Source | Setup | Tokens/s per GPU, observed | Predicted (held out) | Error | Dominant term "
             "| Assumed |",
             "|---|---|---|--:|--:|--:|---|---|"]
    for obs, why in rows:
        j, c = obs.job, obs.cluster
        setup = (f"{j.shape.name}, {j.method}, {'FSDP2' if j.engine == 'fsdp2' else f'ZeRO-{j.stage}'}"
                 f"{' + offload' if j.offload_optimizer else ''}"
                 f"{f', Ulysses SP {j.sequence_parallel}' if j.sequence_parallel > 1 else ''}"
                 f"{f', fp8 {obs.fp8}' if obs.fp8 else ''}{', compiled' if obs.compiled else ''}, "
                 f"{c.gpus}x {c.gpu.name}, {j.micro_batch}x{j.seq_len}x{j.grad_accum}")
        predicted = obs.tokens_per_s_per_gpu * (1 + errors[obs.name])
        dominant = breakdown.dominant(predict_observation(obs, fitted))
        lines.append(f"| {obs.name} | {obs.source} | {setup} | {obs.tokens_per_s_per_gpu:,.0f} | {predicted:,.0f} "
                     f"| {100 * errors[obs.name]:+.0f}% | {dominant} | {why} |")
    absolute = sorted(abs(e) for e in errors.values())
    median = absolute[len(absolute) // 2]
    fitted_errors = sorted(abs(errors[o.name]) for o in runs if o.fitted)
    never = sorted(abs(errors[o.name]) for o in runs if o.name in HELD_OUT)
    lines += ["", f"Held-out error of the {len(fitted_errors)} fitted runs: median "
              f"{100 * fitted_errors[len(fitted_errors) // 2]:.0f}%, largest {100 * fitted_errors[-1]:.0f}%; "
              + (f"of the {len(never)} published rows never fitted (compared only): median "
                 f"{100 * never[len(never) // 2]:.0f}%, largest {100 * never[-1]:.0f}% (the goal, a median within "
                 f"{100 * GOAL_MEDIAN:.0f}% and none beyond {100 * GOAL_WORST:.0f}%: "
                 f"{goal_verdict(never[len(never) // 2], never[-1])}); " if never else "")
              + "over all "
              f"{len(absolute)} runs: median {100 * median:.0f}%, largest {100 * absolute[-1]:.0f}%. Fitted on the "
              "fitted runs: compute at "
              + ", ".join(f"{100 * v:.1f}% of the bf16 peak ({k})" for k, v in fitted.compute.items())
              + f"; compiled decoder layers at {fitted.compiled:.2f}x the uncompiled matmul time; CPU Adam "
              f"{fitted.adam_params_per_s_per_core / 1e6:.0f} M parameters/s per host core (the offloaded runs "
              f"measured here taken on {HOST_CORES} cores; a published row's host, unstated, assumed the same)."]
    return lines


# Published speed-ups of one lever: (the lever, a row, its baseline in the same source's table).
LEVERS = (
    ("fp8 tensorwise, compiled FSDP2, 8 GPUs", "torchao-llama3-8b-fp8-tensorwise", "torchao-llama3-8b-bf16"),
    ("fp8 rowwise, compiled FSDP2, 8 GPUs", "torchao-llama3-8b-fp8-rowwise", "torchao-llama3-8b-bf16"),
    ("fp8 tensorwise, compiled FSDP, 4 GPUs", "torchtune-llama3.2-3b-fp8-tensorwise", "torchtune-llama3.2-3b-bf16"),
    ("fp8 rowwise (weight gradients in high precision), compiled FSDP, 4 GPUs",
     "torchtune-llama3.2-3b-fp8-rowwise-gw-hp", "torchtune-llama3.2-3b-bf16"),
    ("Ulysses SP 4 at 8K: 4 GPUs against 1", "hf-ulysses-qwen3-4b-sp4-8k", "hf-ulysses-qwen3-4b-1gpu-8k"),
    ("Ulysses SP 4 at 32K: 4 GPUs against 1 at 8K", "hf-ulysses-qwen3-4b-sp4-32k", "hf-ulysses-qwen3-4b-1gpu-8k"),
    ("Ulysses SP 4 at 64K: 4 GPUs against 1 at 8K", "hf-ulysses-qwen3-4b-sp4-64k", "hf-ulysses-qwen3-4b-1gpu-8k"),
)


def lever_table(results: Path) -> list[str]:
    """Markdown: each published speed-up of :data:`LEVERS` (the tokens/s of all the row's GPUs over its
    baseline's) beside the planner's, from the constants fitted on every fitted run (never on these rows) with
    fp8's costs fitted on the measured pairs."""
    found = {o.name: (o, why) for o, why in published_observations(results / "published.csv", reference=True)}
    eff = fit_efficiency([o for o, _ in observations(results)])
    eff = replace(eff, fp8_overhead=fp8_pairs.fitted(fp8_pairs.pairs(results), eff))
    lines = ["| Lever | Row | Baseline | Published speed-up | Planner | Error | fp8 cost from | Assumed |",
             "|---|---|---|--:|--:|--:|---|---|"]
    for lever, name, base in LEVERS:
        if name not in found or base not in found:
            continue
        (row, why), (ref, _) = found[name], found[base]
        published = row.tokens_per_s_per_gpu * row.cluster.gpus / (ref.tokens_per_s_per_gpu * ref.cluster.gpus)
        planner = (predict_observation(row, eff).tokens_per_s(row.cluster.gpus) * row.cluster.gpus
                   / (predict_observation(ref, eff).tokens_per_s(ref.cluster.gpus) * ref.cluster.gpus))
        cost = fp8_cost(row.fp8, row.compiled, eff)[1] if row.fp8 else "–"
        lines.append(f"| {lever} | {name} | {base} | {published:.2f}x | {planner:.2f}x "
                     f"| {100 * (planner / published - 1):+.0f}% | {cost} | {why} |")
    return lines
