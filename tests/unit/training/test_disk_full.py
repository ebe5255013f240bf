"""A save that runs out of room: which failures are a full disk, and what the stop says and removes
(training/disk_full.py). On a real filesystem (tmpfs, root only, as CI runs)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from finetune_kit.training import disk_full
from tests.harness import small_filesystem

MIB = 2**20


def test_a_write_out_of_room_is_known_by_its_errno_or_by_what_the_writer_says():
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert disk_full.reason(full) == "No space left on device"
    assert disk_full.reason(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))) == "Disk quota exceeded"
    try:  # torch.save over a file object: the zip writer's error, the OSError in its context
        try:
            raise full
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as err:
        assert disk_full.reason(err) == "No space left on device"
    # torch.save to a path: its C++ stream says no more than this
    assert disk_full.reason(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")) \
        == "a write failed"
    assert disk_full.reason(RuntimeError("SafetensorError: I/O error: No space left on device (os error 28)"))
    assert disk_full.reason(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_full.reason(ValueError("a bug")) is None


def test_a_save_that_fills_the_disk_stops_with_the_numbers_and_removes_its_partial_folder(tmp_path):
    with small_filesystem(tmp_path / "disk", 4 * MIB) as disk:
        partial = disk / "checkpoints/step_000004.partial"
        partial.mkdir(parents=True)
        with pytest.raises(disk_full.DiskFull) as stop:
            with disk_full.room_for(disk / "checkpoints", partial, 6 * MIB, what="the step-4 checkpoint",
                                    kept="The newest complete checkpoint is step_000002 (kept).", writer=True):
                torch.save({"w": torch.zeros(6 * MIB // 4)}, partial / "shard.pt")  # 6 MiB on a 4 MiB disk
        assert str(stop.value) == (
            f"the step-4 checkpoint did not fit on disk: '{disk / 'checkpoints'}' filled up while it was written (a "
            "write failed); it takes about 6.0 MiB and 4.0 MiB are free now (its partial folder removed). The newest "
            "complete checkpoint is step_000002 (kept).")
        assert not partial.exists()


def test_a_rank_whose_peer_left_mid_save_says_the_same_only_where_the_disk_is_short(tmp_path):
    gone = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1234")
    with small_filesystem(tmp_path / "disk", 4 * MIB) as disk:
        partial = disk / "model.partial"
        for needed, stops in ((8 * MIB, True), (1 * MIB, False)):
            partial.mkdir(exist_ok=True)
            with pytest.raises(disk_full.DiskFull if stops else RuntimeError) as stop:
                with disk_full.room_for(disk, partial, needed, what="model/", kept="...", writer=False):
                    raise gone
            assert ("another rank's write failed" in str(stop.value)) == stops
            assert partial.exists() != stops  # removed by every rank that stops, kept where the failure is raised
        with pytest.raises(ValueError, match="a bug"):  # not a write: raised as it came, the partial folder kept
            with disk_full.room_for(disk, partial, 8 * MIB, what="model/", kept="...", writer=True):
                raise ValueError("a bug")
        assert partial.exists()
        assert disk_full.short_of_room(disk, 1 * MIB) is None
        assert disk_full.short_of_room(disk, 4 * MIB) == "it takes about 4.0 MiB and 4.0 MiB are free there"


class OneRank:
    num_processes, is_main_process = 1, True


def test_a_final_save_without_room_is_refused_before_it_is_written_naming_the_checkpoint_to_resume(tmp_path):
    from finetune_kit.training import final_model

    with small_filesystem(tmp_path / "disk", 4 * MIB) as disk:
        (disk / "checkpoints/step_000012").mkdir(parents=True)
        for name in ("trainer_state.json", "manifest.json"):
            (disk / "checkpoints/step_000012" / name).write_text("{}")
        with pytest.raises(disk_full.DiskFull) as stop:
            with final_model._in_room(OneRank(), disk / "model", 8 * MIB):
                raise AssertionError("not written: no room")
        assert str(stop.value) == (
            f"model/ was not written: '{disk}' has no room for it: it takes about 8.0 MiB and 4.0 MiB are free there. "
            "Free space on that disk or point --output at a larger one; relaunch the same command: it resumes from "
            f"the run's newest checkpoint, {disk / 'checkpoints/step_000012'}, and writes model/.")
        with final_model._in_room(OneRank(), disk / "adapter", 1 * MIB):
            (disk / "adapter.partial").mkdir()  # room for it: the save runs
        assert (disk / "adapter.partial").is_dir()


def test_the_last_rank_out_removes_what_ranks_that_stopped_before_it_left_behind(tmp_path):
    """Ranks do not stop at once: the writer fails first and removes the folder while another rank still writes
    (it makes its shard's folder again); that rank's own stop removes it, so nothing is left. A rank whose file
    vanished under it (the folder removed by the first) stops with the same line; a missing file elsewhere is a bug
    raised as it came."""
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with small_filesystem(tmp_path / "disk", 4 * MIB) as disk:
        partial = disk / "checkpoints/step_000006.partial"
        (partial / "pytorch_model").mkdir(parents=True)
        (partial / "pytorch_model/mp_rank_00_model_states.pt").write_bytes(b"x" * MIB)
        with pytest.raises(disk_full.DiskFull, match="No space left on device"):
            with disk_full.room_for(disk, partial, 8 * MIB, what="the step-6 checkpoint", kept="...", writer=True):
                raise full
        assert not partial.exists()
        with pytest.raises(disk_full.DiskFull, match="No space left on device"):  # the late rank, writer=False
            with disk_full.room_for(disk, partial, 8 * MIB, what="the step-6 checkpoint", kept="...", writer=False):
                (partial / "pytorch_model").mkdir(parents=True)
                (partial / "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"x" * MIB)
                raise full
        assert not partial.exists()
        for err in (FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(partial / "random_states_1.pkl")),
                    RuntimeError(f"Parent directory {partial}/pytorch_model does not exist.")):
            with pytest.raises(disk_full.DiskFull, match="another rank's write failed"):
                with disk_full.room_for(disk, partial, 1 * MIB, what="the step-6 checkpoint", kept="...",
                                        writer=False):
                    raise err
        elsewhere = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(disk / "tokenizer.json"))
        with pytest.raises(FileNotFoundError):
            with disk_full.room_for(disk, partial, 1 * MIB, what="the step-6 checkpoint", kept="...", writer=True):
                raise elsewhere
