"""Tokenised examples kept on disk, keyed by everything that decides them, so a relaunch starts in seconds.

The key is a digest of: the data (the file's bytes; a hub dataset's fingerprint), the row format
and its fields, the tokenizer (its whole vocabulary and special tokens), the chat template's text,
``max_seq_len``, and the source of the code that tokenises (this package's ``data`` modules), so
a change to any of them misses the cache and nothing stale is read. An entry is written whole
(``outputs.written_whole``) by the process that tokenised; the others read it. The folder is
``FINETUNE_CACHE_DIR`` (default ``~/.cache/finetune_kit``) + ``tokenised/``, or the recipe's
``--data-cache``; ``none`` turns the cache off. On a cluster, a node-local disk: each node's
first process tokenises once and the node's other processes read its entry.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

from finetune_kit import caches
from finetune_kit.outputs import written_whole

OFF = "none"
_CODE = ("instructions.py", "templates.py", "formats.py", "loss_mask.py", "token_cache.py")


def cache_dir(choice: str = "auto") -> Path | None:
    """The folder of ``--data-cache choice`` (``auto``: the default; ``none``: no cache)."""
    if choice == OFF:
        return None
    if choice != "auto":
        return Path(choice).expanduser()
    return caches.root() / "tokenised"


def key(data, tokenizer, template, max_seq_len: int) -> str:
    """The digest naming the cache entry of ``data`` (InstructionRows) tokenised this way."""
    h = hashlib.sha256()

    def add(part) -> None:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")

    path = Path(data.source).expanduser()
    if path.is_file():
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    else:
        add(getattr(data.rows, "_fingerprint", data.source))
    add(data.format.name)
    add(data.fields)
    add(data.splits)  # which split trains, and which validates (its rows come after the training ones)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    add(backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()))
    add(sorted(tokenizer.special_tokens_map.items()))
    add((tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)))
    add(template.source)
    add(max_seq_len)
    here = Path(__file__).parent
    for name in _CODE:
        add((here / name).read_bytes())
    return h.hexdigest()[:32]


def load(folder: Path | None, digest: str):
    """``(examples, counts_dict)`` of a complete entry, or None."""
    entry = folder / digest if folder else None
    if entry is None or not (entry / "counts.json").is_file():
        return None
    import datasets

    return datasets.load_from_disk(str(entry / "examples")), json.loads((entry / "counts.json").read_text())


def save(folder: Path | None, digest: str, examples, counts) -> Path | None:
    """Write the entry whole; a cache that cannot be written is reported, never fatal."""
    if folder is None:
        return None
    entry = folder / digest
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with written_whole(entry) as tmp:
            examples.save_to_disk(str(tmp / "examples"))
            (tmp / "counts.json").write_text(json.dumps(asdict(counts)) + "\n")  # last: marks it complete
    except OSError as err:
        print(f"tokenised data not cached in {folder}: {err}", file=sys.stderr)
        return None
    return entry
