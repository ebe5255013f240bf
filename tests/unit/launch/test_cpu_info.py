"""py-cpuinfo asked once per machine boot: DeepSpeed's op builders, which ask it twice per op they load, get the
kept answer in this process and in the next ones on the machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from finetune_kit.launch import cpu_info

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
    cpu_info.keep()
    cpu_info.keep()  # once is enough: not wrapped twice
    for builder in (fused, cpu_adam, fused):
        assert FLAGS <= set(builder.cxx_args())
    assert len(asked) == 3
    kept = list((tmp_path / "cpuinfo").glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == ANSWER


def test_the_next_process_on_the_machine_reads_the_kept_answer(asked, tmp_path):
    cpu_info.keep()
    import cpuinfo

    assert cpuinfo.get_cpu_info() == ANSWER and len(asked) == 1
    probe = ("import cpuinfo, json; from finetune_kit.launch import cpu_info\n"
             "cpuinfo.get_cpu_info = lambda: (_ for _ in ()).throw(AssertionError('asked again'))\n"
             "cpu_info.keep(); print(json.dumps(cpuinfo.get_cpu_info()))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ANSWER
    # the negative control: another boot (or machine) finds nothing kept and asks
    other = probe.replace("cpu_info.keep()", "cpu_info.BOOT_ID = __import__('pathlib').Path('/nonexistent'); "
                          "cpu_info.keep()")
    failed = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True)
    assert failed.returncode != 0 and "asked again" in failed.stderr


def test_a_folder_it_cannot_write_costs_only_the_saving(asked, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(blocked))
    cpu_info.keep()
    import cpuinfo

    assert cpuinfo.get_cpu_info() == ANSWER and cpuinfo.get_cpu_info() == ANSWER and len(asked) == 1
