"""The allocator setting of a launch: expandable segments with the long-context levers, a user's own setting kept."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from finetune_kit.launch import cuda_allocator
from finetune_kit.launch.cuda_allocator import EXPANDABLE, VARIABLE


def args(**levers):
    return SimpleNamespace(**{"tiled_mlp": False, "offload_activations": False, "sequence_parallel": 1, **levers})


@pytest.mark.parametrize("levers", [{"tiled_mlp": True}, {"offload_activations": True}, {"sequence_parallel": 2}])
def test_a_long_context_launch_gets_expandable_segments(levers, monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    assert EXPANDABLE in cuda_allocator.use_expandable_segments(args(**levers))
    assert cuda_allocator.expandable() and cuda_allocator.setting() == EXPANDABLE


def test_a_short_launch_and_a_users_own_setting_are_left_alone(monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    assert cuda_allocator.use_expandable_segments(args()) is None and VARIABLE not in __import__("os").environ
    assert not cuda_allocator.expandable() and cuda_allocator.setting() == ""
    monkeypatch.setenv(VARIABLE, "max_split_size_mb:512")
    assert cuda_allocator.use_expandable_segments(args(tiled_mlp=True)) is None
    assert cuda_allocator.setting() == "max_split_size_mb:512" and not cuda_allocator.expandable()


def test_what_a_launch_will_run_with():
    assert cuda_allocator.for_launch(True, {}) == EXPANDABLE and cuda_allocator.for_launch(False, {}) == ""
    assert cuda_allocator.for_launch(True, {VARIABLE: "expandable_segments:False"}) == "expandable_segments:False"
    assert cuda_allocator.long_context(sequence_parallel=4) and not cuda_allocator.long_context()
