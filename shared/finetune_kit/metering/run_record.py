"""The JSON run record every recipe writes at the end: what ran, where, with what, and how fast.

Importing this module needs only pydantic (the report runs without the training stack).
A record is the unit of ``results/``: ``results/runs/*.json`` (GPU runs) and
``results/runs/smoke/*.json`` (CPU runs, kept apart: not performance figures) are what
``python -m finetune_tools.results`` turns into tables and a plot. Nothing there is typed by hand.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import re
import subprocess
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from finetune_kit.data.counts import DataCounts
from finetune_kit.metering.flops import device_name

SCHEMA = "finetune-kit/run-record/2"  # 2: hardware.peak_bf16_tflop_per_s_per_device
LIBRARIES = ("torch", "deepspeed", "transformers", "accelerate", "peft", "bitsandbytes", "datasets")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), populate_by_name=True)


class ModelInfo(_Strict):
    name: str  # hub id or path as given
    architecture: str  # e.g. "llama3-8b (truncated to 8 layers)", or "llama (2 layers, hidden 64)"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    params_total: int
    params_matmul: int  # N of the FLOP formula: all but the input embedding
    params_trainable: int
    truncated: bool = False  # fewer layers than the published model (benchmarks)


class Hardware(_Strict):
    device: str  # torch.cuda.get_device_name(), or "cpu"
    devices: int  # total over all nodes
    nodes: int
    peak_bf16_tflop_per_s_per_device: float | None  # None: CPU or unknown device, no MFU
    gpu_memory_cap_GiB: float | None = None  # FINETUNE_GPU_MEMORY_GIB: each GPU held to this many GiB


class Software(_Strict):
    python: str
    cuda: str | None
    libraries: dict[str, str | None]
    differs_from_pins: dict[str, str] = {}  # e.g. a GPU image's own torch: "2.11.0+cu130 (pinned 2.13.0)"


class Training(_Strict):
    method: str  # "full" | "lora" | "qlora"
    zero_stage: int  # 3 under FSDP2 (full sharding: weights, gradients and optimizer states split)
    engine: str = "deepspeed"  # "deepspeed" | "fsdp2": what shards the model
    offload: str  # "none" | "optimizer" | "optimizer+params"
    seq_len: int
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int  # sequences per optimizer step
    gradient_checkpointing: bool
    recompute_every: int = 1  # every N-th decoder layer checkpointed (1: all), when gradient_checkpointing
    compiled: bool = False  # decoder layers through torch.compile
    levers: str = ""  # --levers auto: the setting it chose, in one line, with its predicted memory and speed
    packing: bool = False
    loss_chunks: int = 0  # the LM loss computed this many token chunks at a time (0: the whole micro-batch)
    loss_kernel: str = "none"  # what computed it: "chunked" (plain torch) | "liger" (fused, CUDA) | "none"
    offload_activations: bool = False  # tensors saved for backward kept in host memory
    sequence_parallel: int = 1  # ranks that share each sequence (Ulysses); the global batch counts sequences
    tiled_mlp: bool = False  # each MLP a slice of the tokens at a time (DeepSpeed TiledMLP)
    fp8: str = "none"  # the linear layers' matmuls in float8 (torchao): "tensorwise" | "rowwise" scales
    cuda_alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF as the ranks had it ("": PyTorch's default allocator)


class Measured(_Strict):
    """Medians over steady-state optimizer steps (warm-up excluded); peaks over the run."""

    steps_total: int
    steps_measured: int
    warmup_steps_excluded: int
    flops_formula: str
    tokens_per_s: float | None = None
    tokens_per_s_per_device: float | None = None
    model_tflop_per_s_per_device: float | None = None
    mfu_percent: float | None = None
    padding_fraction: float | None = None
    step_time_s: float | None = None
    peak_gpu_allocated_GiB: float | None = None  # max over ranks
    peak_gpu_reserved_GiB: float | None = None  # max over ranks
    peak_gpu_device_GiB: float | None = None  # NVML's used memory of the GPU, max over ranks
    peak_host_rss_GiB_per_node: float | None = None  # sum over a node's ranks, max over nodes
    predicted_gpu_GiB: float | None = None  # the memory planner's prediction, when run
    first_step_after_s: float | None = None  # keys.FIRST_STEP_AFTER: rank 0's start to its first step


class SampleFigures(_Strict):
    """The sample answers in figures (training.samples.verdict's). Their text (prompts, references, answers) stays
    in the run folder's samples.jsonl: a record is what gets published, and carries no text of the data."""

    prompts: int  # answered at the end
    scored: int | None = None  # with a reference answer
    form_after: int | None = None  # answers in their reference's form (training.samples.form), after training
    exact_after: int | None = None  # word for word
    form_before: int | None = None  # --sample-before: the model as loaded
    exact_before: int | None = None


class RunRecord(_Strict):
    schema_: str = Field(SCHEMA, alias="schema")
    recipe: str
    label: str = ""  # short variant name for tables, e.g. "micro-batch 2, packed"
    date: str
    git_commit: str
    config_hash: str
    model: ModelInfo
    hardware: Hardware
    software: Software
    training: Training
    measured: Measured
    data: DataCounts | None = None  # instruction recipes: what tokenisation kept, truncated, dropped
    samples: SampleFigures | None = None  # generative recipes: how the final model answered held-out prompts
    evaluation: dict | None = None  # `make eval`'s summary (finetune_tools.harness): task -> metric -> value
    notes: str = ""

    @field_validator("samples", mode="before")
    @classmethod
    def _figures_of_rows(cls, value):
        """A record written before kept the sample rows themselves: read back as their count alone."""
        return {"prompts": len(value)} if isinstance(value, list) else value

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.model_dump(mode="json", by_alias=True), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, path: Path) -> RunRecord:
        data = json.loads(Path(path).read_text())
        if data.get("schema") != SCHEMA:
            raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
        return cls.model_validate(data)


# ---- collecting the provenance ----

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")  # a name==version line of a requirements file


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a requirements file, keyed by normalised name."""
    return {normalise(m[1]): m[2] for line in path.read_text().splitlines() if (m := PIN.match(line))}


def software() -> Software:
    import torch

    versions = {}
    for lib in LIBRARIES:
        try:
            versions[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            versions[lib] = None
    pins = pinned_versions()
    differs = {lib: f"{v} (pinned {pins[lib]})" for lib, v in versions.items()
               if v and lib in pins and v.split("+")[0] != pins[lib]}
    return Software(python=platform.python_version(), cuda=torch.version.cuda, libraries=versions,
                    differs_from_pins=differs)


def pinned_versions(start: Path | None = None) -> dict[str, str]:
    """The versions of the lock (docker/requirements.txt) of the checkout or image holding ``start``
    (default: the current folder); empty when there is none, e.g. a recipe folder copied elsewhere."""
    start = (Path.cwd() if start is None else Path(start)).resolve()
    for folder in (start, *start.parents):
        lock = folder / "docker/requirements.txt"
        if lock.is_file():
            return read_pins(lock)
    return {}


def git_commit(where: Path) -> str:
    """HEAD of the checkout holding ``where``, "+dirty" when it has uncommitted changes;
    "unknown" outside a git checkout (e.g. a copied recipe folder)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def config_hash(*parts) -> str:
    """sha256 (first 16 hex digits) of the JSON of what configures the run: the DeepSpeed
    config and the script's arguments. Equal hashes mean the same configuration."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def offload_of(ds_config: dict) -> str:
    zero = ds_config.get("zero_optimization", {})
    on = [what for what, key in (("optimizer", "offload_optimizer"), ("params", "offload_param"))
          if (zero.get(key) or {}).get("device", "none") not in ("none", None)]
    return "+".join(on) or "none"


def for_training_run(*, recipe: str, model_name: str, arch, flop_counter, params_trainable: int,
                     ds_config: dict, script_args: dict, world: int, nodes: int, training: dict,
                     meter, warmup_steps: int, peaks: dict, where: Path,
                     predicted_gpu_GiB: float | None = None, memory_cap_GiB: float | None = None,
                     engine: str = "deepspeed", first_step_after_s: float | None = None) -> RunRecord:
    """Assemble the record at the end of a run from what the script already has.

    ``training``: method, seq_len, micro_batch_size, grad_accum, gradient_checkpointing
    [, packing]; ``peaks``: from ``metering.peak_memory.peaks_all_ranks``; ``ds_config``: the DeepSpeed
    JSON, or under ``engine="fsdp2"`` the FSDP settings (hashed with the arguments).
    """
    num_labels = flop_counter.num_labels
    summary = meter.summary(warmup_steps)
    medians = {k.removeprefix("median_"): v for k, v in summary.items() if k.startswith("median_")}
    return RunRecord(
        recipe=recipe, date=now(), git_commit=git_commit(where),
        config_hash=config_hash(ds_config, script_args),
        model=ModelInfo(name=model_name, architecture=arch.name, layers=arch.num_hidden_layers,
                        hidden=arch.hidden_size, heads=arch.num_attention_heads, kv_heads=arch.num_key_value_heads,
                        params_total=arch.total_params(num_labels),
                        params_matmul=arch.matmul_params(num_labels), params_trainable=params_trainable,
                        truncated="truncated" in arch.name),
        hardware=Hardware(device=device_name(), devices=world, nodes=nodes,
                          peak_bf16_tflop_per_s_per_device=meter.peak_tflops,
                          gpu_memory_cap_GiB=memory_cap_GiB),
        software=software(),
        training=Training(zero_stage=3 if engine == "fsdp2" else ds_config.get("zero_optimization", {}).get("stage", 0),
                          offload=offload_of(ds_config), engine=engine,
                          global_batch_size=training["micro_batch_size"] * training["grad_accum"] * world
                          // training.get("sequence_parallel", 1),
                          **training),
        measured=Measured(steps_total=len(meter.history), steps_measured=summary["steps_measured"],
                          warmup_steps_excluded=warmup_steps, flops_formula=flop_counter.method,
                          **medians, **peaks,
                          predicted_gpu_GiB=predicted_gpu_GiB, first_step_after_s=first_step_after_s),
    )


# ---- run_info.json: what one run did, in the same shape for every recipe ----

RUN_INFO_SCHEMA = "finetune-kit/run-info/2"  # 2: devices, seq_len (as in the run record)


class RunInfo(_Strict):
    """``run_info.json``: the run's own facts (data split, per-rank shards, evaluation, the memory
    plan), written next to the run record. Recipe-specific facts go in ``details``."""

    schema_: str = Field(RUN_INFO_SCHEMA, alias="schema")
    recipe: str
    model: str
    devices: int  # ranks over all nodes (the run record's hardware.devices)
    nodes: int
    engine: str = "deepspeed"  # "deepspeed" | "fsdp2"
    zero_stage: int  # 3 under FSDP2 (full sharding)
    precision: str  # "bf16" | "fp16" | "fp32"
    deepspeed_config: str  # "" under FSDP2
    steps: int
    total_steps: int
    resumed_from: str  # "" for a fresh run
    eval_loss: float | None = None
    eval_accuracy: float | None = None  # classifiers
    evals: list[dict] = []  # every evaluation of the run, with its step
    train_examples: int  # sequences (after packing) or reviews the training split holds
    eval_example_ids: list[int]  # source rows held out for validation
    seq_len: int  # --max-seq-len (the run record's training.seq_len)
    micro_batch_size: int
    grad_accum: int
    saved_to: str  # the consolidated model or the adapter
    peak_memory: dict[str, float]  # rank 0, metering.keys names
    memory_plan: dict
    ranks: list[dict]  # per rank: rank, machine_rank, world_size, example_ids, params[, optimizer]
    details: dict = {}
    settings: dict = {}  # every flag of the run as parsed (the model card's hyperparameters)
    finished_at: str

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.model_dump(mode="json", by_alias=True), indent=2) + "\n")
        return path
