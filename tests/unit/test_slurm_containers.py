"""Each recipe's Slurm script runs its tasks in the recipe's image through pyxis when CONTAINER_IMAGE
is set, and on the host otherwise (srun and scontrol replaced by shims that record their arguments)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.parent.parent.name for p in (REPO / "recipes").glob("*/slurm/train.sbatch"))


def submit(recipe: str, tmp_path: Path, **env: str) -> list[str]:
    """slurm/train.sbatch from its recipe folder; returns the srun calls it made."""
    shims = tmp_path / "bin"
    shims.mkdir()
    log = tmp_path / "srun.log"
    # one line per call (the bash -c script spans lines); `hostname -I` answers with an address
    (shims / "srun").write_text(f'#!/bin/bash\necho "$*" | tr "\\n" " " >> {log}; echo >> {log}\n'
                                '[[ "${@: -1}" == -I ]] && echo 10.0.0.1\nexit 0\n')
    (shims / "scontrol").write_text("#!/bin/bash\necho node1\n")
    (shims / "python").write_text("#!/bin/bash\nexit 0\n")  # the 70B recipes' config check, on the host
    for shim in shims.iterdir():
        shim.chmod(0o755)
    run_env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "MODEL": "/nfs/m", "DATA": "/nfs/d.jsonl",
               "OUTPUT": str(tmp_path / "out"), "SLURM_JOB_NODELIST": "node[1-2]", **env}
    run_env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run(["bash", "slurm/train.sbatch"], cwd=REPO / "recipes" / recipe, env=run_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines()


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_training_tasks_run_in_the_image_with_pyxis(recipe, tmp_path):
    calls = submit(recipe, tmp_path, CONTAINER_IMAGE="/nfs/images/x.sqsh", CONTAINER_MOUNTS="/nfs:/nfs,/scratch")
    training = [c for c in calls if "train.py" in c]
    assert len(training) == 1, calls
    for flag in ("--container-image=/nfs/images/x.sqsh", "--container-mounts=/nfs:/nfs,/scratch",
                 f"--container-workdir=/workspace/recipes/{recipe}"):
        assert flag in training[0], training[0]
    if recipe.startswith("llama3-70b-qlora"):  # the config check runs in the image too
        assert [c for c in calls if "finetune_kit.launch.multinode" in c and "--container-image=" in c], calls


@pytest.mark.parametrize("recipe", RECIPES)
def test_without_an_image_the_tasks_run_on_the_host(recipe, tmp_path):
    calls = submit(recipe, tmp_path)
    assert calls and not [c for c in calls if "--container" in c], calls
