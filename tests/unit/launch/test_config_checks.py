import json
from pathlib import Path

import pytest
import yaml

from finetune_kit.errors import ConfigError
from finetune_kit.launch import config_checks as checks
from finetune_kit.launch import env
from tests.harness import REPO

RECIPE_CONFIGS = sorted((REPO / "recipes").glob("*/configs/*.json"))
# The DeepSpeed launches; the FSDP2 one (configs/fsdp2.yaml) is checked in test_fsdp.py.
ACCELERATE_YAMLS = sorted(p for p in (REPO / "recipes").glob("*/configs/*.yaml")
                          if "distributed_type: FSDP" not in p.read_text())  # the DeepSpeed launches


def test_auto_values_always_pass():
    cfg = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    checks.check_batch_sizes(cfg, micro_batch_size=3, grad_accum=5, world=7)


def test_consistent_fixed_values_pass():
    cfg = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    checks.check_batch_sizes(cfg, micro_batch_size=4, grad_accum=2, world=8)


@pytest.mark.parametrize("cfg, pattern", [
    ({"train_micro_batch_size_per_gpu": 8}, r"train_micro_batch_size_per_gpu = 8 .*--micro-batch-size 4"),
    ({"gradient_accumulation_steps": 4}, r"gradient_accumulation_steps = 4 .*--grad-accum 2"),
    ({"train_batch_size": 32}, r"train_batch_size = 32.*4 x accumulation 2 x 8 processes = 64"),
])
def test_contradictions_name_both_values(cfg, pattern):
    with pytest.raises(ConfigError, match=pattern):
        checks.check_batch_sizes(cfg, micro_batch_size=4, grad_accum=2, world=8)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        checks.load_deepspeed_config(tmp_path / "x.json")


def test_launched_config_comes_from_accelerate_env(monkeypatch):
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    assert env.launched_deepspeed_config() is None
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "configs/zero3.json")
    assert env.launched_deepspeed_config() == Path("configs/zero3.json")


def fill_auto(cfg: dict, hidden: int = 4096) -> dict:
    """What accelerate writes over the "auto" values at prepare() time."""
    text = json.dumps(cfg)
    filled = json.loads(text)
    filled.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4, train_batch_size=16)
    zo = filled["zero_optimization"]
    for key, value in {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                       "stage3_param_persistence_threshold": 10 * hidden}.items():
        if zo.get(key) == "auto":
            zo[key] = value
    filled["optimizer"]["params"].update(lr=2e-5, weight_decay=0.0)
    return filled


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_shipped_deepspeed_configs_parse_in_deepspeed(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = json.loads(path.read_text())
    parsed = DeepSpeedConfig(fill_auto(raw))
    assert parsed.bfloat16_config.enabled != parsed.float16_config.enabled  # one 16-bit type (fp16: *-fp16.json)
    assert parsed.float16_config.enabled == path.stem.endswith("-fp16")
    assert parsed.zero_config.stage == int(raw["zero_optimization"]["stage"])
    if parsed.zero_config.stage == 3:
        assert parsed.zero_config.gather_16bit_weights_on_model_save
    assert parsed.gradient_clipping == 1.0
    offload = raw["zero_optimization"].get("offload_optimizer", {}).get("device", "none")
    assert (parsed.zero_config.offload_optimizer is not None and
            parsed.zero_config.offload_optimizer.device == "cpu") == (offload == "cpu")


@pytest.mark.parametrize("path", ACCELERATE_YAMLS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_accelerate_yamls_point_at_shipped_json(path):
    cfg = yaml.safe_load(path.read_text())
    assert cfg["distributed_type"] == "DEEPSPEED"
    ds = cfg["deepspeed_config"]
    assert (path.parent.parent / ds["deepspeed_config_file"]).is_file()  # relative to the recipe folder
    assert ds["zero3_init_flag"] is True
    # accelerate refuses these next to deepspeed_config_file; the JSON owns them
    assert "mixed_precision" not in cfg and "gradient_accumulation_steps" not in ds


def trainer_args(**overrides) -> dict:
    """The parsed TrainingArguments flags check_trainer_agreement reads."""
    values = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0,
                  bf16=True, fp16=False, learning_rate=2e-5, adam_epsilon=1e-8, weight_decay=0.0)
    return {**values, **overrides}


def test_trainer_agreement_passes_auto_and_equal_values():
    cfg = {"gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1.0,
           "bf16": {"enabled": True}, "optimizer": {"params": {"lr": "auto"}}}
    checks.check_trainer_agreement(cfg, trainer_args(), world=8)


@pytest.mark.parametrize("cfg, pattern", [
    ({"gradient_accumulation_steps": 4},
     r"gradient_accumulation_steps = 4 but the script was given --gradient_accumulation_steps 2.*"
     r"or pass --gradient_accumulation_steps 4"),
    ({"train_micro_batch_size_per_gpu": 1}, r"= 1 but the script was given --per_device_train_batch_size 4"),
    ({"train_batch_size": 32}, r"train_batch_size = 32.*4 x accumulation 2 x 8 processes = 64"),
    ({"gradient_clipping": 0.5}, r"gradient_clipping = 0.5 but the Trainer was given --max_grad_norm 1.0"),
    ({"bf16": {"enabled": False}}, r"bf16.enabled = False but the Trainer was given --bf16 True.*--bf16 False"),
])
def test_trainer_contradictions_name_the_flag(cfg, pattern):
    with pytest.raises(ConfigError, match=pattern):
        checks.check_trainer_agreement(cfg, trainer_args(), world=8, source="zero2.json")


def test_what_transformers_noted_is_raised_early():
    from types import SimpleNamespace

    noted = ["- ds optimizer.params.betas=[0.9, 0.95] vs hf adam_beta1+adam_beta2=[0.9, 0.999]"]
    args = SimpleNamespace(hf_deepspeed_config=SimpleNamespace(mismatches=noted))
    with pytest.raises(ConfigError, match=r"contradicts the command line:\n- ds optimizer.params.betas"):
        checks.check_trainer_mismatches(args)
    checks.check_trainer_mismatches(SimpleNamespace(hf_deepspeed_config=SimpleNamespace(mismatches=[])))


def test_precision_follows_the_json():
    assert checks.precision_flags({"bf16": {"enabled": True}}) == {"bf16": True, "fp16": False}
    assert checks.precision_flags({"fp16": {"enabled": True}, "bf16": {"enabled": False}}) == {
        "bf16": False, "fp16": True}
    assert checks.precision_flags({"bf16": {"enabled": "auto"}}) == {"bf16": False, "fp16": False}


def test_every_recipe_json_is_checked():
    names = {f"{p.parent.parent.name}/{p.name}" for p in RECIPE_CONFIGS}
    assert {"llama2-13b-zero2/zero2.json", "llama2-13b-zero2/zero2-fp16.json",
            "llama2-13b-zero2/zero2-offload.json"} <= names


def test_deepspeed_json_that_is_not_json_names_line_and_column(tmp_path):
    path = tmp_path / "zero3.json"
    path.write_text('{\n  "zero_optimization": {"stage": 3},\n}\n')  # trailing comma
    with pytest.raises(ConfigError, match=r"is not valid JSON: .* at line 3, column 1\. .*trailing comma"):
        checks.load_deepspeed_config(path)


@pytest.mark.parametrize("cfg, pattern", [
    ({"gradient_clippping": 1.0}, r"unknown top-level key 'gradient_clippping' \(did you mean 'gradient_clipping'\?\)"
                                  r"\. DeepSpeed would ignore it silently"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": "auto"}},
     r"unknown key 'zero_optimization\.stage3_prefetch_bucket_sise' \(did you mean "
     r"'zero_optimization\.stage3_prefetch_bucket_size'\?\)"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memry": True}}},
     r"'zero_optimization\.offload_optimizer\.pin_memry' \(did you mean "
     r"'zero_optimization\.offload_optimizer\.pin_memory'"),
    ({"bf16": {"enabeld": True}}, r"unknown key 'bf16\.enabeld' \(did you mean 'bf16\.enabled'\?\)"),
])
def test_a_deepspeed_key_deepspeed_does_not_know_is_refused(tmp_path, cfg, pattern):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=pattern):
        checks.load_deepspeed_config(path)


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_shipped_configs_use_only_known_keys(path):
    checks.load_deepspeed_config(path)


def test_every_known_top_level_key_is_in_deepspeeds_source():
    import importlib.util

    from finetune_kit.launch.deepspeed_keys import TOP_LEVEL

    root = Path(importlib.util.find_spec("deepspeed").origin).parent
    source = "\n".join(f.read_text(errors="replace") for f in root.rglob("*.py"))
    missing = [key for key in sorted(TOP_LEVEL) if f'"{key}"' not in source and f"'{key}'" not in source]
    assert not missing, f"not read by the installed DeepSpeed: {missing}"
