import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.training import checkpoints


def make_ckpt(output, step, complete=True):
    path = checkpoints.checkpoint_path(output, step)
    path.mkdir(parents=True)
    if complete:
        (path / checkpoints.STATE_FILE).write_text("{}")
    return path


def test_fresh_output_starts_fresh(tmp_path):
    assert checkpoints.resolve_resume(None, tmp_path / "run") is None


def test_existing_checkpoints_are_not_overwritten(tmp_path):
    make_ckpt(tmp_path, 5)
    with pytest.raises(ConfigError, match=r"already holds 1 checkpoint.*--resume"):
        checkpoints.resolve_resume(None, tmp_path)


def test_latest_is_the_highest_complete_step(tmp_path):
    make_ckpt(tmp_path, 5)
    newest = make_ckpt(tmp_path, 20)
    make_ckpt(tmp_path, 30, complete=False)  # interrupted mid-save: ignored
    assert checkpoints.resolve_resume("latest", tmp_path) == newest


def test_resume_without_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint found"):
        checkpoints.resolve_resume("latest", tmp_path)
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        checkpoints.resolve_resume(str(tmp_path), tmp_path)


def test_trainer_layout_finds_the_trainers_own_folders(tmp_path):
    layout = checkpoints.TRAINER_LAYOUT
    for step in (3, 12):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / checkpoints.STATE_FILE).write_text("{}")
    (tmp_path / "checkpoint-20").mkdir()  # no trainer state: an interrupted save
    assert checkpoints.resolve_resume("latest", tmp_path, layout) == tmp_path / "checkpoint-12"
    with pytest.raises(ConfigError, match=r"already holds 2 checkpoint.*--resume_from_checkpoint"):
        checkpoints.resolve_resume(None, tmp_path, layout)
