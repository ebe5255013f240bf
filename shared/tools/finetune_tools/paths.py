"""Where the repository is, found from any folder inside it: tooling never assumes it runs from the root."""

from __future__ import annotations

from pathlib import Path

from finetune_kit.errors import UserInputError


def is_root(folder: Path) -> bool:
    """Both must exist: a checkout has them, a recipe folder copied elsewhere has neither."""
    return (folder / "recipes").is_dir() and (folder / "results/published.csv").is_file()


def find_root(start: Path | None = None, *, flag: str = "--root") -> Path:
    """The first folder from ``start`` (default: the current directory) upwards that holds both
    ``recipes/`` and ``results/published.csv``. ``flag`` names the option that replaces the
    search, for the error message."""
    start = (Path.cwd() if start is None else Path(start)).resolve()
    for folder in (start, *start.parents):
        if is_root(folder):
            return folder
    raise UserInputError(
        f"{start} is not inside the recipes repository: no folder from there upwards holds both recipes/ "
        f"and results/published.csv. Run from inside the repository, or pass {flag}.")
