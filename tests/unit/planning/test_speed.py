"""The speed model: the collectives' bytes by hand, the link that limits them, the fit recovering
known constants, and the held-out error on the runs in results/."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from finetune_kit.models.shapes import Adapter, resolve_model
from finetune_kit.planning import speed
from finetune_kit.planning.hardware import GPUS, LINK_EFFICIENCY, NETWORKS, gpu_for_device
from finetune_kit.planning.speed import CALIBRATED, Cluster, Efficiency, Job, bytes_per_step, predict
from finetune_tools.planning import breakdown
from finetune_tools.planning.speed_fit import Observation, fit_efficiency, held_out_errors
from tests.harness import REPO

LLAMA3_8B = resolve_model("llama3-8b")
P = LLAMA3_8B.total_params()


def test_zero3_sends_two_weight_gathers_and_a_gradient_reduce_scatter_per_micro_batch():
    job = Job(LLAMA3_8B, micro_batch=2, grad_accum=4, stage=3)
    ring = 7 / 8
    assert bytes_per_step(job, 8) == pytest.approx(4 * (2 * ring * 2 * P + ring * 2 * P))
    assert bytes_per_step(replace(job, engine="fsdp2"), 8) == pytest.approx(4 * (2 * ring * 2 * P + ring * 4 * P))
    assert bytes_per_step(replace(job, stage=2), 8) == pytest.approx(4 * ring * 2 * P + ring * 2 * P)
    assert bytes_per_step(replace(job, stage=0), 8) == pytest.approx(2 * ring * 2 * P)  # the seed's all-reduce
    assert bytes_per_step(job, 1) == 0


def test_a_frozen_4bit_base_gathers_half_a_byte_per_weight_and_reduces_only_the_adapters():
    shape = resolve_model("llama3.3-70b")
    job = Job(shape, stage=3, adapter=Adapter(rank=16, quantized=True))
    lora = shape.lora_params(16)
    ring = 7 / 8
    assert bytes_per_step(job, 8) == pytest.approx(2 * ring * (lora * 2 + (shape.total_params() - lora) * 0.5)
                                                   + ring * lora * 2)


def test_across_nodes_the_network_share_of_each_gpu_limits_the_ring():
    job = Job(LLAMA3_8B, micro_batch=4, grad_accum=4, stage=3)
    one_node = predict(job, Cluster(GPUS["h100"], 8, 1))
    ib = predict(job, Cluster(GPUS["h100"], 4, 2, NETWORKS["ib400"]))
    eth = predict(job, Cluster(GPUS["h100"], 4, 2, NETWORKS["eth100"]))
    sent = bytes_per_step(job, 8)
    assert one_node.intra_node_s == pytest.approx(sent / (450e9 * LINK_EFFICIENCY)) and one_node.inter_node_s == 0
    assert eth.inter_node_s == pytest.approx(sent / (12.5e9 * LINK_EFFICIENCY / 4))
    assert breakdown.dominant(eth) == "inter-node" and breakdown.dominant(one_node) == "compute"
    low, high = breakdown.tokens_per_s_range(eth, 8)
    assert low < eth.tokens_per_s(8) < high < ib.tokens_per_s(8)


def test_offload_adds_pcie_and_cpu_adam_time():
    job = Job(LLAMA3_8B, micro_batch=2, grad_accum=8, stage=3)
    cluster = Cluster(GPUS["h100"], 8, 1)
    eff = Efficiency(adam_params_per_s_per_core=1.25e8)  # 2e9 parameters/s on the default 16 host cores
    with_offload = predict(replace(job, offload_optimizer=True), cluster, eff)
    pcie = (8 + 1) * P * 2 / 8 / (64e9 * LINK_EFFICIENCY)  # gradients after each of 8 micro-batches, weights once
    assert with_offload.offload_s == pytest.approx(pcie + P / 2e9)
    assert predict(job, cluster, eff).offload_s == 0
    # 64 cores would update 8e9 parameters/s; the host's memory streams 100e9 / 30 bytes = 3.3e9 of them
    many = predict(replace(job, offload_optimizer=True), replace(cluster, host_cores=64), eff)
    assert many.offload_s == pytest.approx(pcie + P / (100e9 / 30))


def synthetic(eff: Efficiency) -> list[Observation]:
    """Runs whose speeds are what ``eff`` predicts: full and frozen-base, 1 and 8 GPUs, accumulation 1
    to 8, one with offload."""
    shapes = [resolve_model("llama3-8b").truncated(8), resolve_model("llama2-13b").truncated(4)]
    jobs = [Job(s, seq_len=4096, micro_batch=mb, grad_accum=ga, stage=st) for s in shapes
            for mb, ga, st in ((2, 1, 3), (2, 4, 3), (4, 8, 2))]
    jobs += [Job(shapes[0], micro_batch=4, grad_accum=ga, adapter=Adapter(rank=8, quantized=True)) for ga in (1, 4)]
    jobs += [Job(shapes[0], micro_batch=2, grad_accum=8, offload_optimizer=True)]
    clusters = [Cluster(GPUS["h100"], 1, 1), Cluster(GPUS["h100"], 8, 1)]
    return [Observation(f"{i}-{c.gpus}", j, c, predict(j, c, eff).tokens_per_s(c.gpus))
            for i, j in enumerate(jobs) for c in clusters]


def test_the_fit_recovers_the_constants_that_made_the_runs():
    truth = Efficiency({"full": 0.42, "frozen-base": 0.31}, {"deepspeed": 3e-11, "torch": 1e-11}, 8.1e7)
    fitted = fit_efficiency(synthetic(truth))
    for method in ("full", "frozen-base"):
        assert fitted.compute[method] == pytest.approx(truth.compute[method], rel=1e-6)
    assert fitted.step_s_per_param["deepspeed"] == pytest.approx(3e-11, rel=1e-6)
    assert fitted.adam_params_per_s_per_core == pytest.approx(8.1e7, rel=1e-6)
    assert max(map(abs, held_out_errors(synthetic(truth)).values())) < 1e-6


def test_the_held_out_error_sees_a_run_the_model_cannot_explain():
    """Negative control: one run 30% slower than its setup predicts stands out in its own error."""
    truth = Efficiency({"full": 0.42, "frozen-base": 0.31}, {"deepspeed": 3e-11, "torch": 1e-11}, 8.1e7)
    runs = synthetic(truth)
    runs[1] = replace(runs[1], tokens_per_s_per_gpu=runs[1].tokens_per_s_per_gpu * 0.7)
    errors = held_out_errors(runs)
    assert errors[runs[1].name] > 0.25
    assert sorted(abs(e) for e in errors.values())[len(errors) // 2] < 0.05


def test_the_runs_in_results_are_predicted_within_the_error_the_results_page_states():
    from finetune_tools.results import calibration

    rows = calibration.observations(REPO / "results")
    errors = held_out_errors([o for o, _ in rows])
    measured = sorted(abs(errors[o.name]) for o, _ in rows if o.source == "measured")
    assert len(measured) >= 8 and measured[len(measured) // 2] < 0.10  # median of the H100 runs
    page = (REPO / "results/README.md").read_text()
    assert "## Speed: the planner's prediction against every run of known speed" in page


def test_published_rows_held_out_or_for_reference_never_move_the_fit():
    from finetune_tools.results import calibration

    rows = [o for o, _ in calibration.observations(REPO / "results")]
    held = [o for o in rows if o.name in calibration.HELD_OUT]
    assert len(held) >= 8 and not any(o.fitted for o in held)
    assert not {o.name for o in rows} & set(calibration.REFERENCE)  # neither fitted nor predicted
    kept = [o for o in rows if o.name not in calibration.HELD_OUT]
    assert fit_efficiency(rows) == fit_efficiency(kept)
    with pytest.raises(ValueError, match="never fitted"):
        Observation("fp8", Job(LLAMA3_8B), Cluster(GPUS["h100"]), 1.0, fp8="tensorwise")


def test_published_fp8_rows_are_predicted_with_the_cost_fitted_on_measured_pairs():
    from finetune_tools.planning.fp8_speed import predict_fp8
    from finetune_tools.results import calibration, fp8_pairs

    rows = [o for o, _ in calibration.observations(REPO / "results")]
    row = next(o for o in rows if o.name == "torchao-llama3-8b-fp8-tensorwise")
    assert (row.fp8, row.compiled, row.cluster.gpus, row.job.seq_len) == ("tensorwise", True, 8, 8192)
    eff = fit_efficiency(rows)
    cost = fp8_pairs.fitted(fp8_pairs.pairs(REPO / "results"), eff)
    assert "tensorwise compiled" in cost  # measured on an H100 (results/runs/fp8/), not torchao's published pair
    expected = predict_fp8(row.job, row.cluster, replace(eff, fp8_overhead=cost), "tensorwise", True)
    error = held_out_errors(rows, cost)[row.name]
    assert error == pytest.approx(expected.tokens_per_s(8) / 7689.5 - 1)
    assert error != pytest.approx(held_out_errors(rows)[row.name], abs=0.01)  # the measured cost is the one used


def test_the_lever_table_sets_each_published_speed_up_beside_the_planners():
    from finetune_tools.results import calibration

    lines = calibration.lever_table(REPO / "results")
    cells = {line.split(" | ")[1]: line.split(" | ") for line in lines[2:]}
    assert len(cells) == len(calibration.LEVERS)
    assert cells["torchao-llama3-8b-fp8-tensorwise"][3] == f"{7689.5 / 6150:.2f}x"
    assert cells["torchtune-llama3.2-3b-fp8-rowwise-gw-hp"][3] == f"{7573.698 / 6502.143:.2f}x"
    assert cells["hf-ulysses-qwen3-4b-sp4-64k"][3] == f"{13396 / 3633:.2f}x"  # all 4 GPUs against 1
    page = (REPO / "results/README.md").read_text()
    assert "\n".join(lines) in page


def test_device_names_map_to_profiles():
    assert gpu_for_device("NVIDIA H100 80GB HBM3") is GPUS["h100"]
    assert gpu_for_device("H100 PCIe") is GPUS["h100-pcie"]
    assert gpu_for_device("A100 80GB") is GPUS["a100-80"] and gpu_for_device("cpu") is None
    names = {"NVIDIA H200": "h200", "NVIDIA B200": "b200", "NVIDIA L40S": "l40s", "NVIDIA RTX A6000": "rtx-a6000",
             "NVIDIA GeForce RTX 4090": "rtx4090", "NVIDIA GeForce RTX 5090": "rtx5090"}
    for device, profile in names.items():
        assert gpu_for_device(device) is GPUS[profile], device
    for other in ("NVIDIA GB200", "NVIDIA RTX 6000 Ada Generation", "NVIDIA L4", "NVIDIA GeForce RTX 4080"):
        assert gpu_for_device(other) is None, other  # another GPU than any profile: no MFU rather than a wrong one
    assert len({speed.family(gpu) for gpu in GPUS.values()}) == len(GPUS) - 2  # A100 40/80, H100 SXM/PCIe share


@pytest.mark.parametrize("gpu", ["rtx4090", "rtx5090", "rtx-a6000", "l40s", "b200"])
def test_make_plan_answers_for_the_gpus_adapters_run_on(gpu):
    """`make plan RECIPE=llama3-8b-zero3 GPU=... GPUS=1`: the full fine-tune's verdict at the GPU's memory, and with
    a speed the cheapest change; a 24-48 GB card does not hold the 8B's full fine-tune, a B200 does."""
    text = run_planner("--recipe", str(REPO / "recipes/llama3-8b-zero3"), "--gpu", gpu, "--gpus-per-node", "1",
                       "--nodes", "1")
    profile = GPUS[gpu]
    assert f"speed on 1 x {profile.name}" in text and "cheapest change that helps" in text
    verdicts = re.findall(r"verdict: (fits|does not fit)", text)
    assert verdicts and (set(verdicts) == {"does not fit"}) == (profile.memory_GiB < 80), verdicts


def run_planner(*argv: str) -> str:
    import contextlib
    import io

    from finetune_tools.planning.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue()


def test_the_planner_prints_fit_speed_time_and_cost_in_one_table():
    text = run_planner("--recipe", str(REPO / "recipes/llama3-70b-qlora"), "--gpu", "h100", "--gpus-per-node", "4",
                       "--nodes", "2", "--network", "eth100", "--tokens", "5e7", "--price", "3")
    assert "verdict: fits" in text and "speed on 8 x H100 SXM 80 GB, 100 Gb/s Ethernet per node" in text
    speed = float(re.search(r"tokens/s, all GPUs +([\d,]+)", text).group(1).replace(",", ""))
    hours = float(re.search(r"50,000,000 tokens +([\d,.]+) h", text).group(1).replace(",", ""))
    assert hours == pytest.approx(5e7 / speed / 3600, rel=0.01)
    cost = float(re.search(r"([\d,]+) at 3 per GPU-hour", text).group(1).replace(",", ""))
    assert cost == pytest.approx(hours * 8 * 3, rel=0.01)
    assert "dominant: inter-node" in text and "(ib400)" in text  # the network is the cheapest change
    ib = run_planner("--recipe", str(REPO / "recipes/llama3-70b-qlora"), "--gpu", "h100", "--gpus-per-node", "4",
                     "--nodes", "2", "--network", "ib400")
    assert float(re.search(r"tokens/s, all GPUs +([\d,]+)", ib).group(1).replace(",", "")) > 5 * speed


def test_the_planner_counts_the_tokens_of_a_data_file_as_the_recipes_do(tiny_llama3):
    from finetune_kit.data.instructions import load_rows, tokenize_rows
    from finetune_kit.models.loading import load_tokenizer
    from tests.harness import SAMPLE

    text = run_planner("--model", str(tiny_llama3), "--gpu", "h100", "--gpus-per-node", "1", "--seq-len", "128",
                       "--data", str(SAMPLE))
    _, counts = tokenize_rows(load_rows(str(SAMPLE)), load_tokenizer(str(tiny_llama3)), 128, cache="none")
    assert f"{counts.tokens:,} tokens" in text and CALIBRATED in text  # the package's constants, with no flag


def test_a_gpu_family_with_runs_of_its_own_gets_its_own_compute_share():
    """Runs on A100s at 20% and on H100s at 45% of their peaks: each family's share is recovered, and a
    family without runs falls back to the method's."""
    truth = Efficiency({"full": 0.3, "frozen-base": 0.3, "full on A100": 0.20, "full on H100": 0.45},
                       {"deepspeed": 3e-11, "torch": 1e-11})
    runs = [Observation(f"{g}-{ga}", Job(LLAMA3_8B.truncated(8), seq_len=4096, micro_batch=2, grad_accum=ga),
                        Cluster(GPUS[g], 1, 1), 0.0) for g in ("a100-80", "h100") for ga in (1, 4, 8)]
    runs = [replace(o, tokens_per_s_per_gpu=predict(o.job, o.cluster, truth).tokens_per_s(1)) for o in runs]
    fitted = fit_efficiency(runs)
    assert fitted.compute["full on A100"] == pytest.approx(0.20, rel=1e-6)
    assert fitted.compute["full on H100"] == pytest.approx(0.45, rel=1e-6)
    assert fitted.compute_for("full", GPUS["h200"]) == fitted.compute["full"]
