"""``finetune_kit.launch.command``: what each launcher would give a recipe's first rank, read by the
launchers' own code from the README's command lines."""

from __future__ import annotations

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.launch import command
from tests.harness import REPO


@pytest.fixture()
def in_8b(monkeypatch):
    monkeypatch.chdir(REPO / "recipes/llama3-8b-zero3")


def test_accelerate_with_a_deepspeed_yaml(in_8b):
    launch = command.parse(["accelerate", "launch", "--config_file", "configs/zero3.yaml", "--num_processes", "2",
                            "train.py", "--data", "d.jsonl"])
    assert (launch.launcher, launch.script, launch.script_args) == ("accelerate launch", "train.py",
                                                                     ("--data", "d.jsonl"))
    assert launch.env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "configs/zero3.json"
    assert (launch.env["RANK"], launch.env["LOCAL_RANK"], launch.world_size, launch.nodes) == ("0", "0", 2, 1)
    assert launch.describe() == ("train.py, 2 processes on 1 node "
                                 "(accelerate launch, DeepSpeed config configs/zero3.json)")


def test_accelerate_with_the_fsdp2_yaml(in_8b):
    launch = command.parse(["/venv/bin/accelerate", "launch", "--config_file", "configs/fsdp2.yaml", "train.py"])
    assert launch.env["ACCELERATE_USE_FSDP"] == "true" and launch.env["FSDP_VERSION"] == "2"
    assert "ACCELERATE_DEEPSPEED_CONFIG_FILE" not in launch.env
    assert launch.world_size == 8  # the YAML's num_processes when the command gives none


def test_the_70b_worker_node_is_the_second_node(monkeypatch):
    monkeypatch.chdir(REPO / "recipes/llama3-70b-qlora")
    launch = command.parse(["accelerate", "launch", "--config_file", "configs/zero3-worker.yaml",
                            "--main_process_ip", "10.0.0.1", "--main_process_port", "29500", "train.py"])
    assert (launch.world_size, launch.nodes, launch.env["RANK"], launch.env["GROUP_RANK"]) == (8, 2, "4", "1")
    assert launch.env["MASTER_ADDR"] == "10.0.0.1"


def test_torchrun_on_the_second_of_two_nodes():
    launch = command.parse(["torchrun", "--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1",
                            "--master_addr", "h", "train.py", "--deepspeed", "configs/zero2.json"])
    assert (launch.world_size, launch.nodes, launch.env["RANK"], launch.env["LOCAL_RANK"]) == (4, 2, "2", "0")
    assert launch.script_args == ("--deepspeed", "configs/zero2.json")


def test_deepspeed_launcher():
    launch = command.parse(["deepspeed", "--num_gpus", "2", "--master_port", "29501", "train.py", "--x"])
    assert (launch.launcher, launch.world_size, launch.env["MASTER_PORT"], launch.script_args) == (
        "deepspeed", 2, "29501", ("--x",))


def test_the_environment_is_the_first_ranks_only_inside_the_block(in_8b, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    launch = command.parse(["accelerate", "launch", "--config_file", "configs/zero3.yaml", "--num_processes", "2",
                            "train.py"])
    import os

    with launch.environment():
        assert os.environ["WORLD_SIZE"] == "2"
    assert "WORLD_SIZE" not in os.environ


@pytest.mark.parametrize("cmd, says", [
    (["python", "train.py"], r"'python train\.py' is not a launch command this check knows: .*'accelerate launch'"),
    ([], r"'\(nothing\)' is not a launch command"),
    (["torchrun", "--nnodes", "1:2", "train.py"], r"torchrun would refuse this command: --nnodes 1:2 is elastic"),
    (["accelerate", "launch", "--config_file", "nope.yaml", "train.py"],
     r"accelerate launch would refuse this command: The passed configuration file `nope\.yaml` does not exist"),
])
def test_a_command_no_launcher_would_start_is_named(in_8b, cmd, says):
    with pytest.raises(ConfigError, match=says):
        command.parse(cmd)
