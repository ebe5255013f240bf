"""Decoder-only transformer shapes and their parameter counts, from a config alone (no weights).

One shape class for everything that needs sizes without weights: the memory planner, the
model-FLOP formula, run records and the published-figure table. Known architectures are kept
as the shape fields of their real ``config.json`` because nothing can be downloaded on the
machines that need them; any Hugging Face config (object, dict, file or folder) converts with
:func:`resolve_model`. Importing this module needs neither torch nor transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from finetune_kit.errors import ConfigError

# ---- known architectures: shape fields of the published config.json files ----
_LLAMA1 = {"vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False}
_LLAMA2 = {"vocab_size": 32000, "max_position_embeddings": 4096, "rope_theta": 10000.0,
           "tie_word_embeddings": False}
_LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False}
_LLAMA3_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
               "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
               "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False}


def _heads(hidden: int, ffn: int, layers: int, heads: int, kv: int | None = None) -> dict:
    return {"hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv or heads}


KNOWN_MODELS: dict[str, dict] = {
    # Meta LLaMA (2023): the sizes of the DeepSpeed guide's throughput table
    "llama-7b": {"_name_or_path": "huggyllama/llama-7b", **_LLAMA1, **_heads(4096, 11008, 32, 32)},
    "llama-13b": {"_name_or_path": "huggyllama/llama-13b", **_LLAMA1, **_heads(5120, 13824, 40, 40)},
    "llama-30b": {"_name_or_path": "huggyllama/llama-30b", **_LLAMA1, **_heads(6656, 17920, 60, 52)},
    "llama-65b": {"_name_or_path": "huggyllama/llama-65b", **_LLAMA1, **_heads(8192, 22016, 80, 64)},
    "llama2-7b": {"_name_or_path": "meta-llama/Llama-2-7b-hf", **_LLAMA2, **_heads(4096, 11008, 32, 32)},
    "llama2-13b": {"_name_or_path": "meta-llama/Llama-2-13b-hf", **_LLAMA2, **_heads(5120, 13824, 40, 40)},
    "llama2-70b": {"_name_or_path": "meta-llama/Llama-2-70b-hf", **_LLAMA2, **_heads(8192, 28672, 80, 64, 8)},
    "llama3-8b": {"_name_or_path": "meta-llama/Meta-Llama-3-8B", **_LLAMA3_8B},
    # Llama 3.1: 128K positions by the "llama3" rope scaling of the 8K-trained frequencies (its config.json)
    "llama3.1-8b": {"_name_or_path": "meta-llama/Llama-3.1-8B", **_LLAMA3_8B, "max_position_embeddings": 131072,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama3-70b": {"_name_or_path": "meta-llama/Meta-Llama-3-70B", **_LLAMA3_70B},
    # Llama 3.2 3B (torchtune's speed-lever table): the head tied to the embedding
    "llama3.2-3b": {"_name_or_path": "meta-llama/Llama-3.2-3B", **_LLAMA3_8B, **_heads(3072, 8192, 28, 24, 8),
                    "max_position_embeddings": 131072, "tie_word_embeddings": True},
    "llama3.3-70b": {"_name_or_path": "meta-llama/Llama-3.3-70B-Instruct", **_LLAMA3_70B,
                     "max_position_embeddings": 131072},
    # the same shape as 3.3: a shape is named after the first match, so this one comes after it
    "llama3.1-70b": {"_name_or_path": "meta-llama/Llama-3.1-70B", **_LLAMA3_70B, "max_position_embeddings": 131072},
    # Qwen3 4B (Hugging Face's Ulysses sequence-parallelism benchmark): head_dim 128 above hidden/heads, tied head
    "qwen3-4b": {"_name_or_path": "Qwen/Qwen3-4B", **_heads(2560, 9728, 36, 32, 8), "head_dim": 128,
                 "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                 "tie_word_embeddings": True},
    # MosaicML MPT-7B (llm-foundry's benchmark model): GELU MLP x4, tied embeddings, no biases.
    # "mlp" is not an HF config field: it marks the two-matrix MLP for the counts below.
    "mpt-7b": {"_name_or_path": "mosaicml/mpt-7b", **_heads(4096, 16384, 32, 32), "vocab_size": 50432,
               "max_position_embeddings": 2048, "tie_word_embeddings": True, "mlp": "gelu"},
}
_BY_HUB_ID = {cfg["_name_or_path"].lower(): name for name, cfg in KNOWN_MODELS.items()}
_BY_HUB_ID.update({"meta-llama/llama-3.1-8b-instruct": "llama3.1-8b", "meta-llama/meta-llama-3-8b-instruct":
                   "llama3-8b", "meta-llama/meta-llama-3-70b-instruct": "llama3-70b",
                   "meta-llama/llama-2-13b-chat-hf": "llama2-13b"})


@dataclass(frozen=True)
class ModelShape:
    """What memory and FLOPs depend on in a Llama-family config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    name: str = "model"
    mlp: str = "swiglu"  # "swiglu": gate, up, down (Llama); "gelu": up, down (MPT)
    max_position_embeddings: int = 4096

    @classmethod
    def from_config(cls, config, name: str | None = None) -> ModelShape:
        """From a transformers config object or a config.json dict."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if get(k) is None]
        if missing:
            raise ConfigError(f"model config has no {', '.join(missing)}: the memory planner needs a "
                              "Llama-family config.json (hidden_size, intermediate_size, num_hidden_layers, ...).")
        heads = int(get("num_attention_heads"))
        return cls(hidden_size=int(get("hidden_size")), intermediate_size=int(get("intermediate_size")),
                   num_hidden_layers=int(get("num_hidden_layers")), num_attention_heads=heads,
                   num_key_value_heads=int(get("num_key_value_heads") or heads), vocab_size=int(get("vocab_size")),
                   tie_word_embeddings=bool(get("tie_word_embeddings", False)),
                   head_dim=get("head_dim"), mlp=get("mlp", None) or "swiglu",
                   max_position_embeddings=int(get("max_position_embeddings", None) or 4096),
                   name=name or get("_name_or_path") or get("name_or_path") or "model")

    @property
    def dim_per_head(self) -> int:
        return int(self.head_dim or self.hidden_size // self.num_attention_heads)

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.dim_per_head

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.dim_per_head

    def truncated(self, layers: int) -> ModelShape:
        """Same width, fewer decoder layers (so that full optimizer states fit on one GPU)."""
        return replace(self, name=f"{self.name} (truncated to {layers} layers)", num_hidden_layers=layers)

    def identify(self, family: str = "model") -> str:
        """The known name of this shape (e.g. "llama3-8b"; "llama3-8b (truncated to 8 layers)" when
        only the depth is smaller), else a descriptive one."""
        for name, config in KNOWN_MODELS.items():
            known = replace(ModelShape.from_config(config), name=self.name, head_dim=self.head_dim)
            if known == self:
                return name
            if self.num_hidden_layers < known.num_hidden_layers and \
                    replace(known, num_hidden_layers=self.num_hidden_layers) == self:
                return f"{name} (truncated to {self.num_hidden_layers} layers)"
        return f"{family} ({self.num_hidden_layers} layers, hidden {self.hidden_size})"

    # ---- parameter counts (no biases: Llama and MPT have none) ----
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder block, by its transformers module name."""
        h, f = self.hidden_size, self.intermediate_size
        attention = {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                     "o_proj": (self.q_dim, h)}
        if self.mlp == "gelu":
            return {**attention, "up_proj": (h, f), "down_proj": (f, h)}
        return {**attention, "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}

    def block_linear_params(self) -> int:
        return sum(i * o for i, o in self.linear_shapes().values())

    def head_params(self, num_labels: int | None = None) -> int:
        """lm_head (vocab x hidden, 0 when tied) or a classification head (num_labels x hidden)."""
        if num_labels:
            return num_labels * self.hidden_size
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def unquantised_params(self, num_labels: int | None = None) -> int:
        """Embeddings, RMSNorm weights and the head: what bitsandbytes keeps in bf16."""
        norms = (2 * self.num_hidden_layers + 1) * self.hidden_size
        return self.vocab_size * self.hidden_size + norms + self.head_params(num_labels)

    def total_params(self, num_labels: int | None = None) -> int:
        """Parameters as stored (a tied LM head shares the embedding and counts once)."""
        return self.num_hidden_layers * self.block_linear_params() + self.unquantised_params(num_labels)

    def matmul_params(self, num_labels: int | None = None) -> int:
        """Parameters that multiply every token: all but the input embedding lookup.

        The output head counts even when tied to the embedding, since its matmul runs. This is
        the ``N`` of the 6N FLOPs-per-token rule (see :mod:`finetune_kit.metering.flops`).
        """
        tied_head = self.vocab_size * self.hidden_size if self.tie_word_embeddings and not num_labels else 0
        return self.total_params(num_labels) - self.vocab_size * self.hidden_size + tied_head

    def largest_layer_params(self, num_labels: int | None = None) -> int:
        """Largest parameter count held directly by one module (what DeepSpeed's estimator calls a layer)."""
        biggest_linear = max(i * o for i, o in self.linear_shapes().values())
        return max(self.vocab_size * self.hidden_size, self.head_params(num_labels), biggest_linear)

    def lora_params(self, rank: int, targets: str | tuple[str, ...] = "all-linear") -> int:
        shapes = self.linear_shapes()
        names = list(shapes) if targets == "all-linear" else list(targets)
        unknown = [n for n in names if n not in shapes]
        if unknown:
            raise ConfigError(f"LoRA target(s) {unknown} are not linear layers of a Llama block; "
                              f"use 'all-linear' or names from {sorted(shapes)}.")
        return self.num_hidden_layers * sum(rank * (shapes[n][0] + shapes[n][1]) for n in names)

    def dora_magnitudes(self, targets: str | tuple[str, ...] = "all-linear") -> int:
        """DoRA's trained magnitude vectors: one value per output feature of every adapted layer (their weight norms,
        recomputed in each forward from the weight and the adapter, are transient and not counted)."""
        shapes = self.linear_shapes()
        names = list(shapes) if targets == "all-linear" else list(targets)
        return self.num_hidden_layers * sum(shapes[n][1] for n in names)


def resolve_model(spec) -> ModelShape:
    """A ModelShape from a known name (``llama3-8b``), a hub id we know, a config.json path or
    folder, a config dict, or a transformers config object."""
    if isinstance(spec, ModelShape):
        return spec
    if not isinstance(spec, (str, Path)):
        return ModelShape.from_config(spec)
    text = str(spec)
    key = _BY_HUB_ID.get(text.lower(), text.lower())
    if key in KNOWN_MODELS:
        return ModelShape.from_config(KNOWN_MODELS[key], name=key)
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelShape.from_config(json.loads(path.read_text()), name=str(spec))
    raise ConfigError(f"model '{spec}' is neither a config.json/model folder nor a known architecture. "
                      f"Known: {', '.join(sorted(KNOWN_MODELS))} (or their hub ids).")


def from_config(config) -> ModelShape:
    """The shape of a loaded transformers config, named after its known architecture if it is one."""
    shape = ModelShape.from_config(config, name="model")
    return replace(shape, name=shape.identify(getattr(config, "model_type", "model")))


@dataclass(frozen=True)
class Adapter:
    """LoRA (frozen bf16 base) or QLoRA (frozen nf4 base) on the linear layers of every block."""

    rank: int = 8
    targets: str | tuple[str, ...] = "all-linear"
    quantized: bool = True  # nf4 base (QLoRA); False: bf16 base (LoRA)
    double_quant: bool = True
    dora: bool = False  # weight-decomposed LoRA: a trained magnitude per output feature too
