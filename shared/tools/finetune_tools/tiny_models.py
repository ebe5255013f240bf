"""Build a tiny, random model of a real Llama family's shape, plus a tokenizer for it.

    python -m finetune_tools.tiny_models --family llama3 --out build/tiny-llama3

The result is a normal Hugging Face model folder (config.json, safetensors, tokenizer)
that every recipe loads exactly like a hub checkpoint. The shape keeps what matters to
the code paths under test -- grouped-query attention and rope theta 500000 for Llama 3,
multi-head attention for Llama 2, untied embeddings, the families' special tokens and
the Llama 3 chat template -- at a size that trains on a CPU in seconds.

The tokenizer is a byte-level BPE trained on the shipped instruction sample, so no
download is needed. Building is deterministic for a given seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from finetune_kit import command_line
from finetune_kit.data.instructions import SAMPLE_INSTRUCTIONS
from finetune_kit.data.templates import SHIPPED as SHIPPED_TEMPLATES

# The Llama 3 Instruct chat template, as Meta's tokenizers carry it.
LLAMA3_CHAT_TEMPLATE = SHIPPED_TEMPLATES["llama3"].read_text()


@dataclass(frozen=True)
class Family:
    """What a tiny model keeps of its real family (sizes are tiny, ratios are real)."""

    bos: str
    eos: str
    special_tokens: list[str]
    chat_template: str | None
    num_attention_heads: int
    num_key_value_heads: int  # == heads: multi-head attention; fewer: grouped-query
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    extra: dict = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    # Llama 3 8B: 32 heads / 8 KV heads (GQA 4:1), rope theta 500000, 8192 positions.
    "llama3": Family(
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        special_tokens=[
            "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|finetune_right_pad_id|>",
        ],
        chat_template=LLAMA3_CHAT_TEMPLATE,
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=500000.0,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    ),
    # Llama 2 13B: multi-head attention, rope theta 10000, 4096 positions, <unk> at id 0.
    "llama2": Family(
        bos="<s>",
        eos="</s>",
        special_tokens=["<unk>", "<s>", "</s>"],
        chat_template=None,
        num_attention_heads=8,
        num_key_value_heads=8,
        rope_theta=10000.0,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        extra={"unk_token": "<unk>"},
    ),
}


def train_tokenizer(family: Family, texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts`` with the family's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=family.special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Like the real Llama tokenizers: no pad token is set; finetune_kit.models.loading picks one.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.eos,
        model_max_length=family.max_position_embeddings,
        **family.extra,
    )
    if family.chat_template:
        fast.chat_template = family.chat_template
    return fast


def build_tiny(
    family_name: str,
    out: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    texts: list[str] | None = None,
) -> Path:
    """Write a tiny random model of ``family_name`` ('llama3' or 'llama2') to ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if family_name not in FAMILIES:
        raise ValueError(f"unknown family {family_name!r}; choose one of {sorted(FAMILIES)}")
    family = FAMILIES[family_name]
    out = Path(out)
    if texts is None:
        texts = [
            f"{row['prompt']} {row['response']}"
            for row in map(json.loads, SAMPLE_INSTRUCTIONS.read_text().splitlines())
        ]
    tokenizer = train_tokenizer(family, texts, vocab_size)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=int(hidden_size * 3.5),  # Llama 3 8B: 14336 / 4096 = 3.5
        num_hidden_layers=num_layers,
        num_attention_heads=family.num_attention_heads,
        num_key_value_heads=family.num_key_value_heads,
        max_position_embeddings=family.max_position_embeddings,
        rms_norm_eps=family.rms_norm_eps,
        rope_theta=family.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_4bit(source: str | Path, out: str | Path, *, storage: torch.dtype = torch.bfloat16) -> Path:
    """A copy of the 16-bit model folder ``source`` saved in 4-bit as the ``*-bnb-4bit`` downloads are: bitsandbytes
    nf4 with double quantisation, the packed weights stored as ``storage``, config.json carrying the
    ``quantization_config``; with the tokenizer. bitsandbytes quantizes on a CPU too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune_kit.models.qlora import bnb_config

    out = Path(out)
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=bnb_config(torch.bfloat16, storage),
                                                 dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = command_line.ArgumentParser(prog="python -m finetune_tools.tiny_models",
                                         description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama3")
    parser.add_argument("--out", required=True, help="folder to write the model to")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_tiny(args.family, args.out, hidden_size=args.hidden_size,
                      num_layers=args.layers, seed=args.seed)
    print(f"tiny {args.family} model written to {path}")


if __name__ == "__main__":
    main()
