"""QLoRA building blocks: the ZeRO-3 rules, an nf4 classifier with LoRA on the tiny Llama 3 (CPU), merge."""

from types import SimpleNamespace

import pytest
import torch

from finetune_kit.errors import ConfigError
from finetune_kit.models import qlora
from tests.harness import REPO, load_script

RECIPE_4BIT = qlora.bnb_config(torch.bfloat16, torch.bfloat16)  # what the 70B recipe quantizes with (checked below)

RANK, ALPHA = 4, 8
# The tiny Llama 3 (models.tiny): hidden 64, ffn 224, 8 heads / 2 KV heads of 8, 2 layers, vocab 512.
LINEARS = {"q_proj": (64, 64), "k_proj": (64, 16), "v_proj": (64, 16), "o_proj": (64, 64),
           "gate_proj": (64, 224), "up_proj": (64, 224), "down_proj": (224, 64)}  # (in, out)
LAYERS, HIDDEN, VOCAB = 2, 64, 512


def lora(rank: int, alpha: int, targets="all-linear"):
    """The recipe's LoraConfig (llama3-70b-qlora/train.py) at these sizes."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="SEQ_CLS",
                      modules_to_save=[qlora.HEAD], bias="none")


# ---- the rules, no weights ----

def test_parse_dtype_names_the_flag_and_the_choices():
    assert qlora.parse_dtype("bfloat16", "--dtype") is torch.bfloat16
    assert qlora.parse_dtype("float16", "--dtype") is torch.float16
    with pytest.raises(ConfigError, match=r"--quant-storage 'bf16' is not a supported dtype.*'bfloat16'"):
        qlora.parse_dtype("bf16", "--quant-storage")


def test_zero3_refuses_a_device_map():
    qlora.check_zero3_settings(dtype="float16", device_map="")
    with pytest.raises(ConfigError, match=r"--device-map 'auto' cannot be used under DeepSpeed ZeRO-3"):
        qlora.check_zero3_settings(dtype="bfloat16", device_map="auto")


def test_zero3_settings_check_the_dtype_name():
    with pytest.raises(ConfigError, match=r"--dtype 'fp32' is not a supported dtype"):
        qlora.check_zero3_settings(dtype="fp32", device_map=None)


SAVED_4BIT = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
              "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16",
              "bnb_4bit_quant_storage": "bfloat16"}  # what finetune_tools.tiny_models.save_4bit writes


def saved(**settings) -> SimpleNamespace:
    return SimpleNamespace(quantization_config={**SAVED_4BIT, **settings})


def test_a_4bit_folder_of_the_recipes_settings_is_taken_with_them():
    assert qlora.check_prequantized(saved(), RECIPE_4BIT, model="m") == SAVED_4BIT
    assert qlora.check_prequantized(SimpleNamespace(), RECIPE_4BIT, model="m") is None  # a 16-bit folder


def test_the_recipe_asks_for_the_settings_the_tools_build_it_with():
    """The 70B's defaults, decided (models.adapters), quantize as qlora.bnb_config (the tiny 4-bit folder, these
    tests) does."""
    from finetune_kit.models import adapters

    recipe = load_script(REPO / "recipes/llama3-70b-qlora/train.py")
    args = recipe.parse_args(["--data", "x.csv"])
    asked = adapters.decide(args, recipe=recipe.RECIPE, dtype=args.dtype, allowed=("lora", "qlora")).quantization()
    assert asked.to_dict() == RECIPE_4BIT.to_dict()


@pytest.mark.parametrize(("settings", "message"), [
    ({"bnb_4bit_quant_storage": "uint8"}, r"bnb_4bit_quant_storage uint8 where the recipe asks bfloat16 \(the dtype "
                                          r"the 4-bit weights are stored as: under ZeRO-3 --dtype"),
    ({"bnb_4bit_quant_type": "fp4"}, r"bnb_4bit_quant_type fp4 where the recipe asks nf4"),
    ({"bnb_4bit_compute_dtype": "float16"}, r"bnb_4bit_compute_dtype float16 where the recipe asks bfloat16 \(the "
                                            r"dtype the matmuls run in: --dtype\)"),
    ({"bnb_4bit_use_double_quant": False}, r"bnb_4bit_use_double_quant False where the recipe asks True"),
    ({"bnb_4bit_compute_dtype": "float16", "bnb_4bit_use_double_quant": False},
     r"bnb_4bit_use_double_quant False where .*; bnb_4bit_compute_dtype float16 where .* save the 4-bit folder with "
     r"bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16\.$"),
    ({"load_in_4bit": False, "load_in_8bit": True}, r"saved quantized by bitsandbytes \(8-bit\)"),
    ({"quant_method": "gptq", "bits": 4}, r"saved quantized by gptq \(4\)"),
], ids=["uint8-storage", "fp4", "fp16-compute", "no-double-quant", "two-fields", "8-bit", "gptq"])
def test_a_4bit_folder_that_contradicts_the_recipe_is_refused_naming_both(settings, message):
    with pytest.raises(ConfigError, match=message) as err:
        qlora.check_prequantized(saved(**settings), RECIPE_4BIT, model="m")
    assert "\n" not in str(err.value)


def test_a_saved_4bit_folder_round_trips_and_merges_to_plain_bf16(tiny_llama3, tiny_llama3_4bit, tmp_path):
    """The tiny Llama 3 saved in 4-bit on this CPU: its config carries the recipe's settings, it loads with them (no
    quantization_config passed), and dequantized it saves as a plain bf16 model."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(tiny_llama3_4bit)
    assert qlora.check_prequantized(config, RECIPE_4BIT, model=str(tiny_llama3_4bit))["bnb_4bit_quant_type"] == "nf4"
    net = qlora.load_quantized_classifier(str(tiny_llama3_4bit), None, pad_token_id=0)
    fresh = qlora.load_quantized_classifier(str(tiny_llama3), RECIPE_4BIT, pad_token_id=0)  # quantized as it loads
    for (name, a), (_, b) in zip(net.named_parameters(), fresh.named_parameters(), strict=True):
        if "score" not in name:  # nf4 of the same weights, whichever way (packed bytes compared: some read as NaN)
            assert torch.equal(a.data.view(torch.int16), b.data.view(torch.int16)), name
    plain = qlora.forget_4bit_loading(net.dequantize(dtype=torch.bfloat16))
    plain.save_pretrained(tmp_path / "plain")
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path / "plain")
    assert getattr(back.config, "quantization_config", None) is None
    assert torch.equal(back.model.layers[0].mlp.down_proj.weight, plain.model.layers[0].mlp.down_proj.weight)


def test_the_4bit_loading_forget_4bit_loading_removes_is_where_it_was_written_for(tiny_llama3_4bit, tmp_path):
    """transformers keeps the 4-bit deserializer as model._weight_conversions; a transformers that moves it (or
    renames the class), or one outside the versions the workaround was checked on, fails here first. The negative
    control: without the workaround, saving the dequantized model raises."""
    import transformers
    from transformers.integrations.bitsandbytes import Bnb4bitDeserialize

    lowest, highest = (tuple(map(int, v.split("."))) for v in qlora.WRITTEN_FOR_TRANSFORMERS)
    assert lowest <= tuple(map(int, transformers.__version__.split(".")[:2])) <= highest, transformers.__version__
    net = qlora.load_quantized_classifier(str(tiny_llama3_4bit), None, pad_token_id=0)
    conversions = getattr(net, qlora.WEIGHT_CONVERSIONS)
    assert any(isinstance(op, Bnb4bitDeserialize) for c in conversions for op in c.operations)
    dequantized = net.dequantize(dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError):
        dequantized.save_pretrained(tmp_path / "without")
    qlora.forget_4bit_loading(dequantized).save_pretrained(tmp_path / "with")
    assert (tmp_path / "with/config.json").is_file()


def test_the_planner_takes_a_4bit_folders_own_double_quantization():
    """The checks plan a folder saved in 4-bit with the constants it stores (qlora.as_saved, in for_accelerate):
    without double quantization they take 0.047 more bytes a weight (0.37 bit), which the plan then counts."""
    from finetune_kit.models import adapters
    from finetune_kit.planning.model_states import nf4_bytes_per_param

    planned = adapters.Tuning(peft="qlora").plan()
    assert planned.double_quant
    assert not qlora.as_saved(planned, saved(bnb_4bit_use_double_quant=False)).double_quant
    assert qlora.as_saved(planned, saved()) == planned  # the recipe's own settings
    assert qlora.as_saved(planned, SimpleNamespace()) == planned  # a 16-bit folder: quantized as the recipe asks
    assert nf4_bytes_per_param(False) - nf4_bytes_per_param(True) == pytest.approx(0.0466, abs=1e-4)


def test_bnb_config_is_double_quantised_nf4():
    config = qlora.bnb_config(torch.float16, torch.uint8)
    assert config.load_in_4bit and not config.load_in_8bit
    assert config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype is torch.float16
    assert config.bnb_4bit_quant_storage is torch.uint8


def test_pad_token_must_already_be_in_the_vocabulary(tiny_llama3):
    from finetune_kit.models.loading import load_config, load_tokenizer

    tokenizer, config = load_tokenizer(str(tiny_llama3)), load_config(str(tiny_llama3))
    qlora.check_pad_token_fits(tokenizer, config, "tiny")  # Llama 3 reuses <|finetune_right_pad_id|>
    tokenizer.add_special_tokens({"pad_token": "<pad>"})  # what a tokenizer without a spare token needs
    with pytest.raises(ConfigError, match=r"tokenizer of 'tiny' has no pad token to reuse"):
        qlora.check_pad_token_fits(tokenizer, config, "tiny")


# ---- an nf4 classifier with LoRA on the tiny Llama 3, one optimizer step ----

@pytest.fixture(scope="module")
def qlora_run(tiny_llama3, tmp_path_factory):
    """Load, wrap, take one AdamW step on one batch, save the adapter with PEFT; keep what each stage held."""
    from finetune_kit.models.loading import load_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tokenizer(str(tiny_llama3))
    model = qlora.load_quantized_classifier(str(tiny_llama3), RECIPE_4BIT, pad_token_id=tokenizer.pad_token_id)
    model = qlora.add_lora(model, lora(RANK, ALPHA))
    initial = qlora.trainable_state_dict(model)
    batch = tokenizer(["the quick brown fox jumps over the dog", "hello"], padding=True, return_tensors="pt")
    batch["labels"] = torch.tensor([0, 1])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    loss_before = model(**batch).loss
    loss_before.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        loss_after = model(**batch).loss.item()
    adapter = tmp_path_factory.mktemp("qlora") / "adapter"
    model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    return SimpleNamespace(model=model, tokenizer=tokenizer, batch=batch, initial=initial,
                           trained=qlora.trainable_state_dict(model), loss_before=loss_before.item(),
                           loss_after=loss_after, adapter=adapter, base=tiny_llama3)


def test_base_is_nf4_in_bf16_storage_with_the_pad_token_set(qlora_run):
    import bitsandbytes as bnb

    net = qlora_run.model.base_model.model
    q_proj = net.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(q_proj, bnb.nn.Linear4bit)
    assert q_proj.weight.dtype is torch.bfloat16  # quant_storage: partitions with the bf16 parameters
    assert q_proj.weight.quant_state.shape == torch.Size([64, 64])
    assert q_proj.weight.numel() == 64 * 64 // 4  # two 4-bit values per byte, two bytes per element
    assert q_proj.weight.quant_state.quant_type == "nf4"
    assert net.config.pad_token_id == qlora_run.tokenizer.pad_token_id
    assert net.config.use_cache is False and net.is_gradient_checkpointing


def test_parameter_classes_of_the_tiny_llama3(qlora_run):
    classes = qlora.parameter_classes(qlora_run.model)
    lora = LAYERS * sum((i + o) * RANK for i, o in LINEARS.values())
    assert classes["linear4bit_modules"] == LAYERS * len(LINEARS) == 14
    assert classes["lora_trainable"] == lora == 10240
    assert classes["head_trainable"] == 2 * HIDDEN
    # embeddings, 2 norms per layer and the final norm, and PEFT's frozen copy of the original head
    assert classes["other_frozen"] == VOCAB * HIDDEN + (2 * LAYERS + 1) * HIDDEN + 2 * HIDDEN
    assert classes["other_trainable"] == 0
    assert classes["trainable_names_sample"][0].endswith("layers.0.self_attn.q_proj.lora_A.default.weight")
    assert len(classes["trainable_names_sample"]) == 4


def test_quantized_frozen_counts_the_4bit_weights(qlora_run):
    weights = LAYERS * sum(i * o for i, o in LINEARS.values())
    assert qlora.parameter_classes(qlora_run.model)["quantized_frozen"] == weights


def test_trainable_state_dict_is_lora_and_head_as_cpu_copies(qlora_run):
    state = qlora_run.trained
    assert len(state) == 2 * LAYERS * len(LINEARS) + 1
    head = state["base_model.model.score.modules_to_save.default.weight"]
    assert head.shape == (2, HIDDEN) and head.device.type == "cpu"
    a = state["base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight"]
    assert a.shape == (RANK, 224)
    live = dict(qlora_run.model.named_parameters())
    assert all(torch.equal(t, live[name]) for name, t in state.items())
    assert head.data_ptr() != live["base_model.model.score.modules_to_save.default.weight"].data_ptr()  # a copy


def test_one_step_trains_lora_and_head(qlora_run):
    b_name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight"
    head = "base_model.model.score.modules_to_save.default.weight"
    assert not qlora_run.initial[b_name].any()  # LoRA starts as the identity: B = 0
    assert qlora_run.trained[b_name].abs().max() > 0
    assert not torch.equal(qlora_run.trained[head], qlora_run.initial[head])
    assert qlora_run.loss_after < qlora_run.loss_before


def test_keep_cpu_weights_unpacked_stops_the_eval_repacking(qlora_run):
    import bitsandbytes as bnb

    model = qlora_run.model
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = True  # as on a CPU with AVX512-BF16
    shapes = [layer.weight.shape for layer in layers]
    assert qlora.keep_cpu_weights_unpacked(model) == 14
    model.eval()
    try:
        with torch.no_grad():  # repacking would assert: k_proj's 16 outputs are not a multiple of 32
            logits = model(**{k: v for k, v in qlora_run.batch.items() if k != "labels"}).logits
    finally:
        model.train()
    assert logits.shape == (2, 2)
    assert [layer.weight.shape for layer in layers] == shapes
    assert not any(getattr(layer.weight.quant_state, "packing_format_for_cpu", False) for layer in layers)


def test_merge_folds_the_adapter_into_a_plain_bf16_classifier(qlora_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out = qlora.merge_adapter(qlora_run.base, qlora_run.adapter, tmp_path / "merged")
    merged = AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.bfloat16)
    assert merged.config.pad_token_id == qlora_run.tokenizer.pad_token_id
    assert (out / "tokenizer.json").is_file()
    assert torch.equal(merged.score.weight, qlora_run.trained["base_model.model.score.modules_to_save.default.weight"])
    # the LoRA update is folded in: W + (alpha / r) B A, rounded once to bf16
    base = AutoModelForCausalLM.from_pretrained(str(qlora_run.base), dtype=torch.bfloat16)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = (qlora_run.trained[f"{prefix}.lora_{x}.default.weight"].float() for x in "AB")
    w = base.model.layers[0].self_attn.q_proj.weight.float()
    update = ALPHA / RANK * b @ a
    assert update.abs().max() > 1e-3  # large against bf16's spacing near the weights (~1e-4)
    got = merged.model.layers[0].self_attn.q_proj.weight.float()
    torch.testing.assert_close(got, w + update, atol=2e-4, rtol=0)


def test_lora_target_matching_no_layer_is_refused(tiny_llama3):
    """PEFT adapts q_proj and silently skips a misspelt name next to it; the recipe stops instead."""
    base = qlora.load_quantized_classifier(str(tiny_llama3), RECIPE_4BIT, pad_token_id=0)
    with pytest.raises(ConfigError, match=r"--lora-targets names \['vproj'\], which match no layer"):
        qlora.add_lora(base, lora(4, 8, ["q_proj", "vproj"]), gradient_checkpointing=False)
