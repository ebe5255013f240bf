"""--peft and its flags (models.adapters): one decision, checked before launch, read by the run."""

from types import SimpleNamespace

import pytest
import torch

from finetune_kit.errors import ConfigError
from finetune_kit.models import adapters, qlora
from finetune_kit.models.shapes import Adapter
from finetune_kit.training.arguments import Adapters

FLAGS = {f: getattr(Adapters, f) for f in Adapters.__dataclass_fields__}  # the family's defaults


def flags(**given) -> SimpleNamespace:
    return SimpleNamespace(**{**FLAGS, "save_model": True, **given})


def test_the_defaults_train_every_weight_and_lora_takes_the_family_settings():
    full = adapters.decide(flags(), recipe="r")
    assert full == adapters.FULL and full.method == "full" and full.plan() is None and full.quantization() is None
    lora = adapters.decide(flags(peft="lora", lora_targets="q_proj, v_proj"), recipe="r")
    dotted = adapters.decide(flags(peft="lora", lora_targets="self_attn.q_proj"), recipe="r")
    assert dotted.plan().targets == ("q_proj",)  # the planner counts a Llama block's layers by their own names
    assert (lora.method, lora.rank, lora.alpha, lora.targets, lora.quantized) == ("lora", 16, 32, ("q_proj", "v_proj"),
                                                                                  False)
    assert lora.plan() == Adapter(rank=16, targets=("q_proj", "v_proj"), quantized=False)
    assert lora.quantization() is None
    assert lora.describe() == "lora r 16, alpha 32, dropout 0.05, targets q_proj,v_proj"
    config = lora.lora_config("CAUSAL_LM")
    assert (config.r, config.lora_alpha, sorted(config.target_modules), config.use_dora) == \
        (16, 32, ["q_proj", "v_proj"], False)


def test_qlora_quantizes_as_its_flags_say():
    q = adapters.decide(flags(peft="qlora", quant_type="fp4", double_quant=False), recipe="r")
    bnb = q.quantization()
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "fp4" and not bnb.bnb_4bit_use_double_quant
    assert bnb.bnb_4bit_compute_dtype is torch.bfloat16 and bnb.bnb_4bit_quant_storage is torch.bfloat16
    assert q.plan() == Adapter(rank=16, targets="all-linear", quantized=True, double_quant=False)
    assert q.describe() == "qlora r 16, alpha 32, dropout 0.05, targets all-linear, fp4 stored as bfloat16"
    dora = adapters.decide(flags(peft="lora", dora=True), recipe="r")
    assert dora.lora_config("CAUSAL_LM").use_dora and dora.plan().dora
    assert dora.describe() == "lora r 16, alpha 32, dropout 0.05, targets all-linear, DoRA"
    assert q.record()["quant_type"] == "fp4" and "quant_type" not in adapters.decide(flags(peft="lora"),
                                                                                       recipe="r").record()
    prequantized = SimpleNamespace(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    assert q.quantization(prequantized) is None  # a 4-bit folder loads with its own settings


@pytest.mark.parametrize(("given", "message"), [
    ({"peft": "none"}, r"--peft none: llama3-70b-qlora takes --peft lora or qlora .* Pass --peft qlora\.$"),
    ({"lora_rank": 0}, r"--lora-rank 0: the adapter rank must be a positive integer .* Pass e\.g\. --lora-rank 16\."),
    ({"lora_alpha": -1.0}, r"--lora-alpha -1\.0: the adapter's scale alpha / r must be positive"),
    ({"lora_dropout": 1.0}, r"--lora-dropout 1\.0: a dropout probability is in \[0, 1\)"),
    ({"lora_targets": " , "}, r"--lora-targets ' , ' names no module; pass all-linear or e\.g\. q_proj,v_proj\."),
    ({"quant_storage": "float32"}, r"--quant-storage float32 differs from the model's dtype bfloat16\. Under DeepSpeed "
                                   r"ZeRO-3 .* Pass --quant-storage bfloat16\.$"),
    ({"peft": "none", "merge": True}, r"--merge folds an adapter into its base, and --peft none trains every weight"),
    ({"dora": True}, r"--dora with --peft qlora: peft's DoRA over bitsandbytes' 4-bit layers fails under DeepSpeed "
                     r"ZeRO-3.* Pass --peft lora --dora, or drop --dora\.$"),
    ({"merge": True, "save_model": False}, r"--merge with --no-save-model: nothing is saved to merge"),
], ids=["none-for-the-70b", "rank", "alpha", "dropout", "no-target", "storage", "merge-full", "dora-qlora",
        "merge-unsaved"])
def test_a_bad_adapter_flag_is_one_line_naming_it_and_the_fix(given, message):
    allowed = ("lora", "qlora") if given.get("peft") == "none" and "merge" not in given else adapters.PEFT
    with pytest.raises(ConfigError, match=message) as err:
        adapters.decide(flags(**{"peft": "qlora", **given}), recipe="llama3-70b-qlora", allowed=allowed)
    assert "\n" not in str(err.value)


def test_every_named_target_must_be_a_linear_layer_of_the_model(tiny_llama3):
    """Checked on the config alone (the model built on the meta device), before launch: a typo would otherwise be
    skipped by peft as long as another name matches."""
    from finetune_kit.models.loading import load_config

    config = load_config(str(tiny_llama3))
    assert {n.rsplit(".", 1)[-1] for n in adapters.linear_layers(config)} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
    adapters.check_model(adapters.decide(flags(peft="lora", lora_targets="q_proj,v_proj"), recipe="r"), config,
                         model="m")
    adapters.check_model(adapters.decide(flags(peft="lora", lora_targets="self_attn.q_proj"), recipe="r"), config,
                         model="m")  # a dotted suffix, as peft matches it
    bad = adapters.decide(flags(peft="lora", lora_targets="q_proj,qkv_proj"), recipe="r")
    with pytest.raises(ConfigError, match=r"--lora-targets names qkv_proj, which is not a linear layer of --model m; "
                                          r"its linear layers are down_proj, gate_proj, k_proj, lm_head, o_proj, "
                                          r"q_proj, up_proj, v_proj\. Fix the names"):
        adapters.check_model(bad, config, model="m")
    classifier = adapters.linear_layers(config, causal=False)
    assert any(n.endswith(qlora.HEAD) for n in classifier) and not any(n.endswith("lm_head") for n in classifier)


def test_a_4bit_folder_trains_only_as_qlora_and_only_with_its_own_settings(tiny_llama3_4bit):
    from finetune_kit.models.loading import load_config

    config = load_config(str(tiny_llama3_4bit))
    with pytest.raises(ConfigError, match=r"is saved in 4-bit, which --peft lora cannot train over .* Pass --peft "
                                          r"qlora to train adapters over it, or the 16-bit folder\."):
        adapters.check_model(adapters.decide(flags(peft="lora"), recipe="r"), config, model="m")
    with pytest.raises(ConfigError, match=r"--peft none cannot train over"):
        adapters.check_model(adapters.FULL, config, model="m")
    adapters.check_model(adapters.decide(flags(peft="qlora"), recipe="r"), config, model="m")
    with pytest.raises(ConfigError, match=r"bnb_4bit_use_double_quant True where the recipe asks False"):
        adapters.check_model(adapters.decide(flags(peft="qlora", double_quant=False), recipe="r"), config, model="m")


def test_wrap_freezes_the_base_and_adds_the_adapters(tiny_llama3):
    """LoRA over the bf16 base: only the adapters train, in fp32 as peft makes them (the mixed-dtype buckets
    DeepSpeed#8072 broke); the full fine-tune's model is returned as it is."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama3), dtype=torch.bfloat16)
    assert adapters.wrap(model, adapters.FULL) is model
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    wrapped = adapters.wrap(model, adapters.decide(flags(peft="lora", lora_rank=4), recipe="r"))
    trainable = {n: p for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for n, p in wrapped.named_parameters() if not p.requires_grad} == {torch.bfloat16}
    in_out = {"q": 64 + 64, "k": 64 + 16, "v": 64 + 16, "o": 64 + 64, "gate": 64 + 224, "up": 64 + 224,
              "down": 224 + 64}
    assert sum(p.numel() for p in trainable.values()) == 2 * 4 * sum(in_out.values())  # 2 layers, r 4: r (in + out)


def test_a_vocabulary_grown_by_a_pad_token_is_saved_with_the_adapter_and_loads_back(tiny_llama3, tmp_path):
    """A tokenizer with no pad token to reuse gets ``<pad>`` and the model one more embedding row (mean-initialised,
    at random): save_adapter writes the resized embeddings and head beside LoRA, so PeftModel over the base resized
    to the tokenizer (the card's recipe) gives the trained model's logits; without them the new row would differ."""
    from accelerate import Accelerator
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune_kit.models.loading import load_causal_lm
    from finetune_kit.training.final_model import save_adapter

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama3))
    vocab = len(tokenizer)
    tokenizer.add_special_tokens({"pad_token": "<pad>"})  # as ensure_pad_token does when the vocabulary has none
    model = load_causal_lm(str(tiny_llama3), tokenizer=tokenizer)
    assert model.get_input_embeddings().num_embeddings == vocab + 1 and not model.config.use_cache
    model = adapters.wrap(model, adapters.decide(flags(peft="lora", lora_rank=4), recipe="r"))
    saved = save_adapter(Accelerator(cpu=True), model, tokenizer, tmp_path / "adapter", base_vocab=vocab)
    names = load_file(saved / "adapter_model.safetensors")
    assert any("embed_tokens" in n for n in names) and any("lm_head" in n for n in names)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama3), dtype=torch.bfloat16)
    base.resize_token_embeddings(len(AutoTokenizer.from_pretrained(saved)))
    loaded = PeftModel.from_pretrained(base, saved)
    ids = torch.tensor([[1, 5, 9, vocab]])  # the new token too
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
