"""LoRA over a frozen base, 4-bit (QLoRA) or 16-bit, under DeepSpeed ZeRO-3: build, check, report, save, merge.

The frozen base is bitsandbytes 4-bit (``models.adapters.Tuning.quantization``: nf4 with double quantisation and
bf16 compute by default; a folder saved in 4-bit must have been saved with the run's settings, each compared:
:func:`check_prequantized`); LoRA adapters (PEFT) train, and a classifier's head ``score`` with them. Two rules
ZeRO-3 imposes:

- ``bnb_4bit_quant_storage`` must equal the model dtype. ZeRO-3 flattens and partitions
  every parameter of one dtype together; 4-bit weights stored as uint8 next to bf16
  ones cannot be partitioned (and, gathered back, come out as garbage).
- no ``device_map``: ZeRO-3 decides where each shard lives; transformers refuses both.

Under ZeRO-3 every rank holds only a slice of each parameter and ``p.data`` is an empty
placeholder, so a plain ``save_pretrained`` writes zero-size adapter tensors:
:func:`trainable_state_dict` gathers the trainable parameters first
(``training.final_model.save_adapter`` writes them).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from finetune_kit.errors import ConfigError
from finetune_kit.models.shapes import Adapter
from finetune_kit.outputs import written_whole

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HEAD = "score"  # the classification head of Llama's AutoModelForSequenceClassification
ATTENTION = "sdpa"  # PyTorch's scaled_dot_product_attention (flash / memory-efficient kernels on GPUs)


def parse_dtype(name: str, flag: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"{flag} {name!r} is not a supported dtype; choose one of {sorted(DTYPES)}.")
    return DTYPES[name]


def check_zero3_settings(*, dtype: str, device_map: str | None) -> None:
    """Raise ConfigError for settings ZeRO-3 cannot partition (see the module docstring; the 4-bit storage dtype is
    checked with the other adapter flags, ``models.adapters.decide``)."""
    parse_dtype(dtype, "--dtype")
    if device_map:
        raise ConfigError(
            f"--device-map {device_map!r} cannot be used under DeepSpeed ZeRO-3: ZeRO-3 places every "
            "parameter shard itself (each rank on its own GPU). Drop --device-map; use it only for "
            "single-process inference, e.g. when evaluating a saved adapter."
        )


def as_saved(adapter: Adapter, model_config) -> Adapter:
    """``adapter`` as the memory planner sees it with this folder: one saved in 4-bit keeps its quantization
    constants as its config says (double quantized or not), whatever the recipe would quantize with."""
    settings = prequantized(model_config)
    if settings is None or not adapter.quantized:
        return adapter
    return replace(adapter, double_quant=bool(settings.get("bnb_4bit_use_double_quant", False)))


def check_pad_token_fits(tokenizer, model_config, model: str) -> None:
    """A 4-bit base cannot grow its embeddings, so the pad token must already be in the vocabulary."""
    if len(tokenizer) > model_config.vocab_size:
        raise ConfigError(f"tokenizer of '{model}' has no pad token to reuse; a 4-bit base cannot grow "
                          "its embeddings. Use a Llama 3.1+ tokenizer (it has <|finetune_right_pad_id|>).")


def prequantized(model_config) -> dict | None:
    """The quantization settings of a folder saved already quantized (config.json's ``quantization_config``, e.g. a
    ``*-bnb-4bit`` download), or None for a 16-bit folder."""
    settings = getattr(model_config, "quantization_config", None)
    if settings is None:
        return None
    return settings if isinstance(settings, dict) else settings.to_dict()


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_prequantized(model_config, wanted, *, model: str) -> dict | None:
    """A folder saved in 4-bit trains with its own settings, so each must be what the recipe asks (``wanted``, its
    ``BitsAndBytesConfig``): bitsandbytes 4-bit with the same quant type, double quantization, compute and storage
    dtypes; one ConfigError naming each that differs, the folder's value and the recipe's. None for a 16-bit folder
    (the recipe quantizes it with ``wanted`` as it loads); the folder's settings otherwise."""
    settings = prequantized(model_config)
    if settings is None:
        return None
    method = settings.get("quant_method", "an unknown method")
    if method != "bitsandbytes" or not settings.get("load_in_4bit"):
        bits = "8-bit" if settings.get("load_in_8bit") else settings.get("bits", "its own format")
        raise ConfigError(f"--model {model} is saved quantized by {method} ({bits}); this recipe trains on a "
                          "bitsandbytes 4-bit nf4 base. Pass the 16-bit folder (the recipe quantizes it as it loads) "
                          "or one saved in bitsandbytes 4-bit nf4.")
    fields = (  # (key, the folder's value with bitsandbytes' default, the recipe's, what it decides)
        ("bnb_4bit_quant_type", settings.get("bnb_4bit_quant_type", "fp4"), wanted.bnb_4bit_quant_type,
         "the 4-bit code the weights are stored in"),
        ("bnb_4bit_use_double_quant", bool(settings.get("bnb_4bit_use_double_quant", False)),
         bool(wanted.bnb_4bit_use_double_quant), "whether the quantization constants are quantized too"),
        ("bnb_4bit_compute_dtype", _name(settings.get("bnb_4bit_compute_dtype", "float32")),
         _name(wanted.bnb_4bit_compute_dtype), "the dtype the matmuls run in: --dtype"),
        ("bnb_4bit_quant_storage", _name(settings.get("bnb_4bit_quant_storage", "uint8")),
         _name(wanted.bnb_4bit_quant_storage), "the dtype the 4-bit weights are stored as: under ZeRO-3 --dtype, "
         "so they are sharded with the other parameters"),
    )
    differ = [(key, saved, asked, what) for key, saved, asked, what in fields if saved != asked]
    if differ:
        which = "; ".join(f"{key} {saved} where the recipe asks {asked} ({what})" for key, saved, asked, what in differ)
        fix = ", ".join(f"{key}={asked}" for key, _, asked, _ in differ)
        raise ConfigError(f"--model {model} is saved in bitsandbytes 4-bit with settings this recipe does not train "
                          f"with: {which}. Pass the 16-bit folder (the recipe quantizes it as it loads), or save the "
                          f"4-bit folder with {fix}.")
    return settings


def bnb_config(dtype: torch.dtype, quant_storage: torch.dtype):
    """The 70B recipe's 4-bit settings (its train.py writes them out), for the tools and tests that build its base."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",  # normal-float 4-bit: fits normally distributed weights
        bnb_4bit_use_double_quant=True,  # quantise the quantisation constants too: ~0.4 bit/param saved
        bnb_4bit_compute_dtype=dtype,  # matmuls run in this dtype after dequantising
        bnb_4bit_quant_storage=quant_storage,  # container dtype of the packed 4-bit weights
    )


def load_quantized_classifier(model: str, quantization, *, pad_token_id: int, num_labels: int = 2,
                              dtype: torch.dtype | str = torch.bfloat16, device_map=None):
    """``AutoModelForSequenceClassification`` with a 4-bit base (frozen) and a new ``score`` head.

    ``quantization``: the ``BitsAndBytesConfig`` a 16-bit folder is quantized with as it loads; None for a folder
    saved in 4-bit (:func:`prequantized`), which loads with its own settings (:func:`check_prequantized` proved them
    the recipe's). Under ZeRO-3 (an Accelerator with ``zero3_init_flag`` exists) each rank loads only its shard.
    ``pad_token_id`` goes into the config: the classifier reads the last non-pad token of each row and refuses
    batches of several rows without it. ``dtype``: the model's (``--dtype``, or its name).
    """
    from transformers import AutoModelForSequenceClassification

    dtype = parse_dtype(dtype, "--dtype") if isinstance(dtype, str) else dtype
    kwargs = {"device_map": device_map} if device_map else {}
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    net = AutoModelForSequenceClassification.from_pretrained(
        model, num_labels=num_labels, dtype=dtype, attn_implementation=ATTENTION, **kwargs)
    net.config.pad_token_id = pad_token_id
    return net


def add_lora(model, config, *, gradient_checkpointing: bool = True, recompute_every: int = 1):
    """Freeze the base and wrap it with the adapters of ``config`` (a peft ``LoraConfig``); a
    ConfigError when a named target matches no layer. With ``gradient_checkpointing``, every
    ``recompute_every``-th decoder layer is checkpointed. On a CPU-only machine the 4-bit layers are
    kept out of bitsandbytes' CPU repacking (:func:`keep_cpu_weights_unpacked`)."""
    from peft import get_peft_model

    if gradient_checkpointing:
        # non-reentrant: works with frozen inputs and ZeRO-3's parameter hooks
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=recompute_every)
        model.enable_input_require_grads()  # frozen embeddings: let gradients reach the checkpointed blocks
        model.config.use_cache = False
    targets = config.target_modules
    model = get_peft_model(model, config)
    if targets != "all-linear":  # PEFT skips a name that matches nothing, if another one matches
        adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
        missing = sorted(name for name in targets if name not in adapted)
        if missing:
            raise ConfigError(f"--lora-targets names {missing}, which match no layer of the model; its adapted "
                              f"layers would be {sorted(adapted)}. Fix the names (e.g. q_proj,k_proj,v_proj,o_proj).")
    keep_cpu_weights_unpacked(model)
    return model


def keep_cpu_weights_unpacked(model) -> int:
    """Stop bitsandbytes from repacking 4-bit weights in place for CPU inference.

    bitsandbytes 0.50 rewrites ``weight.data`` of a ``Linear4bit`` into a CPU-specific
    layout the first time it runs in eval mode without gradients on an AVX512-BF16 CPU.
    Under ZeRO-3 that data is a gathered, partitioned parameter (the rewrite breaks the
    partitioning), and the layout asserts that out_features is a multiple of 32 (not so
    for tiny test models). No effect on GPUs. Returns the number of layers changed.
    """
    if torch.cuda.is_available():
        return 0
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def _numel(param) -> int:
    return param.ds_numel if hasattr(param, "ds_numel") else param.numel()


def parameter_classes(model) -> dict:
    """Parameter counts (elements, full sizes even under ZeRO-3) by class.

    ``linear4bit_modules``: bitsandbytes ``Linear4bit`` layers; ``quantized_frozen``: their
    weights (4-bit values, not the storage elements that pack them); ``lora_trainable``,
    ``head_trainable``: what the optimizer updates;
    ``other_frozen`` (embeddings, norms) and ``other_trainable`` (should be 0).
    """
    import bitsandbytes as bnb

    out = {"linear4bit_modules": 0, "quantized_frozen": 0, "lora_trainable": 0, "head_trainable": 0,
           "other_frozen": 0, "other_trainable": 0, "trainable_names_sample": []}
    quantized = set()
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            out["linear4bit_modules"] += 1
            quantized.update(id(p) for p in module.parameters(recurse=False))
    for name, param in model.named_parameters():
        n = _numel(param)
        if id(param) in quantized:
            key = "quantized_frozen" if not param.requires_grad else "other_trainable"
            n *= param.element_size() * 2  # each storage element packs two 4-bit values per byte
        elif param.requires_grad:
            key = "lora_trainable" if "lora_" in name else "head_trainable" if f"{HEAD}." in name else "other_trainable"
            if len(out["trainable_names_sample"]) < 4:
                out["trainable_names_sample"].append(name)
        else:
            key = "other_frozen"
        out[key] += n
    return out


def trainable_state_dict(model, also: tuple = ()) -> dict[str, torch.Tensor]:
    """Full copies (on CPU) of the trainable parameters, and of the parameters in ``also`` (such as a resized
    vocabulary's embeddings); all ranks must call.

    Under ZeRO-3 each is gathered from its shards first: without this the adapter would
    be saved with zero-size tensors. Only these are gathered, never the rest of the base.
    """
    extra = {id(p) for p in also}
    params = {name: p for name, p in model.named_parameters() if p.requires_grad or id(p) in extra}
    partitioned = [p for p in params.values() if hasattr(p, "ds_id")]
    if partitioned:
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
            return {name: p.detach().cpu().clone() for name, p in params.items()}
    return {name: p.detach().cpu().clone() for name, p in params.items()}


# transformers keeps how a model was loaded as ``model._weight_conversions`` (core_model_loading.py), a list of
# WeightConverter whose ``operations`` hold, for a 4-bit folder, bitsandbytes' Bnb4bitDeserialize: written for
# transformers 5.17 (the GPU host's) to 5.23 (the pinned stack's); tests/unit/models/test_qlora.py fails when the
# attribute or the class moves.
WEIGHT_CONVERSIONS = "_weight_conversions"
WRITTEN_FOR_TRANSFORMERS = ("5.17", "5.23")


def forget_4bit_loading(net):
    """A dequantized model that saves as a plain one. transformers 5 keeps the loading's 4-bit deserializer among
    the model's weight conversions after ``dequantize()``, and ``save_pretrained`` then tries to reverse it
    (NotImplementedError); the weights are plain now, so it goes."""
    from transformers.integrations.bitsandbytes import Bnb4bitDeserialize, Bnb4bitQuantize

    conversions = getattr(net, WEIGHT_CONVERSIONS, None) or []
    setattr(net, WEIGHT_CONVERSIONS, [c for c in conversions if not any(
        isinstance(op, (Bnb4bitDeserialize, Bnb4bitQuantize)) for op in getattr(c, "operations", ()))])
    return net


def merge_adapter(base: str, adapter: str | Path, out: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                  labels: dict[int, str] | None = None) -> Path:
    """Fold the adapter into an unquantised ``dtype`` copy of the base and save it.

    Merging into 4-bit weights would round the update away, so the base is loaded in
    ``dtype`` (70B in bf16: ~140 GB of host RAM); a base saved in 4-bit (:func:`prequantized`) is loaded as
    it is and dequantized to ``dtype``, the weights the adapter trained against. Run it in a single process,
    outside ZeRO-3 (the process's DeepSpeed config is unset first). The adapter's task (adapter_config.json) picks
    the model: a causal LM's result loads with plain ``AutoModelForCausalLM`` and keeps the adapter folder's chat
    template and generation config (its vocabulary resized to the tokenizer's, if the run added a pad token); a
    classifier's with plain ``AutoModelForSequenceClassification``, ``labels`` (class id -> name) in its config, so a
    pipeline or a server names its predictions.
    """
    import json
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # a plain load, not a partitioned one

    adapter = Path(adapter)
    causal = json.loads((adapter / "adapter_config.json").read_text()).get("task_type") == "CAUSAL_LM"
    tokenizer = AutoTokenizer.from_pretrained(str(adapter))
    if causal:
        net = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    else:
        net = AutoModelForSequenceClassification.from_pretrained(base, num_labels=2, dtype=dtype)
    if prequantized(net.config):
        net = forget_4bit_loading(net.dequantize(dtype=dtype))  # plain Linear layers in dtype
    if causal and len(tokenizer) > net.get_input_embeddings().num_embeddings:
        net.resize_token_embeddings(len(tokenizer))  # the adapter holds the resized rows the run trained with
    net.config.pad_token_id = tokenizer.pad_token_id
    if labels and not causal:
        net.config.id2label, net.config.label2id = dict(labels), {name: i for i, name in labels.items()}
    merged = PeftModel.from_pretrained(net, str(adapter)).merge_and_unload()
    with written_whole(Path(out)) as folder:
        merged.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        if (adapter / "generation_config.json").is_file():  # stops at the chat template's end of turn
            shutil.copy2(adapter / "generation_config.json", Path(folder) / "generation_config.json")
    return Path(out)
