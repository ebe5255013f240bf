"""Decoder-only transformer shapes and their parameter counts, from a config alone (no weights).

Known architectures are kept here as constants because nothing can be downloaded on the
machines that need them (benchmarks, published-figure FLOP counts, memory planning); any
Hugging Face ``config.json`` converts with :meth:`Architecture.from_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Architecture:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    mlp: str = "swiglu"  # "swiglu": gate, up, down (Llama); "gelu": up, down (MPT, GPT)
    max_positions: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_config(cls, config, name: str | None = None) -> Architecture:
        """From a transformers ``PretrainedConfig`` of a Llama-like model."""
        heads = config.num_attention_heads
        arch = cls(
            name=name or "", hidden=config.hidden_size, layers=config.num_hidden_layers, heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            ffn=config.intermediate_size, vocab=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_positions=getattr(config, "max_position_embeddings", 4096),
        )
        return arch if name else replace(arch, name=arch.identify(config.model_type))

    def identify(self, family: str = "model") -> str:
        """The known name of this shape (e.g. "llama-3-8b"), else a descriptive one."""
        def shape(a):
            return (a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, a.vocab, a.tied_embeddings, a.mlp,
                    a.max_positions)

        for known in KNOWN.values():
            if shape(known) == shape(self):
                return known.name
        return f"{family} ({self.layers} layers, hidden {self.hidden})"

    def truncated(self, layers: int) -> Architecture:
        """Same width, fewer decoder layers (for fitting full optimizer states on one GPU)."""
        return replace(self, name=f"{self.name} (truncated to {layers} layers)", layers=layers)

    # ---- parameter counts (norm weights included, no biases: Llama and MPT have none) ----
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv  # q, o: h x h; k, v: h x kv
        mlp = (3 if self.mlp == "swiglu" else 2) * h * self.ffn
        return attention + mlp + 2 * h  # two norms

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self, num_labels: int | None = None) -> int:
        """Output projection: the LM head (vocab x hidden), or a classifier of num_labels."""
        return (num_labels if num_labels else self.vocab) * self.hidden

    def total_params(self, num_labels: int | None = None) -> int:
        """Parameters as stored (a tied LM head shares the embedding and counts once)."""
        head = 0 if (self.tied_embeddings and not num_labels) else self.head_params(num_labels)
        return self.layers * self.layer_params() + self.hidden + self.embedding_params() + head

    def matmul_params(self, num_labels: int | None = None) -> int:
        """Parameters that multiply every token: all but the input embedding lookup.

        The output head is included even when tied to the embedding, since its matmul runs.
        This is the ``N`` of the 6N FLOPs-per-token rule (see :mod:`finetune_kit.flops`).
        """
        return self.layers * self.layer_params() + self.hidden + self.head_params(num_labels)


KNOWN: dict[str, Architecture] = {a.name: a for a in [
    # Meta LLaMA (2023): the seed table's 7B/13B/30B/65B
    Architecture("llama-7b", 4096, 32, 32, 32, 11008, 32000, max_positions=2048),
    Architecture("llama-13b", 5120, 40, 40, 40, 13824, 32000, max_positions=2048),
    Architecture("llama-30b", 6656, 60, 52, 52, 17920, 32000, max_positions=2048),
    Architecture("llama-65b", 8192, 80, 64, 64, 22016, 32000, max_positions=2048),
    # Llama 2 / Llama 3 (config.json of the meta-llama hub repositories)
    Architecture("llama-2-7b", 4096, 32, 32, 32, 11008, 32000),
    Architecture("llama-2-13b", 5120, 40, 40, 40, 13824, 32000),
    Architecture("llama-2-70b", 8192, 80, 64, 8, 28672, 32000),
    Architecture("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, max_positions=8192),
    Architecture("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, max_positions=131072),
    Architecture("llama-3.3-70b", 8192, 80, 64, 8, 28672, 128256, max_positions=131072),
    # MosaicML MPT-7B: GELU MLP with expansion 4, tied embeddings
    Architecture("mpt-7b", 4096, 32, 32, 32, 16384, 50432, tied_embeddings=True, mlp="gelu", max_positions=2048),
]}


def get(name: str) -> Architecture:
    try:
        return KNOWN[name]
    except KeyError:
        raise KeyError(f"unknown architecture '{name}'; known: {', '.join(KNOWN)}. "
                       "Pass a config.json instead.") from None
