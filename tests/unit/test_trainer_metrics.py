import json
from types import SimpleNamespace

import pytest

from finetune_kit import distributed
from finetune_kit.trainer_metrics import MetricsCallback

ARGS = SimpleNamespace(include_num_input_tokens_seen="non_padding")


def state(step: int, tokens_seen: int, main: bool = True):
    return SimpleNamespace(global_step=step, epoch=step / 10, num_input_tokens_seen=tokens_seen,
                           is_world_process_zero=main)


def test_one_line_per_logged_step_with_the_8b_names(tmp_path):
    cb = MetricsCallback(tmp_path / "metrics.jsonl", num_devices=2)
    cb.on_train_begin(ARGS, state(0, 500), None)  # 500 tokens seen before a resume
    cb.on_step_end(ARGS, state(1, 800), None)
    logs = {"loss": 2.5, "learning_rate": 1e-4}
    cb.on_log(ARGS, state(1, 800), None, logs=logs)
    cb.on_step_end(ARGS, state(2, 1000), None)
    cb.on_log(ARGS, state(2, 1000), None, logs={"train_runtime": 3.0})  # the end-of-training summary: skipped
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1
    rec = records[0]
    assert {"step", "epoch", "loss", "lr", "tokens", "tokens_per_s", "tokens_per_s_per_device",
            "step_time_s", "host_rss_GiB"} <= set(rec)
    assert (rec["step"], rec["loss"], rec["lr"], rec["tokens"]) == (1, 2.5, 1e-4, 300)  # this step's tokens only
    assert rec["tokens_per_s_per_device"] == pytest.approx(rec["tokens_per_s"] / 2)
    assert "tokens_per_s" in logs and "peak_mem_GiB" in logs  # shown on the Trainer's own log line


def test_only_the_main_process_writes(tmp_path):
    cb = MetricsCallback(tmp_path / "metrics.jsonl", num_devices=2)
    cb.on_train_begin(ARGS, state(0, 0, main=False), None)
    cb.on_step_end(ARGS, state(1, 10, main=False), None)
    cb.on_log(ARGS, state(1, 10, main=False), None, logs={"loss": 1.0, "learning_rate": 0.1})
    assert not (tmp_path / "metrics.jsonl").exists()


def test_refuses_to_count_padding(tmp_path):
    cb = MetricsCallback(tmp_path / "metrics.jsonl", num_devices=1)
    with pytest.raises(ValueError, match="non_padding"):
        cb.on_train_begin(SimpleNamespace(include_num_input_tokens_seen="all"), state(0, 0), None)


def test_trainer_shim_does_nothing_without_a_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.trainer_cpu_overrides() == {}
