"""A DeepSpeed config that offloads to NVMe is checked before anything loads."""

from __future__ import annotations

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.launch import deepspeed_config as dsc
from finetune_kit.launch import nvme


def nvme_config(path) -> dict:
    return dsc.build(dsc.setup_from(stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path=str(path)))


def test_a_config_without_nvme_needs_nothing():
    assert nvme.nvme_paths(dsc.build(dsc.setup_from(stage=3, offload_optimizer="cpu"))) == {}
    nvme.check(dsc.build(dsc.setup_from(stage=3, offload_optimizer="cpu")), "zero3.json")


def test_an_nvme_folder_that_does_not_exist_is_named_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"zero_optimization.offload_optimizer.nvme_path '.*/no-disk' is not a "
                                          r"folder. Create it on a fast local NVMe disk \(mkdir -p"):
        nvme.check(nvme_config(tmp_path / "no-disk"), "zero3-nvme.json")


def test_an_nvme_section_without_a_path_is_refused():
    config = nvme_config("/x")
    del config["zero_optimization"]["offload_optimizer"]["nvme_path"]
    with pytest.raises(ConfigError, match=r"offload_optimizer offloads to nvme but .*nvme_path is not set"):
        nvme.check(config, "zero3-nvme.json")


def test_without_libaio_the_async_io_op_is_named_with_the_package_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "async_io_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs DeepSpeed's async_io op.*apt-get install libaio-dev"):
        nvme.check(nvme_config(tmp_path), "zero3-nvme.json")


def test_a_usable_nvme_folder_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "async_io_available", lambda: True)
    nvme.check(nvme_config(tmp_path), "zero3-nvme.json")
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind
