"""--report-to: accelerate's trackers, checked before anything loads."""

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.metering import trackers


def test_none_asks_for_nothing(tmp_path):
    assert trackers.check_trackers("none") == [] and trackers.check_trackers(None) == []
    assert trackers.check_trackers(["none"]) == []
    assert trackers.accelerator_kwargs("none", tmp_path) == {}


def test_tensorboard_writes_under_the_output(tmp_path):
    kwargs = trackers.accelerator_kwargs("tensorboard", tmp_path)
    assert kwargs["log_with"] == ["tensorboard"]
    assert kwargs["project_config"].logging_dir == str(tmp_path / "tensorboard")


def test_a_missing_package_is_named_with_the_fix(monkeypatch):
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"--report_to wandb needs the wandb package.*pip install wandb"):
        trackers.check_trackers(["wandb"], flag="--report_to")


def test_an_unknown_tracker_is_refused():
    with pytest.raises(ConfigError, match=r"--report-to comet_ml: not a tracker.*none, tensorboard, wandb, mlflow"):
        trackers.check_trackers("comet_ml")
