import json

import pytest

from finetune_kit import outputs
from finetune_kit.errors import ConfigError
from finetune_kit.training.checkpointing import checkpoints, resharding


def make_ckpt(output, step, complete=True):
    """A checkpoint folder as save_checkpoint leaves it; without its marks when not ``complete``."""
    path = checkpoints.checkpoint_path(output, step)
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"x" * step)
    if complete:
        (path / checkpoints.STATE_FILE).write_text("{}")
        checkpoints.write_manifest(path)
    return path


class FakeAccelerator:
    """One rank; ``save_state`` writes a shard, or fails like a killed process when told to."""

    is_main_process, process_index = True, 0

    def __init__(self, fail: bool = False):
        self.fail = fail

    def wait_for_everyone(self):
        pass

    def save_state(self, folder):
        from pathlib import Path

        Path(folder).mkdir(parents=True)
        (Path(folder) / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"y" * 10)
        if self.fail:
            raise KeyboardInterrupt("killed mid-save")


def test_fresh_output_starts_fresh(tmp_path):
    assert checkpoints.resolve_resume(None, tmp_path / "run") is None
    assert checkpoints.resolve_resume("auto", tmp_path / "run") is None


def test_auto_continues_from_the_newest_complete_checkpoint(tmp_path):
    make_ckpt(tmp_path, 5)
    newest = make_ckpt(tmp_path, 20)
    make_ckpt(tmp_path, 30, complete=False)
    assert checkpoints.resolve_resume("auto", tmp_path) == newest


def test_auto_never_overwrites_a_finished_run(tmp_path):
    make_ckpt(tmp_path, 5)
    (tmp_path / checkpoints.FINISHED).write_text("{}")
    with pytest.raises(ConfigError, match=r"holds a finished run \(run_record\.json\) and already holds 1 "
                                          r"checkpoint\(s\).*--resume latest"):
        checkpoints.resolve_resume("auto", tmp_path)
    (tmp_path / "checkpoints/step_000005").rename(tmp_path / "elsewhere")  # no checkpoints: still finished work
    with pytest.raises(ConfigError, match=r"holds a finished run"):
        checkpoints.resolve_resume("auto", tmp_path)


def test_existing_checkpoints_are_not_overwritten(tmp_path):
    make_ckpt(tmp_path, 5)
    with pytest.raises(ConfigError, match=r"already holds 1 checkpoint.*--resume"):
        checkpoints.resolve_resume(None, tmp_path)


def test_latest_is_the_highest_complete_step(tmp_path):
    make_ckpt(tmp_path, 5)
    newest = make_ckpt(tmp_path, 20)
    make_ckpt(tmp_path, 30, complete=False)  # interrupted mid-save: ignored
    (newest.parent / "step_000040.partial").mkdir()
    assert checkpoints.resolve_resume("latest", tmp_path) == newest


def zero_block(path, offset=1, length=4):
    """Overwrite ``length`` bytes of ``path`` with zeros in place: the size stays, the contents do not."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(length))


def test_a_damaged_checkpoint_is_named_not_resumed(tmp_path):
    newest = make_ckpt(tmp_path, 20)
    (newest / "mp_rank_00_model_states.pt").write_bytes(b"x" * 3)  # truncated
    with pytest.raises(ConfigError, match=r"every checkpoint under '.*checkpoints' is damaged \(the newest, "
                                          r"step_000020: mp_rank_00_model_states\.pt has 3 bytes, the manifest says "
                                          r"20\)\. Move them away to start fresh, .*nothing was deleted"):
        checkpoints.resolve_resume("auto", tmp_path)
    with pytest.raises(ConfigError, match=r"step_000020' is damaged: mp_rank_00_model_states\.pt has 3 bytes, the "
                                          r"manifest says 20\. Resume from another checkpoint"):
        checkpoints.resolve_resume(str(newest), tmp_path)
    (newest / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(ConfigError, match=r"mp_rank_00_model_states\.pt is missing"):
        checkpoints.resolve_resume(str(newest), tmp_path)


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_newest_that_verifies(tmp_path):
    """Real bytes damaged on disk: a block of the newest zeroed in place (its size unchanged: only the checksum
    sees it), then the one before truncated. auto and latest fall back, one line each naming the damaged file;
    a folder named on the command line is refused; the damaged ones stay where they were."""
    oldest, middle, newest = (make_ckpt(tmp_path, step) for step in (10, 20, 30))
    zero_block(newest / "mp_rank_00_model_states.pt")
    for resume in ("auto", "latest"):
        lines = []
        assert checkpoints.resolve_resume(resume, tmp_path, report=lines.append) == middle
        saved = json.loads((newest / "manifest.json").read_text())["checksums"]["mp_rank_00_model_states.pt"]
        assert lines == [f"not resuming from {newest}: it is damaged (mp_rank_00_model_states.pt has the size the "
                         f"manifest says but not its contents (xxh3_64 {saved} when saved)); resuming from "
                         "step_000020, the newest checkpoint that verifies. The damaged one is left in place; a later "
                         "save of its step replaces it."]
    with pytest.raises(ConfigError, match=r"step_000030' is damaged: mp_rank_00_model_states\.pt has the size the "
                                          r"manifest says but not its contents"):
        checkpoints.resolve_resume(str(newest), tmp_path)
    with open(middle / "mp_rank_00_model_states.pt", "r+b") as f:
        f.truncate(7)
    lines = []
    assert checkpoints.resolve_resume("auto", tmp_path, report=lines.append) == oldest
    assert [line.split(":")[0] for line in lines] == [f"not resuming from {newest}", f"not resuming from {middle}"]
    assert "mp_rank_00_model_states.pt has 7 bytes, the manifest says 20" in lines[1]
    assert checkpoints.list_checkpoints(tmp_path) == [oldest, middle, newest]  # nothing was deleted


def test_a_manifest_of_sizes_only_resumes_with_a_note(tmp_path):
    """A checkpoint saved before manifests carried checksums: its sizes are checked, and a note says that its
    contents are not; a wrong size is still refused."""
    path = make_ckpt(tmp_path, 20)
    manifest = json.loads((path / checkpoints.MANIFEST).read_text())
    (path / checkpoints.MANIFEST).write_text(json.dumps({"files": manifest["files"], "bytes": manifest["bytes"]}))
    zero_block(path / "mp_rank_00_model_states.pt")
    lines = []
    assert checkpoints.resolve_resume("auto", tmp_path, report=lines.append) == path
    assert lines == [f"note: checkpoint '{path}' has a manifest of file sizes only (saved before checksums were "
                     "written): its sizes match; its contents are not checked."]
    (path / "mp_rank_00_model_states.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"has 1 bytes, the manifest says 20"):
        checkpoints.resolve_resume(str(path), tmp_path, report=lines.append)


def test_each_rank_checksums_the_files_it_wrote(tmp_path):
    names = ["pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt", "pytorch_model/bf16_zero_pp_rank_0_mp_rank_00_"
             "optim_states.pt", "random_states_1.pkl", "pytorch_model/__1_0.distcp", "scheduler.bin",
             "pytorch_model/mp_rank_00_model_states.pt", "random_states_0.pkl"]
    assert [checkpoints.writer(name) for name in names] == [1, 0, 1, 1, 0, 0, 0]
    for i, name in enumerate(names):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(bytes([i]) * (i + 1))
    mine = [checkpoints.own_checksums(tmp_path, rank) for rank in (0, 1)]
    assert sorted(mine[1]) == sorted(n for n in names if checkpoints.writer(n) == 1) and not set(mine[0]) & set(mine[1])
    manifest = checkpoints.write_manifest(tmp_path, {**mine[0], **mine[1]}, save_seconds=1.5)
    assert manifest["checksums"] == {name: checkpoints.checksum(tmp_path / name) for name in names}
    assert manifest["checksum"] == "xxh3_64" and manifest["save_seconds"] == 1.5
    assert len(set(manifest["checksums"].values())) == len(names)  # the contents differ, and so do their sums
    (tmp_path / "empty").touch()  # an empty file cannot be memory-mapped: hashed as no bytes
    assert checkpoints.checksum(tmp_path / "empty") == "2d06800538d394c2"  # XXH3-64 of nothing (xxhash's spec)


def test_a_checkpoint_without_its_manifest_is_refused_by_path(tmp_path):
    path = make_ckpt(tmp_path, 20)
    (path / checkpoints.MANIFEST).unlink()
    with pytest.raises(ConfigError, match=r"not a complete checkpoint folder \(no manifest\.json"):
        checkpoints.resolve_resume(str(path), tmp_path)


def test_save_is_atomic_and_prunes_only_after_the_new_one_is_complete(tmp_path):
    first = checkpoints.save_checkpoint(FakeAccelerator(), tmp_path, 4, {"step": 4}, keep=1)
    assert json.loads((first / checkpoints.MANIFEST).read_text())["files"] == {
        "trainer_state.json": (first / "trainer_state.json").stat().st_size,
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": 10}
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save_checkpoint(FakeAccelerator(fail=True), tmp_path, 8, {"step": 8}, keep=1)
    assert checkpoints.list_checkpoints(tmp_path) == [first]  # the last complete one survived the failed save
    assert checkpoints.resolve_resume("auto", tmp_path) == first
    assert checkpoints.clean_partial(tmp_path) == [tmp_path / "checkpoints/step_000008.partial"]
    second = checkpoints.save_checkpoint(FakeAccelerator(), tmp_path, 8, {"step": 8}, keep=1)
    assert checkpoints.list_checkpoints(tmp_path) == [second] and not first.exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000008"]


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


# ---- a folder to write to, and room on its disk ----

def test_an_output_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"output folder '.*file/run' cannot be written: '.*file', where it would "
                                          r"be created, \(Not a directory\)\. Pass --output"):
        outputs.check_writable(tmp_path / "file" / "run")

    def refuse(dir):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(outputs.tempfile, "TemporaryFile", refuse)  # as for a user without rights there
    with pytest.raises(ConfigError, match=r"'.*run' cannot be written: .* \(Permission denied\)"):
        outputs.check_writable(tmp_path / "run")
    assert not (tmp_path / "run").exists()  # the check creates nothing


def fake_disk(monkeypatch, free: int):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: usage(free * 10, free * 9, free))


def test_a_save_without_room_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    first = checkpoints.save_checkpoint(FakeAccelerator(), tmp_path, 4, {"step": 4}, keep=0, estimate=10)
    size = checkpoints.predicted_bytes(tmp_path, estimate=10)
    assert size == json.loads((first / checkpoints.MANIFEST).read_text())["bytes"] > 10  # measured, not estimated

    fake_disk(monkeypatch, free=size)  # less than size x the margin
    with pytest.raises(ConfigError, match=r"not saving the step-8 checkpoint: '.*checkpoints' has 0\.0 MiB free and "
                                          r"a checkpoint takes about 0\.0 MiB \(x1\.1 margin\)\..* the newest complete "
                                          r"checkpoint is .*step_000004\. Relaunch the same command"):
        checkpoints.save_checkpoint(FakeAccelerator(), tmp_path, 8, {"step": 8}, keep=0)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000004"]

    fake_disk(monkeypatch, free=int(size * checkpoints.FREE_SPACE_MARGIN) + 1)
    checkpoints.save_checkpoint(FakeAccelerator(), tmp_path, 8, {"step": 8}, keep=0)


def test_checkpoint_size_estimate_follows_the_zero_stage():
    assert checkpoints.estimate_bytes(1000, 1000, zero_stage=3) == 12_000  # fp32 master + Adam m, v
    assert checkpoints.estimate_bytes(1000, 1000, zero_stage=2) == 14_000  # + bf16 module weights
    assert checkpoints.estimate_bytes(1000, 10, zero_stage=3) == 120  # a frozen base is not saved


# ---- a resume continues the same run ----

def test_resume_refuses_a_checkpoint_of_another_model_or_adapter(tmp_path):
    path = make_ckpt(tmp_path, 4)
    identity = {"architecture": "llama: hidden 64", "lora": "r 16, alpha 32, targets all-linear"}
    (path / checkpoints.STATE_FILE).write_text(json.dumps({"step": 4, "run": identity}))
    checkpoints.check_same_run(path, identity)
    with pytest.raises(ConfigError, match=r"belongs to a different run: lora 'r 16, alpha 32, targets all-linear' in "
                                          r"the checkpoint, 'r 8, alpha 32, targets all-linear' now\. Relaunch with "
                                          r"the checkpoint's settings.*new --output"):
        checkpoints.check_same_run(path, {**identity, "lora": "r 8, alpha 32, targets all-linear"})
    (path / checkpoints.STATE_FILE).write_text(json.dumps({"step": 4}))  # saved before runs recorded it
    checkpoints.check_same_run(path, {**identity, "architecture": "other"})


# ---- another number of ranks ----

def test_the_data_position_is_counted_in_sequences_across_rank_counts():
    state = {"step": 4, "epoch": 1, "batch_in_epoch": 8, "world_size": 2}  # 2 ranks x 8 micro-batches, before
    assert resharding.reshaped_position(state, data_ranks=1, micro_batch=4) == {**state, "batch_in_epoch": 16}
    assert resharding.reshaped_position(state, data_ranks=4, micro_batch=4) == {**state, "batch_in_epoch": 4}


def test_ranks_sharing_sequences_are_one_data_rank():
    """Saved by 2 ranks sharing each sequence (one data rank, micro-batch 8) after 2 micro-batches: on one rank
    with micro-batch 8 the same 2; on 2 ranks of their own with micro-batch 4, 2 each; counting every rank as a data
    rank (as before) would skip to micro-batch 4 on one rank."""
    state = {"step": 2, "epoch": 0, "batch_in_epoch": 2, "world_size": 2, "data_ranks": 1, "micro_batch": 8}
    assert resharding.reshaped_position(state, data_ranks=1, micro_batch=8)["batch_in_epoch"] == 2
    assert resharding.reshaped_position(state, data_ranks=2, micro_batch=4)["batch_in_epoch"] == 2
    assert resharding.reshaped_position({k: v for k, v in state.items() if k not in ("data_ranks", "micro_batch")},
                                        data_ranks=1, micro_batch=8)["batch_in_epoch"] == 4


@pytest.mark.parametrize("micro, accum, pattern", [
    (4, 4, r"saved by 1 rank with 16 sequences per optimizer step; this launch's 2 ranks take 4 x 4 x 2 = 32\. "
           r"Keep the global batch .*: pass --grad-accum 2\."),
    (3, 1, r"choose --micro-batch-size and --grad-accum whose product is 8"),
])
def test_another_number_of_ranks_must_keep_the_global_batch(tmp_path, monkeypatch, micro, accum, pattern):
    from types import SimpleNamespace



    path = make_ckpt(tmp_path, 4)
    (path / checkpoints.STATE_FILE).write_text(json.dumps({"step": 4, "world_size": 1, "global_batch": 16}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    resharding.check_reshape(path, SimpleNamespace(micro_batch_size=4, grad_accum=2), zero_stage=3)  # 4 x 2 x 2 = 16
    with pytest.raises(ConfigError, match=pattern):
        resharding.check_reshape(path, SimpleNamespace(micro_batch_size=micro, grad_accum=accum), zero_stage=3)
    with pytest.raises(ConfigError, match=r"another number of ranks is supported under ZeRO-3\. Launch 1 rank\."):
        resharding.check_reshape(path, SimpleNamespace(micro_batch_size=4, grad_accum=2), zero_stage=2)


# ---- nothing a user made is lost ----

def test_an_interrupted_trainer_save_is_cleaned_and_complete_ones_are_kept(tmp_path):
    layout = checkpoints.TRAINER_LAYOUT
    for step, complete in ((3, True), (6, False)):
        (tmp_path / f"checkpoint-{step}/global_step{step}").mkdir(parents=True)
        if complete:
            (tmp_path / f"checkpoint-{step}" / checkpoints.STATE_FILE).write_text("{}")
    (tmp_path / "model").mkdir()  # not a checkpoint
    assert checkpoints.clean_partial(tmp_path, layout) == [tmp_path / "checkpoint-6"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "model"]


def test_a_final_output_replaces_the_old_one_only_once_complete(tmp_path):
    from finetune_kit.outputs import written_whole

    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_model.safetensors").write_text("old")
    with pytest.raises(KeyboardInterrupt), written_whole(out) as folder:
        (folder / "adapter_model.safetensors").write_text("half")
        raise KeyboardInterrupt  # killed while writing
    assert (out / "adapter_model.safetensors").read_text() == "old"
    with written_whole(out) as folder:
        (folder / "adapter_model.safetensors").write_text("new")
    assert (out / "adapter_model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    with written_whole(tmp_path / "model", writer=False) as folder:  # another rank of a collective save
        assert folder == tmp_path / "model.partial"
    assert not folder.exists()


def test_a_fresh_start_never_overwrites_a_model_an_unfinished_run_left(tmp_path):
    (tmp_path / "adapter").mkdir()
    with pytest.raises(ConfigError, match=r"holds adapter/ from an earlier run that has no checkpoint to continue "
                                          r"and did not finish \(run_record\.json missing\).*nothing was overwritten"):
        checkpoints.resolve_resume("auto", tmp_path)
    make_ckpt(tmp_path, 4)  # with a checkpoint, the same command continues that run
    assert checkpoints.resolve_resume("auto", tmp_path) == checkpoints.checkpoint_path(tmp_path, 4)


def test_the_trainer_checks_the_disk_before_each_checkpoint_it_writes(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from finetune_kit.training.hf_trainer import RoomToSaveCallback

    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / checkpoints.STATE_FILE).write_text("{}")
    (tmp_path / "checkpoint-3" / "model.safetensors").write_bytes(b"w" * 1000)
    trainer = SimpleNamespace(accelerator=FakeAccelerator())
    room = RoomToSaveCallback(trainer, estimate=10)
    args, state = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=6)
    fake_disk(monkeypatch, free=1050)  # the newest checkpoint's 1002 bytes x 1.1 do not fit
    room.on_step_end(args, state, SimpleNamespace(should_save=False))  # no save due: nothing checked
    with pytest.raises(ConfigError, match=r"not saving the step-6 checkpoint: .*--save_total_limit 1.*the newest "
                                          r"checkpoint is .*checkpoint-3\. Relaunch the same command"):
        room.on_step_end(args, state, SimpleNamespace(should_save=True))
    fake_disk(monkeypatch, free=2000)
    room.on_step_end(args, state, SimpleNamespace(should_save=True))


def test_a_disk_too_small_for_the_checkpoints_kept_and_the_final_save_is_warned_of(tmp_path):
    """A real 4 MiB filesystem (tmpfs): room for one checkpoint of 1 MiB, not for the three that --keep-checkpoints 2
    has at once with the final save; enough with --keep-checkpoints 1 and a small adapter; checkpoints already
    there count as room, since rotation deletes them."""
    from tests.harness import small_filesystem

    mib = 2**20
    with small_filesystem(tmp_path / "disk", 4 * mib) as disk:
        final = checkpoints.final_save_bytes(500_000, 500_000, adapted=False)  # model/ in bf16: 1,000,000 bytes
        assert final == 1_000_000 and checkpoints.final_save_bytes(10**6, 10**4, adapted=True, merge=True) == 2_040_000
        assert checkpoints.final_save_bytes(10**6, 10**6, adapted=False, save_model=False) == 0
        assert checkpoints.free_space_problem(disk / "run", 3 * mib // 2) is None  # the save-time check passes
        assert checkpoints.planned_room_warning(disk / "run", mib, keep=2, final=final) is None  # 3.95 of 4 MiB
        warning = checkpoints.planned_room_warning(disk / "run", 3 * mib // 2, keep=2, final=final)
        assert warning == (f"warning: '{disk}' has 4.0 MiB free; this run needs about 5.5 MiB there (3 checkpoints of "
                           "1.5 MiB: --keep-checkpoints 2 keeps 2 at once, plus one being written; and 1.0 MiB for "
                           "the final save). It starts, but a save will stop it once the disk is full: free space, "
                           "lower --keep-checkpoints, or point the output at a larger disk."), warning
        assert checkpoints.planned_room_warning(disk / "run", 3 * mib // 2, keep=1, final=10_000) is None
        assert "--keep-checkpoints 0 keeps every one (counted: 2)" in checkpoints.planned_room_warning(
            disk / "run", 2 * mib, keep=0, final=final)
        make_ckpt(disk / "run", 3 * mib // 2)  # a checkpoint of 1.5 MiB already there: 2.5 MiB free
        assert "has 2.5 MiB free" in checkpoints.planned_room_warning(disk / "run", 3 * mib // 2, keep=2, final=0)
        # two of 1.5 MiB and the final save: 3.0 MiB, of which the one there is the older (rotation deletes it)
        assert checkpoints.planned_room_warning(disk / "run", 3 * mib // 2, keep=1, final=10_000) is None
