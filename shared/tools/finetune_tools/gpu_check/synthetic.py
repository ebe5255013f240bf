"""Models and data for the GPU check: real shapes with fewer layers, random weights, no download.

A check model is a published architecture (:data:`finetune_kit.models.shapes.KNOWN_MODELS`) with
``layers`` decoder layers, saved as a normal Hugging Face folder that the recipes load like a hub
checkpoint. ``tiny=True`` keeps the attention-head ratio and the rest of the config but shrinks
the width to 64 and the vocabulary to 1,024, for the CPU version of the check. The tokenizer is the tiny byte-level
BPE of :mod:`finetune_tools.tiny_models` (its ids fit any vocabulary); the data is random words from
the shipped sample, long enough that every sequence is truncated to the full length. At long
context (32K-512K tokens) the same instruction conversations fill one sequence each; the
``long-documents`` kind holds documents a fraction of the sequence long, for packing.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import replace
from pathlib import Path

from finetune_kit.models.shapes import KNOWN_MODELS, ModelShape

TINY_WIDTH = {"hidden_size": 64, "intermediate_size": 224, "num_attention_heads": 4, "vocab_size": 1024}
CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
               "max_position_embeddings", "rope_theta", "rope_scaling", "tie_word_embeddings")


def check_config(arch: str, layers: int, tiny: bool = False, max_positions: int = 0) -> dict:
    """The config.json fields of ``arch`` with ``layers`` decoder layers (and a tiny width;
    ``max_positions``: a longer context than the published one, 0 to keep it)."""
    if arch not in KNOWN_MODELS:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(KNOWN_MODELS)}")
    known = KNOWN_MODELS[arch]
    config = {k: known[k] for k in CONFIG_KEYS if k in known}
    config["num_hidden_layers"] = layers
    if max_positions:
        config["max_position_embeddings"] = max_positions
    if tiny:
        group = known["num_attention_heads"] // known.get("num_key_value_heads", known["num_attention_heads"])
        heads = max(TINY_WIDTH["num_attention_heads"], group)  # at least one KV head: 70B's 64:8 -> 8:1
        config.update(TINY_WIDTH, num_attention_heads=heads, num_key_value_heads=heads // group)
    return config


def check_shape(arch: str, layers: int, tiny: bool = False) -> ModelShape:
    """What the planner and the FLOP formula see for that model (no weights)."""
    shape = ModelShape.from_config(check_config(arch, layers, tiny), name=arch)
    return replace(shape, name=f"{arch} (truncated to {layers} layers)" if not tiny else shape.name)


def build_model(arch: str, family: str, layers: int, out: Path, *, tiny: bool = False, seed: int = 0,
                max_positions: int = 0) -> Path:
    """Write the check model (random bf16 weights) and a tokenizer to ``out``; reuse it if there."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune_tools.tiny_models import FAMILIES, train_tokenizer

    out = Path(out)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    fam = FAMILIES[family]
    tokenizer = train_tokenizer(fam, sample_texts(), vocab_size=512)
    config = LlamaConfig(**check_config(arch, layers, tiny, max_positions), rms_norm_eps=fam.rms_norm_eps,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of billions of weights: on the GPU
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def folder_bytes(arch: str, layers: int, tiny: bool = False, prequantized: bool = False) -> int:
    """What the check model's folder takes on disk: bf16 weights, or (``prequantized``) the decoder layers' linear
    weights at 4 bits with one absmax byte a block of 64 (double quantization: a float32 a group of 256 blocks), and
    for each weight its code books (16 + 256 float32) and its settings' JSON (about 170 bytes); the rest in bf16."""
    shape = check_shape(arch, layers, tiny)
    if not prequantized:
        return 2 * shape.total_params()
    linear = layers * shape.block_linear_params()
    per_weight = 4 * (16 + 256) + 4 + 170
    return linear // 2 + linear // 64 + linear // 4096 + layers * len(shape.linear_shapes()) * per_weight \
        + 2 * shape.unquantised_params()


SHARD_BYTES = 5 * 2**30  # the hub's folders are cut in shards of about 5 GB


def build_4bit_model(arch: str, family: str, layers: int, out: Path, *, tiny: bool = False, seed: int = 0) -> Path:
    """Write the check model as a ``*-bnb-4bit`` download is saved (bitsandbytes nf4, double quantization, the
    packed weights stored as bf16: :func:`finetune_kit.models.qlora.bnb_config`, what the 70B recipes train with)
    and a tokenizer to ``out``; reuse it if there. Built one decoder layer at a time (random bf16 weights on the
    GPU, quantized there, written in shards of :data:`SHARD_BYTES`), so a 70B folder never needs its 140 GB of
    16-bit weights in memory or on disk. The embeddings and the LM head stay bf16, as bitsandbytes leaves them."""
    import bitsandbytes as bnb
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from finetune_kit.models.qlora import bnb_config
    from finetune_tools.tiny_models import FAMILIES, train_tokenizer

    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file():
        return out
    fam = FAMILIES[family]
    tokenizer = train_tokenizer(fam, sample_texts(), vocab_size=512)
    config = LlamaConfig(**check_config(arch, layers, tiny), rms_norm_eps=fam.rms_norm_eps,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         architectures=["LlamaForCausalLM"], dtype="bfloat16")
    quantization = bnb_config(torch.bfloat16, torch.bfloat16)
    config.quantization_config = quantization
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(seed)
    std = config.initializer_range
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict] = [{}]
    total = 0

    def keep(name: str, tensor) -> None:
        nonlocal total
        if sum(t.nbytes for t in shards[-1].values()) + tensor.nbytes > SHARD_BYTES and shards[-1]:
            save_file(shards[-1], out / f"part-{len(shards)}.safetensors", metadata={"format": "pt"})
            shards.append({})
            shards[-2] = dict.fromkeys(shards[-2])  # written: only the names stay
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        total += tensor.nbytes

    def random_bf16(*shape):
        return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=generator)

    keep("model.embed_tokens.weight", random_bf16(config.vocab_size, config.hidden_size))
    for index in range(layers):
        with torch.device(device):
            layer = LlamaDecoderLayer(config, layer_idx=index).to(torch.bfloat16)
        for parent in list(layer.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                          compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                          quant_storage=torch.bfloat16, device="meta")
                    q.weight = bnb.nn.Params4bit(random_bf16(child.out_features, child.in_features),
                                                 requires_grad=False, compress_statistics=True, quant_type="nf4",
                                                 quant_storage=torch.bfloat16, module=q).to(device)  # quantizes
                    setattr(parent, child_name, q)
        for name, tensor in layer.state_dict(prefix=f"model.layers.{index}.").items():
            keep(name, tensor)
        del layer
    keep("model.norm.weight", torch.ones(config.hidden_size, dtype=torch.bfloat16))
    keep("lm_head.weight", random_bf16(config.vocab_size, config.hidden_size))
    save_file(shards[-1], out / f"part-{len(shards)}.safetensors", metadata={"format": "pt"})
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        (out / f"part-{number}.safetensors").rename(out / name)
        weight_map.update(dict.fromkeys(shard, name))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    config.save_pretrained(out)  # last: a folder with its config.json is whole
    return out


def sample_texts() -> list[str]:
    from finetune_kit.data.instructions import SAMPLE_INSTRUCTIONS

    return [f"{r['prompt']} {r['response']}" for r in map(json.loads, SAMPLE_INSTRUCTIONS.read_text().splitlines())]


def _words(rng: random.Random, count: int, vocabulary: list[str]) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(count))


TOKENS_PER_WORD = 3.75  # measured: the check tokenizer (512-token BPE) over words of the shipped sample
# examples per packed sequence, about: rows written per sequence a run reads
EXAMPLES_PER_SEQUENCE = {"short-instructions": 8, "long-documents": 3}


def write_data(kind: str, path: Path, *, rows: int, seq_len: int, seed: int = 0) -> Path:
    """``rows`` examples longer than ``seq_len`` tokens: instruction JSONL (conversations of many
    short exchanges, which truncation at turn boundaries cuts to within one exchange of
    ``seq_len``: nearly no padding, at any length: one conversation per sequence at 512K tokens too)
    or review CSV (truncation fills every sequence). Or, for packing, ``short-instructions``: one
    exchange each, of 1/16 to 1/4 of ``seq_len`` tokens; ``long-documents``: one exchange each whose
    answer is a document of 1/8 to 1/2 of ``seq_len`` tokens (at TOKENS_PER_WORD), about three a sequence."""
    rng = random.Random(seed)
    vocabulary = sorted({w for text in sample_texts() for w in text.split()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "instructions":
        with path.open("w") as f:
            words = max(1, seq_len // 256)  # per answer: about 1% of the sequence as padding at most
            for _ in range(rows):
                turns = [[{"role": "user", "content": "Continue."},
                          {"role": "assistant", "content": _words(rng, words, vocabulary)}]
                         for _ in range(seq_len // (words + 4) + 1)]  # an exchange is more than words + 4 tokens
                f.write(json.dumps({"messages": [m for turn in turns for m in turn]}) + "\n")
    elif kind == "short-instructions":  # for packing: one exchange of 1/16 to 1/4 of seq_len tokens
        with path.open("w") as f:
            for _ in range(rows):
                answer = _words(rng, rng.randint(seq_len // 64, seq_len // 16), vocabulary)  # ~2-3 tokens a word
                f.write(json.dumps({"messages": [{"role": "user", "content": "Continue."},
                                                 {"role": "assistant", "content": answer}]}) + "\n")
    elif kind == "long-documents":  # for packing at long context: whole documents, several per sequence
        with path.open("w") as f:
            for _ in range(rows):
                tokens = rng.randint(seq_len // 8, seq_len // 2)
                document = _words(rng, max(1, round(tokens / TOKENS_PER_WORD)), vocabulary)
                f.write(json.dumps({"messages": [{"role": "user", "content": "Continue."},
                                                 {"role": "assistant", "content": document}]}) + "\n")
    elif kind == "reviews":
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["rating", "text"])
            for i in range(rows):
                writer.writerow([1 if i % 2 else 5, _words(rng, 2 * seq_len, vocabulary)])
    else:
        raise ValueError(f"data kind {kind!r}: instructions, short-instructions, long-documents or reviews")
    return path
