"""Importing the package keeps third-party noise out of a recipe's log."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys


def test_bitsandbytes_kernel_download_warning_is_silenced():
    import finetune_kit  # noqa: F401

    name = "bitsandbytes.backends.cpu.ops"
    assert importlib.util.find_spec(name) is not None  # the logger is that module's own
    assert not logging.getLogger(name).isEnabledFor(logging.WARNING)
    assert logging.getLogger("bitsandbytes").isEnabledFor(logging.WARNING)  # nothing else of it


def test_importing_bitsandbytes_after_the_package_prints_no_kernel_warning():
    """On CPUs with AVX512-BF16 bitsandbytes prints "Failed to load CPU gemm_4bit_forward ..." at import;
    elsewhere it prints nothing either way."""
    code = "import finetune_kit, bitsandbytes, logging; logging.basicConfig()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gemm_4bit_forward" not in proc.stdout + proc.stderr


def test_no_recipe_import_prints_the_kernel_warning():
    """Each recipe's train.py imports the package before anything that loads bitsandbytes (the HF
    Trainer does, through peft). On CPUs without AVX512-BF16 this passes either way."""
    from tests.harness import REPO

    for train in sorted(REPO.glob("recipes/*/train.py")):
        proc = subprocess.run([sys.executable, "-c", "import train"], cwd=train.parent, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "gemm_4bit_forward" not in proc.stdout + proc.stderr, train
