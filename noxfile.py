"""Verification sessions. `make test` runs the default ones; `make demo` runs `demo`.

    nox                             # lint, unit, and every recipe session
    nox -s test-llama3-8b-zero3   # one recipe end to end on a tiny model, 2 CPU processes
    nox -s demo                     # the 8B recipe on the tiny model, for a first look
    nox -s results                  # regenerate results/README.md and results/throughput.png
    nox -s image                    # build the images with podman and train in the 8B one
    nox -s test-llama3-8b-zero3-nvme    # ZeRO-Infinity to a temporary folder (compiles DeepSpeed's async_io first)
    nox -s live-metrics             # a real Prometheus scraping a 2-process run; TensorBoard beside it
    nox -s lock                     # regenerate the hash locks from the pins (make lock)

The sessions that train (unit, every recipe, demo) share one environment, ``.nox/stack``: the
pinned stack (docker/requirements.txt + requirements-dev.txt), built once and rebuilt only when
a lock file changes, with DeepSpeed's CPU ops compiled once into it. Each session reinstalls the
runtime package (finetune_kit) and the tools over the repository (finetune_tools, shared/tools) as a
user would (regular, non-editable installs). On a CPU without bf16 and fp16 matrix instructions (AVX2 only),
the test sessions' processes compute those products in fp32 (tests/half_matmul.py): torch's own kernels
there are a scalar loop, and were about half of the recipes' step time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import nox

nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "stack", "unit", "test-llama3-8b-zero3", "gpu-check-cpu", "wheelhouse",
                        "test-llama2-13b-zero2", "test-llama3-8b-dpo", "test-llama3-70b-qlora",
                        "test-llama3-70b-qlora-chat", "kubernetes", "gpu-bundle", "slurm", "live-metrics",
                        "test-llama3-8b-zero3-nvme", "image"]

ROOT = Path(__file__).parent
STACK = ROOT / ".nox/stack"
LOCKS = ("docker/requirements.txt", "docker/requirements-dev.txt", "docker/install-python-deps.sh")


def stack(session: nox.Session) -> dict[str, str]:
    """Create (or reuse) the shared environment, install the package into it, and return the
    environment variables that put it first on PATH."""
    digest = hashlib.sha256(b"".join((ROOT / lock).read_bytes() for lock in LOCKS)).hexdigest()
    stamp = STACK / "locks.sha256"
    env = {"PATH": f"{STACK / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(STACK),
           # DeepSpeed JIT-builds its CPU ops into a cache keyed by op name only: one cache for
           # this environment, so the ops are compiled once for every session.
           "TORCH_EXTENSIONS_DIR": str(STACK / "torch_extensions")}
    if not stamp.is_file() or stamp.read_text() != digest:
        session.log(f"building the shared environment {STACK} from {', '.join(LOCKS)}")
        shutil.rmtree(STACK, ignore_errors=True)
        session.run(sys.executable, "-m", "venv", str(STACK), external=True)
        session.run("bash", str(ROOT / "docker/install-python-deps.sh"), "--dev", env=env, external=True)
        stamp.write_text(digest)
    installed, source = STACK / "package.sha256", package_digest()
    if not installed.is_file() or installed.read_text() != source:  # once per change of the packages' files
        session.run(str(STACK / "bin/python"), "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall",
                    str(ROOT), str(ROOT / "shared/tools"), env=env, external=True)
        installed.write_text(source)
    install_half_matmul()
    return env


def install_half_matmul() -> None:
    """tests/half_matmul.py into the shared environment, loaded at each interpreter's start by a .pth file: with
    HALF_MATMUL_VIA_FP32=1 (the test sessions), bf16 and fp16 matrix products in fp32 on a CPU without instructions
    for them (a scalar loop in torch there, many times slower); otherwise it does nothing."""
    site = next(STACK.glob("lib/python3*/site-packages"))
    module, source = site / "half_matmul_via_fp32.py", (ROOT / "tests/half_matmul.py").read_text()
    if not module.is_file() or module.read_text() != source:
        module.write_text(source)
    pth = site / "half_matmul_via_fp32.pth"
    if not pth.is_file():
        pth.write_text("import half_matmul_via_fp32\n")


def package_digest() -> str:
    """A digest of what `pip install .` installs: sessions reinstall the package only when it changed,
    so none rewrites it under another still running (make test builds the images alongside)."""
    files = [ROOT / "pyproject.toml", ROOT / "README.md",
             *(f for f in sorted((ROOT / "shared").rglob("*")) if f.is_file() and "__pycache__" not in f.parts
               and "build" not in f.relative_to(ROOT).parts  # pip's in-tree build of shared/tools
               and not any(part.endswith(".egg-info") for part in f.parts))]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.relative_to(ROOT)}\0".encode() + f.read_bytes())
    return digest.hexdigest()


TIMES = ROOT / ".nox/session-times.jsonl"  # read by `python -m finetune_tools.repo suite-time` (.ci/run)


def timed(func):
    """Append the session's name, wall-clock and CPU seconds and result to TIMES when it ends (make test starts the
    file afresh): how long each session took and how much of the machine it used, whatever nox prints."""

    @functools.wraps(func)
    def run(session: nox.Session) -> None:
        start, started, ok, cpu = time.monotonic(), time.time(), False, children_cpu_seconds()
        os.environ["SUITE_SESSION"] = session.name  # the tests' launch counts name their session (tests/conftest.py)
        try:
            func(session)
            ok = True
        finally:
            TIMES.parent.mkdir(exist_ok=True)
            with TIMES.open("a") as f:
                f.write(json.dumps({"session": session.name, "started": round(started, 1),
                                    "seconds": round(time.monotonic() - start, 1),
                                    "cpu_seconds": round(children_cpu_seconds() - cpu, 1), "ok": ok}) + "\n")

    return run


def children_cpu_seconds() -> float:
    """User and system CPU seconds of every finished process this one waited for, and theirs: a session's
    processes (pytest, the ranks it launches, pip, compilers), not the containers podman runs beside it."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_in_stack(session: nox.Session, *args: str) -> None:
    # tests/half_matmul.py (HALF_MATMUL_VIA_FP32=0 in the environment: torch's own kernels)
    env = {**stack(session), "HALF_MATMUL_VIA_FP32": os.environ.get("HALF_MATMUL_VIA_FP32", "1")}
    session.run(str(STACK / "bin" / args[0]), *args[1:], env=env, external=True)


@nox.session
@timed
def lint(session: nox.Session) -> None:
    """ruff on all Python, hadolint on the Dockerfiles."""
    session.install("-r", "docker/requirements-dev.txt")
    session.run("ruff", "check", ".")
    for dockerfile in sorted(ROOT.glob("**/Dockerfile")):
        if ".nox" not in dockerfile.parts:
            session.run("hadolint", "--failure-threshold", "warning", str(dockerfile))


@nox.session(name="stack", venv_backend="none")
@timed
def stack_session(session: nox.Session) -> None:
    """The shared environment every later session runs in, built (or found up to date) before them: make test
    then compiles DeepSpeed's ops into it in the background (the ops session) while the tests run."""
    stack(session)


@nox.session(venv_backend="none", default=False)
@timed
def ops(session: nox.Session) -> None:
    """DeepSpeed's JIT ops the sessions load on CPU, compiled into the shared environment's cache ahead of
    their first use (tests/ops.py); make test runs this in the background from when the environment exists.
    nox -s ops -- NAME ...: those ops alone (make test-quick)."""
    run_in_stack(session, "python", "-m", "tests.ops", *session.posargs)


@nox.session(venv_backend="none")
@timed
def unit(session: nox.Session) -> None:
    """Unit tests of the shared package and the shipped configs."""
    run_in_stack(session, "pytest", "tests/unit", *session.posargs)


# One session per recipe, named like its folder: its own train.py and configs on a tiny model.
RECIPE_SESSIONS = {
    "llama3-8b-zero3": "tiny Llama 3, 2 CPU processes",
    "llama2-13b-zero2": "tiny Llama 2, 2 CPU processes, both launchers",
    "llama3-8b-dpo": "DPO on preference pairs, tiny Llama 3, 1 and 2 CPU processes",
    "llama3-70b-qlora": "two-node job (2 launchers, 1 CPU rank each)",
    "llama3-70b-qlora-chat": "two-node job on chat data (2 launchers, 1 CPU rank each)",
}


def recipe_session(name: str, what: str) -> None:
    def run(session: nox.Session) -> None:
        run_in_stack(session, "pytest", f"tests/recipes/test_{name.replace('-', '_')}.py", *session.posargs)

    run.__doc__ = f"The {name} recipe end to end: {what}."
    nox.session(name=f"test-{name}", venv_backend="none")(timed(run))


for _name, _what in RECIPE_SESSIONS.items():
    recipe_session(_name, _what)

QUICK_FILES = [f"tests/recipes/test_{name.replace('-', '_')}.py" for name in RECIPE_SESSIONS]


@nox.session(name="readme-commands", venv_backend="none", default=False)
@timed
def readme_commands(session: nox.Session) -> None:
    """Each recipe's README command once on its tiny model, with the checks that only read what it wrote (the tests
    marked quick), and make demo's verdict: make test-quick's part of the recipe sessions, which run them too."""
    run_in_stack(session, "pytest", "-m", "quick", *QUICK_FILES, *session.posargs)


@nox.session(name="test-llama3-8b-zero3-nvme", venv_backend="none")
@timed
def recipe_llama3_8b_nvme(session: nox.Session) -> None:
    """The 8B recipe with ZeRO-Infinity (configs/zero3-nvme.*), 2 CPU processes: trains through NVMe swap
    files and resumes exactly. DeepSpeed's async_io op compiles into the shared environment once, ahead in
    make test's ops session or at its first use here (minutes); installs libaio if missing."""
    run_in_stack(session, "pytest", "tests/recipes/test_llama3_8b_zero3_nvme.py", *session.posargs)


@nox.session(venv_backend="none")
@timed
def slurm(session: nox.Session) -> None:
    """A real Slurm cluster (Debian's slurmctld, slurmdbd on MariaDB and two slurmd nodes in network
    namespaces; installed if missing) runs each recipe's slurm/train.sbatch unchanged: the 8B and 13B
    jobs on one node, the 70B job across both, a preempted and a timed-out job requeued and resumed; and
    the 8B recipe's slurm/long-context.sbatch with one sequence-parallel group across both nodes.
    tests/slurm_cluster.py starts it, waits for both nodes to be idle and tears it down whatever happens."""
    run_in_stack(session, "pytest", "tests/recipes/test_slurm.py", *session.posargs)


@nox.session(venv_backend="none")
@timed
def kubernetes(session: nox.Session) -> None:
    """The recipes' Kubernetes manifests run as their pods would: each container command in network
    namespaces as PID 1, with the variables Kubeflow Trainer and the training-operator inject; a
    stopped pod checkpoints and its restart resumes. (The manifests' validation is in the unit tests.)"""
    run_in_stack(session, "pytest", "tests/recipes/test_k8s_launch.py", *session.posargs)


@nox.session(name="live-metrics", venv_backend="none")
@timed
def live_metrics(session: nox.Session) -> None:
    """Debian's Prometheus (installed if missing) with docker/monitoring's scrape configuration reads
    both ranks' series from a 2-process run of the 8B recipe, which also reports to TensorBoard."""
    run_in_stack(session, "pytest", "tests/recipes/test_live_metrics.py", *session.posargs)


@nox.session(name="gpu-check-cpu", venv_backend="none")
@timed
def gpu_check_cpu(session: nox.Session) -> None:
    """The GPU check (make gpu-check) at a tiny width on CPU: every recipe's code path, its records."""
    run_in_stack(session, "pytest", "tests/recipes/test_gpu_check.py", *session.posargs)


@nox.session(name="gpu-bundle", venv_backend="none")
@timed
def gpu_bundle(session: nox.Session) -> None:
    """The offline bundle for a GPU host with its own torch (make gpu-bundle), made for an imitation
    of such a host on CPU, installed there with --no-index, and the GPU smoke run from it at the tiny width.
    With arguments, only makes a bundle: nox -s gpu-bundle -- [--have FREEZE] [--cuda 130] [DIR]."""
    if session.posargs:
        env = stack(session)
        session.run("bash", str(ROOT / "docker/build-gpu-bundle.sh"), *session.posargs, env=env, external=True)
        return
    run_in_stack(session, "pytest", "tests/offline/test_gpu_bundle.py")


@nox.session(venv_backend="none")
@timed
def wheelhouse(session: nox.Session) -> None:
    """The offline install: a wheelhouse of the whole pinned stack (DeepSpeed built as a wheel),
    installed into a fresh environment with pip's --no-index, then imported."""
    env = stack(session)  # DeepSpeed's wheel is built against the pinned torch installed there
    house, target = ROOT / ".nox/wheelhouse", ROOT / ".nox/offline"
    for folder in (house, target):
        shutil.rmtree(folder, ignore_errors=True)
    session.run("bash", str(ROOT / "docker/build-wheelhouse.sh"), str(house), env=env, external=True)
    session.run(sys.executable, "-m", "venv", str(target), external=True)
    offline = {"PATH": f"{target / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(target),
               "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "",  # no index, no other folder: only the wheelhouse
               # no bytecode: one process imports the libraries, compiling what it loads; pip's compile of every
               # module (19,000 files, 294 MB in the shared environment) is about a minute of one core on the EPYC
               "PIP_COMPILE": "0"}
    session.run("bash", str(ROOT / "docker/install-python-deps.sh"), "--wheelhouse", str(house), env=offline,
                external=True)
    session.run(str(target / "bin/python"), "-c", IMPORT_CHECK, env=offline, external=True)


IMPORT_CHECK = """
import importlib.metadata as md
import accelerate, bitsandbytes, datasets, deepspeed, peft, torch, transformers
import lm_eval, rouge_score, sqlitedict, word2number  # the evaluation harness; the last three built from source
pins = dict(l.split("==") for l in open("docker/requirements.txt") if "==" in l and not l.startswith("#"))
for lib in ("torch", "deepspeed", "transformers", "accelerate", "peft", "bitsandbytes", "datasets"):
    got = md.version(lib).split("+")[0]
    assert got == pins[lib].strip(), (lib, got, pins[lib])
    print(f"{lib} {got}: installed from the wheelhouse")
"""


@nox.session(venv_backend="none")
@timed
def image(session: nox.Session) -> None:
    """The images built and run with podman: docker/Dockerfile and the 8B recipe's Dockerfile on a
    Debian base standing in for the CUDA base, from a wheelhouse of the CPU lock; then the 8B recipe
    trains with 2 processes in the container (needs root and Debian's podman, installed if missing)."""
    run_in_stack(session, "pytest", "tests/container", *session.posargs)


@nox.session(name="image-build", venv_backend="none", default=False)
@timed
def image_build(session: nox.Session) -> None:
    """The image session's two images built ahead (make test runs this in the background from its start; the image
    session then takes them from podman's layer cache). Needs no shared environment: nox's own Python runs it (and
    fetches the image's wheelhouse with its pip), so it starts while the lint and stack sessions leave a core idle."""
    session.run(sys.executable, "-m", "tests.container.images", external=True,
                env={"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})


@nox.session(default=False)
def lock(session: nox.Session) -> None:
    """Regenerate docker/requirements.lock and requirements-cpu.lock from the pins (needs the index;
    TORCH_CPU_WHEELS=DIR takes the CPU torch wheel from a folder)."""
    session.install("-c", "docker/requirements-dev.txt", "uv")
    session.install("-c", "docker/requirements.txt", "pydantic")  # the pins check reads the run record's schema
    session.run("bash", "docker/lock.sh", external=True)
    session.run("python", "-c", "import sys; sys.path[:0] = ['shared', 'shared/tools']; "
                "from finetune_tools.repo.__main__ import main; sys.exit(main(['pins']))")


# The demo's schedule, chosen by measurement on a 2-core AMD EPYC (the tiny model: hidden 64, 2 layers, a 512-token
# vocabulary): 3 epochs at 1e-3 (60 steps) left 0 of 8 held-out answers in the references' form; 12 at 5e-3 (84
# steps) 4; 17 at 4e-3 (119 steps) 5; 24 at 3e-3 (168 steps) 7, validation loss 6.27 -> 2.08 nats/token.
DEMO_EPOCHS, DEMO_LR = "24", "3e-3"


@nox.session(default=False, venv_backend="none")
def demo(session: nox.Session) -> None:
    """Fine-tune a tiny Llama 3 on the shipped sample with the 8B recipe (2 CPU processes), long enough that its
    held-out answers take the form of the references: the run ends with the answers before and after and a
    verdict line (DEMO_OUTPUT: where the run goes, by default out/demo/llama3-8b-zero3)."""
    env = stack(session)
    python = str(STACK / "bin/python")
    model = ROOT / "build/tiny-llama3"
    if not (model / "config.json").is_file():
        session.run(python, "-m", "finetune_tools.tiny_models", "--family", "llama3", "--out", str(model), env=env,
                    external=True)
    output = Path(os.environ.get("DEMO_OUTPUT") or ROOT / "out/demo/llama3-8b-zero3").resolve()
    if output.exists():
        session.log(f"removing the previous demo run in {output}")
        shutil.rmtree(output)
    session.chdir(ROOT / "recipes/llama3-8b-zero3")
    session.run(  # the README's launch command, its inputs checked once first (finetune_kit.check)
        python, "-m", "finetune_kit.check",
        str(STACK / "bin/accelerate"), "launch", "--config_file", "configs/zero3.yaml", "--num_processes", "2",
        "train.py", "--model", str(model),
        "--data", str(ROOT / "shared/finetune_kit/data/samples/instructions.jsonl"),
        "--output", str(output), "--max-seq-len", "256", "--micro-batch-size", "4", "--grad-accum", "1",
        # rows packed 256 tokens to a sequence: each step sees ~8x the rows of padded ones for about the same time
        # (a tiny model's step is overhead)
        "--pack", "--epochs", DEMO_EPOCHS, "--lr", DEMO_LR, "--save-every", "50", "--log-every", "10",
        # held-out prompts answered before and after (their answers are short), then the verdict line
        "--samples", "8", "--sample-tokens", "48", "--sample-before",
        env=env, external=True,
    )
    session.log(f"demo finished: model in {output / 'model'} (its card: README.md there), sample answers in "
                f"{output / 'samples.jsonl'}, per-step metrics in {output / 'metrics.jsonl'}")


@nox.session(default=False)
def results(session: nox.Session) -> None:
    """Regenerate results/README.md and throughput.png from published.csv and the run records
    (needs only pydantic and matplotlib, pinned by the same lock files; no torch)."""
    session.install("-c", "docker/requirements.txt", "-c", "docker/requirements-dev.txt", "pydantic", "matplotlib")
    session.install("--no-deps", "--force-reinstall", str(ROOT), str(ROOT / "shared/tools"))
    session.run("python", "-m", "finetune_tools.results", *session.posargs)
