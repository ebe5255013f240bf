"""The run record: built from what a run has, written, read back, and strict about its schema."""

import json

import pytest
from pydantic import ValidationError

from finetune_kit import run_record
from finetune_kit.architectures import resolve_model
from finetune_kit.flops import FlopCounter
from finetune_kit.throughput import ThroughputMeter

DS = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True}}


def a_record(monkeypatch, tmp_path, steps=5):
    clock = iter(range(100))
    monkeypatch.setattr("finetune_kit.throughput.time.perf_counter", lambda: float(next(clock)))
    meter = ThroughputMeter(num_devices=8, peak_tflops=989.0)
    for _ in range(steps):
        meter.step(tokens=16_000, padded_tokens=16_384, flops=16_000 * 48.25e9)
    arch = resolve_model("llama3-8b")
    return run_record.for_training_run(
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
    assert data["schema"] == run_record.SCHEMA and "schema_" not in data
    assert run_record.RunRecord.read(path) == rec


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
        run_record.RunRecord.read(path)


def test_config_hash_changes_with_the_configuration():
    same = run_record.config_hash(DS, {"lr": 2e-5})
    assert same == run_record.config_hash(json.loads(json.dumps(DS)), {"lr": 2e-5})
    assert same != run_record.config_hash(DS, {"lr": 1e-5})
    assert len(same) == 16


def test_git_commit_of_this_checkout():
    from tests.conftest import REPO

    commit = run_record.git_commit(REPO)
    if commit != "unknown":  # an exported tree has no git metadata
        assert len(commit.removesuffix("+dirty")) == 40


@pytest.mark.parametrize("zero, offload", [
    ({"stage": 2}, "none"),
    ({"stage": 3, "offload_optimizer": {"device": "none"}}, "none"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}}, "optimizer+params"),
])
def test_offload_description(zero, offload):
    assert run_record.offload_of({"zero_optimization": zero}) == offload
