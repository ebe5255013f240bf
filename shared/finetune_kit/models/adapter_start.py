"""Which weights a run starts from when ``--model`` names an SFT run's adapter: its base with the adapter folded in,
merged once per machine into the cache.

A LoRA/QLoRA run saves ``adapter/`` (``adapter_config.json`` names its base). The model that run ended with is the
base plus that adapter, so a run that continues from it -- DPO after SFT -- must start from, and take as its
reference, the merged model and not the base beneath it (starting from the base silently drops the SFT step, the
LLaMA-Factory#8459 failure). :func:`start_weights` turns such a folder into the merged model's folder, under
``$FINETUNE_CACHE_DIR/merged/<digest of the adapter and its base>``; every other ``--model`` is returned as given.
The first process to ask merges (:func:`finetune_kit.models.qlora.merge_adapter`: the base in bf16, 2 bytes per
parameter of host RAM); the others wait on a file lock and read the result. Run before any DeepSpeed config is set
(the merge is a plain load): the recipes call it in their checks.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import sys
from pathlib import Path

from finetune_kit import caches
from finetune_kit.errors import ConfigError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def start_weights(model: str) -> str:
    """``model``, or for an adapter folder the folder of its base with the adapter merged in (made once)."""
    adapter = Path(model).expanduser()
    if not (adapter / "adapter_config.json").is_file():
        return model
    config = json.loads((adapter / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base or config.get("task_type") != "CAUSAL_LM":
        raise ConfigError(f"model folder '{model}' is a PEFT adapter of {'a ' + repr(config.get('task_type'))} task "
                          f"over {base or 'an unnamed base'}: a run starts from a causal LM's adapter whose "
                          "adapter_config.json names its base. Pass the base (--model <base>) or a merged folder.")
    entry = caches.root() / "merged" / digest(adapter, base)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f"{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one merge per machine; the others wait and read it
        if not (entry / "config.json").is_file():
            from finetune_kit.models.qlora import merge_adapter

            print(f"--model {model}: an adapter over {base}; merging it into its base once, into {entry}",
                  file=sys.stderr)
            merge_adapter(base, adapter, entry)
    return str(entry)


def digest(adapter: Path, base: str) -> str:
    """The cache entry's name: the adapter's files, read whole, and its base's name."""
    h = hashlib.sha256(base.encode())
    for name in ADAPTER_FILES:
        if (adapter / name).is_file():
            h.update(name.encode())
            h.update((adapter / name).read_bytes())
    return h.hexdigest()[:32]
