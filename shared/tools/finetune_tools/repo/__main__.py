"""python -m finetune_tools.repo readmes [--check] [--root R]: regenerate the recipe READMEs' generated blocks.
python -m finetune_tools.repo pins [--root R]: check the locks, the Dockerfiles and noxfile.py against the pins.
python -m finetune_tools.repo suite-time LOG [--root R]: make test's minutes per session against their budgets."""

from __future__ import annotations

import sys
from pathlib import Path

from finetune_kit import command_line
from finetune_kit.errors import UserInputError
from finetune_tools.paths import find_root
from finetune_tools.repo import pins, readmes, suite_time


def main(argv=None) -> int:
    p = command_line.ArgumentParser(prog="python -m finetune_tools.repo", description="Repository tooling.")
    commands = p.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("readmes", help="regenerate the generated blocks of recipes/*/README.md",
                              description=readmes.__doc__.split("\n")[0])
    cmd.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is out of date")
    cmd.add_argument("--root", type=Path, default=None,
                     help="repository root (default: found upwards from the current folder)")
    cmd = commands.add_parser("pins", help="check the hash locks, Dockerfiles and noxfile.py against the pins",
                              description=pins.__doc__.split("\n")[0])
    cmd.add_argument("--root", type=Path, default=None,
                     help="repository root (default: found upwards from the current folder)")
    cmd = commands.add_parser("suite-time", help="make test's minutes per session and slowest tests, against "
                              f"{suite_time.BUDGETS}", description=suite_time.__doc__.split("\n")[0])
    cmd.add_argument("log", type=Path, help="make test's output (for the durations pytest printed)")
    cmd.add_argument("--root", type=Path, default=None,
                     help="repository root (default: found upwards from the current folder)")
    args = p.parse_args(argv)
    root = args.root or find_root()
    if args.command == "suite-time":
        return suite_time.main(args.log, root)
    if args.command == "pins":
        found = pins.problems(root)
        print("\n".join(found) or f"{root / 'docker'}: the locks, the Dockerfiles and noxfile.py agree with the pins")
        return 1 if found else 0
    stale = readmes.update(root, args.check)
    for readme in stale:
        print(f"{readme}: generated blocks {'out of date' if args.check else 'updated'}")
    if args.check and stale:
        print("run `make readmes` and commit the result", file=sys.stderr)
        return 1
    if not stale:
        print(f"{root / 'recipes'}: every README's generated blocks are current")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserInputError as err:
        sys.exit(f"error: {err}")
