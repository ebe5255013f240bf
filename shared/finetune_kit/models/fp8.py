"""fp8 matmuls for the linear layers of a full fine-tune: torchao's float8 training, through accelerate.

``--fp8 tensorwise`` (or ``rowwise``) makes accelerate swap the decoder's ``nn.Linear`` layers for
torchao's ``Float8Linear`` when the model is prepared (``Accelerator(mixed_precision="fp8")`` with an
``AORecipeKwargs``): each matmul of the forward and the backward casts its two operands to float8
(e4m3; the output gradient e5m2) with a dynamic scale, one per tensor or one per row, and multiplies
with ``torch._scaled_mm``, which accumulates in higher precision; weights, gradients, optimizer states
and everything outside those matmuls stay as they were (bf16 compute, fp32 master weights). On an H100
an fp8 matmul runs at up to twice the bf16 rate (1,979 against 989 dense TFLOP/s on the datasheet);
torchtitan measured Llama 3.1 8B on 8 H100s at 1.28x the tokens/s of compiled bf16, the gain coming
with torch.compile fusing the casts: uncompiled, the casts' own memory traffic makes fp8 slower than bf16.
Measured here on one H100 (:data:`MEASURED_SPEEDUP`): under ZeRO-3, which cannot compile, 0.61x; compiled
under FSDP2, tensorwise 1.06x and rowwise 0.94x. Every launch with ``--fp8`` says so (:func:`speed_note`).

Which layers stay in bf16 (:func:`keeps_fp8`), as torchtitan chooses: the LM head (its output feeds
the loss directly; torchtitan's ``filter_fqns=["output"]``), and any linear layer whose input or output
width is not a multiple of 16, which ``_scaled_mm`` refuses. Llama 3 8B's attention and MLP
projections all convert (4,096, 1,024 and 14,336 wide): 224 layers, 93% of the matmul weights; with
attention's own matmuls (not converted) at 2,048 tokens, 87% of the model FLOPs.

Where it runs (:func:`check`): on GPUs of compute capability 8.9 or above (Ada, Hopper, Blackwell:
fp8 tensor cores) -- elsewhere torch's ``_scaled_mm`` has no fp8 kernel; on a machine without a GPU (the
tests) torchao emulates it: the same layers, casts and scales, the matmul in fp32. Not on a 4-bit base
(QLoRA computes in the dequantised bf16 and its trainable LoRA matrices are too small to gain). Under DeepSpeed ZeRO-3,
accelerate converts the layers before ``deepspeed.initialize`` (accelerate's ``Accelerator.prepare``:
``_prepare_ao`` before ``_prepare_deepspeed``), so DeepSpeed's partitioning hooks land on the new
layers and the weights it gathers are the ones the float8 matmul reads.
"""

from __future__ import annotations

from finetune_kit.errors import ConfigError

CHOICES = ("none", "tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell
KEPT_IN_BF16 = ("lm_head",)  # torchtitan's filter_fqns=["output"]: the head that feeds the loss
ALIGNMENT = 16  # torch._scaled_mm wants both matmul widths divisible by 16
# fp8 tokens/s over bf16's in the same command, per (scaling, --compile), measured on one H100 80GB HBM3 on
# 2026-11-27: Llama 3 8B truncated to 8 layers, 4,096 tokens x 2 x accumulation 4 (results/README.md, "fp8 against
# bf16"; a test compares these with the records in results/runs/fp8/)
MEASURED_SPEEDUP = {("tensorwise", True): 1.06, ("rowwise", True): 0.94, ("tensorwise", False): 0.61}


def keeps_fp8(module, fqn: str) -> bool:
    """accelerate's ``module_filter_func``: True for the linear layers that compute in fp8."""
    from torch import nn

    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] in KEPT_IN_BF16:
        return False
    return module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0


def accelerator_kwargs(choice: str) -> dict:
    """What ``Accelerator(...)`` needs for ``--fp8 choice``: nothing for ``none``. Without a CUDA GPU, torchao's
    emulation: the operands cast to float8 with the same scales, multiplied in fp32 (as ``_scaled_mm``
    accumulates): torch's CPU ``_scaled_mm`` runs only where oneDNN has fp8 kernels (it fails on AVX2-only
    CPUs), and its results differ with the CPU; the emulation is the same on every machine."""
    if choice == "none":
        return {}
    import dataclasses

    import torch
    from accelerate.utils import AORecipeKwargs
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(choice)
    if not torch.cuda.is_available():  # the tests' CPU path: the same casts and scales, the matmul in fp32
        config = dataclasses.replace(config, emulate=True)
    return {"mixed_precision": "fp8", "kwargs_handlers": [AORecipeKwargs(config=config, module_filter_func=keeps_fp8)]}


def check(choice: str, *, method: str, device_capability: tuple[int, int] | None, cpu_ram_efficient_loading=False):
    """ConfigError, naming the value, the rule and the fix, where ``--fp8 choice`` cannot run or cannot help.
    ``device_capability``: the GPU's (major, minor), None on a machine without one (the tests' CPU path)."""
    if choice == "none":
        return
    if choice not in CHOICES:
        raise ConfigError(f"--fp8 {choice}: not one of {', '.join(CHOICES)}.")
    if method != "full":
        raise ConfigError(f"--fp8 {choice} on a {method} run: the frozen base computes in the dequantised bf16 and the "
                          "trainable LoRA matrices are too small for fp8 matmuls to gain. Drop --fp8.")
    if device_capability is not None and tuple(device_capability) < MIN_CAPABILITY:
        major, minor = device_capability
        raise ConfigError(f"--fp8 {choice} on a GPU of compute capability {major}.{minor}: fp8 matmuls need 8.9 or "
                          "above (L4/L40, H100/H200, B200). Drop --fp8 (bf16 runs at the same model quality).")
    if cpu_ram_efficient_loading:
        raise ConfigError(f"--fp8 {choice} with fsdp_cpu_ram_efficient_loading: true: accelerate's torchao path "
                          "converts the layers of the whole model on every rank. Launch with configs/fsdp2-fp8.yaml "
                          "(fsdp_cpu_ram_efficient_loading: false), or a DeepSpeed config.")


def speed_note(choice: str, compiled: bool) -> str:
    """One line for the log of a run with ``--fp8 choice``: what this setting measured against bf16, and where fp8
    pays."""
    best = f"fp8 pays compiled under FSDP2 (configs/fsdp2-fp8.yaml --compile --fp8 tensorwise: " \
           f"{MEASURED_SPEEDUP['tensorwise', True]:.2f}x)"
    where = "on one H100 (results/README.md, fp8 against bf16)"
    setting = f"--fp8 {choice} {'with' if compiled else 'without'} --compile"
    if (choice, compiled) not in MEASURED_SPEEDUP:
        return (f"{setting}: not measured; tensorwise {'compiled' if compiled else 'uncompiled'} measured "
                f"{MEASURED_SPEEDUP['tensorwise', compiled]:.2f}x the bf16 tokens/s {where}; {best}")
    speedup = MEASURED_SPEEDUP[choice, compiled]
    verdict = "faster" if speedup > 1 else "slower: " + ("the casts run unfused; " if not compiled else "") + best
    against = "compiled bf16" if compiled else "bf16"
    return f"{setting}: measured {speedup:.2f}x the tokens/s of {against} {where}, {verdict}"


def converted(model) -> int:
    """How many of ``model``'s layers compute in fp8 (torchao's ``Float8Linear``)."""
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in model.modules())
