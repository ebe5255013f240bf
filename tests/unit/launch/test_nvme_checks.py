"""A DeepSpeed config that offloads to NVMe is checked before anything loads."""

from __future__ import annotations

import json

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.launch import nvme
from finetune_tools import deepspeed_configs as dsc


def nvme_config(path) -> dict:
    return dsc.build(dsc.setup_from(stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path=str(path)))


def test_a_config_without_nvme_needs_nothing():
    assert nvme.nvme_paths(dsc.build(dsc.setup_from(stage=3, offload_optimizer="cpu"))) == {}
    nvme.check_paths(dsc.build(dsc.setup_from(stage=3, offload_optimizer="cpu")), "zero3.json")


def test_an_nvme_folder_that_does_not_exist_is_named_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"zero_optimization.offload_optimizer.nvme_path '.*/no-disk' is not a "
                                          r"folder. Create it on a fast local NVMe disk \(mkdir -p"):
        nvme.check_paths(nvme_config(tmp_path / "no-disk"), "zero3-nvme.json")


def test_an_nvme_section_without_a_path_is_refused():
    config = nvme_config("/x")
    del config["zero_optimization"]["offload_optimizer"]["nvme_path"]
    with pytest.raises(ConfigError, match=r"offload_optimizer offloads to nvme but .*nvme_path is not set"):
        nvme.check_paths(config, "zero3-nvme.json")


def test_without_libaio_the_async_io_op_is_named_with_the_package_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "async_io_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs DeepSpeed's async_io op.*apt-get install libaio-dev"):
        nvme.check_paths(nvme_config(tmp_path), "zero3-nvme.json")


def test_a_usable_nvme_folder_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "async_io_available", lambda: True)
    nvme.check_paths(nvme_config(tmp_path), "zero3-nvme.json")
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind


# ---- the NVMe parameter buffers against the model's largest parameter ----
SMALL = {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
         "num_attention_heads": 4}  # largest parameter: the embedding, 32,000 x 256 = 8,192,000 elements


def llama(**fields):
    from transformers import LlamaConfig

    return LlamaConfig(**fields)


def with_param_buffers(count, size) -> dict:
    config = nvme_config("/local_nvme")
    config["zero_optimization"]["offload_param"] |= {"buffer_count": count, "buffer_size": size}
    return config


def test_a_buffer_smaller_than_the_largest_partition_is_refused_with_the_size_to_set():
    with pytest.raises(ConfigError) as err:
        nvme.check_param_buffers(with_param_buffers(5, 4e6), llama(**SMALL), 1, "zero3-nvme.json")
    message = str(err.value)
    for fragment in ("zero3-nvme.json: zero_optimization.offload_param.buffer_size is 4,000,000 elements",
                     "the embedding (32,000 x 256 = 8,192,000 elements)",
                     "a partition of 8,192,000 elements per rank across 1 rank (ceil(numel / ranks))",
                     "'More elements ... than buffer size'",
                     "Set zero_optimization.offload_param.buffer_size to at least 8,200,000 in zero3-nvme.json",
                     "5 x 8,200,000 x 2 bytes = 0.1 GiB", "or launch on more GPUs"):
        assert fragment in message, message


@pytest.mark.parametrize(("ranks", "size", "fits"), [
    (2, 4_096_000, True), (2, 4_095_999, False),  # 8,192,000 / 2
    (3, 2_730_667, True), (3, 2_730_666, False),  # ceil(8,192,000 / 3): DeepSpeed pads to a multiple of the ranks
])
def test_the_rule_is_a_ranks_partition_rounded_up_against_buffer_size(ranks, size, fits):
    config, model = with_param_buffers(5, size), llama(**SMALL)
    if fits:
        nvme.check_param_buffers(config, model, ranks, "zero3-nvme.json")
    else:
        with pytest.raises(ConfigError, match=rf"a partition of {size + 1:,} elements per rank across {ranks} ranks"):
            nvme.check_param_buffers(config, model, ranks, "zero3-nvme.json")


def test_an_untied_head_as_large_as_the_embedding_is_named_once_and_a_wider_mlp_wins():
    with pytest.raises(ConfigError, match=r"largest parameter, the embedding \(32,000 x 256 "):
        nvme.check_param_buffers(with_param_buffers(5, 1e6), llama(**SMALL, tie_word_embeddings=True), 1, "x.json")
    wide = {**SMALL, "vocab_size": 1000, "intermediate_size": 8192}  # gate_proj 8,192 x 256 > 1,000 x 256
    with pytest.raises(ConfigError, match=r"largest parameter, gate_proj \(8,192 x 256 = 2,097,152 elements\)"):
        nvme.check_param_buffers(with_param_buffers(5, 1e6), llama(**wide), 1, "x.json")


def test_no_buffers_at_all_is_refused():
    with pytest.raises(ConfigError, match=r"buffer_count is 0, .*Set zero_optimization.offload_param.buffer_count "
                                          r"to at least 1 in zero3-nvme.json"):
        nvme.check_param_buffers(with_param_buffers(0, 6e8), llama(**SMALL), 1, "zero3-nvme.json")


def test_partitions_deepspeed_keeps_in_host_memory_need_no_buffer():
    tiny = {**SMALL, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128}  # 64,000 bf16: < 1 MiB
    nvme.check_param_buffers(with_param_buffers(0, 1000), llama(**tiny), 1, "zero3-nvme.json")


@pytest.mark.parametrize("ranks", [1, 8])
def test_the_shipped_nvme_config_holds_llama3_8b(ranks):
    from finetune_kit.models.shapes import KNOWN_MODELS

    shipped = dsc.build(dsc.SHIPPED["recipes/llama3-8b-zero3/configs/zero3-nvme.json"])
    llama3_8b = llama(**{k: v for k, v in KNOWN_MODELS["llama3-8b"].items() if not k.startswith("_")})
    nvme.check_param_buffers(shipped, llama3_8b, ranks, "zero3-nvme.json")  # 525,336,576 / ranks <= 6e8
    squeezed = with_param_buffers(5, 525_336_576 // ranks - 1)
    with pytest.raises(ConfigError, match=rf"a partition of {525_336_576 // ranks:,} elements"):
        nvme.check_param_buffers(squeezed, llama3_8b, ranks, "zero3-nvme.json")


@pytest.mark.parametrize("config", [
    {},
    dsc.build(dsc.setup_from(stage=3, offload_optimizer="nvme", offload_param="none", nvme_path="/local_nvme")),
    dsc.build(dsc.setup_from(stage=3, offload_optimizer="cpu", offload_param="cpu")),
    {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0, "buffer_size": 1}}},
    {"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/x", "buffer_size": 1}}},
])
def test_a_config_that_keeps_parameters_off_nvme_is_untouched(config):
    before = json.dumps(config, sort_keys=True)
    nvme.check_param_buffers(config, llama(**SMALL), 1, "zero3.json")
    assert json.dumps(config, sort_keys=True) == before
