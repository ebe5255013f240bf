"""What a launcher told this process (torchrun variables), and the Accelerator built from it."""

import os

import pytest
import torch

from finetune_kit.launch import accelerator as distributed
from finetune_kit.launch import env

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "TORCHELASTIC_RESTART_COUNT",
               "ACCELERATE_USE_DEEPSPEED", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")

# Rank 5 of a torchrun job of 2 nodes x 4 processes: the second process of the second node.
TWO_NODES = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
             "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29611"}


@pytest.fixture
def no_launcher(monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.fixture
def two_nodes(no_launcher):
    for key, value in TWO_NODES.items():
        no_launcher.setenv(key, value)
    return no_launcher


def test_without_a_launcher_rank_0_of_1(no_launcher):
    assert env.view().as_dict() == {"rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1,
                                    "machine_rank": 0, "num_machines": 1, "host": os.uname().nodename}
    assert not env.launched()
    assert (env.world_size(), env.num_nodes(), env.is_main_rank(), env.restart_count()) == (1, 1, True, 0)
    assert env.rendezvous() is None
    assert env.launched_deepspeed_config() is None


def test_torchrun_two_nodes_of_four(two_nodes):
    v = env.view()
    assert (v.rank, v.world_size, v.local_rank, v.local_world_size, v.machine_rank, v.num_machines) == (
        5, 8, 1, 4, 1, 2)
    assert env.launched() and env.world_size() == 8 and env.num_nodes() == 2
    assert not env.is_main_rank()
    assert env.rendezvous() == ("10.1.2.3", 29611)


def test_a_world_of_one_is_still_launched(no_launcher):
    no_launcher.setenv("WORLD_SIZE", "1")
    assert env.launched() and env.world_size() == 1


def test_without_local_world_size_every_process_is_on_one_node(no_launcher):
    no_launcher.setenv("WORLD_SIZE", "4")
    assert env.view().local_world_size == 4
    assert env.num_nodes() == 1


def test_restarts_counted_by_the_elastic_agent(no_launcher):
    no_launcher.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert env.restart_count() == 2


def test_deepspeed_config_passed_by_accelerate(no_launcher, tmp_path):
    no_launcher.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "zero3.json"))
    assert env.launched_deepspeed_config() == tmp_path / "zero3.json"
    no_launcher.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")  # accelerate's spelling of "no file"
    assert env.launched_deepspeed_config() is None
    no_launcher.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")
    assert env.launched_deepspeed_config() is None


def test_deepspeed_launcher_two_nodes_of_four(no_launcher):
    for key, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "4", "CROSS_RANK": "1",
                       "CROSS_SIZE": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29611"}.items():
        no_launcher.setenv(key, value)
    v = env.view()
    assert (v.local_world_size, v.machine_rank, v.num_machines) == (4, 1, 2)
    assert env.num_nodes() == 2


# ---- the Accelerator ----

@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_make_accelerator_without_a_launcher_is_one_cpu_process(no_launcher, fresh_accelerate_state):
    from accelerate.utils import DistributedType

    acc = distributed.make_accelerator(gradient_accumulation_steps=2)
    assert (acc.num_processes, acc.process_index, acc.is_main_process) == (1, 0, True)
    assert acc.distributed_type == DistributedType.NO
    assert acc.device == torch.device("cpu")
    assert acc.gradient_accumulation_steps == 2
    assert not torch.distributed.is_initialized()  # no process group: nothing to join


def test_several_cpu_processes_get_the_gloo_backend_and_the_timeout(two_nodes, monkeypatch):
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    monkeypatch.setattr(distributed, "RecipeAccelerator", lambda **kwargs: kwargs)  # what it would be built with
    monkeypatch.setattr(distributed, "release_shm_buffer", lambda barrier: None)  # no process group here
    monkeypatch.setattr(distributed, "on_cpu_only", lambda: True)
    mine = object()
    handlers = [mine]
    kwargs = distributed.make_accelerator(kwargs_handlers=handlers, gradient_accumulation_steps=4)
    assert kwargs["gradient_accumulation_steps"] == 4
    assert kwargs["kwargs_handlers"][0] is mine
    assert kwargs["kwargs_handlers"][1] == InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=600))
    assert handlers == [mine]  # the caller's list is left alone

    monkeypatch.setattr(distributed, "on_cpu_only", lambda: False)  # on GPUs: NCCL, as accelerate picks
    monkeypatch.setenv("FINETUNE_COLLECTIVE_TIMEOUT_S", "90")
    assert distributed.make_accelerator(gradient_accumulation_steps=4) == {
        "gradient_accumulation_steps": 4, "kwargs_handlers": [InitProcessGroupKwargs(timeout=timedelta(seconds=90))]}


def test_the_shm_buffer_of_this_rank_is_removed_once_every_rank_is_past_its_init(monkeypatch, tmp_path):
    """DeepSpeed's CPU collectives leave deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> in
    /dev/shm; after a barrier each rank removes its own name (and again at exit, for a late one)."""
    import os

    from finetune_kit.launch import accelerator

    registered, barriers = [], []
    monkeypatch.setattr(accelerator, "SHM_DIR", tmp_path)
    monkeypatch.setattr(accelerator, "on_cpu_only", lambda: True)
    monkeypatch.setattr(accelerator.atexit, "register", lambda fn, **kw: registered.append((fn, kw)))
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(name, value)
    mine = tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29555_1"
    other = tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29555_0"
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    accelerator.release_shm_buffer(lambda: barriers.append(mine.exists()))
    assert barriers == [True]  # the barrier came first, with the buffer still there
    assert not mine.exists() and other.exists()
    mine.write_bytes(b"x")  # a buffer created after that point: the exit handler removes it
    [(unlink, kwargs)] = registered
    unlink(**kwargs)
    assert not mine.exists() and other.exists()
    monkeypatch.delenv("WORLD_SIZE")  # no launcher: nothing to remove, no barrier
    accelerator.release_shm_buffer(lambda: barriers.append("called"))
    assert len(registered) == 1 and barriers == [True]

