import pytest
import torch

from finetune_kit.metering import throughput
from finetune_kit.metering.flops import FlopCounter
from finetune_kit.models.shapes import ModelShape

TINY = ModelShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512)


def fake_clock(monkeypatch, times):
    clock = iter(times)
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))


def test_rates_use_wall_clock_between_steps(monkeypatch):
    fake_clock(monkeypatch, [10.0, 12.0, 13.0])
    meter = throughput.ThroughputMeter(num_devices=4)
    first = meter.step(8000)
    assert first.step_time_s == 2.0
    assert first.tokens_per_s == 4000.0 and first.tokens_per_s_per_device == 1000.0
    second = meter.step(1000)
    assert second.tokens_per_s == pytest.approx(1000.0)
    assert meter.total_tokens == 9000


def test_tally_counts_real_tokens_padding_and_flops():
    counter = FlopCounter(TINY)
    tally = throughput.StepTally(counter)
    tally.add({"attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])})  # 5 real tokens in 8 slots, T = 4
    tally.add({"attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1]])})  # 6 real in 6, T = 6
    totals = tally.reduce()
    assert totals == {"tokens": 11, "padded_tokens": 14,
                      "flops": 5 * counter.per_token(4) + 6 * counter.per_token(6)}
    assert tally.reduce() == {"tokens": 0, "padded_tokens": 0, "flops": 0.0}  # the next step starts at zero


def test_padding_fraction_tflops_and_mfu(monkeypatch):
    fake_clock(monkeypatch, [0.0, 2.0])
    meter = throughput.ThroughputMeter(num_devices=2, peak_tflops=989.0)
    rate = meter.step(tokens=750, padded_tokens=1000, flops=3.956e15)
    assert rate.padding_fraction == pytest.approx(0.25)
    assert rate.model_tflop_per_s_per_device == pytest.approx(989.0)  # 3.956e15 / 2 s / 2 devices
    assert rate.mfu_percent == pytest.approx(100.0)


def test_cpu_runs_report_no_mfu(monkeypatch):
    fake_clock(monkeypatch, [0.0, 1.0])
    rate = throughput.ThroughputMeter(num_devices=1, peak_tflops=None).step(100, 100, flops=1e12)
    metrics = rate.as_metrics()
    assert "mfu_percent" not in metrics and metrics["model_tflop_per_s_per_device"] == pytest.approx(1.0)


def test_summary_is_the_median_after_warmup(monkeypatch):
    fake_clock(monkeypatch, [0, 10, 11, 12, 14, 15])  # step times 10 (warm-up), 1, 1, 2, 1
    meter = throughput.ThroughputMeter(num_devices=1)
    for _ in range(5):
        meter.step(100, 100)
    summary = meter.summary(warmup_steps=1)
    assert summary["steps_measured"] == 4 and summary["warmup_steps_excluded"] == 1
    assert summary["median_step_time_s"] == 1.0
    assert summary["median_tokens_per_s"] == 100.0
    assert "median_mfu_percent" not in summary
    assert meter.summary(warmup_steps=5) == {"steps_measured": 0, "warmup_steps_excluded": 5}
