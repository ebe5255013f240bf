"""The stop flag: set by the first signal, unchanged by repeats, agreed over ranks."""

import os
import signal

import pytest
import torch

from finetune_kit.training.stop import SIGNALS, StopSignal, stop_line


class OneRank:
    num_processes = 1
    device = torch.device("cpu")
    is_local_main_process = False  # no announcement on stderr


class TwoRanks(OneRank):
    """The other rank was signalled: the reduce adds its flag."""

    num_processes = 2

    def reduce(self, tensor, op):
        assert op == "sum"
        return tensor + 1


@pytest.fixture
def stop():
    saved = {name: signal.getsignal(getattr(signal, name)) for name in SIGNALS}
    yield StopSignal(OneRank())
    for name, handler in saved.items():
        signal.signal(getattr(signal, name), handler)


@pytest.mark.parametrize("name", SIGNALS)
def test_a_signal_sets_the_flag_and_repeats_change_nothing(stop, name):
    assert not stop.agreed()
    os.kill(os.getpid(), getattr(signal, name))
    os.kill(os.getpid(), getattr(signal, name))  # a launcher forwarding the same signal: still caught
    assert stop.received == name and stop.agreed() and stop.describe() == name


def test_every_rank_stops_when_another_was_signalled(stop):
    stop.accelerator = TwoRanks()
    assert stop.agreed() and stop.describe() == "a stop signal to another rank"


def test_the_stop_line_names_the_checkpoint_and_what_to_do():
    assert stop_line("SIGTERM", 3, 8, "out/checkpoints/step_000003") == (
        "stopped by SIGTERM after step 3 of 8; checkpoint: out/checkpoints/step_000003. "
        "Run the same command again to continue from it.")
