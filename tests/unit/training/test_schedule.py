"""The learning-rate schedule (training/engine.py) is transformers' cosine with warm-up, to the bit."""

from __future__ import annotations

import pytest
import torch

from finetune_kit.training.engine import cosine_with_warmup


@pytest.mark.parametrize("warmup, total", [(0, 1), (0, 8), (1, 8), (3, 40), (30, 1000), (8, 8)])
def test_the_schedule_is_transformers_cosine_with_warmup(warmup, total):
    from transformers import get_cosine_schedule_with_warmup

    theirs = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0),
                                             num_warmup_steps=warmup, num_training_steps=total)
    assert [cosine_with_warmup(s, warmup=warmup, total=total) for s in range(total + 2)] == \
        [theirs.lr_lambdas[0](s) for s in range(total + 2)]


def test_the_comparison_bites_on_a_schedule_one_step_longer():
    from transformers import get_cosine_schedule_with_warmup

    theirs = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0),
                                             num_warmup_steps=3, num_training_steps=41)
    ours = [cosine_with_warmup(s, warmup=3, total=40) for s in range(42)]
    assert ours != [theirs.lr_lambdas[0](s) for s in range(42)]


def test_the_optimizer_and_schedule_import_no_peft():
    """transformers.optimization imports the Trainer's utilities, PEFT and bitsandbytes: seconds of CPU in every
    rank of every launch (the 8B recipe uses neither). Run in a fresh interpreter: this one may have them."""
    import subprocess
    import sys

    code = ("import sys, types, torch\n"
            "from finetune_kit.training import engine\n"
            "args = types.SimpleNamespace(lr=1e-3, weight_decay=0.0, warmup_ratio=0.1)\n"
            "checked = types.SimpleNamespace(fsdp=object())\n"
            "opt, schedule = engine.optimizer_and_schedule([torch.nn.Parameter(torch.ones(1))], checked, args, 10)\n"
            "print(sorted({'peft', 'bitsandbytes', 'transformers.optimization'} & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out
