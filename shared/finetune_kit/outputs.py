"""Final output folders (a model, an adapter, a merged model) written whole or not at all."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path


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
