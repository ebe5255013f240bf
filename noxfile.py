"""Verification sessions. `make test` runs the default ones; `make demo` runs `demo`.

    nox                             # lint, unit, and every recipe session
    nox -s recipe-llama3-8b-zero3   # one recipe end to end on a tiny model, 2 CPU processes
    nox -s demo                     # the 8B recipe on the tiny model, for a first look
    nox -s results                  # regenerate results/README.md and results/throughput.png

Every session installs the one pinned stack (docker/requirements.txt) and the shared
package as a user would (a regular, non-editable install).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "unit", "recipe-llama3-8b-zero3", "recipe-llama2-13b-zero2", "recipe-llama3-70b-qlora"]

ROOT = Path(__file__).parent


def install_stack(session: nox.Session) -> None:
    session.run("bash", str(ROOT / "docker/install-python-deps.sh"), "--dev", external=True)
    # DeepSpeed JIT-builds its CPU ops into ~/.cache/torch_extensions, keyed by op name only:
    # venvs sharing it rebuild each other's builds (a minute or more each). One cache per venv.
    session.env["TORCH_EXTENSIONS_DIR"] = str(Path(session.virtualenv.location) / "torch_extensions")
    session.install("--no-deps", "--force-reinstall", str(ROOT))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff on all Python, hadolint on the Dockerfiles."""
    session.install("-r", "docker/requirements-dev.txt")
    session.run("ruff", "check", ".")
    for dockerfile in sorted(ROOT.glob("**/Dockerfile")):
        if ".nox" not in dockerfile.parts:
            session.run("hadolint", "--failure-threshold", "warning", str(dockerfile))


@nox.session
def unit(session: nox.Session) -> None:
    """Unit tests of the shared package and the shipped configs."""
    install_stack(session)
    session.run("pytest", "tests/unit", *session.posargs)


@nox.session(name="recipe-llama3-8b-zero3")
def recipe_llama3_8b_zero3(session: nox.Session) -> None:
    """The 8B recipe's own train.py and configs on a tiny Llama 3, 2 CPU processes."""
    install_stack(session)
    session.run("pytest", "tests/recipes/test_llama3_8b_zero3.py", *session.posargs)


@nox.session(name="recipe-llama2-13b-zero2")
def recipe_llama2_13b_zero2(session: nox.Session) -> None:
    """The 13B recipe's own train.py and configs on a tiny Llama 2, 2 CPU processes, both launchers."""
    install_stack(session)
    session.run("pytest", "tests/recipes/test_llama2_13b_zero2.py", *session.posargs)


@nox.session(name="recipe-llama3-70b-qlora")
def recipe_llama3_70b_qlora(session: nox.Session) -> None:
    """The 70B QLoRA recipe's own train.py and configs as a two-node job (2 launchers, 1 CPU rank each)."""
    install_stack(session)
    session.run("pytest", "tests/recipes/test_llama3_70b_qlora.py", *session.posargs)


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """Fine-tune a tiny Llama 3 on the shipped sample with the 8B recipe (2 CPU processes)."""
    install_stack(session)
    model = ROOT / "build/tiny-llama3"
    if not (model / "config.json").is_file():
        session.run("python", "-m", "finetune_kit.tiny", "--family", "llama3", "--out", str(model))
    output = ROOT / "out/demo/llama3-8b-zero3"
    if output.exists():
        session.log(f"removing the previous demo run in {output}")
        shutil.rmtree(output)
    session.chdir(ROOT / "recipes/llama3-8b-zero3")
    session.run(
        "accelerate", "launch", "--config_file", "configs/zero3.yaml", "--num_processes", "2",
        "train.py", "--model", str(model),
        "--data", str(ROOT / "shared/finetune_kit/sample_data/instructions.jsonl"),
        "--output", str(output), "--max-seq-len", "256", "--micro-batch-size", "4",
        "--grad-accum", "2", "--epochs", "3", "--lr", "1e-3", "--save-every", "30", "--log-every", "5",
    )
    session.log(f"demo finished: model in {output / 'model'}, per-step metrics in {output / 'metrics.jsonl'}")


@nox.session(default=False)
def results(session: nox.Session) -> None:
    """Regenerate results/README.md and throughput.png from published.csv and the run records
    (needs only pydantic and matplotlib, pinned by the same lock files)."""
    session.install("-c", "docker/requirements.txt", "-c", "docker/requirements-dev.txt", "pydantic", "matplotlib")
    session.install("--no-deps", "--force-reinstall", str(ROOT))
    session.run("python", "-m", "finetune_kit.report", *session.posargs)
