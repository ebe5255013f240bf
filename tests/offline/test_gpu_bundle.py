"""The offline bundle for a GPU host that has its own torch, rehearsed on CPU, and the GPU smoke run from it.

A fresh environment imitates such a host: torch already there (the pinned build, linked in from
the stack rather than installed again), an older transformers and the libraries a GPU image
brings, none of deepspeed, bitsandbytes, datasets, pydantic or lm-eval. `make gpu-bundle`'s script
asks that environment for its packages and bundles what it lacks (with the eval extra and
Liger-Kernel, as `make gpu-bundle` makes it); the bundle goes in with pip's --no-index, and the GPU
smoke (`python -m finetune_tools.gpu_check --smoke`) runs from it at the tiny width, as it runs on a
GPU host, its rows that use each carried library (REHEARSED): each row in its own process, then make eval
and make merge on what two rows saved.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.harness import REPO
from tests.op_compiler import op_compiler

pytestmark = pytest.mark.recipe

HOST_LIBRARIES = ["transformers==5.17.0", "accelerate", "tokenizers", "safetensors", "huggingface-hub", "numpy",
                  "pandas", "pyarrow", "ninja", "psutil", "pyyaml", "tqdm", "regex", "requests", "packaging",
                  "einops", "msgpack", "py-cpuinfo", "prometheus-client", "nvidia-ml-py",
                  # what lm-eval needs that such an image has (docker/gpu-host-packages.txt)
                  "scikit-learn", "sacrebleu", "jinja2", "absl-py", "six", "xxhash", "joblib", "click"]
EXTRAS = ["--extra", "eval", "--also", "liger-kernel==0.8.5"]  # as make gpu-bundle's BUNDLE_EXTRAS
# The smoke's rows that bring each carried library into play: deepspeed, datasets and the pinned transformers
# (samples), lm-eval (eval), torchao (fp8), bitsandbytes and peft (qlora, merge); liger-kernel's row says it is
# not applicable on a CPU. The others (packed varlen, the tiled MLP with offloaded checkpoints, compiled FSDP2
# fp8) use no library the bundle adds: the 8B recipe's tests run those paths on CPU, and every row's flags go
# through the recipes' parsers in tests/unit/gpu_check/test_smoke.py.
REHEARSED = ["8b-zero3-samples", "8b-eval-cuda", "8b-liger", "8b-zero3-fp8-rowwise", "70b-qlora", "70b-merge"]
WORK = REPO / ".nox/gpu-host"
# the ops the rehearsed rows load on a CPU (every row's optimizer is fused Adam, none CPU Adam: gpu_check.smoke.OPS)
BUILD_OPS = ("from deepspeed.accelerator import get_accelerator\n"
             "for name in ('FusedAdamBuilder', 'ShareMemCommBuilder'):\n"
             "    get_accelerator().create_op_builder(name).load(verbose=False)\n")


def link_torch(site: Path, into: Path) -> list[str]:
    """Symlink the installed torch and everything it requires (its files and dist-info) into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    todo, done = ["torch"], set()
    while todo:
        name = todo.pop()
        dist = metadata.distribution(name)
        key = dist.metadata["Name"].lower()
        if key in done:
            continue
        done.add(key)
        tops = {Path(f).parts[0] for f in dist.files or [] if not Path(f).parts[0].startswith("..")}
        for top in tops:
            if (site / top).exists() and not (into / top).exists():
                (into / top).symlink_to(site / top)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(done)


@pytest.fixture(scope="module")
def host() -> dict:
    """The imitation host: its Python, the bundle made for it, and the folder the bundle went into."""
    shutil.rmtree(WORK, ignore_errors=True)
    venv, torch_dir, bundle, site = WORK / "venv", WORK / "torch", WORK / "bundle", WORK / "site"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin/python"
    stack_site = Path(metadata.distribution("torch").locate_file(""))
    linked = link_torch(stack_site, torch_dir)
    pth = next((venv / "lib").glob("python3*/site-packages")) / "host-torch.pth"
    pth.write_text(f"{torch_dir}\n")
    # the host's own libraries, resolved beside its torch: an older transformers than the recipes pin,
    # with the hub client and tokenizers it accepts; the lock's versions for the rest
    own = ("#", "torch==", "transformers==", "huggingface-hub==", "huggingface_hub==", "tokenizers==")
    pins = [line for line in (REPO / "docker/requirements.txt").read_text().splitlines()
            if "==" in line and not line.startswith(own)]
    constraints = WORK / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    # --no-compile here and below: no bytecode compiled at install (about 20 CPU seconds of each install); the processes
    # that then import a module compile it and keep it, the host's and the bundle's folders being writable (the smoke's
    # environment lets them write it)
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-compile", "-c", str(constraints),
                    *HOST_LIBRARIES], check=True)
    # as on the hosts described: no pydantic (pip brings it for the newest typer, which such images predate)
    subprocess.run([str(py), "-m", "pip", "uninstall", "--quiet", "--yes", "pydantic", "pydantic-core"], check=True)
    made = subprocess.run(["bash", str(REPO / "docker/build-gpu-bundle.sh"), "--host-python", str(py), *EXTRAS,
                           str(bundle)], capture_output=True, text=True, cwd=REPO)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-compile", "--no-index", "--no-deps", "--target",
                    str(site), *map(str, sorted(bundle.glob("*.whl")))], check=True)
    return {"python": py, "bundle": bundle, "site": site, "linked": linked, "log": made.stdout + made.stderr}


def wheels(bundle: Path) -> dict[str, str]:
    return {w.name.split("-")[0].lower().replace("_", "-"): w.name.split("-")[1] for w in bundle.glob("*.whl")}


def test_the_bundle_holds_what_the_host_lacks_and_nothing_it_has(host):
    carried = wheels(host["bundle"])
    assert {"deepspeed", "bitsandbytes", "datasets", "pydantic", "hjson", "lm-eval", "evaluate",
            "liger-kernel"} <= set(carried), carried
    assert {"rouge-score", "sqlitedict", "word2number"} <= set(carried)  # source-only pins, built into wheels
    assert carried["transformers"] == "5.23.0"  # the host's 5.17.0 is older than the pin
    assert not {"torch", "accelerate", "numpy", "pyarrow", "tokenizers", "scikit-learn", "triton"} & set(carried)
    assert "transformers 5.23.0: 5.17.0 is older than the pinned 5.23.0" in host["log"]
    assert "carry lm-eval 0.4.13: missing (the kit's [eval] extra)" in host["log"]
    assert "carry liger-kernel 0.8.5: asked for (--also" in host["log"]


def test_bitsandbytes_carries_only_its_cpu_and_one_cuda_library(host):
    bnb = next(host["bundle"].glob("bitsandbytes-*.whl"))
    libs = sorted(Path(n).name for n in zipfile.ZipFile(bnb).namelist() if "libbitsandbytes_" in n)
    assert libs == ["libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so"]


def test_the_smoke_runs_from_the_bundle_with_the_hosts_torch(host, tmp_path):
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(map(str, (host["site"], REPO / "shared", REPO / "shared/tools"))),
           "PATH": f"{host['site'] / 'bin'}{os.pathsep}{host['python'].parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1",
           # the host's own op cache: DeepSpeed keys its JIT builds by op name, and the bundle's sources (another
           # path) would rebuild the shared environment's ops there, and its next launch rebuild them back
           "TORCH_EXTENSIONS_DIR": str(WORK / "torch_extensions")}
    env.pop("VIRTUAL_ENV", None)
    # the host's and the bundle's modules, installed without bytecode, compiled once by the first process that imports
    # them and kept for the next ones, as on a host (with PYTHONDONTWRITEBYTECODE set, as on some CI machines, every
    # process of the rehearsal would compile them again)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    where = subprocess.run([str(host["python"]), "-c", "import torch, transformers, deepspeed, lm_eval; "
                            "print(torch.__file__, transformers.__version__, deepspeed.__file__, lm_eval.__file__)"],
                           capture_output=True, text=True, env=env, check=True).stdout.splitlines()[-1].split()
    assert where[0].startswith(str(WORK / "torch")) and where[1] == "5.23.0"
    assert where[2].startswith(str(host["site"])) and where[3].startswith(str(host["site"]))
    # DeepSpeed's CPU ops built from the bundle's sources into the host's cache first: each row's timeout is for
    # its run, not for a first compile on cores that make test's other sessions share. The sources are the shared
    # environment's DeepSpeed's in another folder: objects its ops session compiled are taken as they are
    # (tests/op_compiler.py; each source still preprocessed and its object linked into the host's op)
    with op_compiler() as compiler:
        wrapper = compiler["PATH"].split(os.pathsep)[0]  # before the host's PATH
        built = subprocess.run([str(host["python"]), "-c", BUILD_OPS], capture_output=True, text=True,
                               env={**env, **compiler, "PATH": f"{wrapper}{os.pathsep}{env['PATH']}"}, timeout=1500)
    assert built.returncode == 0, built.stderr[-3000:]
    proc = subprocess.run([str(host["python"]), "-m", "finetune_tools.gpu_check", "--smoke", "--tiny", "--rows",
                           ",".join(REHEARSED), "--case-timeout", "600", "--out", str(tmp_path)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {row["name"]: row["status"] for row in summary["rows"]}
    assert list(status) == REHEARSED
    assert status.pop("8b-liger") == "not applicable"  # Liger's kernel needs CUDA; on a GPU it runs
    assert set(status.values()) == {"ok"}, {r["name"]: r.get("error") for r in summary["rows"]}
    assert summary["libraries"]["transformers"] == "5.23.0" and summary["libraries"]["lm-eval"] == "0.4.13"
    rows = {row["name"]: row for row in summary["rows"]}
    assert rows["8b-eval-cuda"]["result"]["tasks"]["heldout"]["loss"] > 0  # lm-eval ran, from the bundle
    assert rows["70b-merge"]["result"]["merged_files"] and (tmp_path / "70b-qlora/merged/config.json").is_file()
    assert (tmp_path / "8b-zero3-samples/samples.jsonl").read_text().count("\n") == 4
    assert all(rows[name]["tokens_per_s_per_device"] > 0 for name in status if not name.endswith(("eval-cuda",
                                                                                                    "merge")))
    assert "row" in proc.stdout and f"{len(status)} of {len(rows)} ok, 0 failed" in proc.stdout
