"""results/: the committed page and plot are exactly what the generator makes from the data."""

import shutil

import pytest

from finetune_tools.results import report
from tests.harness import REPO
from tests.unit.metering.test_run_record import a_record

RESULTS = REPO / "results"


def test_the_package_data_fitted_on_the_records_is_the_committed_one():
    """The speed model's constants that --levers auto ranks with, and the fp8 speed-ups, are package data of the
    runtime: what make results fits on results/ now, to the byte."""
    for path, text in report.packaged_files(RESULTS).items():
        assert (REPO / path).read_text() == text, f"{path} is not what 'make results' fits; run it and commit"


def test_the_package_data_check_bites_on_changed_records(tmp_path):
    """Negative control: every published speed tripled, the fitted constants differ from the committed ones."""
    import csv
    import shutil

    from finetune_tools.results import calibration

    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    with (results / "published.csv").open() as f:
        reader = csv.DictReader(f)
        rows, columns = list(reader), reader.fieldnames
    for row in rows:
        if row["tokens_per_s_per_device"]:
            row["tokens_per_s_per_device"] = str(3 * float(row["tokens_per_s_per_device"]))
    with (results / "published.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    assert report.packaged_files(results)[calibration.PACKAGED] != (REPO / calibration.PACKAGED).read_text()


def test_committed_results_are_regenerated_byte_for_byte(tmp_path):
    for path in report.generate(RESULTS, tmp_path):
        committed = RESULTS / path.name
        assert path.read_bytes() == committed.read_bytes(), (
            f"results/{path.name} is not what 'make results' makes from the records; run it and commit")


def test_check_mode_fails_on_a_stale_page(tmp_path):
    shutil.copytree(RESULTS, tmp_path / "results")
    assert report.main(["--results", str(tmp_path / "results"), "--check"]) == 0
    (tmp_path / "results/README.md").write_text("typed by hand\n")
    assert report.main(["--results", str(tmp_path / "results"), "--check"]) == 1


def published_by_id() -> dict:
    _, rows = report.published_rows(RESULTS / "published.csv")
    return {r.label.split(" · ")[0]: r for r in rows}


def test_published_rows_get_per_gpu_rates_and_mfu_from_one_formula():
    by_id = published_by_id()
    assert by_id["answerai-fsdp-qlora-llama2-70b"].tokens_per_s_per_device == pytest.approx(1024 * 2048 / 667 / 4)
    assert by_id["seed-llama-13b-zero2"].tokens_per_s_per_device == 3500 / 8
    assert by_id["llm-foundry-mpt-7b"].mfu == pytest.approx(46.44, abs=0.1)  # the source's own MFU, recomputed
    assert not any(r.measured for r in by_id.values())
    named = [r for r in by_id.values() if "not stated" not in r.label]
    assert named and all(r.mfu is not None for r in named)


def swiglu_matmul_params(hidden: int, ffn: int, layers: int, q_dim: int, kv_dim: int, vocab: int) -> int:
    """N by hand: every weight that multiplies a token (attention, the gated MLP, the LM head; not the embedding)."""
    return layers * (2 * hidden * q_dim + 2 * hidden * kv_dim + 3 * hidden * ffn) + hidden * vocab


def test_the_fp8_long_context_and_nvidia_rows_derive_their_rates_and_mfu_by_hand():
    by_id = published_by_id()
    # torchao's 8B on 8 H100s at 8,192 tokens, tokens/s per GPU as quoted: 6N + 12 L H Q T per token
    n = swiglu_matmul_params(4096, 14336, 32, 4096, 1024, 128256)
    for name, speed in [("torchao-llama3-8b-bf16", 6150), ("torchao-llama3-8b-fp8-tensorwise", 7689.5),
                        ("torchao-llama3-8b-fp8-rowwise", 6768)]:
        assert by_id[name].tokens_per_s_per_device == speed
        assert by_id[name].mfu == pytest.approx(speed * (6 * n + 12 * 32 * 4096 * 8192) / 989e12 * 100, abs=0.05)
    assert by_id["torchao-llama3-8b-bf16"].mfu == pytest.approx(36.0, abs=0.1)
    # the Ulysses post's 32K row: 7,733 tokens/s for the 4 GPUs; Qwen3-4B's heads are 128 wide (q 4,096 > 2,560)
    n = swiglu_matmul_params(2560, 9728, 36, 4096, 1024, 151936)
    row = by_id["hf-ulysses-qwen3-4b-sp4-32k"]
    assert row.tokens_per_s_per_device == 7733 / 4
    assert row.mfu == pytest.approx(7733 / 4 * (6 * n + 12 * 36 * 4096 * 32768) / 989e12 * 100, abs=0.05)
    assert row.mfu == pytest.approx(16.05, abs=0.05)
    # Transformer Engine's tutorial: 8 rows of at most 256 tokens in 185 ms on an unnamed GPU: no MFU
    assert by_id["te-llama3-8b-te-fp8"].tokens_per_s_per_device == pytest.approx(8 * 256 / 0.185)
    assert by_id["te-llama3-8b-te-fp8"].mfu is None
    # NeMo 24.07's 70B LoRA, per GPU as quoted; a frozen base: 4N + 12 L H Q T per token
    n = swiglu_matmul_params(8192, 28672, 80, 8192, 1024, 32000)
    row = by_id["nemo-24.07-llama2-70b-lora"]
    assert row.tokens_per_s_per_device == 2557
    assert row.mfu == pytest.approx(2557 * (4 * n + 12 * 80 * 8192 * 4096) / 989e12 * 100, abs=0.05)


def test_gpu_runs_and_cpu_smoke_runs_are_kept_apart(monkeypatch, tmp_path):
    results = tmp_path / "results"
    (results / "runs/smoke").mkdir(parents=True)
    shutil.copy(RESULTS / "published.csv", results)
    gpu = a_record(monkeypatch, tmp_path)
    gpu.hardware.device = "NVIDIA H100 80GB HBM3"
    gpu.write(results / "runs/llama3-8b-h100.json")
    smoke = a_record(monkeypatch, tmp_path)
    smoke.hardware.device, smoke.measured.mfu_percent = "cpu", None
    smoke.write(results / "runs/smoke/llama3-8b-cpu.json")

    page, rows = report.render(results)
    measured = [r for r in rows if r.measured]
    assert [r.label.split(" · ")[0] for r in measured] == ["llama3-8b-h100"]  # the smoke run is no bar
    assert measured[0].tokens_per_s_per_device == 2_000
    gpu_section = page.split("## Measured on GPUs")[1].split("## CPU smoke runs")[0]
    smoke_section = page.split("## CPU smoke runs")[1]
    assert "`llama3-8b-h100`" in gpu_section and "llama3-8b-cpu" not in gpu_section
    assert "`llama3-8b-cpu`" in smoke_section and "llama3-8b-h100" not in smoke_section
    assert "| 2,000 |" in gpu_section  # tokens/s per GPU
    report.generate(results, results)
    assert (results / "throughput.png").stat().st_size > 10_000


def test_check_finds_results_from_any_folder_in_the_repository(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(REPO / "recipes/llama3-8b-zero3")
    assert report.main(["--check"]) == 0
    monkeypatch.chdir(tmp_path)
    assert report.main(["--check"]) == 2
    assert "pass --results" in capsys.readouterr().err


def _ablation_record(monkeypatch, tmp_path, micro_batch: int, step_time: float, checkpointing: bool = True,
                     grad_accum: int = 1):
    rec = a_record(monkeypatch, tmp_path)
    rec.training.engine, rec.training.grad_accum, rec.training.seq_len = None, grad_accum, 4096
    rec.training.offload = "none"
    rec.training.micro_batch_size, rec.training.gradient_checkpointing = micro_batch, checkpointing
    rec.measured.step_time_s = step_time
    return f"mb{micro_batch}", rec


def test_step_time_fit_recovers_the_fixed_and_per_sequence_parts(monkeypatch, tmp_path):
    line = {1: 0.5, 2: 0.65, 4: 0.95}  # 0.35 s per step + 0.15 s per sequence
    records = [_ablation_record(monkeypatch, tmp_path, mb, t) for mb, t in line.items()]
    fixed, per_seq = report.step_time_fit(records)
    assert (fixed, per_seq) == (pytest.approx(0.35), pytest.approx(0.15))
    # unlike runs (no checkpointing) stay out of the fit; with two micro-batch sizes left there is none
    records[-1] = _ablation_record(monkeypatch, tmp_path, 4, 9.9, checkpointing=False)
    assert report.step_time_fit(records) is None
    section = "\n".join(report.ablation_table(records[:2]))
    assert f"| `mb2` | {records[1][1].recipe} | deepspeed, none | 4,096 | 2 × 1 | on | 0.650 |" in section
    assert "least-squares" not in section


def test_accumulation_fit_recovers_the_fixed_and_per_micro_batch_parts(monkeypatch, tmp_path):
    line = {1: 0.5, 4: 1.4, 8: 2.6}  # 0.2 s per optimizer step + 0.3 s per micro-batch
    records = [_ablation_record(monkeypatch, tmp_path, 2, t, grad_accum=ga) for ga, t in line.items()]
    assert report.accumulation_fit(records) == (pytest.approx(0.2), pytest.approx(0.3))
    records[0] = _ablation_record(monkeypatch, tmp_path, 4, 0.5)  # another micro-batch: not on this line
    assert report.accumulation_fit(records) is None


def test_planner_table_states_the_error_against_both_peaks(monkeypatch, tmp_path):
    rec = a_record(monkeypatch, tmp_path)  # peaks 40.0 allocated, 44.0 reserved
    rec.measured.predicted_gpu_GiB = 46.2
    row = [line for line in report.planner_table([("r", rec)]) if line.startswith("| `r`")][0]
    assert row.endswith("| 46.2 | 40.0 | 44.0 | – | 15.5 | 5.0 | – |")
    rec.measured.peak_gpu_device_GiB = 46.2 * 1.1
    row = [line for line in report.planner_table([("r", rec)]) if line.startswith("| `r`")][0]
    assert row.endswith("| 46.2 | 40.0 | 44.0 | 50.8 | 15.5 | 5.0 | -9.1 |")


def test_evaluated_records_get_a_row_per_task_and_metric(monkeypatch, tmp_path):
    results = tmp_path / "results"
    (results / "runs/smoke").mkdir(parents=True)
    shutil.copy(RESULTS / "published.csv", results)
    plain = a_record(monkeypatch, tmp_path)
    plain.write(results / "runs/smoke/not-evaluated.json")
    evaluated = a_record(monkeypatch, tmp_path)
    evaluated.evaluation = {"model": "out/model", "lm_eval": "0.4.13", "device": "cpu", "dtype": "float32",
                            "tasks": {"heldout": {"perplexity": 261.0412, "loss": 5.56468}}}
    evaluated.write(results / "runs/smoke/evaluated.json")
    section = report.render(results)[0].split("## Evaluation of the saved models")[1]
    assert "| `evaluated` | llama3-8b-zero3 | cpu | heldout | perplexity | 261 | 0.4.13 |" in section
    assert "| heldout | loss | 5.565 |" in section and "not-evaluated" not in section
