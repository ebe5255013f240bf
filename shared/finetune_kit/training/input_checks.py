"""Is this launch good to go? Every check that needs no process group, data or weights, in seconds.

One set of checks with two front ends: :func:`for_accelerate` (the recipes that run their own
loop, launched with a DeepSpeed JSON or an FSDP2 accelerate YAML) and :func:`for_trainer`
(the HF Trainer recipe, which names its DeepSpeed JSON with ``--deepspeed``). Both check the
model's config and the sequence length, the engine's config and its batch sizes, the memory
plan, the CUDA ops and NVMe paths it needs, the metrics port and trackers, and the output
folder (writable, room for a checkpoint, a resumable checkpoint of the same run); both return
a :class:`CheckedLaunch` that the run reads from then on. Each failure is one ConfigError that
names the value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from finetune_kit import output_lock, outputs
from finetune_kit.errors import ConfigError, DataError
from finetune_kit.launch import config_checks, cuda_allocator, cuda_ops, env, fsdp, memory_cap, nvme
from finetune_kit.metering import prometheus, trackers
from finetune_kit.models import adapters, fp8, tiled_mlp
from finetune_kit.models import loading as models
from finetune_kit.models.shapes import ModelShape, from_config
from finetune_kit.planning import verdict
from finetune_kit.training import launch_plan, nonfinite, sequence_parallel
from finetune_kit.training.checkpointing import checkpoints, resharding

# What the memory check calls the Trainer recipe's flags in its suggestions (the accelerate recipes'
# are planning.verdict.describe_changes' defaults).
TRAINER_FLAGS = {"micro_batch": "--per_device_train_batch_size", "grad_accum": "--gradient_accumulation_steps",
                 "gradient_checkpointing": "--activation_checkpointing true", "loss_chunks": "--loss_chunks"}


FSDP_CONFIG = "accelerate launch --config_file configs/fsdp2.yaml"  # where a recipe offers FSDP2


@dataclass(frozen=True)
class CheckedLaunch:
    """What the checks established; the run reads it, nothing changes it."""

    recipe: str
    output: Path
    model_config: object  # the transformers config of --model
    shape: ModelShape  # its shape: memory plan, model FLOPs, the checkpoint's identity
    ds_path: Path | None  # the launched DeepSpeed JSON; None under FSDP2
    ds_config: dict  # its settings; {} under FSDP2
    fsdp: fsdp.FsdpLaunch | None  # the FSDP2 settings, when the launch config selects FSDP
    plan: launch_plan.LaunchPlan  # the batch split, levers, memory cap and memory plan: decided once, here
    resume_from: Path | None  # the checkpoint to continue, or None for a fresh run
    identity: dict  # what a resumed checkpoint must share with this launch
    checkpoint_estimate: int  # bytes of the first checkpoint, before one exists to measure
    script_args: dict  # what configures the run, for the record's config hash
    method: str = "full"  # "full" | "lora" | "qlora": picks the FLOP formula and labels the record
    num_labels: int | None = None  # a classification head instead of the LM head
    tuning: adapters.Tuning = adapters.FULL  # what trains (--peft): every weight, or adapters over a frozen base
    data_ranks: int = 1  # ranks that read different sequences (the world over --sequence-parallel): what the global
    #                      batch, the schedule and a checkpoint's data position count in
    nonfinite: nonfinite.Policy = nonfinite.STOP  # what a step with a NaN or Inf loss or gradient norm does

    @property
    def engine(self) -> str:
        """``"deepspeed"`` or ``"fsdp2"``: what shards the model in this run."""
        return "deepspeed" if self.fsdp is None else fsdp.ENGINE

    @property
    def quantization(self):
        """The ``BitsAndBytesConfig`` the base is quantized with as it loads (``--peft qlora`` over a 16-bit folder),
        else None (:meth:`~finetune_kit.models.adapters.Tuning.quantization`)."""
        return self.tuning.quantization(self.model_config)

    @property
    def zero_stage(self) -> int:
        return _stage(self.fsdp, self.ds_config)

    def reshaping(self) -> bool:
        """The checkpoint to resume was saved by another number of ranks than this launch has."""
        saved = self.resume_from and resharding.saved_world(self.resume_from)
        return bool(saved) and saved != env.world_size()


def for_accelerate(recipe: str, args, *, zero_stage: int, launch: str, configs: str,
                   tuning: adapters.Tuning = adapters.FULL, num_labels: int | None = None,
                   resume_must_match: dict | None = None) -> CheckedLaunch:
    """The checks of a recipe whose ``args`` carry the flags of ``training.arguments``' families.
    ``launch``/``configs``: the launch command and the configs to suggest; ``tuning``: what trains, as
    :func:`finetune_kit.models.adapters.decide` decided it (held here against the model); ``resume_must_match``: the
    recipe's settings a checkpoint must have been saved with (besides the architecture, method and adapters)."""
    if getattr(args, "data", "") is None:
        raise DataError("no training data: pass --data with a .jsonl/.csv file or a hub dataset name.")
    if (allocator := cuda_allocator.use_expandable_segments(args)) and env.is_main_rank():  # before CUDA starts
        print(allocator, file=sys.stderr)
    model_config, shape = _model(args.model, args.max_seq_len, causal=num_labels is None)
    adapters.check_model(tuning, model_config, model=args.model, causal=num_labels is None)
    method, adapter = tuning.method, tuning.plan()
    if adapter is not None and adapter.quantized:
        from finetune_kit.models.qlora import as_saved

        adapter = as_saved(adapter, model_config)  # a folder saved in 4-bit: planned as it stores its constants
    _data_workers(getattr(args, "data_workers", 0), "--data-workers")
    _samples(args, "-")
    _attention(getattr(args, "attention", "auto"), "--attention")
    _loss_kernel(getattr(args, "loss_kernel", "chunked"), "--loss-kernel")
    _compiler(getattr(args, "compile", False), "--compile")
    fsdp_launch = fsdp.read() if fsdp.launched() else None
    if getattr(args, "compile", False) and fsdp_launch is None:
        raise ConfigError("--compile under DeepSpeed ZeRO: its parameter hooks on every linear layer are kept out of "
                          "torch.compile, so each decoder layer breaks into small graphs that recompile per module "
                          f"(no gain). Compile with FSDP2 ({FSDP_CONFIG}), or drop --compile.")
    if fsdp_launch is not None:  # the same full sharding as ZeRO-3, by PyTorch
        if method != "full" or zero_stage != 3:
            adapted = f" with adapters (--peft {tuning.peft})" if tuning.adapted else ""
            raise ConfigError(f"{recipe} runs under DeepSpeed ZeRO-{zero_stage}{adapted}; FSDP2 launch configs are "
                              f"supported for full fine-tuning with ZeRO-3's sharding. Launch with {launch}.")
        fsdp.check_settings(fsdp_launch, model_config=model_config, gradient_checkpointing=args.gradient_checkpointing)
        ds_path, ds_config = None, {}
    else:
        ds_path, ds_config = config_checks.launched_zero_config(zero_stage, launch=launch, configs=configs)
    cap = memory_cap.requested()  # FINETUNE_GPU_MEMORY_GIB, parsed here alone: the plan carries it

    def memory_kwargs_of(args) -> dict:
        return dict(micro_batch=args.micro_batch_size, seq_len=args.max_seq_len,
                    gradient_checkpointing=args.gradient_checkpointing, num_labels=num_labels,
                    recompute_every=_recompute_every(args.recompute_every, "--recompute-every"),
                    loss_chunks=_loss_chunks(getattr(args, "loss_chunks", 0), "--loss-chunks"),
                    offload_activations=args.offload_activations,
                    sequence_parallel=getattr(args, "sequence_parallel", 1),
                    tiled_mlp=getattr(args, "tiled_mlp", False), adapter=adapter,
                    # the causal recipes' forward takes no mask (data.model_inputs): SDPA keeps k, v at their
                    # own heads; the classifier's padded rows reach it with theirs
                    kv_repeated=num_labels is not None, expandable_segments=cuda_allocator.expandable())

    choice = launch_plan.choose(args, model_config, None if fsdp_launch else ds_config, memory_kwargs_of(args),
                                cap_GiB=cap, classifier=num_labels is not None,
                                compile_ok=fsdp_launch is not None and _device_capability() is not None)
    if choice:  # the checks below see what will run (the recipe applies checked.plan.flags likewise)
        args = dataclasses.replace(args, **choice[0])
    if fsdp_launch is None:
        config_checks.check_batch_sizes(ds_config, micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum,
                                        world=env.world_size(), source=str(ds_path))
    sequence_parallel.check(getattr(args, "sequence_parallel", 1), world=env.world_size(),
                            gpus_per_node=env.view().local_world_size, model_config=model_config,
                            max_seq_len=args.max_seq_len, attention=getattr(args, "attention", "auto"),
                            pack=getattr(args, "pack", False), engine=fsdp.ENGINE if fsdp_launch else "deepspeed",
                            loss_chunks=getattr(args, "loss_chunks", 0))
    spanning = sequence_parallel.across_nodes(getattr(args, "sequence_parallel", 1), model_config=model_config,
                                              gpus_per_node=env.view().local_world_size,
                                              max_seq_len=args.max_seq_len, micro_batch=args.micro_batch_size)
    if spanning and env.is_main_rank():
        print(spanning, file=sys.stderr)
    data_ranks = env.world_size() // getattr(args, "sequence_parallel", 1)  # the check above: it divides
    fp8.check(getattr(args, "fp8", "none"), method=method, device_capability=_device_capability(),
              cpu_ram_efficient_loading=bool(fsdp_launch and fsdp_launch.cpu_ram_efficient_loading))
    if getattr(args, "tiled_mlp", False) and fsdp_launch is not None:
        raise ConfigError("--tiled-mlp under FSDP2: DeepSpeed's TiledMLP holds each slice's gradients back for ZeRO, "
                          "which FSDP2's reduce-scatter would take once per slice. Launch with a DeepSpeed config "
                          "(configs/zero3-ulysses.yaml), or drop --tiled-mlp.")
    if getattr(args, "tiled_mlp", False):
        tiled_mlp.check(model_config)
    identity = {"architecture": architecture(model_config, shape), "method": method, "num_labels": num_labels,
                "engine": fsdp.ENGINE if fsdp_launch else "deepspeed",
                **({"adapters": tuning.describe()} if tuning.adapted else {}), **(resume_must_match or {})}

    def check_resume(checkpoint: Path) -> None:
        checkpoints.check_same_run(checkpoint, identity)
        resharding.check_reshape(checkpoint, args, zero_stage, ds_config, data_ranks)

    policy = nonfinite.decide(args)  # --on-nonfinite, --max-nonfinite-skips
    memory_kwargs = dict(memory_kwargs_of(args), skip=args.skip_memory_check)
    decided = {"grad_accum": args.grad_accum, "loss_kernel": args.loss_kernel if hasattr(args, "loss_kernel") else None,
               "compile": args.compile, "levers": choice[1] if choice else ""}
    return _common(
        recipe, model_config, shape, ds_path, ds_config, fsdp_launch, method=method, num_labels=num_labels,
        memory_kwargs=memory_kwargs, cap=cap, decided=decided,
        report_to=(args.report_to, "--report-to"), output=Path(args.output), layout=checkpoints.RECIPE_LAYOUT,
        resume=args.resume, check_resume=check_resume, identity=identity,
        saving=bool(args.save_every), no_save_flag="--save-every 0", model=args.model, data_ranks=data_ranks,
        keeping=Keeping(args.keep_checkpoints, "--keep-checkpoints", args.save_model, getattr(args, "merge", False)),
        tuning=tuning, script_args={k: v for k, v in vars(args).items() if k not in ("output", "resume", "report_to")},
        on_nonfinite=policy)


def for_trainer(recipe: str, recipe_args, trainer_kwargs: dict, *, zero_stage: int, configs: str,
                tuning: adapters.Tuning = adapters.FULL, dpo=None) -> CheckedLaunch:
    """The same checks for an HF Trainer recipe: ``recipe_args`` (model, max_seq_len,
    skip_memory_check) and TrainingArguments' fields as parsed, before they are built. Fills
    ``bf16``/``fp16`` left as None in ``trainer_kwargs`` from the DeepSpeed JSON. ``tuning``: what trains (as
    :func:`~finetune_kit.models.adapters.decide` decided it); ``dpo``: a preference run's pairs and reference
    (:class:`finetune_kit.planning.preference.Dpo`; the micro-batch then counts pairs)."""
    if getattr(recipe_args, "data", "") is None:
        raise DataError("no training data: pass --data with a .jsonl/.csv file or a hub dataset name.")
    ds_path = trainer_kwargs["deepspeed"]
    if not ds_path:
        raise ConfigError(f"no DeepSpeed config: pass --deepspeed {configs}.")
    ds_config = config_checks.load_deepspeed_config(ds_path)
    if config_checks.zero_stage(ds_config) != zero_stage:
        raise ConfigError(f"{ds_path} sets ZeRO stage {config_checks.zero_stage(ds_config)}; this recipe is "
                          f"ZeRO-{zero_stage}. Use {configs}.")
    for key, from_json in config_checks.precision_flags(ds_config).items():
        if trainer_kwargs[key] is None:  # --bf16/--fp16 not given: the JSON decides
            trainer_kwargs[key] = from_json
    config_checks.check_trainer_agreement(ds_config, trainer_kwargs, world=env.world_size(), source=ds_path)
    model_config, shape = _model(recipe_args.model, recipe_args.max_seq_len)
    adapters.check_model(tuning, model_config, model=recipe_args.model)
    adapter = tuning.plan()
    if adapter is not None and adapter.quantized:
        from finetune_kit.models.qlora import as_saved

        adapter = as_saved(adapter, model_config)  # a folder saved in 4-bit: planned as it stores its constants
    _data_workers(getattr(recipe_args, "data_workers", 0), "--data_workers")
    _samples(recipe_args, "_")
    _attention(getattr(recipe_args, "attention", "auto"), "--attention")
    _loss_kernel(getattr(recipe_args, "loss_kernel", "chunked"), "--loss_kernel")
    _compiler(trainer_kwargs.get("torch_compile", False), "--torch_compile")
    identity = {"architecture": architecture(model_config, shape), **({"method": tuning.method} if dpo else {}),
                **({"adapters": tuning.describe()} if tuning.adapted else {}),
                **({"dpo_reference": dpo.reference} if dpo else {})}

    def check_resume(checkpoint: Path) -> None:
        saved = resharding.trainer_saved_world(checkpoint)
        if saved and saved != env.world_size():
            raise ConfigError(f"checkpoint '{checkpoint}' was saved by {resharding.ranks(saved)}, this launch has "
                              f"{env.world_size()}: the Trainer's ZeRO-2 checkpoints resume on the same number of "
                              f"ranks. Launch {resharding.ranks(saved)}, or start a new --output_dir from the "
                              "consolidated model (the accelerate recipes' ZeRO-3 checkpoints resume on any number).")
        if (checkpoint / "config.json").is_file():  # the Trainer saves the model's
            saved_arch = architecture(models.load_config(str(checkpoint)))
            if saved_arch != identity["architecture"]:
                raise ConfigError(f"checkpoint '{checkpoint}' belongs to a different model: {saved_arch} in the "
                                  f"checkpoint, {identity['architecture']} now (--model {recipe_args.model}). "
                                  "Relaunch with the checkpoint's model to continue it, or pass a new --output_dir "
                                  "to start over; nothing was overwritten.")

    return _common(
        recipe, model_config, shape, Path(ds_path), ds_config, None,
        memory_kwargs=dict(micro_batch=trainer_kwargs["per_device_train_batch_size"],
                           seq_len=recipe_args.max_seq_len,
                           gradient_checkpointing=trainer_kwargs["activation_checkpointing"],
                           recompute_every=_recompute_every(
                               recompute_every(trainer_kwargs.get("activation_checkpointing_kwargs")),
                               "--activation_checkpointing_kwargs' every_n_layers"),
                           loss_chunks=_loss_chunks(getattr(recipe_args, "loss_chunks", 0), "--loss_chunks"),
                           offload_activations=getattr(recipe_args, "offload_activations", False),
                           adapter=adapter, dpo=dpo,
                           skip=recipe_args.skip_memory_check, skip_flag="--skip_memory_check", flags=TRAINER_FLAGS),
        cap=memory_cap.requested(), decided={"grad_accum": trainer_kwargs["gradient_accumulation_steps"]},
        report_to=(trainer_kwargs.get("report_to"), "--report_to"), output=Path(trainer_kwargs["output_dir"]),
        layout=checkpoints.TRAINER_LAYOUT, resume=trainer_kwargs["resume_from_checkpoint"],
        check_resume=check_resume, identity=identity,
        saving=trainer_kwargs["save_strategy"] != "no", no_save_flag="--save_strategy no", model=recipe_args.model,
        keeping=Keeping(trainer_kwargs.get("save_total_limit") or 0, "--save_total_limit",
                        getattr(recipe_args, "save_model", True)),
        method=tuning.method, tuning=tuning,
        script_args={**vars(recipe_args), **{k: v for k, v in trainer_kwargs.items()
                                             if k not in ("output_dir", "resume_from_checkpoint", "report_to")}},
        on_nonfinite=nonfinite.decide(recipe_args))


@dataclasses.dataclass(frozen=True)
class Keeping:
    """What a run keeps on its output disk: ``keep`` checkpoints at once (0: all; flag ``keep_flag``), and at its end
    the model or adapter (``save_model``) and merged/ (``merge``)."""

    keep: int
    keep_flag: str
    save_model: bool = True
    merge: bool = False


def _common(recipe: str, model_config, shape: ModelShape, ds_path: Path | None, ds_config: dict,
            fsdp_launch: fsdp.FsdpLaunch | None, *, memory_kwargs: dict, cap: float | None, decided: dict,
            report_to: tuple, output: Path,
            layout: checkpoints.Layout, resume, check_resume: Callable[[Path], None], identity: dict,
            saving: bool, no_save_flag: str, keeping: Keeping, script_args: dict, model: str, method: str = "full",
            num_labels: int | None = None, data_ranks: int | None = None,
            tuning: adapters.Tuning = adapters.FULL, on_nonfinite: nonfinite.Policy = nonfinite.STOP) -> CheckedLaunch:
    """The checks both front ends share, in order: memory (against the GPU's free memory, at most ``cap``), the
    model's tokenizer files, engine needs, metrics, output, resume, disk. ``decided``: the launch plan's fields
    that ``memory_kwargs`` does not hold (:class:`~finetune_kit.training.launch_plan.LaunchPlan`)."""
    plan = verdict.check_fits(shape, ds_config if fsdp_launch is None else None, world_size=env.world_size(),
                              memory_cap_GiB=cap, **memory_kwargs)
    decision = launch_plan.LaunchPlan(
        micro_batch_size=memory_kwargs["micro_batch"], gradient_checkpointing=memory_kwargs["gradient_checkpointing"],
        recompute_every=memory_kwargs["recompute_every"], memory=plan, memory_cap_GiB=cap, **decided)
    models.check_tokenizer_files(model)
    if fsdp_launch is None:
        cuda_ops.check_ops(ds_config, quantized=method == "qlora")
        nvme.check_paths(ds_config, str(ds_path))
        nvme.check_param_buffers(ds_config, shape, env.world_size(), str(ds_path))
    if prometheus.requested_port() is not None:
        prometheus.requested_addr()  # the endpoint's address: one of this host's
    trackers.check_trackers(*report_to)
    outputs.check_writable(output)
    if env.is_main_rank():  # one run per output folder: refused before anything in it is touched
        output_lock.check_free(output)
        for path in checkpoints.clean_partial(output, layout):
            print(f"removed {path}: a checkpoint save that never completed (not resumable)")
    resume_from = checkpoints.resolve_resume(resume, output, layout,  # sizes and checksums, before anything loads
                                         report=_say if env.is_main_rank() else lambda line: None)
    if resume_from is not None:
        check_resume(resume_from)
    estimate = checkpoints.estimate_bytes(plan.total_params, plan.trainable_params, _stage(fsdp_launch, ds_config),
                                          model_copy=layout is checkpoints.TRAINER_LAYOUT)
    if saving:
        problem = checkpoints.free_space_problem(output, checkpoints.predicted_bytes(output, estimate, layout), layout)
        if problem:
            raise ConfigError(f"{problem}; or pass {no_save_flag} to train without checkpoints.")
    final = checkpoints.final_save_bytes(plan.total_params, plan.trainable_params, adapted=tuning.adapted,
                                         save_model=keeping.save_model, merge=keeping.merge)
    room = checkpoints.planned_room_warning(output, checkpoints.predicted_bytes(output, estimate, layout) if saving
                                            else 0, keeping.keep, final, layout, keeping.keep_flag)
    if room and env.is_main_rank():  # a warning: the disk may yet be freed, or the run stopped before it fills
        print(room, file=sys.stderr, flush=True)
    return CheckedLaunch(recipe, output, model_config, shape, ds_path, ds_config, fsdp_launch, decision, resume_from,
                         identity, estimate, script_args, method=method, num_labels=num_labels, tuning=tuning,
                         data_ranks=env.world_size() if data_ranks is None else data_ranks, nonfinite=on_nonfinite)


def _say(line: str) -> None:
    print(line, flush=True)  # in the log even if the job is killed soon after


def _stage(fsdp_launch, ds_config: dict) -> int:
    """ZeRO's stage, or 3 for FSDP2's full sharding."""
    return 3 if fsdp_launch is not None else config_checks.zero_stage(ds_config)


def _loss_chunks(chunks: int, flag: str) -> int:
    if chunks < 0:
        raise ConfigError(f"{flag} {chunks}: the loss is computed in that many chunks of tokens, a whole number "
                          f"from 1 (8 is the default), or 0 for the whole micro-batch at once. Pass {flag} 8.")
    return chunks


def recompute_every(activation_checkpointing_kwargs) -> int:
    """``every_n_layers`` of the Trainer's ``--activation_checkpointing_kwargs`` (a dict, or its JSON
    as parsed from the command line); 1 when absent."""
    kwargs = activation_checkpointing_kwargs or {}
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    return kwargs.get("every_n_layers", 1)


def _recompute_every(every: int, flag: str) -> int:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"{flag} {every}: activation checkpointing applies to every N-th decoder layer, N a whole "
                          f"number from 1 (every layer, the default). Pass {flag} 1, or 2 to keep every other "
                          "layer's activations.")
    return every


def _loss_kernel(choice: str, flag: str) -> None:
    from finetune_kit.losses import KERNELS, LIGER_TESTED, liger_available

    if choice not in KERNELS:
        raise ConfigError(f"{flag} {choice}: the loss kernel is one of {', '.join(KERNELS)}. Pass {flag} auto.")
    if choice == "liger" and not liger_available():
        raise ConfigError(f"{flag} liger: Liger-Kernel's fused loss is a Triton kernel for CUDA GPUs, and this "
                          "machine has no CUDA GPU or no liger-kernel package. Install it on the GPU host (pip "
                          f"install liger-kernel=={LIGER_TESTED}), or pass {flag} chunked (the same loss in plain "
                          "torch).")


def _compiler(enabled: bool, flag: str) -> None:
    import shutil

    if enabled and not any(shutil.which(cc) for cc in (os.environ.get("CC", "cc"), "gcc", "clang")):
        raise ConfigError(f"{flag}: torch.compile builds its kernels with a C compiler (Triton's launcher on a GPU, "
                          "Inductor's C++ on a CPU), and none is on PATH (cc, gcc, clang, $CC). Install gcc, or "
                          f"drop {flag}.")


def _attention(choice: str, flag: str) -> None:
    import torch

    from finetune_kit.models.packed_attention import CHOICES

    if choice not in CHOICES:
        raise ConfigError(f"{flag} {choice}: not one of {', '.join(CHOICES)}. Pass {flag} auto (packed rows through "
                          "the variable-length kernel, else PyTorch's SDPA).")
    if choice == "flex_attention" and not torch.cuda.is_available():
        raise ConfigError(f"{flag} flex_attention needs a CUDA GPU: PyTorch's FlexAttention has no backward pass on "
                          f"CPU. Pass {flag} auto (or sdpa) on this machine.")


def _data_workers(workers: int, flag: str) -> None:
    if workers < 0:
        raise ConfigError(f"{flag} {workers}: that many processes tokenise the data, a whole number from 1, or 0 "
                          f"to take one per CPU (up to 8) for large data. Pass {flag} 0.")


def _samples(args, dash: str) -> None:
    """The sample-answer flags (training.samples); ``dash``: how the recipe's flags join words."""
    if not hasattr(args, "samples"):
        return
    name = lambda flag: "--" + flag.replace("_", dash)  # noqa: E731
    if args.samples < 0:
        raise ConfigError(f"{name('samples')} {args.samples}: the number of held-out prompts the final model answers, "
                          f"0 or more. Pass {name('samples')} 0 to answer none.")
    if args.sample_tokens < 1:
        raise ConfigError(f"{name('sample_tokens')} {args.sample_tokens}: the most new tokens of a sample answer, 1 "
                          f"or more. Pass e.g. {name('sample_tokens')} 128.")
    if args.sample_before and not args.samples:
        raise ConfigError(f"{name('sample_before')} with {name('samples')} 0: there are no prompts to answer before "
                          f"training. Pass {name('samples')} 4 (or more), or drop {name('sample_before')}.")
    if args.sample_prompts:  # read and checked now, as --data is: a bad file fails before the launch
        from finetune_kit.data.instructions import load_rows

        load_rows(args.sample_prompts, flag=name("sample_prompts"))


def _model(model: str, max_seq_len: int, causal: bool = True) -> tuple[object, ModelShape]:
    config = models.load_config(model)
    if causal:
        models.check_causal_lm(config, model)
    models.check_seq_len(max_seq_len, config, model)
    return config, from_config(config)


def architecture(config, shape: ModelShape | None = None) -> str:
    """The model's shape in one line (``llama: hidden 4096, 32 layers, ...``): what a checkpoint must match."""
    s = shape or ModelShape.from_config(config)
    return (f"{getattr(config, 'model_type', 'model')}: hidden {s.hidden_size}, {s.num_hidden_layers} layers, "
            f"{s.num_attention_heads}/{s.num_key_value_heads} heads, ffn {s.intermediate_size}, vocab {s.vocab_size}")


def _device_capability() -> tuple[int, int] | None:
    """The first GPU's compute capability, or None without one."""
    import torch

    return torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
