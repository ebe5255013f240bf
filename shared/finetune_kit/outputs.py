"""Output folders: whether one can be written (:func:`check_writable`), and final outputs (a model, an
adapter, a merged model) written whole or not at all (:func:`written_whole`; a single file:
:func:`write_text_whole`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from finetune_kit.errors import ConfigError


@contextmanager
def written_whole(out: Path, writer: bool = True):
    """Yield ``<out>.partial`` to write a final output folder (model, adapter, merged model) into; put
    it in place of ``out`` only once complete, so an interrupted write never leaves half a model where
    a whole one was (the old folder is replaced in two renames, then deleted). When several ranks
    enter (a collective save), only the ``writer`` touches the folders."""
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    if not writer:
        yield tmp
        return
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    old = out.with_name(out.name + ".replaced")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def jsonl(rows: list[dict]) -> str:
    """``rows`` as JSON lines (UTF-8 text kept as is)."""
    import json

    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_text_whole(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through ``<path>.partial`` and a rename: a reader finds the old file or the
    new one, never half of it."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)
    return path


def check_writable(output: Path) -> None:
    """ConfigError naming the folder unless ``output`` (or, before it exists, the folder it will be
    made in) takes a file; a probe file is written and removed, nothing else is created."""
    output = Path(output)
    existing = next(p for p in (output, *output.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, os.strerror(20))
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        where = "" if existing == output else f": '{existing}', where it would be created,"
        reason = os.strerror(err.errno) if err.errno else str(err)
        raise ConfigError(f"output folder '{output}' cannot be written{where} ({reason}). Pass --output with a "
                          "folder you can write to, on a disk with room for the checkpoints.") from err
