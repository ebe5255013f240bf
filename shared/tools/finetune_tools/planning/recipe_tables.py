"""A recipe's memory setups (``recipes/<name>/memory_plan.json``), planned with the method it trains by default or the
one asked (``--peft none|lora|qlora``, the recipes' flag) and, for a DPO recipe, its reference (``"dpo"``), and the
README tables of their predictions."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from finetune_kit.errors import UserInputError
from finetune_kit.models.shapes import Adapter, ModelShape, resolve_model
from finetune_kit.planning.preference import Dpo, default_reference
from finetune_kit.planning.verdict import GiB, Plan, Setup, plan, setup_for_launch, suggest
from finetune_tools.planning import breakdown
from finetune_tools.tables import markdown_table

SETUP_KEYS = ("nodes", "gpus_per_node", "gpu_memory_GiB", "host_memory_GiB", "micro_batch", "seq_len",
              "gradient_checkpointing", "recompute_every", "loss_chunks", "offload_activations", "sequence_parallel",
              "tiled_mlp", "kv_repeated")
PEFT = ("none", "lora", "qlora")  # the recipes' --peft: every weight trains, LoRA over the bf16 base, over nf4
LORA_RANK, LORA_TARGETS = 16, "all-linear"  # the recipes' --lora-rank and --lora-targets defaults


def gib(value: int) -> str:
    return f"{value / GiB:.1f}"


def read_spec(recipe_dir: Path) -> dict:
    """The recipe's memory_plan.json."""
    path = recipe_dir / "memory_plan.json"
    if not path.is_file():
        raise UserInputError(f"{path} does not exist: a recipe lists its memory setups there (see "
                             "python -m finetune_tools.planning --help).")
    return json.loads(path.read_text())


def method_of(adapter: Adapter | None) -> str:
    """The --peft value that trains as ``adapter``: none (every weight), lora (bf16 base) or qlora (nf4 base)."""
    return "none" if adapter is None else "qlora" if adapter.quantized else "lora"


def recipe_methods(spec: dict) -> tuple[str, tuple[str, ...]]:
    """The --peft value the recipe trains with by default (its ``"adapter"``: null for a full fine-tune) and those it
    takes (its ``"peft"``; every one of :data:`PEFT` where it lists none)."""
    default = method_of(Adapter(**spec["adapter"]) if spec.get("adapter") else None)
    return default, tuple(spec.get("peft", PEFT))


def parse_targets(text: str) -> str | tuple[str, ...]:
    """--lora-targets: "all-linear", or comma-separated module names."""
    text = text.strip()
    if text == "all-linear":
        return text
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise UserInputError(f"--lora-targets {text!r} names no module: pass all-linear or names such as "
                             "q_proj,v_proj.")
    return names


def adapter_for(peft: str | None, lora_rank: int | None = None, lora_targets: str | None = None, *,
                default: Adapter | None = None, choices: tuple[str, ...] = PEFT, where: str = "this plan"
                ) -> Adapter | None:
    """The adapter that ``--peft`` (with ``--lora-rank``, ``--lora-targets``) plans: LoRA keeps a frozen bf16 base
    (2 bytes per parameter) and trains the adapter with fp32 master weights and Adam; QLoRA quantizes the base to nf4
    with double quantization, leaving the embeddings, norms and head in 16-bit as bitsandbytes does. ``peft`` None:
    ``default``'s method (a recipe's own), with the rank or targets given. Rank and targets not given: ``default``'s,
    else the recipes' defaults (rank 16 on every linear layer)."""
    asked = [f"{f} {v}" for f, v in (("--lora-rank", lora_rank), ("--lora-targets", lora_targets)) if v is not None]
    method = peft or method_of(default)
    if method not in choices:
        raise UserInputError(f"--peft {method}: {where} takes --peft {' or '.join(choices)}"
                             + (" (it trains adapters over a frozen base)" if "none" not in choices else "")
                             + f". Pass --peft {choices[-1]}.")
    if method == "none":
        if asked:
            raise UserInputError(f"{' and '.join(asked)} with --peft none: a full fine-tune trains every weight and "
                                 "has no adapter to size. Pass --peft lora or --peft qlora, or drop "
                                 f"{' and '.join(a.split()[0] for a in asked)}.")
        return None
    rank = lora_rank if lora_rank is not None else default.rank if default else LORA_RANK
    if rank < 1:
        raise UserInputError(f"--lora-rank {rank}: the adapter rank is a positive integer (8 to 64 is usual). Pass "
                             f"e.g. --lora-rank {LORA_RANK}.")
    targets = parse_targets(lora_targets) if lora_targets is not None else default.targets if default else \
        LORA_TARGETS
    double_quant = default.double_quant if default and default.quantized else True
    return Adapter(rank=rank, targets=targets, quantized=method == "qlora", double_quant=double_quant)


def recipe_adapter(recipe_dir: Path, peft: str | None = None, lora_rank: int | None = None,
                   lora_targets: str | None = None) -> Adapter | None:
    """The adapter a plan of the recipe uses: its memory_plan.json's, or the one ``--peft`` asks among those it
    takes (:func:`adapter_for`)."""
    spec = read_spec(recipe_dir)
    default = Adapter(**spec["adapter"]) if spec.get("adapter") else None
    return adapter_for(peft, lora_rank, lora_targets, default=default, choices=recipe_methods(spec)[1],
                       where=recipe_dir.name)


def fsdp2_config(entry: dict) -> bool:
    """Whether a memory_plan.json entry launches with an accelerate YAML (FSDP2) rather than a DeepSpeed JSON."""
    return Path(entry["config"]).suffix in (".yaml", ".yml")


RECIPES_OWN = object()  # recipe_setups' adapter: the recipe's memory_plan.json's
DPO_KEYS = ("reference",)  # what a memory_plan.json's "dpo" object may hold


def dpo_of(value, adapter: Adapter | None, reference: str | None = None, *, where: str = "memory_plan.json"
           ) -> Dpo | None:
    """The DPO training a memory_plan.json's ``"dpo"`` value declares (null or absent: not DPO): ``{"reference":
    ...}``, one of ``preference.REFERENCES`` (``{}``: precomputed). The declared reference is the full-weight run's: a
    plan with ``adapter`` (``--peft lora|qlora``) takes the base with the adapters off, the only reference adapters
    have. ``reference`` (``--dpo-reference``) replaces either, and plans DPO where the recipe declares none."""
    if value is not None and not isinstance(value, dict):
        raise UserInputError(f'{where}: "dpo": {json.dumps(value)} is not an object: write "dpo": {{"reference": '
                             '"precomputed"}, or leave "dpo" out for a recipe that is not DPO.')
    unknown = sorted(set(value or {}) - set(DPO_KEYS))
    if unknown:
        raise UserInputError(f'{where}: "dpo" has {", ".join(unknown)}; it takes {", ".join(DPO_KEYS)} only '
                             '(e.g. "dpo": {"reference": "sharded"}). Remove the others.')
    if reference is None and value is None:
        return None
    if reference is None and adapter is not None:
        return Dpo(default_reference(adapter))
    return Dpo(reference or value.get("reference") or default_reference(adapter))


def recipe_setups(recipe_dir: Path, key: str = "setups", adapter=RECIPES_OWN, dpo_reference: str | None = None
                  ) -> tuple[ModelShape, list[tuple[dict, Setup]]]:
    """The model shape of the recipe's memory_plan.json and each entry of its ``key`` list
    ("setups": the memory table's; "speed": the speed table's) with the Setup it describes, with the recipe's own
    adapter or ``adapter`` (None: a full fine-tune; :func:`recipe_adapter` makes one from --peft). With an adapter,
    the FSDP2 entries are left out: the recipes train adapters under DeepSpeed ZeRO only. DPO: the entry's ``"dpo"``,
    else the file's (:func:`dpo_of`), or ``dpo_reference``'s."""
    spec = read_spec(recipe_dir)
    if adapter is RECIPES_OWN:
        adapter = Adapter(**spec["adapter"]) if spec.get("adapter") else None
    model = spec["model"]
    if not any(model.startswith(p) for p in ("/", ".")) and (recipe_dir / model).exists():
        model = str(recipe_dir / model)
    out = []
    for entry in spec.get(key, []):
        if adapter is not None and fsdp2_config(entry):
            continue
        fields = {k: entry.get(k, spec.get(k)) for k in SETUP_KEYS if entry.get(k, spec.get(k)) is not None}
        config = recipe_dir / entry["config"]
        ds = None if fsdp2_config(entry) else json.loads(config.read_text())  # .yaml: FSDP2's
        nodes, per_node = fields.pop("nodes", 1), fields.pop("gpus_per_node", Setup.gpus_per_node)
        dpo = dpo_of(entry["dpo"] if "dpo" in entry else spec.get("dpo"), adapter, dpo_reference,
                     where=f"{recipe_dir / 'memory_plan.json'}")
        out.append((entry, setup_for_launch(ds, world_size=nodes * per_node, gpus_per_node=per_node, adapter=adapter,
                                            num_labels=spec.get("num_labels"), dpo=dpo, **fields)))
    return resolve_model(model), out


def first_setup(recipe_dir: Path, adapter=RECIPES_OWN, dpo_reference: str | None = None, **hardware
                ) -> tuple[dict, ModelShape, Setup]:
    """The recipe's first memory setup (its main launch config at memory_plan.json's defaults), with ``adapter`` and
    ``dpo_reference`` (as :func:`recipe_setups`), moved to ``hardware`` (Setup fields: nodes, gpus_per_node,
    gpu_memory_GiB, ...): what ``make plan RECIPE=... GPU=...`` plans."""
    shape, setups = recipe_setups(recipe_dir, adapter=adapter, dpo_reference=dpo_reference)
    entry, setup = setups[0]
    return entry, shape, replace(setup, **hardware)


def recipe_plans(recipe_dir: Path, adapter=RECIPES_OWN, dpo_reference: str | None = None) -> list[tuple[dict, Plan]]:
    """Each setup of the recipe's memory table with its plan (``adapter``, ``dpo_reference``: as
    :func:`recipe_setups`)."""
    shape, setups = recipe_setups(recipe_dir, adapter=adapter, dpo_reference=dpo_reference)
    return [(entry, plan(shape, setup)) for entry, setup in setups]


def recipe_table(recipe_dir: Path) -> str:
    """The markdown memory table of the recipe's setups, with a note on what it counts."""
    plans = recipe_plans(recipe_dir)
    rows = []
    for entry, p in plans:
        s, kinds = p.setup, breakdown.gpu_by_kind(p)
        if p.fits:
            verdict = f"fits, {p.gpu_headroom_GiB:.1f} GiB free"
        else:
            fix = suggest(p.model, s)
            verdict = "does not fit" + (f"; fix: {'; '.join(fix.changes)} ({gib(fix.plan.gpu_bytes)} GiB/GPU, "
                                        f"{gib(fix.plan.host_bytes)} GiB host)" if fix else "")
        cpu = gib(p.host_bytes) + (f" of {s.host_memory_GiB:g}" if s.host_memory_GiB is not None else "")
        if p.disk_parts:
            cpu += f" (+ {gib(breakdown.disk_bytes(p))} on NVMe)"
        rows.append([entry.get("label", f"{s.nodes} x {s.gpus_per_node} GPUs"), f"`{entry['config']}`",
                     f"{batch_shape(s)} x {s.seq_len}", "on" if s.gradient_checkpointing else "off",
                     gib(kinds["model states"]), gib(kinds["activations"]), gib(kinds["overhead"]),
                     f"**{gib(p.gpu_bytes)}** of {s.gpu_memory_GiB:g}", cpu, verdict])
    shape = plans[0][1].model
    if plans[0][1].setup.adapter:
        states = "the frozen base (nf4 with its quantisation constants, or bf16), LoRA weights with full Adam states"
    else:
        states = ("model states as DeepSpeed's own estimators count them (full fine-tuning; FSDP2 rows: 16 bytes "
                  "per parameter sharded, plus the gathered layers)")
    note = (f"Predicted by `make plan RECIPE={recipe_dir.name}` "
            f"({shape.name}, {plans[0][1].total_params / 1e9:.2f} B parameters). GiB per GPU: {states}, "
            f"activations with the loss's logits{logits_note(plans[0][1].setup)}, and CUDA context + allocator "
            "overhead; host RAM per node "
            "includes DeepSpeed's 1.5x margin. Formulas and assumptions: `shared/finetune_kit/planning/` "
            "(`model_states.py`, `activations.py`, `verdict.py`).")
    header = ["setup", "config", "micro-batch x tokens", "checkpointing", "model states",
              "activations", "overhead", "total / GPU", "host RAM / node", "verdict"]
    return note + "\n\n" + markdown_table(header, rows)


def long_context_table(recipe_dir: Path) -> str:
    """The markdown memory table of the recipe's ``long_context`` setups (memory_plan.json): one sequence per
    micro-batch, the long-context levers of each row named as the script's flags."""
    shape, setups = recipe_setups(recipe_dir, "long_context")
    rows = []
    for entry, setup in setups:
        p = plan(shape, setup)
        kinds = breakdown.gpu_by_kind(p)
        flags = [f"--sequence-parallel {setup.sequence_parallel}" if setup.sequence_parallel > 1 else "",
                 "--tiled-mlp" if setup.tiled_mlp else "", "--offload-activations" if setup.offload_activations else "",
                 f"--loss-chunks {setup.loss_chunks}"]
        verdict = f"fits, {p.gpu_headroom_GiB:.1f} GiB free" if p.fits else "does not fit"
        rows.append([entry["label"], f"`{entry['config']}`", f"{setup.seq_len:,}", " ".join(f for f in flags if f),
                     gib(kinds["activations"]), f"**{gib(p.gpu_bytes)}** of {setup.gpu_memory_GiB:g}",
                     f"{gib(p.host_bytes)} of {setup.host_memory_GiB:g}", verdict])
    note = (f"Predicted by the memory planner (`make plan RECIPE={recipe_dir.name} MODEL=llama3.1-8b GPU=h100 GPUS=8 "
            "SP=8 SEQ=max` searches the longest that fits), micro-batch 1, every layer checkpointed, the attention "
            "of FlashAttention's varlen kernel (packed rows). GiB per GPU and host RAM per node as in the table "
            "above; the allocator with expandable segments, as the recipe sets it with these flags. The planner's "
            "long-context terms were fitted on one H100 at 128K and 256K tokens "
            "([results/long-context.md](../../results/long-context.md)); these setups themselves are not measured.")
    header = ["setup", "config", "tokens per sequence", "flags", "activations", "total / GPU", "host RAM / node",
              "verdict"]
    return note + "\n\n" + markdown_table(header, rows)


def batch_shape(setup: Setup) -> str:
    """A micro-batch's examples: "4", or under DPO "4 pairs (8 sequences)"."""
    if setup.dpo is None:
        return f"{setup.micro_batch}"
    return f"{setup.micro_batch} pair{'s' * (setup.micro_batch != 1)} ({setup.sequences} sequences)"


def logits_note(setup) -> str:
    if setup.loss_chunks and not setup.num_labels:
        return f" (the loss in {setup.loss_chunks} chunks of tokens, the recipe's default)"
    return ""


def speed_table(recipe_dir: Path, calibration: Path | None = None) -> str:
    """The markdown speed table of the recipe's ``speed`` setups (memory_plan.json): predicted
    tokens/s, the dominant term and the time and GPU-hours per 100 M tokens, accumulation 4; with the package's
    calibrated constants, or ``calibration``'s."""
    from finetune_kit.planning.hardware import gpu_profile, network_profile
    from finetune_kit.planning.speed import Cluster, calibrated, job_for, predict

    shape, setups = recipe_setups(recipe_dir, "speed")
    efficiency, _ = calibrated(calibration)
    rows = []
    for entry, setup in setups:
        network = network_profile(entry["network"]) if entry.get("network") else None
        cluster = Cluster(gpu_profile(entry["gpu"]), setup.gpus_per_node, setup.nodes, network)
        pred = predict(job_for(shape, setup, 4), cluster, efficiency)
        low, high = breakdown.tokens_per_s_range(pred, cluster.gpus)
        per_gpu = pred.tokens_per_s(cluster.gpus)
        hours = 1e8 / (per_gpu * cluster.gpus) / 3600
        rows.append([entry["label"], f"`{entry['config']}`", f"{per_gpu:,.0f} ({low:,.0f}-{high:,.0f})",
                     f"{per_gpu * cluster.gpus:,.0f}", breakdown.dominant(pred), f"{hours:,.1f}",
                     f"{hours * cluster.gpus:,.0f}"])
    note = (f"Predicted by `make plan RECIPE={recipe_dir.name} GPU=... GPUS=... NODES=... NETWORK=...` at the "
            "defaults above and accumulation 4: the speed model of `shared/finetune_kit/planning/speed.py` "
            "with the constants `make results` fitted on every run of known speed "
            "(`shared/finetune_kit/planning/speed-calibration.json`, package data; its held-out error per run is "
            "in `results/README.md`). The range: communication hidden behind compute, or not at all. Add `TOKENS=` "
            "(or `DATA=` and `MODEL=`) and `PRICE=` for your run's time and cost.")
    header = ["setup", "config", "tokens/s per GPU (range)", "tokens/s, all GPUs", "dominant term",
              "hours per 100 M tokens", "GPU-hours per 100 M tokens"]
    return note + "\n\n" + markdown_table(header, rows)


METHOD_GPU, METHOD_GPUS = "h100", (1, 8)  # the Method table's GPU profile and its GPU counts (one node)


def what_trains(adapter: Adapter | None, num_labels: int | None = None) -> str:
    """What trains, in words: every weight, or the adapter (and a classification head) over the frozen base."""
    if adapter is None:
        return "full fine-tune: every weight"
    targets = "every linear layer" if adapter.targets == "all-linear" else ", ".join(adapter.targets)
    base = "nf4 base (double quantization)" if adapter.quantized else "bf16 base"
    head = f" and the {num_labels}-label head" if num_labels else ""
    return f"{'QLoRA' if adapter.quantized else 'LoRA'} r{adapter.rank} on {targets}{head}, frozen {base}"


def method_table(recipe_dir: Path) -> str:
    """The README's Method table: each method the recipe takes (``--peft``) at its defaults, the predicted GiB per GPU
    on one and on eight H100 80 GB under its main launch config (:func:`first_setup`, as make plan plans it)."""
    from finetune_kit.planning.hardware import gpu_profile

    spec, gpu = read_spec(recipe_dir), gpu_profile(METHOD_GPU)
    own = Adapter(**spec["adapter"]) if spec.get("adapter") else None
    rows, config = [], None
    for method in recipe_methods(spec)[1]:
        adapter = adapter_for(method, default=own, where=recipe_dir.name)
        cells = []
        for gpus in METHOD_GPUS:
            entry, shape, setup = first_setup(recipe_dir, adapter, nodes=1, gpus_per_node=gpus,
                                              gpu_memory_GiB=gpu.memory_GiB, host_memory_GiB=None)
            p, config = plan(shape, setup), entry["config"]
            cells.append(f"**{gib(p.gpu_bytes)}**, {'fits' if p.fits else 'does not fit'}")
        rows.append([f"`--peft {method}`" + (" (default)" if adapter == own else ""),
                     what_trains(adapter, spec.get("num_labels")),
                     f"{p.trainable_params / 1e9:.3f} B", *cells])
    caption = (f"Predicted by the memory planner, not measured: GiB per GPU at the recipe's defaults (micro-batch "
               f"{setup.micro_batch} x {setup.seq_len:,} tokens, `{config}`), `make plan RECIPE={recipe_dir.name} "
               f"PEFT=... GPU={METHOD_GPU} GPUS=1` (or `8`).")
    header = ["method", "what trains", "trainable parameters",
              *[f"predicted GiB per GPU, {n} x {gpu.name}" for n in METHOD_GPUS]]
    return caption + "\n\n" + markdown_table(header, rows)
