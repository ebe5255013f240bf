"""MeteredTrainer's callback: one metrics line per logged step, closed over all ranks' tallies."""

import json
from types import SimpleNamespace

import pytest
import torch

from finetune_kit.launch import accelerator as distributed
from finetune_kit.metering import keys
from finetune_kit.metering.flops import FlopCounter
from finetune_kit.metering.metrics_log import MetricsLog
from finetune_kit.metering.throughput import StepTally, ThroughputMeter
from finetune_kit.models.shapes import ModelShape
from finetune_kit.training.hf_trainer import MeteringCallback

TINY = ModelShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512)


def fake_trainer(monkeypatch, tmp_path, main=True):
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr("finetune_kit.metering.throughput.time.perf_counter", lambda: next(clock))
    trainer = SimpleNamespace(tally=StepTally(FlopCounter(TINY)), rates=ThroughputMeter(2), accelerator=None)
    return trainer, MeteringCallback(trainer, MetricsLog(tmp_path, enabled=main))


def state(step):
    return SimpleNamespace(global_step=step, epoch=step / 10)


def test_one_line_per_logged_step_with_the_8b_names(monkeypatch, tmp_path):
    trainer, cb = fake_trainer(monkeypatch, tmp_path)
    cb.on_train_begin(None, state(0), None)
    # micro-batches of step 1 (what training_step sees)
    trainer.tally.add({"attention_mask": torch.tensor([[1, 1, 1, 0]])})
    trainer.tally.add({"attention_mask": torch.tensor([[1, 1, 0, 0]])})
    cb.on_step_end(None, state(1), None)
    logs = {"loss": 2.5, "learning_rate": 1e-4}
    cb.on_log(None, state(1), None, logs=logs)
    trainer.tally.add({"attention_mask": torch.tensor([[1, 1]])})
    cb.on_step_end(None, state(2), None)
    cb.on_log(None, state(2), None, logs={"train_runtime": 3.0})  # the end-of-training summary: skipped
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1
    rec = records[0]
    assert (rec["step"], rec["loss"], rec["lr"], rec["tokens"]) == (1, 2.5, 1e-4, 5)  # this step's real tokens
    assert rec["padding_fraction"] == pytest.approx(3 / 8)
    assert rec["tokens_per_s_per_device"] == pytest.approx(rec["tokens_per_s"] / 2)
    flops = 5 * FlopCounter(TINY).per_token(4)
    assert rec["model_tflop_per_s_per_device"] == pytest.approx(flops / rec["step_time_s"] / 2 / 1e12)
    assert "tokens_per_s" in logs and "host_rss_GiB" in logs  # on the Trainer's log line, metrics.jsonl names
    assert [r.tokens for r in trainer.rates.history] == [5, 2]  # every step is metered, logged or not


def test_only_the_main_process_writes(monkeypatch, tmp_path):
    trainer, cb = fake_trainer(monkeypatch, tmp_path / "run", main=False)
    trainer.tally.add({"attention_mask": torch.tensor([[1]])})
    cb.on_step_end(None, state(1), None)
    cb.on_log(None, state(1), None, logs={"loss": 1.0, "learning_rate": 0.1})
    assert not (tmp_path / "run").exists()


def test_trainer_shim_does_nothing_without_a_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.trainer_cpu_overrides() == {}


def test_fp16_runs_log_the_loss_scale_and_the_skipped_steps(monkeypatch, tmp_path):
    """fp16 cannot run on a CPU: a stand-in DeepSpeed engine with a loss scaler that has skipped a step."""
    trainer, cb = fake_trainer(monkeypatch, tmp_path)
    trainer.model_wrapped = SimpleNamespace(fp16_enabled=lambda: True, skipped_steps=1,
                                            optimizer=SimpleNamespace(loss_scale=32768.0))
    trainer.tally.add({"attention_mask": torch.tensor([[1]])})
    cb.on_step_end(None, state(1), None)
    cb.on_log(None, state(1), None, logs={"loss": 1.0, "learning_rate": 0.1})
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (rec["loss_scale"], rec["skipped_steps"]) == (32768.0, 1)
    trainer.model_wrapped = SimpleNamespace(fp16_enabled=lambda: False)  # bf16: nothing to report
    assert keys.loss_scaling(trainer.model_wrapped) == {}


class FakeEndpoint:
    def __init__(self):
        self.records, self.tokens = [], 0

    def update(self, record):
        self.records.append(dict(record))

    def rank_tokens(self, n):
        self.tokens += n

    def close(self):
        self.closed = True


def test_trackers_get_every_figure_and_the_endpoint_every_step(monkeypatch, tmp_path):
    trainer, _ = fake_trainer(monkeypatch, tmp_path)
    endpoint = FakeEndpoint()
    cb = MeteringCallback(trainer, MetricsLog(tmp_path, enabled=True), endpoint)
    args = SimpleNamespace(report_to=["tensorboard"])
    trainer.tally.add({"attention_mask": torch.tensor([[1, 1, 1, 0]])})
    cb.on_step_end(args, state(1), None)
    logs = {"loss": 2.5, "learning_rate": 1e-4}
    cb.on_log(args, state(1), None, logs=logs)
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    # the Trainer's report_to callbacks see metrics.jsonl's names and values (step and epoch are theirs)
    assert {k: v for k, v in logs.items() if k != "learning_rate"} == {k: v for k, v in rec.items()
                                                                       if k not in ("step", "epoch")}
    assert endpoint.tokens == 3  # this rank's real tokens, before the reduce over ranks
    assert endpoint.records[0]["step"] == 1 and endpoint.records[0]["tokens_per_s"] == rec["tokens_per_s"]
    assert endpoint.records[-1]["loss"] == 2.5  # the logged step reaches it too
