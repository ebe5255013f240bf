"""Measuring a run: metric names and units (:mod:`.keys`), model FLOPs and MFU (:mod:`.flops`), tokens/s
(:mod:`.throughput`), peak memory (:mod:`.peak_memory`), metrics.jsonl (:mod:`.metrics_log`), the
per-step meter of the accelerate loops (:mod:`.step_meter`) and the run record (:mod:`.run_record`)."""
