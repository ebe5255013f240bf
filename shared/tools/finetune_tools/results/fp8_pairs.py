"""fp8 against bf16 as measured: the pairs in ``results/runs/fp8/``, the planner's fp8 cost fitted on them, the table.

Each ``results/runs/fp8/<date>-<gpu>-<n>.json`` is the ``summary.json`` of one GPU command of the ablation's fp8
rows (``python -m finetune_tools.gpu_check --ablation --variants ...``), and ``records/<same name>/`` holds that
command's run records. A pair is an fp8 row and the bf16 row its speed-up is against (``baseline``), both of one
command on one machine. For each pair the planner's fp8 cost (:func:`finetune_tools.planning.speed.fit_fp8_overhead`,
a fraction of the covered matmuls' bf16 time) is the one at which it predicts the measured speed-up for that
run's job; the mean per scaling and compile setting goes to ``speed-calibration.json`` (``fp8_overhead``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from finetune_kit.metering.run_record import RunRecord
from finetune_tools.gpu_check.host_check import fp8_choice
from finetune_tools.planning.speed import Cluster, Efficiency, Job, fit_fp8_overhead, fp8_key, predict, predict_fp8
from finetune_tools.results.jobs import job_of

FOLDER = "runs/fp8"


@dataclass(frozen=True)
class Pair:
    command: str  # the summary's file stem: one GPU command
    run: str  # the fp8 row
    baseline: str  # its bf16 row of the same command
    scaling: str  # tensorwise | rowwise
    compiled: bool
    engine: str  # as the table names it
    tokens_per_s: float  # fp8, per GPU
    baseline_tokens_per_s: float
    job: Job  # the bf16 row's, for the planner
    cluster: Cluster
    row: dict  # the fp8 row of the summary

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.baseline_tokens_per_s

    @property
    def key(self) -> str:
        return fp8_key(self.scaling, self.compiled)


def pairs(results: Path) -> list[Pair]:
    """Every finished fp8 row of ``results/runs/fp8/*.json`` whose bf16 baseline finished in the same command."""
    out = []
    for path in sorted((results / FOLDER).glob("*.json")):
        rows = {r.get("run"): r for r in json.loads(path.read_text())["cases"]}
        for name, row in rows.items():
            scaling = fp8_choice(row.get("extra_flags", []))
            base = rows.get(row.get("baseline"))
            if scaling == "none" or row["status"] != "ok" or not base or base["status"] != "ok":
                continue
            planned = job_of(RunRecord.read(results / FOLDER / "records" / path.stem / f"{base['run']}.json"))
            if planned is None:
                continue
            job, cluster = planned
            out.append(Pair(path.stem, name, base["run"], scaling, "--compile" in row["extra_flags"],
                            "FSDP2" if job.engine == "fsdp2" else f"ZeRO-{job.stage}", row["tokens_per_s_per_device"],
                            base["tokens_per_s_per_device"], job, cluster, row))
    return out


def fitted(found: list[Pair], efficiency: Efficiency) -> dict[str, float]:
    """The planner's fp8 cost per ``"<scaling> compiled|uncompiled"``: the mean over the pairs of that setting of
    the cost at which it predicts each pair's measured speed-up."""
    costs: dict[str, list[float]] = {}
    for pair in found:
        costs.setdefault(pair.key, []).append(fit_fp8_overhead(pair.job, pair.cluster, pair.speedup, efficiency))
    return {key: sum(values) / len(values) for key, values in sorted(costs.items())}


def predicted_speedup(pair: Pair, efficiency: Efficiency) -> float:
    fp8 = predict_fp8(pair.job, pair.cluster, efficiency, pair.scaling, pair.compiled)
    return predict(pair.job, pair.cluster, efficiency).step_s / fp8.step_s


def table(results: Path, efficiency: Efficiency) -> list[str]:
    """Markdown: each measured pair with the planner's speed-up before the fit (torchao's published pair and the
    assumed unfused casts) and after it (``efficiency`` with the costs fitted on these pairs)."""
    found = pairs(results)
    if not found:
        return ["None measured yet."]
    before = replace(efficiency, fp8_overhead={})
    after = replace(efficiency, fp8_overhead=fitted(found, efficiency))
    lines = ["| Command | fp8 row | Engine | torch.compile | Scaling | Tokens/s per GPU, fp8 | bf16 (same command) "
             "| Measured speed-up | Planner before the fit | Planner fitted | MFU % fp8 | Peak reserved GiB fp8 |",
             "|---|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for pair in found:
        r = pair.row
        lines.append(f"| {pair.command} | `{pair.run}` | {pair.engine} | {'yes' if pair.compiled else 'no'} "
                     f"| {pair.scaling} | {pair.tokens_per_s:,.0f} | {pair.baseline_tokens_per_s:,.0f} "
                     f"| {pair.speedup:.2f}x | {predicted_speedup(pair, before):.2f}x "
                     f"| {predicted_speedup(pair, after):.2f}x | {r['mfu_percent']:.1f} "
                     f"| {r['peak_gpu_reserved_GiB']:.1f} |")
    shapes = sorted({p.job.shape.name for p in found})
    devices = sorted({p.row["device"] for p in found})
    lines += ["", f"On {', '.join(devices)}: {', '.join(shapes)}, one GPU, accumulation 4, torchao "
              "float8 linear layers (the LM head in bf16). MFU against the bf16 peak. \"Planner before the fit\": its "
              "fp8 cost fitted on torchao's published compiled Llama 3 8B pair on 8 H100s, plus an assumed cost of "
              "the unfused casts when uncompiled; \"fitted\": the cost fitted on these pairs (one per scaling and "
              "compile setting, so a single pair is reproduced exactly; `make plan FP8=...` names which setting "
              "is fitted on a measurement and which is predicted)."]
    return lines
