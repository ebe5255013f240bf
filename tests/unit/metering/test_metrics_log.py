import json

from finetune_kit.metering import metrics_log


class FakeAccelerator:
    """What MetricsLog uses of accelerate's tracking API: ``trackers`` and ``log``."""

    def __init__(self, trackers):
        self.trackers, self.logged = trackers, []

    def log(self, values, step=None):
        self.logged.append((values, step))


def test_lines_and_tracker_scalars(tmp_path):
    acc = FakeAccelerator(trackers=["tensorboard"])
    log = metrics_log.MetricsLog(tmp_path / "run", accelerator=acc)
    log.write({"step": 1, "loss": 2.5, "tokens_per_s": 100.0, "note": "text is not a scalar"})
    log.write({"step": 2, "loss": 2.0, "tokens_per_s": 110.0})
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in lines] == [2.5, 2.0]
    assert acc.logged == [({"loss": 2.5, "tokens_per_s": 100.0}, 1), ({"loss": 2.0, "tokens_per_s": 110.0}, 2)]


def test_no_tracker_no_log_call(tmp_path):
    acc = FakeAccelerator(trackers=[])
    metrics_log.MetricsLog(tmp_path / "run", accelerator=acc).write({"step": 1, "loss": 1.0})
    assert acc.logged == [] and (tmp_path / "run/metrics.jsonl").is_file()


def test_other_ranks_write_nothing(tmp_path):
    acc = FakeAccelerator(trackers=["tensorboard"])
    log = metrics_log.MetricsLog(tmp_path / "run", enabled=False, accelerator=acc)
    log.write({"step": 1, "loss": 1.0})
    assert not (tmp_path / "run").exists() and acc.logged == []
