"""results/: the committed page and plot are exactly what the generator makes from the data."""

import shutil

import pytest

from finetune_tools.results import report
from tests.harness import REPO
from tests.unit.metering.test_run_record import a_record

RESULTS = REPO / "results"


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


def test_published_rows_get_per_gpu_rates_and_mfu_from_one_formula():
    lines, rows = report.published_rows(RESULTS / "published.csv")
    by_label = {r.label: r for r in rows}
    qlora = next(r for label, r in by_label.items() if label.startswith("llama2-70b"))
    assert qlora.tokens_per_s_per_device == pytest.approx(1024 * 2048 / 667 / 4)  # samples x tokens / s / GPUs
    seed_13b = next(r for label, r in by_label.items() if label.startswith("llama-13b"))
    assert seed_13b.tokens_per_s_per_device == 3500 / 8
    foundry = next(r for label, r in by_label.items() if label.startswith("mpt-7b"))
    assert foundry.mfu == pytest.approx(46.44, abs=0.1)  # the source's own MFU, recomputed
    assert all(r.mfu is not None and not r.measured for r in rows)


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
