"""What an evaluation needs, checked before any weights load: the run folder, the model in it, its held-out rows,
the task names and the device.

Each bad input ends in one :class:`~finetune_kit.errors.UserInputError` that names the value, the rule and the
fix (docs/bad-input.md lists them); what passes is an :class:`Evaluation`, the frozen description of the run
the harness then makes. Loading stays out of here except where a check needs it: torch (is there a GPU?),
lm-eval's task index (is the name a task?: ~5 s, only when a task other than ``heldout`` is named).
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from finetune_kit.data import formats
from finetune_kit.errors import ConfigError, DataError, UserInputError

HELDOUT = "heldout"  # the run's own held-out split, as a task written into <run>/eval/tasks/
CAUSAL, CLASSIFIER = "causal", "classifier"  # a language model (8B, 13B recipes); a sequence classifier (70B)
# Where a run keeps what it saved, in the order the default model is picked (finetune_kit.training.final_model).
MODEL_FOLDERS = ("model", "merged", "adapter")
HELDOUT_FILE = "heldout.jsonl"
ROW_SHAPES = {CAUSAL: '{"example_id": int, "messages": [{"role": ..., "content": ...}, ...], "tools": [...] if any} '
                     '(instruction recipes)',
              CLASSIFIER: '{"example_id": int, "text": str, "label": 0|1, "label_name": str} (70B recipe)'}


@dataclass(frozen=True)
class ModelSource:
    """The weights to evaluate: a model folder, or an adapter folder over its base."""

    folder: Path  # holds config.json (a full model) or adapter_config.json (a PEFT adapter), and the tokenizer
    kind: str  # CAUSAL or CLASSIFIER
    base: str | None = None  # an adapter's base model (local folder or cached hub id); None for a full model

    def describe(self) -> str:
        return f"{self.folder} over {self.base}" if self.base else str(self.folder)


@dataclass(frozen=True)
class Evaluation:
    """One evaluation, every input checked."""

    run: Path
    model: ModelSource
    tasks: tuple[str, ...]  # HELDOUT and lm-eval task names or YAML paths, in the order given
    heldout: tuple  # heldout.jsonl's rows, checked: Conversations, or reviews' dicts; empty when not asked for
    include_path: Path | None  # more lm-eval task YAMLs (lm_eval --include_path)
    device: str  # cpu or cuda
    dtype: str  # bfloat16 or float32
    batch_size: int
    limit: int | None  # the first N documents of each task (lm_eval --limit); None: all
    apply_chat_template: bool  # lm-eval's --apply_chat_template for the other tasks (heldout is rendered already)
    max_length: int | None  # the run's --max-seq-len (run_info.json): reviews are cut there, as in training

    @property
    def out(self) -> Path:
        """Where the results go: ``<run>/eval``."""
        return self.run / "eval"

    @property
    def other_tasks(self) -> tuple[str, ...]:
        return tuple(t for t in self.tasks if t != HELDOUT)


def check(run: str, *, model: str | None = None, base: str | None = None, tasks: str = HELDOUT,
          include_path: str | None = None, device: str | None = None, dtype: str | None = None,
          batch_size: int | None = None, limit: int | None = None, apply_chat_template: bool = False) -> Evaluation:
    """Every input of ``python -m finetune_tools.harness`` (its flags, same names), checked in the order a user
    fixes them; UserInputError at the first that cannot work."""
    _harness_installed()
    folder = Path(run).expanduser()
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise UserInputError(f"run folder '{run}' {what}. Pass the --output folder of a training run (it holds "
                             "model/ or adapter/, heldout.jsonl and run_info.json), e.g. out/llama3-8b-zero3.")
    info = _read_json(folder / "run_info.json")
    source = _model(folder, model, base, info)
    include = str(Path(include_path).expanduser()) if include_path else None
    names = _task_names(tasks, include)
    rows = _heldout_rows(folder, source) if HELDOUT in names else ()
    device = _device(device)
    settings = info.get("settings", {}) if isinstance(info.get("settings"), dict) else {}
    max_length = settings.get("max_seq_len") if isinstance(settings.get("max_seq_len"), int) else None
    return Evaluation(run=folder, model=source, tasks=names, heldout=rows,
                      include_path=Path(include) if include else None, device=device,
                      dtype=dtype or ("bfloat16" if device == "cuda" else "float32"),
                      batch_size=batch_size or default_batch_size(max_length), limit=limit,
                      apply_chat_template=apply_chat_template, max_length=max_length)


# lm-eval scores a batch through the log-softmax of every position's logits in float32: batch x length x vocabulary
# x 4 bytes (Llama 3: 0.5 MB a token), beside the bf16 logits. 16,384 tokens a batch are 8.4 GB of it. Measured on
# an H100 (80 GB) before batches were sized by their tokens and documents cut at --max-seq-len: 4 held-out
# conversations of about 17,600 tokens in one batch asked for 33.7 GiB there and ran out of memory.
BATCH_TOKENS = 16_384
MAX_BATCH = 8


def default_batch_size(max_length: int | None) -> int:
    """Documents per forward: BATCH_TOKENS' worth at ``max_length`` (the run's --max-seq-len), 1 to MAX_BATCH."""
    return max(1, min(MAX_BATCH, BATCH_TOKENS // max_length)) if max_length else MAX_BATCH


def _harness_installed() -> None:
    """lm-eval is in the pinned stack and the images, but not a dependency of ``pip install finetune-kit`` (its
    scikit-learn and SciPy would ride along to every GPU host): its extra ``[eval]`` adds it."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise UserInputError("lm-evaluation-harness (lm_eval) is not installed in this Python: evaluation runs it. "
                             "Install the pinned stack (bash docker/install-python-deps.sh), or "
                             "pip install 'finetune-kit[eval]' for the harness alone.")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):  # absent or damaged: the run's record is optional here
        return {}
    return value if isinstance(value, dict) else {}


# ---- the model ----

def _model(run: Path, model: str | None, base: str | None, info: dict) -> ModelSource:
    if model is not None:
        folder = Path(model).expanduser()
        if not (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
            what = "does not exist" if not folder.exists() else "holds neither config.json nor adapter_config.json"
            raise ConfigError(f"--model '{model}' {what}: it is not a model or adapter folder. Pass a folder with "
                              "config.json and the weights (such as <run>/model or <run>/merged), or a PEFT adapter "
                              "folder (adapter_config.json, such as <run>/adapter).")
        return _source(folder, base, info)
    for name in MODEL_FOLDERS:
        folder = run / name
        if (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file():
            return _source(folder, base, info)
    raise ConfigError(f"run folder '{run}' holds no model to evaluate: none of {'/, '.join(MODEL_FOLDERS)}/ has a "
                      "config.json or adapter_config.json (a run writes model/ or adapter/ when it finishes; before, "
                      "it holds checkpoints only). Evaluate a finished run, or pass --model <model folder>.")


def _source(folder: Path, base: str | None, info: dict) -> ModelSource:
    if (folder / "config.json").is_file():
        architectures = _read_json(folder / "config.json").get("architectures") or []
        classifier = any(str(a).endswith("ForSequenceClassification") for a in architectures)
        return ModelSource(folder, CLASSIFIER if classifier else CAUSAL)
    adapter = _read_json(folder / "adapter_config.json")
    kind = CLASSIFIER if adapter.get("task_type") == "SEQ_CLS" else CAUSAL
    base = base or info.get("model") or adapter.get("base_model_name_or_path")
    return ModelSource(folder, kind, _base_model(base, folder))


def _base_model(base: str | None, adapter: Path) -> str:
    """The adapter's base as from_pretrained takes it: a local folder, or a hub id already in the local cache
    (the harness runs offline unless HF_HUB_OFFLINE=0 is exported)."""
    fix = (f"Pass --base with the base model's local folder (the adapter '{adapter}' was trained over it; "
           "run_info.json's \"model\" names it)")
    if not base:
        raise ConfigError(f"adapter '{adapter}' names no base model: no --base, no run_info.json with \"model\", "
                          f"no base_model_name_or_path in adapter_config.json. {fix}.")
    path = Path(base).expanduser()
    if path.exists() or base.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise ConfigError(f"base model '{base}' of the adapter '{adapter}' is not a model folder here (no "
                              f"config.json). {fix}.")
        return str(path)
    if os.environ.get("HF_HUB_OFFLINE", "1") not in ("0", "false", "False"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(base, "config.json"), str):
            raise ConfigError(f"base model '{base}' of the adapter '{adapter}' is not in the Hugging Face cache, and "
                              f"the evaluation runs offline. {fix}, or download it first (hf download {base}), "
                              "or export HF_HUB_OFFLINE=0 to let it download.")
    return base


# ---- the tasks ----

def _task_names(tasks: str, include_path: str | None) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(t.strip() for t in tasks.split(",") if t.strip()))
    if not names:
        raise UserInputError(f"--tasks '{tasks}' names no task. Pass heldout (the run's held-out rows), lm-eval "
                             "task names, or both, separated by commas.")
    if include_path and not Path(include_path).expanduser().is_dir():
        raise UserInputError(f"--include-path '{include_path}' is not a folder. Pass the folder that holds your "
                             "task YAMLs (lm-eval reads every *.yaml under it).")
    others = [t for t in names if t != HELDOUT]
    index = task_index(others, include_path)
    unknown = [t for t in others if t not in index.all_tasks and not _is_task_file(t)]
    if unknown:
        near = difflib.get_close_matches(unknown[0], index.all_tasks, n=3)
        where = f" or under --include-path '{include_path}'" if include_path else ""
        raise UserInputError(
            f"task '{unknown[0]}' is not a task, group or tag of lm-eval {_lm_eval_version()}{where}"
            + (f" (did you mean {', '.join(near)}?)" if near else "")
            + ". Pass heldout, a name that `lm_eval ls tasks` lists, or the name of a task YAML in the folder "
            "given to --include-path.")
    return names


def _is_task_file(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) and Path(name).is_file()  # lm-eval takes a YAML's path as a task


def task_index(others, include_path: str | None):
    """The smallest lm-eval task index that knows the task names ``others``: the YAMLs under ``include_path``
    alone when they hold them all (or there are none to find), else lm-eval's own tasks as well."""
    wanted = [t for t in others if not _is_task_file(t)]
    local = task_manager(include_path, False)
    return local if all(t in local.all_tasks for t in wanted) else task_manager(include_path, True)


@lru_cache(maxsize=4)
def task_manager(include_path: str | None, defaults: bool):
    """lm-eval's task index: the YAMLs under ``include_path``, and with ``defaults`` its own ~14,700 tasks, groups
    and tags (reading their YAMLs takes ~5 s). Built once per process for each argument pair."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


# ---- the held-out rows ----

def _heldout_rows(run: Path, source: ModelSource) -> tuple[dict, ...]:
    path = run / HELDOUT_FILE
    if not path.is_file():
        raise DataError(f"run folder '{run}' has no {HELDOUT_FILE}, which the heldout task evaluates: a run writes "
                        "its held-out validation rows there when it finishes. Evaluate a finished run, pass --tasks "
                        f"with lm-eval tasks only, or write the rows yourself, one JSON object a line: "
                        f"{ROW_SHAPES[source.kind]}.")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = _row(json.loads(line))
        except ValueError as err:
            raise DataError(f"'{path}' line {number}: {err}. Each line must be one JSON object: "
                            f"{ROW_SHAPES[source.kind]}. Fix or remove the line.") from err
        kind = CAUSAL if isinstance(row, formats.Conversation) else CLASSIFIER
        if kind != source.kind:
            rows_are = "conversations" if kind == CAUSAL else "labelled reviews"
            model_is = "a sequence classifier" if source.kind == CLASSIFIER else "a language model"
            raise ConfigError(
                f"'{path}' holds {rows_are} (line {number}), but the model '{source.describe()}' is {model_is}: "
                "the heldout task scores a run's rows with the kind of model that run trained. Pass --model with "
                "that run's model (model/ for the instruction recipes, adapter/ or merged/ for the 70B classifier).")
        rows.append(row)
    if not rows:
        raise DataError(f"'{path}' is empty: no held-out rows to evaluate. Pass --tasks with lm-eval tasks only, "
                        f"or write the rows: {ROW_SHAPES[source.kind]}.")
    return tuple(rows)


def _row(row) -> formats.Conversation | dict:
    """A conversation that ends in an answer (as the run wrote it), or a labelled review; ValueError naming what
    is wrong otherwise."""
    if not isinstance(row, dict):
        raise ValueError(f"a {type(row).__name__}, not a JSON object")
    if "messages" in row:
        conversation = formats.Conversation.from_record(row)
        if not any(m["role"] == "assistant" for m in conversation.messages):
            raise ValueError("the conversation has no assistant turn, so no answer to score")
        return conversation
    if "text" in row and "label" in row:
        if not isinstance(row["text"], str) or row["label"] not in (0, 1) or isinstance(row["label"], bool):
            raise ValueError(f"text {type(row['text']).__name__} and label {row['label']!r}: text must be a string, "
                             "label 0 or 1")
        return row
    raise ValueError(f"keys {sorted(row)} are neither a conversation (messages) nor a labelled review (text, label)")


# ---- the device ----

def _device(device: str | None) -> str:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU here (its CUDA build: "
                          f"{torch.version.cuda or 'none, a CPU-only torch'}). Evaluate with --device cpu (float32: "
                          "seconds for a tiny model; an 8B one needs ~32 GB of RAM and is slow), or run on a machine "
                          "with a GPU.")
    return device or ("cuda" if torch.cuda.is_available() else "cpu")
