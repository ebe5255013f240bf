"""DeepSpeed's CPU accelerator reads the NUMA layout once per process: as shipped, each ``device_count()`` (ZeRO-3
asks at every gradient reduce) runs ``numactl`` in a new process."""

from __future__ import annotations

import pytest

from finetune_kit.launch import numa_layout


@pytest.fixture
def asked(monkeypatch):
    """A NUMA reader that counts its questions (two nodes of two cores), no LOCAL_SIZE, and the module's own
    function restored after the test."""
    from deepspeed.utils import numa

    questions = []
    monkeypatch.setattr(numa, "get_numa_cores", lambda: questions.append(1) or [[0, 1], [2, 3]])
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    return questions


def test_the_accelerator_asks_at_every_count_and_once_in_all_when_kept(asked):
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accelerator = CPU_Accelerator()
    assert [accelerator.device_count() for _ in range(3)] == [2, 2, 2]
    assert len(asked) == 3  # DeepSpeed as shipped: a new numactl process each time
    numa_layout.keep()
    numa_layout.keep()  # once is enough: not wrapped twice
    assert [accelerator.device_count() for _ in range(3)] == [2, 2, 2]
    assert len(asked) == 4


def test_a_launcher_that_sets_local_size_is_not_asked(asked, monkeypatch):
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    monkeypatch.setenv("LOCAL_SIZE", "2")
    numa_layout.keep()
    assert CPU_Accelerator().device_count() == 2 and asked == []
