"""The run record: built from what a run has, written, read back, and strict about its schema."""

import json

import pytest
from pydantic import ValidationError

from finetune_kit.metering import run_record as record
from finetune_kit.metering.flops import FlopCounter
from finetune_kit.metering.throughput import ThroughputMeter
from finetune_kit.models.shapes import resolve_model

DS = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True}}


def a_record(monkeypatch, tmp_path, steps=5):
    clock = iter(range(100))
    monkeypatch.setattr("finetune_kit.metering.throughput.time.perf_counter", lambda: float(next(clock)))
    meter = ThroughputMeter(num_devices=8, peak_tflops=989.0)
    for _ in range(steps):
        meter.step(tokens=16_000, padded_tokens=16_384, flops=16_000 * 48.25e9)
    arch = resolve_model("llama3-8b")
    return record.for_training_run(
        recipe="llama3-8b-zero3", model_name="meta-llama/Meta-Llama-3-8B", arch=arch,
        flop_counter=FlopCounter(arch), params_trainable=arch.total_params(), ds_config=DS,
        script_args={"lr": 2e-5}, world=8, nodes=1, meter=meter, warmup_steps=2,
        peaks={"peak_gpu_allocated_GiB": 40.0, "peak_gpu_reserved_GiB": 44.0, "peak_host_rss_GiB_per_node": 130.0},
        where=tmp_path, training={"method": "full", "seq_len": 2048, "micro_batch_size": 4, "grad_accum": 2,
                                  "gradient_checkpointing": True})


def test_record_holds_the_run_and_its_provenance(monkeypatch, tmp_path):
    rec = a_record(monkeypatch, tmp_path)
    assert rec.model.params_total == 8_030_261_248 and rec.model.params_matmul == 7_504_924_672
    assert rec.training.global_batch_size == 64 and rec.training.offload == "optimizer"
    assert rec.training.zero_stage == 3
    m = rec.measured
    assert (m.steps_total, m.steps_measured, m.warmup_steps_excluded) == (5, 3, 2)
    assert m.tokens_per_s == 16_000 and m.tokens_per_s_per_device == 2_000  # one step per clock second
    assert m.model_tflop_per_s_per_device == pytest.approx(16_000 * 48.25e9 / 8 / 1e12)
    assert m.mfu_percent == pytest.approx(100 * m.model_tflop_per_s_per_device / 989.0)
    assert m.padding_fraction == pytest.approx(384 / 16_384)
    assert m.peak_host_rss_GiB_per_node == 130.0 and m.flops_formula.startswith("full")
    assert rec.git_commit == "unknown"  # tmp_path is no git checkout
    assert set(rec.software.libraries) >= {"torch", "deepspeed", "transformers", "accelerate", "peft",
                                           "bitsandbytes"}
    assert rec.software.libraries["torch"].startswith("2.")


def test_record_round_trips_through_json(monkeypatch, tmp_path):
    rec = a_record(monkeypatch, tmp_path)
    path = rec.write(tmp_path / "runs/r.json")
    data = json.loads(path.read_text())
    assert data["schema"] == record.SCHEMA and "schema_" not in data
    assert record.RunRecord.read(path) == rec


@pytest.mark.parametrize("change, error", [
    (lambda d: d.update(schema="something/else"), ValueError),
    (lambda d: d["measured"].pop("steps_total"), ValidationError),
    (lambda d: d["measured"].update(tokens_per_sec=1.0), ValidationError),  # a typo is not a new field
    (lambda d: d["training"].update(seq_len="long"), ValidationError),
])
def test_schema_rejects_malformed_records(monkeypatch, tmp_path, change, error):
    path = a_record(monkeypatch, tmp_path).write(tmp_path / "r.json")
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(error):
        record.RunRecord.read(path)


def test_config_hash_changes_with_the_configuration():
    same = record.config_hash(DS, {"lr": 2e-5})
    assert same == record.config_hash(json.loads(json.dumps(DS)), {"lr": 2e-5})
    assert same != record.config_hash(DS, {"lr": 1e-5})
    assert len(same) == 16


def test_git_commit_of_this_checkout():
    from tests.harness import REPO

    commit = record.git_commit(REPO)
    if commit != "unknown":  # an exported tree has no git metadata
        assert len(commit.removesuffix("+dirty")) == 40


@pytest.mark.parametrize("zero, offload", [
    ({"stage": 2}, "none"),
    ({"stage": 3, "offload_optimizer": {"device": "none"}}, "none"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}}, "optimizer+params"),
])
def test_offload_description(zero, offload):
    assert record.offload_of({"zero_optimization": zero}) == offload


def run_info(**overrides) -> dict:
    fields = dict(recipe="llama3-8b-zero3", model="tiny", devices=2, nodes=1, zero_stage=3, precision="bf16",
                  deepspeed_config="configs/zero3.json", steps=8, total_steps=8, resumed_from="",
                  train_examples=300, eval_example_ids=[3, 9], seq_len=128, micro_batch_size=4, grad_accum=2,
                  saved_to="out/model", peak_memory={"host_rss_GiB": 1.2}, memory_plan={"fits": None},
                  ranks=[{"rank": 0}, {"rank": 1}], finished_at="2026-01-01T00:00:00+0000")
    return {**fields, **overrides}


def test_run_info_has_one_schema_for_every_recipe(tmp_path):
    """One shape for all recipes: the common facts by name, anything recipe-specific under details."""
    info = record.RunInfo(**run_info(eval_loss=0.5, details={"lora": {"rank": 8}}))
    written = json.loads(info.write(tmp_path / "run_info.json").read_text())
    assert written["schema"] == record.RUN_INFO_SCHEMA
    assert written["details"] == {"lora": {"rank": 8}} and written["eval_accuracy"] is None
    with pytest.raises(ValidationError):
        record.RunInfo(**run_info(parameter_classes={}))  # a recipe-specific key outside details
    with pytest.raises(ValidationError):
        record.RunInfo(**{k: v for k, v in run_info().items() if k != "saved_to"})


def test_software_names_libraries_that_differ_from_the_lock(monkeypatch, tmp_path):
    from tests.harness import REPO

    pins = record.pinned_versions(REPO / "recipes/llama3-8b-zero3")
    assert pins["torch"] == "2.13.0" and pins["deepspeed"] == "0.19.8"
    assert record.pinned_versions(tmp_path) == {}  # a copied recipe folder has no lock beside it
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(record, "pinned_versions", lambda: {**pins, "torch": "2.11.0"})
    differs = record.software().differs_from_pins
    assert list(differs) == ["torch"] and differs["torch"].endswith("(pinned 2.11.0)")


def test_the_record_keeps_the_sample_answers_as_figures_and_an_old_one_loses_their_text(monkeypatch, tmp_path):
    """A record is what a run publishes (results/runs/), so it holds no text of the data: the sample answers are
    counted there, their text stays in samples.jsonl. A record written before, with the rows themselves, reads back
    as their count, and written again it holds none of their text."""
    from finetune_kit.training.samples import figures

    rows = [{"example_id": 3, "prompt": "What is the capital of Peru?", "reference": "The capital of Peru is Lima.",
             "answer": "The capital of Peru is Quito.", "before": "zzzz"},
            {"example_id": 8, "prompt": "Spell the word 'river' backwards.",
             "reference": "'river' backwards is 'revir'.", "answer": "'river' backwards is 'revir'.",
             "before": "river"}]
    rec = a_record(monkeypatch, tmp_path)
    rec.samples = record.SampleFigures(**figures(rows))
    assert rec.samples.model_dump() == {"prompts": 2, "scored": 2, "form_after": 2, "exact_after": 1,
                                        "form_before": 0, "exact_before": 0}
    old = json.loads(rec.write(tmp_path / "new.json").read_text()) | {"samples": rows}
    (tmp_path / "old.json").write_text(json.dumps(old))
    texts = [t for row in rows for k, t in row.items() if k != "example_id"]
    assert all(t in (tmp_path / "old.json").read_text() for t in texts)  # the control: the old layout holds them
    read = record.RunRecord.read(tmp_path / "old.json")
    assert read.samples == record.SampleFigures(prompts=2)
    written = read.write(tmp_path / "again.json").read_text()
    assert not [t for t in texts if t in written]
