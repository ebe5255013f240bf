import pytest

from finetune_kit import throughput


def test_rates_use_wall_clock_between_steps(monkeypatch):
    clock = iter([10.0, 12.0, 13.0])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    meter = throughput.ThroughputMeter(num_devices=4)
    first = meter.step(8000)
    assert first.step_time_s == 2.0
    assert first.tokens_per_s == 4000.0 and first.tokens_per_s_per_device == 1000.0
    second = meter.step(1000)
    assert second.tokens_per_s == pytest.approx(1000.0)
    assert meter.total_tokens == 9000


def test_peak_memory_reports_host_rss_in_gib():
    mem = throughput.peak_memory_gib()
    assert 0.01 < mem["host_rss_GiB"] < 64
