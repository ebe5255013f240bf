"""Every metric's key and unit, defined once.

metrics.jsonl, the progress bar, the Trainer's log line, ``run_info.json``, ``run_record.json``
and results/ all take their names from here. A key carries its unit (``_s`` seconds,
``_GiB`` 2**30 bytes, ``_percent``, ``per_s``); ``label`` is the short form for a progress
bar or a table header. Peaks in the run record are ``peak_`` + key (+ a scope suffix such as
``_per_node``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    key: str
    unit: str
    label: str
    description: str

    def __str__(self) -> str:
        return self.key


STEP = Metric("step", "optimizer steps", "step", "optimizer steps taken so far")
EPOCH = Metric("epoch", "epochs", "epoch", "passes over the training data (fractional in the Trainer)")
LOSS = Metric("loss", "nats/token", "loss", "training loss of the step: the mean over its labelled tokens, all ranks")
LR = Metric("lr", "1", "lr", "learning rate the step trained with")
GRAD_NORM = Metric("grad_norm", "1", "grad_norm", "L2 norm of the step's whole gradient, before clipping")
TOKENS = Metric("tokens", "tokens", "tokens", "real (non-padding) tokens in the step, all ranks")
PADDING_FRACTION = Metric("padding_fraction", "1", "padding", "padded slots / all slots in the step's batches")
STEP_TIME = Metric("step_time_s", "s", "s/step", "wall-clock time of the step")
FIRST_STEP_AFTER = Metric("first_step_after_s", "s", "s", "from the process's start to its first step: imports, "
                          "data, the model's load, the engine's set-up (once a run, not a step metric)")
TOKENS_PER_S = Metric("tokens_per_s", "tokens/s", "tok/s", "real tokens per second, all ranks")
TOKENS_PER_S_PER_DEVICE = Metric("tokens_per_s_per_device", "tokens/s", "tok/s/dev",
                                 "real tokens per second per device (GPU, or CPU rank)")
TFLOPS_PER_DEVICE = Metric("model_tflop_per_s_per_device", "TFLOP/s", "TFLOP/s/dev",
                           "model FLOPs (metering.flops) per second per device")
MFU = Metric("mfu_percent", "%", "mfu", "model FLOPs utilisation against the dense bf16 peak (GPUs only)")
GPU_ALLOCATED = Metric("gpu_allocated_GiB", "GiB", "gpu_allocated", "peak memory of live tensors (torch allocator)")
GPU_RESERVED = Metric("gpu_reserved_GiB", "GiB", "gpu_reserved", "peak memory the torch allocator held from the GPU")
GPU_DEVICE = Metric("gpu_device_GiB", "GiB", "gpu_device",
                    "peak memory in use on the GPU as its driver reports it (NVML: CUDA context, NCCL and every "
                    "allocator included), sampled at each logged step")
HOST_RSS = Metric("host_rss_GiB", "GiB", "host_rss", "peak resident set size of the process")
LOSS_SCALE = Metric("loss_scale", "1", "scale", "fp16 dynamic loss scale after the step (fp16 runs only)")
SKIPPED_STEPS = Metric("skipped_steps", "steps", "skipped",
                       "optimizer steps skipped so far because fp16 gradients overflowed (fp16 runs only)")

# Preference tuning (DPO), from TRL's DPOTrainer: the reward of an answer is beta x (policy - reference) log-probability
# of its tokens; each figure is the mean over the step's pairs, all ranks.
REWARD_CHOSEN = Metric("reward_chosen", "nats", "r_chosen", "beta x log-probability ratio (policy / reference) of the "
                       "chosen answers, mean over the step's pairs")
REWARD_REJECTED = Metric("reward_rejected", "nats", "r_rejected", "the same for the rejected answers")
REWARD_MARGIN = Metric("reward_margin", "nats", "margin", "chosen reward - rejected reward, mean over the step's pairs")
PREFERENCE_ACCURACY = Metric("preference_accuracy", "1", "pref_acc", "share of the step's pairs whose chosen reward is "
                             "strictly above the rejected one (0 where the policy equals the reference)")
LOGPS_CHOSEN = Metric("logps_chosen", "nats", "logp_chosen", "the policy's log-probability of each chosen answer (sum "
                      "over its tokens), mean over the step's pairs")
LOGPS_REJECTED = Metric("logps_rejected", "nats", "logp_rejected", "the same for the rejected answers")
PREFERENCE = {"rewards/chosen": REWARD_CHOSEN, "rewards/rejected": REWARD_REJECTED, "rewards/margins": REWARD_MARGIN,
              "rewards/accuracies": PREFERENCE_ACCURACY, "logps/chosen": LOGPS_CHOSEN,
              "logps/rejected": LOGPS_REJECTED}  # TRL's log names -> ours


def preference(logs: dict, prefix: str = "") -> dict[str, float]:
    """The DPO figures TRL put in a Trainer log (``prefix`` "eval_" for an evaluation's), under our keys."""
    return {metric.key: float(logs[prefix + name]) for name, metric in PREFERENCE.items() if prefix + name in logs}


# metrics.jsonl columns, in order; absent ones (MFU on CPU, GPU memory without CUDA) are left out.
STEP_METRICS = (STEP, EPOCH, LOSS, LR, GRAD_NORM, *PREFERENCE.values(), TOKENS, PADDING_FRACTION, TOKENS_PER_S,
                TOKENS_PER_S_PER_DEVICE, TFLOPS_PER_DEVICE, MFU, STEP_TIME, GPU_ALLOCATED, GPU_RESERVED, GPU_DEVICE,
                HOST_RSS, LOSS_SCALE, SKIPPED_STEPS)
MEMORY = (GPU_ALLOCATED, GPU_RESERVED, GPU_DEVICE, HOST_RSS)


def loss_scaling(engine) -> dict[str, float]:
    """The loss scaler's state of a DeepSpeed engine running fp16: the scale and the steps it
    skipped on overflow; {} for bf16/fp32 engines (or anything that is not an engine)."""
    fp16 = getattr(engine, "fp16_enabled", None)
    if fp16 is None or not fp16():
        return {}
    scale = getattr(engine.optimizer, "loss_scale", None)
    out = {SKIPPED_STEPS.key: int(engine.skipped_steps)}
    return {LOSS_SCALE.key: float(scale), **out} if scale is not None else out


def peak_key(metric: Metric, scope: str = "") -> str:
    """The run record's name for the peak of ``metric``: ``peak_gpu_reserved_GiB``,
    ``peak_host_rss_GiB_per_node``."""
    return f"peak_{metric.key}{scope}"


def memory_headline(record: dict) -> tuple[Metric, float]:
    """The one memory figure a short log line shows: GPU reserved when there is a GPU, else host RSS."""
    metric = GPU_RESERVED if GPU_RESERVED.key in record else HOST_RSS
    return metric, record[metric.key]


def progress_text(record: dict) -> str:
    """A logged step's figures for the progress bar: loss, lr, tokens/s, TFLOP/s, MFU, memory."""
    parts = [f"{LOSS.label}={record[LOSS.key]:.4f}", f"{LR.label}={record[LR.key]:.2e}",
             f"{TOKENS_PER_S.label}={record[TOKENS_PER_S.key]:,.0f}"]
    if TFLOPS_PER_DEVICE.key in record:
        parts.append(f"{TFLOPS_PER_DEVICE.label}={record[TFLOPS_PER_DEVICE.key]:.3g}")
    if MFU.key in record:
        parts.append(f"{MFU.label}={record[MFU.key]:.1f}%")
    metric, value = memory_headline(record)
    return ", ".join(parts + [f"{metric.key}={value:.1f}"])  # the unit is in the key
