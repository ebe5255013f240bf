"""DeepSpeed's Muon module imported with TorchDynamo off (finetune_kit/launch/muon_import.py), in a fresh interpreter
each: Inductor's compiler stays unimported, Muon's function plain, the environment as it was; the negative control,
DeepSpeed's own import, brings Inductor's compiler in; a Muon run is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from finetune_kit.launch.muon_import import MODULE, import_muon_uncompiled, uses_muon

PROBE = """
import json, os, sys
import torch
from finetune_kit.launch.muon_import import MODULE, import_muon_uncompiled
config = json.loads(sys.argv[1])
imported = import_muon_uncompiled(config) if sys.argv[2] == "ours" else bool(__import__(MODULE))
muon = sys.modules.get(MODULE)
function = muon and sys.modules["deepspeed.runtime.zero.muon.original_muon"].zeropower_via_newtonschulz5
print(json.dumps({"imported": imported, "inductor": "torch._inductor.compile_fx" in sys.modules,
                  "plain": callable(function) and type(function).__name__ == "function"
                  and not hasattr(function, "_torchdynamo_orig_callable"),
                  "env": os.environ.get("TORCHDYNAMO_DISABLE")}))
"""


def probe(config: dict, how: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TORCHDYNAMO_DISABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(config), how], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "zero_optimization": {"stage": 3}}


@pytest.mark.parametrize("how, want", [
    ("ours", {"imported": True, "inductor": False, "plain": True, "env": None}),
    ("deepspeed", {"imported": True, "inductor": True, "plain": False, "env": None}),  # the negative control
])
def test_muon_imports_without_inductor_for_another_optimizer(how, want):
    assert probe(ADAMW, how) == want


def test_a_muon_run_is_left_to_deepspeed(monkeypatch):
    """Its optimizer compiled as DeepSpeed means: nothing is imported ahead."""
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    config = {**ADAMW, "optimizer": {"type": "Muon", "params": {"lr": "auto"}}}
    assert uses_muon(config) and not uses_muon(ADAMW) and not uses_muon({})
    assert import_muon_uncompiled(config) is False and MODULE not in sys.modules
