"""Preference pairs as token ids, in the columns TRL's DPOTrainer collates: ``prompt_ids``, ``chosen_ids``,
``rejected_ids`` (and ``example_id``, the source row).

The prompt is rendered by the chat template up to the assistant's turn (the generation prompt); an answer's tokens are
those of prompt + answer from where they depart from the prompt's. That is TRL's own rule (``common_prefix_length`` in
trl/trainer/dpo_trainer.py, ``_prepare_dataset``: a template may render a prompt alone differently from its start in
a longer conversation), so the loss is on the answer and its end of turn only, as the DPO recipe's reference and policy
both read it. A pair longer than ``max_seq_len`` keeps its start (TRL's ``keep_start``);
:func:`finetune_kit.data.preferences.check_room` has refused the prompts that leave no room for an answer.

The tokenised pairs are kept on disk (``--data-cache``, as :mod:`.token_cache` keeps instruction data), keyed by a
digest of the pairs themselves, the tokenizer, the template, ``max_seq_len``, which rows the set holds and this code.
The digest is also the ``datasets.Dataset``'s fingerprint, so what is derived from the set and cached beside it (the
precomputed reference log-probabilities, ``training.preference``) is found again by a relaunch or a resume.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from finetune_kit.data import templates, token_cache
from finetune_kit.data.preferences import Pair, PreferenceRows
from finetune_kit.errors import DataError
from finetune_kit.outputs import written_whole

COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
_CODE = ("preference_tokens.py", "preferences.py", "templates.py", "formats.py")


def holdout_pairs(data: PreferenceRows, fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, held out): ``max(1, round(n * fraction))`` pairs chosen by ``seed`` held out (none for 0), each list in
    the source's order."""
    if not fraction:
        return list(data.pairs), []
    count = max(1, round(len(data) * fraction))
    if count >= len(data):
        raise DataError(f"data '{data.source}' has {len(data)} preference pair(s): holding out {count} for "
                        "validation leaves none to train on. Add pairs, or lower --eval-fraction (0: none held out).")
    held = set(random.Random(seed).sample(range(len(data)), count))
    return ([p for i, p in enumerate(data.pairs) if i not in held],
            [p for i, p in enumerate(data.pairs) if i in held])


def tokenize_pair(pair: Pair, tokenizer, template: templates.ChatTemplate, max_seq_len: int) -> dict:
    """One pair's ids: the prompt's, then each answer's tokens after it, prompt + answer cut at ``max_seq_len``."""

    def ids(messages: list[dict], generation_prompt: bool = False) -> list[int]:
        text = templates.render(tokenizer, template, messages, generation_prompt=generation_prompt)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt = ids(pair.prompt, generation_prompt=True)
    chosen, rejected = ids(pair.prompt + pair.chosen), ids(pair.prompt + pair.rejected)
    start = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    room = max_seq_len - start
    return {"example_id": pair.example_id, "prompt_ids": prompt[:start], "chosen_ids": chosen[start:][:room],
            "rejected_ids": rejected[start:][:room]}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # the shorter one may be a prefix
        if x != y:
            break
        n += 1
    return n


def key(pairs: list[Pair], tokenizer, template: templates.ChatTemplate, max_seq_len: int) -> str:
    """The digest that names the tokenised set (and is its fingerprint)."""
    h = hashlib.sha256()
    for part in (json.dumps([p.record() for p in pairs], sort_keys=True), template.source, max_seq_len,
                 sorted(tokenizer.special_tokens_map.items()), (tokenizer.pad_token_id, len(tokenizer))):
        h.update(str(part).encode() + b"\0")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else str(sorted(tokenizer.get_vocab().items()))).encode())
    here = Path(__file__).parent
    for name in _CODE:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:32]


def tokenize_pairs(pairs: list[Pair], tokenizer, template: templates.ChatTemplate, max_seq_len: int, *,
                   cache: str = "auto"):
    """``pairs`` as a ``datasets.Dataset`` of token ids, read from ``--data-cache`` when an entry has the same digest
    (else tokenised and written there whole). With ``cache`` none, an in-memory set (nothing derived is kept)."""
    import datasets

    digest = key(pairs, tokenizer, template, max_seq_len)
    folder = token_cache.cache_dir(cache)
    entry = folder / f"pairs-{digest}" if folder else None
    if entry is not None and (entry / "dataset_info.json").is_file():
        return _load(entry, digest)
    rows = [tokenize_pair(p, tokenizer, template, max_seq_len) for p in pairs]
    columns = {name: [row[name] for row in rows] for name in ("example_id", *COLUMNS)}
    table = datasets.Dataset.from_dict(columns).data
    dataset = datasets.Dataset(table, fingerprint=digest)
    if entry is None:
        return dataset
    try:
        with written_whole(entry) as partial:
            dataset.save_to_disk(str(partial))
    except OSError as err:  # a cache that cannot be written is reported, never fatal
        print(f"tokenised pairs not cached in {entry}: {err}")
        return dataset
    return _load(entry, digest)


def _load(entry: Path, digest: str):
    """The entry memory-mapped from its files (so what is cached beside it lands in the entry too), under its
    digest: ``load_from_disk`` names a set after its files instead."""
    import datasets

    return datasets.Dataset(datasets.load_from_disk(str(entry)).data, fingerprint=digest)
