"""The typed DeepSpeed config builder: the shipped files are what it builds; contradictions are refused."""

from __future__ import annotations

import json
import shutil

import pytest

from finetune_kit.errors import ConfigError
from finetune_tools import deepspeed_configs as dsc
from tests.harness import REPO


def test_every_shipped_deepspeed_json_is_what_its_setup_builds():
    shipped = {str(p.relative_to(REPO)) for p in REPO.glob("recipes/*/configs/*.json")}
    assert shipped == set(dsc.SHIPPED), "a DeepSpeed JSON file without a setup in deepspeed_config.SHIPPED"
    assert dsc.stale(REPO) == []


def test_a_hand_edit_of_a_shipped_file_is_caught_and_rewritten(tmp_path):
    path = "recipes/llama3-8b-zero3/configs/zero3.json"
    (tmp_path / path).parent.mkdir(parents=True)
    for name in dsc.SHIPPED:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    edited = json.loads((tmp_path / path).read_text())
    edited["zero_optimization"]["stage3_max_live_parameters"] = 3e9
    (tmp_path / path).write_text(json.dumps(edited))
    assert dsc.stale(tmp_path) == [path]
    assert dsc.write(tmp_path) == [path] and dsc.stale(tmp_path) == []


def test_the_offload_config_puts_adams_state_in_cpu_memory_and_keeps_parameters_on_the_gpu():
    zero = dsc.build(dsc.SHIPPED["recipes/llama3-8b-zero3/configs/zero3-offload.json"])["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"]["device"] == "none"


def test_nvme_offload_names_its_path_sizes_its_buffers_and_sets_async_io():
    config = dsc.build(dsc.setup_from(stage=3, offload_optimizer="nvme", offload_param="nvme",
                                      nvme_path="/local_nvme"))
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                                     "buffer_count": 5, "buffer_size": 6e8}
    assert config["aio"] == {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                             "overlap_events": True}
    assert "aio" not in dsc.build(dsc.setup_from(stage=3, offload_optimizer="cpu"))


def test_fp16_carries_its_loss_scaling_and_turns_bf16_off():
    config = dsc.build(dsc.setup_from(stage=2, precision="fp16", loss_scaling={"initial_scale_power": 12}))
    assert config["fp16"]["enabled"] and config["fp16"]["initial_scale_power"] == 12
    assert config["fp16"]["loss_scale"] == 0 and config["bf16"] == {"enabled": False}


@pytest.mark.parametrize(("choices", "message"), [
    ({"stage": 2, "offload_param": "cpu"}, r"offload_param='cpu' needs ZeRO stage 3 \(stage is 2\).*Use stage=3"),
    ({"stage": 0, "offload_optimizer": "cpu"}, r"offload_optimizer='cpu' needs ZeRO stage 1-3"),
    ({"stage": 3, "offload_optimizer": "nvme"}, r"offload to 'nvme' needs nvme_path"),
    ({"stage": 3, "extra": {"fp16": {"enabled": True}}}, r"extra turns fp16 on while precision='bf16'"),
    ({"stage": 4}, r"stage: Input should be 0, 1, 2 or 3"),
    ({"stage": 3, "offload": "cpu"}, r"offload: Extra inputs are not permitted"),
])
def test_contradictions_are_refused_with_the_rule_and_the_fix(choices, message):
    with pytest.raises(ConfigError, match=message):
        dsc.setup_from(**choices)


def test_a_key_deepspeed_does_not_know_is_refused():
    setup = dsc.setup_from(stage=3, extra={"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 5e8}})
    with pytest.raises(ConfigError, match=r"stage3_prefetch_bucket_sise.*stage3_prefetch_bucket_size"):
        dsc.build(setup)
