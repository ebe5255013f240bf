"""The DPO recipe's decisions that need no process group: the reference, the DPOConfig values it fixes, and the
name of a precomputed reference's cache."""

from __future__ import annotations

import shutil

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.metering import keys
from finetune_kit.models.adapters import FULL, Tuning
from finetune_kit.training import preference_trainer


def test_auto_picks_the_reference_each_method_can_use():
    assert preference_trainer.decide("auto", Tuning(peft="lora"), "auto").reference == "adapters-off"
    assert preference_trainer.decide("auto", FULL, "auto").reference == "precomputed"
    assert preference_trainer.decide("sharded", FULL, "none").reference == "sharded"  # keeps nothing on disk
    with pytest.raises(ConfigError, match="--data_cache none keeps nothing"):
        preference_trainer.decide("auto", FULL, "none")


def test_the_reference_decides_precompute_and_a_contradicting_flag_is_refused():
    dpo = preference_trainer.decide("auto", FULL, "auto")
    fixed = preference_trainer.fixed(dpo, None, max_seq_len=64, fresh=True)
    assert fixed["precompute_ref_log_probs"] is True and fixed["max_length"] == 64 and fixed["eval_on_start"]
    assert preference_trainer.fixed(dpo, True, max_seq_len=64, fresh=False)["eval_on_start"] is False
    with pytest.raises(ConfigError, match="--precompute_ref_log_probs False contradicts --dpo_reference precomputed"):
        preference_trainer.fixed(dpo, False, max_seq_len=64, fresh=True)


def test_the_reference_identity_follows_every_weight_byte_and_the_precision(tmp_path):
    """A copy of the folder has the same identity; one byte changed in a weight file, or another precision, does
    not (the negative control of the cache's key)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (folder / "tokenizer.json").write_text("{}")
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    base = preference_trainer.reference_identity(str(folder), "bf16")
    assert preference_trainer.reference_identity(str(copy), "bf16") == base
    (copy / "tokenizer.json").write_text('{"other": 1}')  # not a weight: the same reference
    assert preference_trainer.reference_identity(str(copy), "bf16") == base
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[600_000] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert preference_trainer.reference_identity(str(copy), "bf16") != base
    assert preference_trainer.reference_identity(str(folder), "fp32") != base


def test_trls_log_names_become_ours():
    logs = {"loss": 0.69, "rewards/chosen": 0.1, "rewards/rejected": -0.1, "rewards/margins": 0.2,
            "rewards/accuracies": 1.0, "logps/chosen": -5.0, "logps/rejected": -7.0, "eval_rewards/margins": 0.3}
    assert keys.preference(logs) == {"reward_chosen": 0.1, "reward_rejected": -0.1, "reward_margin": 0.2,
                                     "preference_accuracy": 1.0, "logps_chosen": -5.0, "logps_rejected": -7.0}
    assert keys.preference(logs, "eval_") == {"reward_margin": 0.3}
    assert preference_trainer.evaluation({"eval_loss": 0.5, "eval_rewards/accuracies": 0.75}) == {
        "eval_loss": 0.5, "eval_preference_accuracy": 0.75}
