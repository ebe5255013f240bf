"""Model and tokenizer loading: a hub id or a local folder, bf16, a real pad token.

Under DeepSpeed ZeRO-3 (an ``Accelerator`` built from a config with
``zero3_init_flag: true`` must exist first), ``from_pretrained`` runs inside
``deepspeed.zero.Init``: each rank materialises only its own shard of the weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from finetune_kit.errors import ConfigError

# Tokens that can pad without being EOS, in order of preference. Llama 3.1+ reserves
# <|finetune_right_pad_id|> for this; Llama 3 has unused reserved tokens; Llama 2 has <unk>.
PAD_CANDIDATES = ("<|finetune_right_pad_id|>", "<|reserved_special_token_0|>")


def load_config(model: str):
    """The model's ``config.json`` (cheap: no weights), or a ConfigError naming the fix."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if model.startswith((".", "/", "~")) and not path.exists():
        raise ConfigError(
            f"model path '{model}' does not exist. Pass --model with a local model folder "
            "(one that holds config.json) or a hub id such as meta-llama/Meta-Llama-3-8B."
        )
    if path.is_dir():
        check_not_a_run_file(model, path)
    if path.exists() and not (path / "config.json").is_file():
        raise ConfigError(
            f"model folder '{model}' has no config.json: it is not a Hugging Face model folder. "
            "Point --model at the folder that holds config.json and the weights."
        )
    if path.is_dir():
        unreadable = sorted(f.name for f in path.iterdir() if f.is_file() and not os.access(f, os.R_OK))
        if unreadable:
            raise ConfigError(
                f"model folder '{model}' has files this user (uid {os.getuid()}) cannot read: "
                f"{', '.join(unreadable[:5])}. Every file of the model must be readable by the training "
                f"user: chmod -R a+rX '{model}', or run the container with --user \"$(id -u):$(id -g)\"."
            )
    try:
        return AutoConfig.from_pretrained(str(path) if path.exists() else model)
    except OSError as err:
        if _is_gated(err):
            token = ("HF_TOKEN is set, but its account has no access yet" if os.environ.get("HF_TOKEN")
                     else "no HF_TOKEN is set")
            raise ConfigError(
                f"model '{model}' is gated on the Hugging Face hub and {token}. Accept its licence at "
                f"https://huggingface.co/{model}, then export HF_TOKEN=<a read token of that account> (or run "
                "`hf auth login`) on every node; or download it once and pass the local folder."
            ) from err
        raise ConfigError(
            f"model '{model}' is neither a local folder nor reachable on the Hugging Face hub "
            f"({err.__class__.__name__}). Check the spelling, your hub access token for gated "
            "models, or download it and pass the local path."
        ) from err


def check_not_a_run_file(model: str, path: Path) -> None:
    """A ConfigError for the folders a user may take for a model and that are not one, each saying what to pass
    instead: a PEFT adapter, one of this project's checkpoints (``checkpoints/step_N``), a run's output folder."""
    import json

    if (path / "adapter_config.json").is_file():
        try:
            base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or "?"
        except (OSError, ValueError):
            base = "?"
        raise ConfigError(
            f"model folder '{model}' is a PEFT adapter (adapter_config.json; its base: '{base}'), not a model: the "
            "recipes train a whole model or a new adapter on one. Merge it into its base first (make merge "
            f"RUN=<its run folder> for this project's QLoRA runs, or PEFT's merge_and_unload()) and pass the merged "
            f"folder, or pass --model {base} to start from the base.")
    if not (path / "config.json").is_file() and ((path / "manifest.json").is_file()
                                                 or (path / "trainer_state.json").is_file()):
        run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        raise ConfigError(
            f"model folder '{model}' is a training checkpoint (optimizer and sharded weights, no config.json), not a "
            f"model. To continue its run, launch the run's command again with --output {run} --resume {model}; to "
            f"start a new run from its finished weights, pass --model {run / 'model'}.")
    if not (path / "config.json").is_file() and any((path / f).is_file() for f in ("run_record.json", "run_info.json")):
        saved = [path / name for name in ("model", "merged") if (path / name / "config.json").is_file()]
        raise ConfigError(
            f"model folder '{model}' is a training run's output folder, not a model: "
            + (f"its saved model is {saved[0]}; pass --model {saved[0]}." if saved else
               "it holds no saved model (model/ or merged/) yet; pass the folder of one."))


def check_causal_lm(config, model: str) -> None:
    """A ConfigError when ``config`` is of a sequence classifier (a score head, no LM head) given to a recipe
    that trains a causal LM."""
    architectures = getattr(config, "architectures", None) or []
    classifier = next((a for a in architectures if a.endswith("ForSequenceClassification")), None)
    if classifier:
        labels = getattr(config, "num_labels", "?")
        raise ConfigError(
            f"model '{model}' is a sequence classifier ({classifier}: a score head of {labels} labels, no LM head); "
            "this recipe trains a causal LM. Pass the causal LM it was built from, or train the classifier with "
            "the llama3-70b-qlora recipe.")


def _is_gated(err: BaseException) -> bool:
    """transformers wraps huggingface_hub's GatedRepoError in an OSError; look down the chain."""
    from huggingface_hub.errors import GatedRepoError

    while err is not None:
        if isinstance(err, GatedRepoError):
            return True
        err = err.__cause__ or err.__context__
    return False


def max_positions(config) -> int:
    """Longest sequence the model was built for (its position embedding limit)."""
    return int(getattr(config, "max_position_embeddings", 0) or 0)


def check_seq_len(max_seq_len: int, config, model: str) -> None:
    limit = max_positions(config)
    if max_seq_len < 8:
        raise ConfigError(f"--max-seq-len {max_seq_len} is too short to hold a prompt and an "
                          "answer; use at least 8 (typical: 2048 or 4096).")
    if limit and max_seq_len > limit:
        raise ConfigError(
            f"--max-seq-len {max_seq_len} is above the limit of model '{model}' "
            f"(max_position_embeddings = {limit}). Use --max-seq-len {limit} or less."
        )


# Files a tokenizer loads from (transformers reads any one): a fast tokenizer's tokenizer.json, SentencePiece's
# model (Llama 2), a BPE or WordPiece vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt")


def check_tokenizer_files(model: str) -> None:
    """A local model folder holds a tokenizer, or a ConfigError naming the fix: several export tools and a bare
    ``model.save_pretrained(folder)`` leave the weights and config.json alone, and every rank would then die in
    ``AutoTokenizer.from_pretrained`` after the launch. A hub id is left to the hub."""
    path = Path(model).expanduser()
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"model folder '{model}' has config.json but no tokenizer (none of {', '.join(TOKENIZER_FILES)}). "
            "Save the tokenizer beside the weights (tokenizer.save_pretrained(folder)), or copy those files from "
            "the base model the weights came from."
        )


def load_tokenizer(model: str):
    """The model's tokenizer, with a pad token that is not EOS (EOS must stay learnable)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ensure_pad_token(tokenizer)
    tokenizer.padding_side = "right"
    return tokenizer


def ensure_pad_token(tokenizer) -> str:
    """Set ``tokenizer.pad_token`` to a token other than EOS; return which one.

    Padding with EOS (a common shortcut) masks EOS out of the labels with the padding,
    so the model never learns to stop. Prefer a reserved token already in the vocabulary;
    add ``<pad>`` only as a last resort (the model's embeddings must then be resized).
    """
    if tokenizer.pad_token is not None and tokenizer.pad_token != tokenizer.eos_token:
        return tokenizer.pad_token
    vocab = tokenizer.get_vocab()
    for candidate in PAD_CANDIDATES:
        if candidate in vocab:
            tokenizer.pad_token = candidate
            return candidate
    if tokenizer.unk_token is not None and tokenizer.unk_token != tokenizer.eos_token:
        tokenizer.pad_token = tokenizer.unk_token
        return tokenizer.unk_token
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    return "<pad>"


def load_causal_lm(model: str, attention: str = "sdpa", quantization=None, *, tokenizer=None):
    """``AutoModelForCausalLM`` to train, in bf16 (the checkpoints' own dtype) with ``attention`` (PyTorch's SDPA,
    or e.g. :func:`~finetune_kit.models.packed_attention.attention_for`'s choice for packed rows) and no KV cache
    (packed sequences need its absence); ``quantization``: the ``BitsAndBytesConfig`` its linear layers are
    quantized with as they load (QLoRA: the embeddings and the LM head stay bf16), or None. Its embeddings and head
    are resized to ``tokenizer`` if that has more tokens: only if a ``<pad>`` had to be added
    (:func:`ensure_pad_token`)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"quantization_config": quantization} if quantization is not None else {}
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation=attention, **kwargs)
    if tokenizer is not None and len(tokenizer) > net.get_input_embeddings().num_embeddings:
        net.resize_token_embeddings(len(tokenizer))
    net.config.use_cache = False
    return net
