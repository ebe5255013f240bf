"""The multi-node config-pair check on the shipped 70B QLoRA configs and on broken pairs."""

from __future__ import annotations

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.launch.multinode import check_pair, load_launch_config
from tests.harness import REPO

CONFIGS = REPO / "recipes/llama3-70b-qlora/configs"


@pytest.fixture
def pair():
    return load_launch_config(CONFIGS / "zero3-main.yaml"), load_launch_config(CONFIGS / "zero3-worker.yaml")


def test_shipped_pair_forms_one_job(pair):
    assert check_pair(*pair, node_rank=1).startswith("ok: 2 machines x 4 processes")


@pytest.mark.parametrize("side, key, value, pattern", [
    (1, "machine_rank", 0, "worker must have a machine_rank from 1 to 1"),
    (0, "machine_rank", 1, "num_machines|main node must be machine_rank 0"),
    (1, "num_machines", 3, "num_machines differs between the nodes: main has 2, worker has 3"),
    (1, "num_processes", 4, "num_processes differs"),
    (1, "main_process_port", 29501, "main_process_port differs"),
])
def test_disagreements_are_named(pair, side, key, value, pattern):
    configs = [dict(pair[0]), dict(pair[1])]
    configs[side][key] = value
    with pytest.raises(ConfigError, match=pattern):
        check_pair(*configs)


def test_pdsh_launcher_is_refused(pair):
    main, worker = (dict(c, deepspeed_config=dict(c["deepspeed_config"])) for c in pair)
    for c in (main, worker):
        del c["deepspeed_config"]["deepspeed_multinode_launcher"]
    with pytest.raises(ConfigError, match="set it to 'standard'"):
        check_pair(main, worker)


def test_node_rank_must_match_a_config(pair):
    with pytest.raises(ConfigError, match="NODE_RANK=2"):
        check_pair(*pair, node_rank=2)
