"""The speed model's fp8 matmuls: the share of the model FLOPs they carry, their gain bounded by the peaks,
the published speed-ups (one fitted, one held out) under the fit on published figures alone, the cost fitted on
the pairs measured here (results/runs/fp8/, tests/unit/results/test_fp8_pairs.py), and the planner's fp8 lines
and refusals."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.models.shapes import Adapter, resolve_model
from finetune_kit.planning.hardware import GPUS
from finetune_kit.planning.speed import Cluster, Efficiency, Job, calibrated, predict
from finetune_tools.planning import breakdown
from finetune_tools.planning.fp8_speed import (
    FP8_PUBLISHED,
    UNFUSED_CASTS,
    fitted_fp8_overhead,
    fp8_overhead,
    fp8_share,
    predict_fp8,
)
from tests.harness import REPO

LLAMA3_8B = resolve_model("llama3-8b")
EFFICIENCY, _ = calibrated()  # with the fp8 cost fitted on measured pairs
PUBLISHED_ONLY = replace(EFFICIENCY, fp8_overhead={})  # the fp8 cost from torchao's published pair (and assumed)
H100_NODE = Cluster(GPUS["h100"], 8, 1)


def speedup(job: Job, cluster: Cluster, recipe: str = "tensorwise", compiled: bool = True,
            efficiency=EFFICIENCY) -> float:
    return predict_fp8(job, cluster, efficiency, recipe, compiled).tokens_per_s(cluster.gpus) \
        / predict(job, cluster, efficiency).tokens_per_s(cluster.gpus)


def test_fp8_carries_the_decoder_linear_layers_share_of_the_8b_flops():
    # Per decoder layer: q and o 4,096 x 4,096, k and v 4,096 x 1,024, gate, up and down 4,096 x 14,336.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    covered = 6 * 32 * per_layer
    head = 128256 * 4096
    attention = 12 * 32 * 32 * 128 * 2048
    norms = (2 * 32 + 1) * 4096
    total = 6 * (32 * per_layer + head + norms) + attention
    job = Job(LLAMA3_8B, seq_len=2048)
    assert job.flops_per_token() == pytest.approx(total)
    assert fp8_share(job) == pytest.approx(covered / total)
    assert 0.865 < fp8_share(job) < 0.870  # 86.8%: the head (6.5%) and attention (6.7%) stay bf16
    assert fp8_share(replace(job, seq_len=8192)) < fp8_share(job)  # attention's share grows with the length


def test_a_layer_with_a_width_not_a_multiple_of_16_stays_bf16():
    odd = replace(LLAMA3_8B, intermediate_size=14344)  # 14,344 = 16 x 896.5: the MLP cannot convert
    attention_only = 2 * 4096 * 4096 + 2 * 4096 * 1024
    job = Job(odd, seq_len=2048)
    assert fp8_share(job) == pytest.approx(6 * 32 * attention_only / job.flops_per_token())


def test_the_covered_matmuls_run_at_the_fp8_peak_plus_the_overhead_the_rest_at_bf16():
    job = Job(LLAMA3_8B, micro_batch=4, grad_accum=4)
    base, fast = predict(job, H100_NODE, EFFICIENCY), predict_fp8(job, H100_NODE, EFFICIENCY, "tensorwise", False)
    covered = base.matmul_s * fp8_share(job)
    overhead = fp8_overhead("tensorwise", False, EFFICIENCY)
    assert fast.matmul_s == pytest.approx(base.matmul_s - covered + covered * 989 / 1979 + overhead * covered)
    assert (fast.optimizer_s, fast.intra_node_s, fast.offload_s) == (base.optimizer_s, base.intra_node_s,
                                                                    base.offload_s)


@pytest.mark.parametrize("model", ["llama3-8b", "llama2-13b", "llama3.3-70b"])
@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_compiled_fp8_stays_below_the_peak_ratio_and_tensorwise_never_loses_where_compute_bound(model, gpu):
    # measured on one H100: compiled tensorwise 1.06x, compiled rowwise 0.94x (results/README.md)
    cluster = Cluster(GPUS[gpu], 8, 1)
    ratio = GPUS[gpu].peak_fp8_tflops / GPUS[gpu].peak_bf16_tflops
    checked = 0
    for seq_len in (1024, 2048, 4096, 8192):
        for micro_batch, grad_accum in ((1, 1), (4, 4), (8, 8)):
            for engine in ("deepspeed", "fsdp2"):
                job = Job(resolve_model(model), seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum,
                          engine=engine)
                if breakdown.dominant(predict(job, cluster, EFFICIENCY)) != "compute":
                    continue
                assert 1.0 <= speedup(job, cluster, "tensorwise") < ratio, (model, seq_len, micro_batch, engine)
                assert speedup(job, cluster, "rowwise") < speedup(job, cluster, "tensorwise")
                for recipe in FP8_PUBLISHED:  # the published pairs: both scalings gain
                    assert 1.0 <= speedup(job, cluster, recipe, efficiency=PUBLISHED_ONLY) < ratio
                checked += 1
    assert checked >= 6


def test_uncompiled_fp8_gains_less_than_compiled_and_rowwise_less_than_tensorwise():
    job = Job(LLAMA3_8B, micro_batch=4, grad_accum=4)
    for efficiency in (EFFICIENCY, PUBLISHED_ONLY):
        assert speedup(job, H100_NODE, compiled=False, efficiency=efficiency) \
            < speedup(job, H100_NODE, "rowwise", efficiency=efficiency) \
            < speedup(job, H100_NODE, "tensorwise", efficiency=efficiency)
    assert fp8_overhead("tensorwise", False, PUBLISHED_ONLY) - fp8_overhead("tensorwise", True, PUBLISHED_ONLY) \
        == pytest.approx(UNFUSED_CASTS)


def test_negative_control_an_fp8_peak_equal_to_bf16_gains_nothing():
    same_peak = Cluster(replace(GPUS["h100"], peak_fp8_tflops=989.0), 8, 1)
    assert speedup(Job(LLAMA3_8B, micro_batch=4, grad_accum=4), same_peak) < 1.0


def test_the_compiled_overhead_reproduces_the_published_pair_it_is_fitted_on():
    job = Job(LLAMA3_8B, seq_len=8192, micro_batch=1, engine="fsdp2")
    for recipe, (bf16, fp8) in FP8_PUBLISHED.items():
        assert speedup(job, H100_NODE, recipe, efficiency=PUBLISHED_ONLY) == pytest.approx(fp8 / bf16, rel=1e-4)
    assert 0 < fitted_fp8_overhead("tensorwise", EFFICIENCY) < fitted_fp8_overhead("rowwise", EFFICIENCY) < 0.5


def test_held_out_torchtitan_float8_over_compiled_bf16_on_8_h100():
    # torchtitan benchmarks (results/published.csv: torchtitan-llama3.1-8b-compile): Llama 3.1 8B, FSDP, local
    # batch 2, torch.compile: 6,667 tokens/s per GPU in bf16, 8,532 with float8 (1.28x). Not fitted on.
    # The fit on torchao's pair predicts it within 5%; the cost measured on the recipe's own path (one H100,
    # 8 layers, fp8 weights gathered in bf16) predicts less: 1.10x, 14% under torchtitan's tuned run.
    job = Job(resolve_model("llama3.1-8b"), seq_len=8192, micro_batch=2, engine="fsdp2")
    assert speedup(job, H100_NODE, efficiency=PUBLISHED_ONLY) == pytest.approx(8532 / 6667, rel=0.05)
    assert 1.0 < speedup(job, H100_NODE) < 8532 / 6667


def test_fp8_peaks_of_the_gpu_profiles():
    assert GPUS["h100"].peak_fp8_tflops == GPUS["h200"].peak_fp8_tflops == 1979.0
    assert GPUS["a100-80"].peak_fp8_tflops is None and GPUS["a100-40"].peak_fp8_tflops is None


def test_fp8_is_refused_on_an_a100_and_on_a_frozen_base():
    with pytest.raises(ConfigError, match=r"--fp8 tensorwise on A100 SXM 80 GB: it has no fp8 tensor cores"):
        predict_fp8(Job(LLAMA3_8B), Cluster(GPUS["a100-80"], 8, 1))
    with pytest.raises(ConfigError, match="LoRA/QLoRA"):
        predict_fp8(Job(LLAMA3_8B, adapter=Adapter(rank=16)), H100_NODE)


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune_tools.planning", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def test_plan_prints_the_predicted_fp8_speedup_for_zero3_and_fsdp2():
    proc = run_plan("--recipe", "recipes/llama3-8b-zero3", "--gpu", "h100", "--fp8", "tensorwise")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.split("fp8 over bf16 (predicted")[1]
    assert "tensorwise scaling" in out and "86.8% of the model FLOPs" in out
    assert "bf16 MFU % (989 TFLOP/s)" in out and "fp8 % of the fp8 peak (1,979 TFLOP/s)" in out
    rows = {line[:20].strip(): line for line in out.splitlines()}
    assert {"ZeRO-3, uncompiled", "FSDP2, uncompiled", "FSDP2, torch.compile"} <= set(rows)
    assert "(slower)" in rows["ZeRO-3, uncompiled"] and "(slower)" not in rows["FSDP2, torch.compile"]
    assert all(rows[r].rstrip().endswith("fitted on a measured pair") for r in rows if r.startswith(("ZeRO", "FSDP")))


def test_plan_says_which_fp8_cost_is_measured_and_which_predicted(tmp_path):
    proc = run_plan("--recipe", "recipes/llama3-8b-zero3", "--gpu", "h100", "--fp8", "rowwise")
    assert proc.returncode == 0, proc.stderr
    rows = {line[:20].strip(): line.rstrip() for line in proc.stdout.split("fp8 over bf16 (predicted")[1].splitlines()}
    assert rows["FSDP2, torch.compile"].endswith("fitted on a measured pair")
    assert rows["ZeRO-3, uncompiled"].endswith(
        "predicted: its measured compiled cost plus tensorwise's measured unfused casts")
    defaults = tmp_path / "uncalibrated.json"  # the speed model's defaults: no fp8 pair measured
    defaults.write_text(json.dumps(dataclasses.asdict(Efficiency())))
    uncalibrated = run_plan("--recipe", "recipes/llama3-8b-zero3", "--gpu", "h100", "--fp8", "rowwise",
                            "--calibration", str(defaults))
    assert "predicted: torchao's published pair plus assumed unfused casts" in uncalibrated.stdout


def test_plan_without_fp8_prints_no_fp8_lines():
    proc = run_plan("--recipe", "recipes/llama3-8b-zero3", "--gpu", "h100")
    assert proc.returncode == 0, proc.stderr
    assert "fp8" not in proc.stdout


def test_plan_refuses_fp8_on_an_a100_in_one_line():
    proc = run_plan("--recipe", "recipes/llama3-8b-zero3", "--gpu", "a100-80", "--fp8", "tensorwise")
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: --fp8 tensorwise on A100 SXM 80 GB: it has no fp8 tensor cores (its profile has no fp8 peak); fp8 "
        "matmuls need compute capability 8.9 or above. Use --gpu h100 or h200, or drop --fp8."]


def test_plan_refuses_fp8_without_a_gpu():
    proc = run_plan("--model", "llama3-8b", "--fp8", "tensorwise")
    assert proc.returncode != 0 and "--fp8 tensorwise predicts a speed: it needs --gpu" in proc.stderr
