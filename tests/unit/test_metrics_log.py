import json

from finetune_kit.metering import metrics_log


class FakeWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, key, value, global_step):
        self.scalars.append((key, value, global_step))

    def flush(self):
        pass

    def close(self):
        pass


def test_lines_and_tensorboard_scalars(monkeypatch, tmp_path):
    writer = FakeWriter()
    monkeypatch.setattr(metrics_log, "_summary_writer", lambda log_dir: writer)
    log = metrics_log.MetricsLog(tmp_path / "run")
    log.write({"step": 1, "loss": 2.5, "tokens_per_s": 100.0, "note": "text is not a scalar"})
    log.write({"step": 2, "loss": 2.0, "tokens_per_s": 110.0})
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in lines] == [2.5, 2.0]
    assert writer.scalars == [("loss", 2.5, 1), ("tokens_per_s", 100.0, 1), ("loss", 2.0, 2),
                              ("tokens_per_s", 110.0, 2)]


def test_other_ranks_write_nothing(tmp_path):
    log = metrics_log.MetricsLog(tmp_path / "run", enabled=False)
    log.write({"step": 1, "loss": 1.0})
    assert not (tmp_path / "run").exists()
