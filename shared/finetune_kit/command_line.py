"""argparse whose errors are one line: a bad flag or value names itself and points at ``--help``, as every other
bad input is one line (argparse prints its whole usage first: 30 lines and more for a recipe). The recipes, the
package's ``python -m`` commands and the tools over the repository all parse with it."""

from __future__ import annotations

import argparse


class OneLineErrors:
    """Mixin for an argparse parser class (argparse's own, or transformers' ``HfArgumentParser``)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}. Run {self.prog} --help for every flag.\n")


class ArgumentParser(OneLineErrors, argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with one-line errors; ``--help`` still prints the usage."""
