"""One name and unit per metric: every writer takes its keys from metering.keys."""

from dataclasses import fields

from finetune_kit.metering import keys, peak_memory
from finetune_kit.metering.run_record import Measured
from finetune_kit.metering.throughput import StepRate


def test_peak_memory_reports_host_rss_in_gib():
    mem = peak_memory.peaks()
    assert 0.01 < mem[keys.HOST_RSS.key] < 64
    assert set(mem) <= {m.key for m in keys.MEMORY}


def test_progress_text_shows_units_and_mfu_only_when_known():
    cpu = {"loss": 2.0, "lr": 1e-4, "tokens_per_s": 1234.5, "model_tflop_per_s_per_device": 0.00123,
           "host_rss_GiB": 1.5}
    assert keys.progress_text(cpu) == ("loss=2.0000, lr=1.00e-04, tok/s=1,234, TFLOP/s/dev=0.00123, "
                                       "host_rss_GiB=1.5")
    gpu = {**cpu, "mfu_percent": 41.26, "gpu_reserved_GiB": 70.2}
    assert keys.progress_text(gpu).endswith("mfu=41.3%, gpu_reserved_GiB=70.2")


def test_every_step_rate_field_is_a_defined_metric():
    defined = {m.key for m in keys.STEP_METRICS}
    assert {f.name for f in fields(StepRate)} <= defined


def test_run_record_measures_use_the_defined_names():
    """Medians are named after a step metric, peaks are peak_<metric>[_per_node]."""
    step = {m.key for m in keys.STEP_METRICS}
    peaks = {keys.peak_key(m) for m in keys.MEMORY} | {keys.peak_key(m, "_per_node") for m in keys.MEMORY}
    bookkeeping = {"steps_total", "steps_measured", "warmup_steps_excluded", "flops_formula", "predicted_gpu_GiB",
                   keys.FIRST_STEP_AFTER.key}
    for name in Measured.model_fields:
        assert name in step | peaks | bookkeeping, name


def test_units_are_in_the_keys():
    for metric in keys.STEP_METRICS:
        if metric.unit == "GiB":
            assert metric.key.endswith("_GiB"), metric
        if metric.unit == "s":
            assert metric.key.endswith("_s"), metric
        if metric.unit == "%":
            assert metric.key.endswith("_percent"), metric
