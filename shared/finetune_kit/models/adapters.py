"""Which weights a run trains: every one, or LoRA adapters (peft) over a frozen base kept in 16-bit or quantized to
4 bits as it loads (bitsandbytes): the recipes' ``--peft none|lora|qlora`` and its flags
(``training.arguments.Adapters``), decided once before launch.

:func:`decide` turns the flags into a :class:`Tuning` and refuses a bad value in one line; :func:`check_model`
holds it against the model's config (a folder saved in 4-bit trains with its own settings, which must be these;
every named target is a linear layer of the model). The recipe reads the decision everywhere after: the base's
quantization (:meth:`Tuning.quantization`), the adapters (:func:`wrap`), the memory plan (:meth:`Tuning.plan`),
the run's method, what a resumed checkpoint must share (:meth:`Tuning.record`) and what the run saves.

Three failures of exactly this stack are on the public trackers; the 8B recipe's adapter launches are their tests
(tests/recipes/test_llama3_8b_zero3.py, "adapters"):

- non-reentrant activation checkpointing over ZeRO-3's frozen partitions raised ``CheckpointError`` in the
  backward: the recompute's forward hooks released a frozen weight the checkpoint still referenced
  (transformers#47254, trl#2514; DeepSpeed keeps frozen weights gathered through a recompute since 0.19.3);
- an adapter saved under ZeRO-3 held zero-size tensors, each rank's ``p.data`` being an empty placeholder
  (trl#4416): ``training.final_model.save_adapter`` gathers them first and refuses an empty one;
- peft's fp32 adapters (``autocast_adapter_dtype``) over a bf16 base broke ZeRO-3's coalesced all-gather of
  persistent parameters at the first optimizer step (DeepSpeed#8072): the adapters stay fp32, as peft makes them,
  and the launch steps with both dtypes in its buckets.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

from finetune_kit.errors import ConfigError
from finetune_kit.models.shapes import Adapter

PEFT = ("none", "lora", "qlora")


@dataclass(frozen=True)
class Tuning:
    """The run's method, as decided: every weight (``peft`` none), or LoRA over the 16-bit or 4-bit frozen base."""

    peft: str = "none"
    rank: int = 16
    alpha: float = 32
    dropout: float = 0.05
    targets: str | tuple[str, ...] = "all-linear"
    dora: bool = False
    quant_type: str = "nf4"
    double_quant: bool = True
    dtype: str = "bfloat16"  # the model's dtype: what the matmuls run in, after dequantising a 4-bit weight
    quant_storage: str = "bfloat16"

    @property
    def method(self) -> str:
        """``full``, ``lora`` or ``qlora``: the run record's method and the FLOP count's (frozen weights 4N)."""
        return "full" if self.peft == "none" else self.peft

    @property
    def adapted(self) -> bool:
        return self.peft != "none"

    @property
    def quantized(self) -> bool:
        return self.peft == "qlora"

    def quantization(self, model_config=None):
        """The ``BitsAndBytesConfig`` the base is quantized with as it loads; None unless ``qlora``, and None for a
        ``model_config`` saved in 4-bit (it loads with its own settings, which :func:`check_model` proved these)."""
        from finetune_kit.models.qlora import prequantized

        if not self.quantized or (model_config is not None and prequantized(model_config) is not None):
            return None
        import torch
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.double_quant,  # the quantization constants quantized too: ~0.4 bit less
            bnb_4bit_compute_dtype=getattr(torch, self.dtype),  # the matmuls run in it after dequantising
            bnb_4bit_quant_storage=getattr(torch, self.quant_storage))  # ZeRO-3 shards it with the 16-bit weights

    def lora_config(self, task_type: str, modules_to_save: list[str] | None = None):
        """peft's ``LoraConfig`` of these adapters (``task_type`` CAUSAL_LM or SEQ_CLS; ``modules_to_save``: modules
        trained in full beside them, such as a new classification head)."""
        from peft import LoraConfig

        targets = self.targets if self.targets == "all-linear" else list(self.targets)
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, bias="none",
                          target_modules=targets, use_dora=self.dora, task_type=task_type,
                          modules_to_save=modules_to_save)

    def plan(self) -> Adapter | None:
        """The memory planner's description of the adapters; None for a full fine-tune."""
        if not self.adapted:
            return None
        targets = self.targets if self.targets == "all-linear" else tuple(t.rsplit(".", 1)[-1] for t in self.targets)
        return Adapter(rank=self.rank, targets=targets, quantized=self.quantized, double_quant=self.double_quant,
                       dora=self.dora)

    def describe(self) -> str:
        """One line: ``lora r 16, alpha 32, dropout 0.05, targets all-linear`` (qlora: and its 4-bit code); what a
        resumed checkpoint must have been saved with."""
        if not self.adapted:
            return "every weight"
        targets = self.targets if isinstance(self.targets, str) else ",".join(self.targets)
        four_bit = f", {self.quant_type}{' double-quantized' if self.double_quant else ''} stored as " \
                   f"{self.quant_storage}" if self.quantized else ""
        return (f"{self.peft} r {self.rank}, alpha {self.alpha:g}, dropout {self.dropout:g}, targets {targets}"
                f"{', DoRA' if self.dora else ''}{four_bit}")

    def record(self) -> dict:
        """What run_info.json keeps (and the model card shows)."""
        if not self.adapted:
            return {"peft": "none"}
        kept = asdict(self) if self.quantized else {k: v for k, v in asdict(self).items() if not k.startswith("quant")
                                                    and k != "double_quant"}
        return {**kept, "targets": self.targets if isinstance(self.targets, str) else ",".join(self.targets)}


FULL = Tuning()  # every weight trains


def parse_targets(text: str) -> str | tuple[str, ...]:
    """``--lora-targets``: "all-linear", or comma-separated module names (spaces ignored)."""
    if text.strip() == "all-linear":
        return "all-linear"
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise ConfigError(f"--lora-targets {text!r} names no module; pass all-linear or e.g. q_proj,v_proj.")
    return names


def decide(args, *, recipe: str, dtype: str = "bfloat16", allowed: tuple[str, ...] = PEFT) -> Tuning:
    """The :class:`Tuning` of ``args``' adapter flags (``dtype``: the model's), or one ConfigError naming the
    value, the rule and the fix."""
    if args.peft not in allowed:
        raise ConfigError(f"--peft {args.peft}: {recipe} takes --peft {' or '.join(allowed)} (it trains adapters "
                          f"over a frozen base). Pass --peft {allowed[-1]}.")
    tuning = Tuning(peft=args.peft, rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                    targets=parse_targets(args.lora_targets), dora=args.dora, quant_type=args.quant_type,
                    double_quant=args.double_quant, dtype=dtype, quant_storage=args.quant_storage)
    if getattr(args, "merge", False) and not tuning.adapted:
        raise ConfigError("--merge folds an adapter into its base, and --peft none trains every weight: model/ is the "
                          "whole model already. Drop --merge, or pass --peft lora or qlora.")
    if getattr(args, "merge", False) and not args.save_model:
        raise ConfigError("--merge with --no-save-model: nothing is saved to merge. Drop one of them.")
    if not tuning.adapted:
        return tuning
    if tuning.rank < 1:
        raise ConfigError(f"--lora-rank {tuning.rank}: the adapter rank must be a positive integer (8 to 64 is "
                          "usual). Pass e.g. --lora-rank 16.")
    if not tuning.alpha > 0:
        raise ConfigError(f"--lora-alpha {tuning.alpha}: the adapter's scale alpha / r must be positive (alpha is "
                          "usually r or 2r). Pass e.g. --lora-alpha 32.")
    if not 0 <= tuning.dropout < 1:
        raise ConfigError(f"--lora-dropout {tuning.dropout}: a dropout probability is in [0, 1). Pass e.g. "
                          "--lora-dropout 0.05 (0: none).")
    if tuning.quantized and tuning.dora:
        raise ConfigError("--dora with --peft qlora: peft's DoRA over bitsandbytes' 4-bit layers fails under "
                          "DeepSpeed ZeRO-3, whose partitioning does not reach the 4-bit weight DoRA's weight norm "
                          "reads ('Params4bit' object has no attribute 'ds_status'). Pass --peft lora --dora, or drop "
                          "--dora.")
    if tuning.quantized and tuning.quant_storage != dtype:
        raise ConfigError(f"--quant-storage {tuning.quant_storage} differs from the model's dtype {dtype}. Under "
                          "DeepSpeed ZeRO-3 the 4-bit weights must be stored in the model's dtype so they are "
                          f"partitioned with the other parameters. Pass --quant-storage {dtype}.")
    return tuning


def linear_layers(model_config, *, causal: bool = True) -> list[str]:
    """The dotted names of the model's linear layers (built on the meta device from its config: no weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = copy.deepcopy(model_config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a 4-bit folder's modules have the same names in 16-bit
    with torch.device("meta"):
        net = (AutoModelForCausalLM if causal else AutoModelForSequenceClassification).from_config(config)
    return [name for name, module in net.named_modules() if isinstance(module, torch.nn.Linear)]


def check_model(tuning: Tuning, model_config, *, model: str, causal: bool = True) -> None:
    """``tuning`` against ``--model``'s config: a folder saved in 4-bit trains with its own quantization, which must
    be the flags' (and is refused unless the run is QLoRA); every named target must be a linear layer of it."""
    from finetune_kit.models import qlora

    if qlora.prequantized(model_config) is not None and not tuning.quantized:
        raise ConfigError(f"--model {model} is saved in 4-bit, which --peft {tuning.peft} cannot train over (it "
                          "trains 16-bit weights). Pass --peft qlora to train adapters over it, or the 16-bit folder.")
    if tuning.quantized:
        qlora.check_prequantized(model_config, tuning.quantization(), model=model)
    if tuning.adapted and tuning.targets != "all-linear":
        linears = linear_layers(model_config, causal=causal)
        leaves = sorted({name.rsplit(".", 1)[-1] for name in linears})
        missing = [t for t in tuning.targets if not any(n == t or n.endswith(f".{t}") for n in linears)]
        if missing:
            raise ConfigError(f"--lora-targets names {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'}"
                              f" not a linear layer of --model {model}; its linear layers are {', '.join(leaves)}. "
                              "Fix the names (e.g. q_proj,k_proj,v_proj,o_proj), or pass all-linear.")


def wrap(model, tuning: Tuning, *, task_type: str = "CAUSAL_LM", modules_to_save: list[str] | None = None):
    """``model`` with the base frozen and ``tuning``'s adapters added (peft); the model as it is for a full
    fine-tune. Activation checkpointing, if on, is enabled before: the frozen embeddings' output is then made to
    require gradients, so the checkpointed blocks have something to send them back to."""
    if not tuning.adapted:
        return model
    from finetune_kit.models import qlora

    if getattr(model, "is_activation_checkpointing", False):
        model.enable_input_require_grads()
    return qlora.add_lora(model, tuning.lora_config(task_type, modules_to_save), gradient_checkpointing=False)
