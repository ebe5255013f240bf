"""The start-up speed-ups for CPU launches (finetune_kit/launch/startup.py): py-cpuinfo asked once per machine boot,
the NUMA layout read once per process, DeepSpeed's Muon module imported without Inductor; and the one call that
applies them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from finetune_kit.launch import startup
from finetune_kit.launch.startup import MODULE, import_muon_uncompiled, uses_muon

# ---- py-cpuinfo: DeepSpeed's op builders, which ask it twice per op they load, get the kept answer in this process
# and in the next ones on the machine

FLAGS = {"-march=native", "-fopenmp", "-D__AVX256__"}
ANSWER = {"arch": "X86_64", "flags": ["avx2"]}


@pytest.fixture
def asked(monkeypatch, tmp_path):
    """A py-cpuinfo that counts its questions, a cache folder of the test's own."""
    import cpuinfo

    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path))
    questions = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: questions.append(1) or dict(ANSWER))
    return questions


def builders():
    from deepspeed.accelerator import get_accelerator

    return [get_accelerator().create_op_builder(name) for name in ("FusedAdamBuilder", "CPUAdamBuilder")]


def test_deepspeeds_builders_ask_twice_per_op_and_once_in_all_when_kept(asked, tmp_path):
    fused, cpu_adam = builders()
    assert FLAGS <= set(fused.cxx_args())
    assert len(asked) == 2  # DeepSpeed as shipped: two questions (two new processes) per op
    startup.keep_cpu_info()
    startup.keep_cpu_info()  # once is enough: not wrapped twice
    for builder in (fused, cpu_adam, fused):
        assert FLAGS <= set(builder.cxx_args())
    assert len(asked) == 3
    kept = list((tmp_path / "cpuinfo").glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == ANSWER


def test_the_next_process_on_the_machine_reads_the_kept_answer(asked, tmp_path):
    startup.keep_cpu_info()
    import cpuinfo

    assert cpuinfo.get_cpu_info() == ANSWER and len(asked) == 1
    probe = ("import cpuinfo, json; from finetune_kit.launch import startup\n"
             "cpuinfo.get_cpu_info = lambda: (_ for _ in ()).throw(AssertionError('asked again'))\n"
             "startup.keep_cpu_info(); print(json.dumps(cpuinfo.get_cpu_info()))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ANSWER
    # the negative control: another boot (or machine) finds nothing kept and asks
    other = probe.replace("startup.keep_cpu_info()", "startup.BOOT_ID = __import__('pathlib').Path('/nonexistent'); "
                          "startup.keep_cpu_info()")
    failed = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True)
    assert failed.returncode != 0 and "asked again" in failed.stderr


def test_a_folder_it_cannot_write_costs_only_the_saving(asked, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(blocked))
    startup.keep_cpu_info()
    import cpuinfo

    assert cpuinfo.get_cpu_info() == ANSWER and cpuinfo.get_cpu_info() == ANSWER and len(asked) == 1


# ---- the NUMA layout: as shipped, each of DeepSpeed's CPU accelerator's ``device_count()`` (ZeRO-3 asks at every
# gradient reduce) runs ``numactl`` in a new process


@pytest.fixture
def numa_asked(monkeypatch):
    """A NUMA reader that counts its questions (two nodes of two cores), no LOCAL_SIZE, and the module's own
    function restored after the test."""
    from deepspeed.utils import numa

    questions = []
    monkeypatch.setattr(numa, "get_numa_cores", lambda: questions.append(1) or [[0, 1], [2, 3]])
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    return questions


def test_the_accelerator_asks_at_every_count_and_once_in_all_when_kept(numa_asked):
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accelerator = CPU_Accelerator()
    assert [accelerator.device_count() for _ in range(3)] == [2, 2, 2]
    assert len(numa_asked) == 3  # DeepSpeed as shipped: a new numactl process each time
    startup.keep_numa_layout()
    startup.keep_numa_layout()  # once is enough: not wrapped twice
    assert [accelerator.device_count() for _ in range(3)] == [2, 2, 2]
    assert len(numa_asked) == 4


def test_a_launcher_that_sets_local_size_is_not_asked(numa_asked, monkeypatch):
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    monkeypatch.setenv("LOCAL_SIZE", "2")
    startup.keep_numa_layout()
    assert CPU_Accelerator().device_count() == 2 and numa_asked == []


# ---- DeepSpeed's Muon module imported with TorchDynamo off, in a fresh interpreter each: Inductor's compiler stays
# unimported, Muon's function plain, the environment as it was; the negative control, DeepSpeed's own import, brings
# Inductor's compiler in; a Muon run is left alone

PROBE = """
import json, os, sys
import torch
from finetune_kit.launch.startup import MODULE, import_muon_uncompiled
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
MUON = {**ADAMW, "optimizer": {"type": "Muon", "params": {"lr": "auto"}}}


@pytest.mark.parametrize("how, want", [
    ("ours", {"imported": True, "inductor": False, "plain": True, "env": None}),
    ("deepspeed", {"imported": True, "inductor": True, "plain": False, "env": None}),  # the negative control
])
def test_muon_imports_without_inductor_for_another_optimizer(how, want):
    assert probe(ADAMW, how) == want


def test_a_muon_run_is_left_to_deepspeed(monkeypatch):
    """Its optimizer compiled as DeepSpeed means: nothing is imported ahead."""
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    assert uses_muon(MUON) and not uses_muon(ADAMW) and not uses_muon({})
    assert import_muon_uncompiled(MUON) is False and MODULE not in sys.modules


# ---- the one call


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_one_call_applies_what_fits_the_process(asked, numa_asked, monkeypatch):
    """On a CPU-only machine both answers are kept; a Muon run's config imports nothing ahead."""
    import cpuinfo
    from deepspeed.utils import numa

    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    startup.speed_up(MUON)
    assert MODULE not in sys.modules
    assert cpuinfo.get_cpu_info.kept and numa.get_numa_cores.kept
    assert cpuinfo.get_cpu_info() == cpuinfo.get_cpu_info() == ANSWER and len(asked) == 1
    assert numa.get_numa_cores() == numa.get_numa_cores() and len(numa_asked) == 1
