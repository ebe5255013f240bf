"""Model states per GPU and per node: weights, gradients and optimizer states, before activations.

Everything is arithmetic on the model's ``config.json`` (no weights, no torch, no GPU):

* **Model states** (weights, gradients, optimizer) for full fine-tuning under ZeRO-3 without offload are
  what DeepSpeed's stage 3 holds (16 bytes per parameter, sharded) and the peak is the larger of the
  optimizer step's and the backward's working sets; see :func:`zero3_model_states` (measured on one H200,
  ``results/runs/mfu/``). Otherwise (ZeRO-0/1/2, offload) they are the
  numbers of DeepSpeed's own estimators, ``estimate_zero2_model_states_mem_needs`` and
  ``estimate_zero3_model_states_mem_needs`` (deepspeed 0.19.8), reproduced formula for formula
  in :func:`deepspeed_model_states` (the tests compare with DeepSpeed's functions). They count
  18 bytes per parameter for bf16 weights' gradients, fp32 gradients, fp32 master weights and two
  Adam moments, plus 2 bytes of bf16 weights, 4 bytes per parameter of the largest layer for
  ZeRO-3's gathered weights, and a 1.5x margin on host memory. :func:`zero_paper_model_states`
  gives the ZeRO paper's leaner accounting (2 + 2 + K bytes, K = 12) for comparison.
* **FSDP2** (full fine-tuning, full sharding, fp32 sharded weights cast to bf16 for compute,
  fp32 gradient reduction): 16 bytes per parameter split over all GPUs, plus the working set of
  the units being gathered; see :func:`fsdp2_model_states`.
* **ZeRO-Infinity** (offload to NVMe): the offloaded states go to swap files on the disk instead of
  host memory, which holds DeepSpeed's pinned swap buffers instead; see :func:`nvme_parts`.
* **LoRA / QLoRA**: frozen base weights (bf16, or nf4 with its quantisation constants), the
  bf16 layers bitsandbytes does not quantise (embeddings, norms, head), LoRA weights with full
  Adam states; see :func:`adapter_model_states`.

Memory is in bytes. Activations are :mod:`.activations`; the plan that adds both up, :mod:`.verdict`.
"""

from __future__ import annotations

from finetune_kit.errors import ConfigError
from finetune_kit.models.shapes import Adapter, ModelShape

# Bytes per element.
BF16, FP32 = 2, 4
# DeepSpeed's per-parameter multipliers (deepspeed/runtime/zero/stage_1_and_2.py comments):
# 2 bf16 weights; 18 = 2 bf16 grads + 4 fp32 grads + 4 fp32 master weights + 8 Adam moments.
DS_PARAM16, DS_STATES = 2, 18
# bitsandbytes nf4 with blocksize 64: 4 bits per weight; one absmax per 64 weights, stored as
# fp32, or with double quantisation as uint8 plus one fp32 constant per 256 absmax values
# (Dettmers et al. 2023, QLoRA, section 3: 0.5 -> 0.127 bits per parameter of constants).
NF4_BLOCK, DQ_BLOCK = 64, 256


def nf4_bytes_per_param(double_quant: bool = True) -> float:
    """Bytes per quantised weight, constants included: 0.515869 with double quantisation, 0.5625 without."""
    constants = (1 + FP32 / DQ_BLOCK) / NF4_BLOCK if double_quant else FP32 / NF4_BLOCK
    return 0.5 + constants


def deepspeed_model_states(total_params: int, largest_layer_params: int, *, stage: int, gpus_per_node: int = 1,
                           nodes: int = 1, offload_optimizer: bool = False, offload_param: bool = False,
                           zero_init: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(host bytes per node, GPU bytes per GPU) exactly as DeepSpeed 0.19.8 estimates them.

    Stage 2 is ``estimate_zero2_model_states_mem_needs`` (``cpu_offload`` = offload_optimizer),
    stage 3 ``estimate_zero3_model_states_mem_needs`` (``cpu_offload_params`` = offload_param).
    Stages 0 and 1 have no DeepSpeed estimator: stage 1 uses the ZeRO paper's 2Ψ + 2Ψ + 12Ψ/N
    and stage 0 16Ψ, with stage 2's host figure.
    """
    gpus = nodes * gpus_per_node
    psi = total_params
    if stage == 3:
        largest = 4 * largest_layer_params
        per_node = 1 / nodes
        if offload_optimizer and offload_param:
            gpu = largest
            cpu = psi * (18 * per_node if zero_init else max(4 * gpus_per_node, 18 * per_node))
        elif offload_optimizer:
            gpu = largest + int(2 * psi / gpus)
            cpu = psi * (16 * per_node if zero_init else max(4 * gpus_per_node, 16 * per_node))
        elif offload_param:
            raise ConfigError("offload_param without offload_optimizer: DeepSpeed's estimator has no such case; "
                              "offload the optimizer too (zero_optimization.offload_optimizer.device = \"cpu\").")
        else:
            gpu = largest + int(18 * psi / gpus)
            cpu = (largest_layer_params if zero_init else psi) * 4 * gpus_per_node
        return int(cpu * additional_buffer_factor), int(gpu)
    if offload_param:
        raise ConfigError(f"offload_param needs ZeRO stage 3 (got stage {stage}): set zero_optimization.stage "
                          "to 3, or remove offload_param.")
    if stage == 2 and offload_optimizer:
        return int(psi * max(4 * gpus, 16) * additional_buffer_factor), 2 * psi
    cpu = int(psi * 4 * gpus_per_node * additional_buffer_factor)
    if stage == 2:
        return cpu, 2 * psi + int(18 * psi / gpus)
    if offload_optimizer:
        raise ConfigError(f"offload_optimizer needs ZeRO stage 2 or 3 (got stage {stage}).")
    return cpu, int(zero_paper_model_states(psi, stage, gpus))


def zero_paper_model_states(psi: float, stage: int, num_gpus: int, k: int = 12) -> float:
    """Bytes per GPU for mixed-precision Adam in the ZeRO paper (Rajbhandari et al. 2020, figure 1):
    2Ψ fp16 weights + 2Ψ gradients + KΨ optimizer states (K = 12: fp32 weights, momentum, variance),
    sharded by stage: 0 none, 1 optimizer (P_os), 2 + gradients (P_os+g), 3 + weights (P_os+g+p)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / num_gpus
    if stage == 2:
        return 2 * psi + (2 + k) * psi / num_gpus
    return (2 + 2 + k) * psi / num_gpus


# What DeepSpeed's stage 3 (deepspeed/runtime/zero/stage3.py, 0.19.8) holds on the GPU per parameter of this rank's
# partition when nothing is offloaded: the bf16 weights (``fp16_partitioned_groups_flat``, 2 B), the bf16 gradients
# (``grad_partitions_flat_buffer``, 2 B), the fp32 master weights (4 B) and Adam's two fp32 moments (8 B). The fp32
# gradients DeepSpeed's estimator counts (its 18 B) never exist for the whole model at once: the step makes them one
# sub-group at a time (``_prepare_fp32_grad_for_sub_group``: ``self.flatten(grads).to(fp32)``, a bf16 flat copy and
# its fp32 cast, 2 + 4 B per parameter of the sub-group) and drops them after that sub-group's Adam update.
ZERO3_STATES, ZERO3_STEP_BYTES = 2 + 2 + FP32 + 2 * FP32, BF16 + FP32
# torch's AdamW under FSDP2 (``training.engine``: foreach, the default on CUDA) takes the square root of all second
# moments into new tensors (``torch._foreach_sqrt(exp_avg_sqs)`` in ``_multi_tensor_adam``): 4 B per sharded parameter
# beside the 16 B of states. Measured: FSDP2 with checkpointing on one H100 peaked at 52.14 GiB allocated
# (results/runs/fp8/records/2026-11-27-h100-1/8b-fsdp2-compile-bf16.json), 20 B x 2.80 B parameters = 52.07 GiB.
ADAMW_FOREACH_BYTES = FP32


def parameter_sizes(shape: ModelShape, num_labels: int | None = None) -> list[int]:
    """Element counts of the model's parameters in ``model.parameters()`` order (what the optimizer and DeepSpeed's
    sub-groups see): the embedding, per decoder layer q, k, v, o, the MLP's linears and the two norms, the final
    norm, then the head (untied LM head or classification head)."""
    h = shape.hidden_size
    layer = [i * o for i, o in shape.linear_shapes().values()] + [h, h]
    head = shape.head_params(num_labels)
    return [shape.vocab_size * h, *layer * shape.num_hidden_layers, h, *([head] if head else [])]


def zero3_largest_sub_group(shape: ModelShape, *, gpus: int, num_labels: int | None = None,
                            sub_group_size: float | None = None) -> int:
    """Elements of this rank's largest optimizer sub-group under ZeRO-3: DeepSpeed's ``_create_fp16_sub_groups``
    walks the parameters in order, adding each one's partition (ceil(numel / GPUs)), and closes a group when it
    reaches ``sub_group_size`` (the shipped configs' 1e9, DeepSpeed's default), so a group overshoots by up to one
    parameter. Llama 3 8B's shape truncated to 8 layers on one GPU: 1.0035e9, 1.0486e9 and 0.7435e9."""
    limit = SUB_GROUP_SIZE if sub_group_size is None else sub_group_size
    largest = current = 0
    for numel in parameter_sizes(shape, num_labels):
        current += -(-numel // gpus)
        if current >= limit:
            largest, current = max(largest, current), 0
    return max(largest, current)


def zero3_model_states(shape: ModelShape, *, gpus: int, num_labels: int | None = None) -> dict[str, int]:
    """{part: GPU bytes per GPU} of full fine-tuning under ZeRO-3 without offload, in two phases that never overlap:

    * always: 16 bytes per parameter / GPUs (bf16 weights and gradients, fp32 master weights, Adam's moments;
      ``ZERO3_STATES``);
    * in the backward: the gathered largest layer's bf16 weights and its bf16 gradient (4 B per parameter of the
      largest layer, DeepSpeed's estimator's own term), beside the activations;
    * in the optimizer step, when activations and gathered layers are gone: the largest sub-group's gradients
      flattened in bf16 and cast to fp32 (6 B per parameter of it, ``ZERO3_STEP_BYTES``).

    Measured on one H200 (results/runs/mfu/records/2026-11-28-h200-1/8b-mb2-ga4.json, 8b-padded.json,
    8b-packed-varlen.json, 2026-11-28-h200-2/8b-mb4-ga4-liger.json; the H100's
    results/runs/fp8/records/2026-11-27-h100-*/8b-zero3-bf16.json): every run whose activations are small peaked at
    the same 47.61 GiB allocated, whatever its micro-batch; 16 B x 2.7956 B parameters + 6 B x 1.0486e9 = 47.52 GiB.
    """
    psi = shape.total_params(num_labels)
    return {"states": ZERO3_STATES * psi // gpus,
            "backward": 4 * shape.largest_layer_params(num_labels),
            "step": ZERO3_STEP_BYTES * zero3_largest_sub_group(shape, gpus=gpus, num_labels=num_labels)}


def fsdp2_model_states(shape: ModelShape, *, gpus: int, num_labels: int | None = None
                       ) -> dict[str, tuple[int, int]]:
    """{part: (host bytes per node, GPU bytes per GPU)} of full fine-tuning under FSDP2 as the recipes
    launch it (``launch.fsdp``: one unit per decoder layer, the embedding and the final norm + head as
    units of their own, full sharding, ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``).

    * sharded over all GPUs: fp32 weights (4 B; they are the optimizer's master weights), fp32
      gradients (4 B) and Adam's two fp32 moments (8 B): 16 bytes per parameter / N, where
      DeepSpeed's ZeRO-3 estimator counts 18 (bf16 and fp32 gradients both);
    * gathered in bf16: the decoder layer computing and the next one, prefetched (2 x 2 B per
      layer parameter), and the head, which accelerate keeps gathered from its forward to its
      backward (``reshard_after_forward=False`` for the last unit);
    * one unit's unsharded gradients in backward: bf16, and the fp32 copy reduce-scattered (6 B);
    * host: rank 0 reads the whole checkpoint and holds it in fp32 while the shards are sent out
      (``fsdp_cpu_ram_efficient_loading``); the other ranks build the model on the meta device.
    """
    psi = shape.total_params(num_labels)
    layer = (psi - shape.vocab_size * shape.hidden_size - shape.head_params(num_labels)
             - shape.hidden_size) // shape.num_hidden_layers  # a decoder layer with its two norms
    head = shape.head_params(num_labels)
    unit = max(layer, head, shape.vocab_size * shape.hidden_size)
    return {
        "fp32 weights + gradients + Adam, sharded (16 B/param / GPUs)": (0, (FP32 + FP32 + 2 * FP32) * psi // gpus),
        "gathered bf16 weights (2 layers + head)": (0, BF16 * (2 * layer + head)),
        "one unit's unsharded gradients (bf16 + fp32)": (0, (BF16 + FP32) * unit),
        "full fp32 state dict on rank 0 while loading": (FP32 * psi, 0),
    }


# DeepSpeed's swap buffers for ZeRO-Infinity: the optimizer swapper's pinned buffers (its default
# buffer_count, each the size of the largest optimizer sub-group), and the parameter buffers the
# shipped config sets (launch.nvme.PARAM_BUFFERS: buffer_count x buffer_size bf16 elements).
OPTIMIZER_SWAP_BUFFERS, SUB_GROUP_SIZE = 4, 1e9


def _param_swap_buffers() -> tuple[int, float]:
    from finetune_kit.launch.nvme import PARAM_BUFFERS

    return PARAM_BUFFERS


def nvme_parts(total_params: int, s) -> tuple[dict[str, int], dict[str, int]]:
    """({part: host bytes per node}, {part: disk bytes per node}) of ZeRO-3 offloading to NVMe.

    On the disk, each rank swaps its partition: fp32 weights, Adam's two moments and the fp32
    gradients (16 bytes per parameter) with the optimizer, and the bf16 weights (2) with the
    parameters. In host memory, instead of those states: the pinned swap buffers of every rank on
    the node (the optimizer's: 4 x one sub-group in fp32; the parameters': buffer_count x buffer_size bf16
    elements, from the launched JSON, or the shipped config's 5 x 6e8 for a Setup built by hand).
    ``s``: the plan's Setup (:class:`finetune_kit.planning.verdict.Setup`).
    """
    share = total_params / s.nodes  # what one node's ranks hold between them
    host, disk = {}, {}
    if s.offload_optimizer:
        sub_group = min(SUB_GROUP_SIZE, total_params / s.gpus)
        host["optimizer swap buffers (pinned)"] = int(OPTIMIZER_SWAP_BUFFERS * sub_group * FP32 * s.gpus_per_node)
        disk["fp32 weights + Adam + fp32 gradients (swap files)"] = int((FP32 + 2 * FP32 + FP32) * share)
    if s.offload_param:
        count, size = s.param_buffers or _param_swap_buffers()
        host["parameter swap buffers (pinned)"] = int(count * size * BF16 * s.gpus_per_node)
        disk["bf16 weights (swap files)"] = int(BF16 * share)
    return host, disk


def adapter_model_states(shape: ModelShape, adapter: Adapter, *, stage: int, gpus: int, nodes: int,
                         offload_optimizer: bool, offload_param: bool, num_labels: int | None = None,
                         additional_buffer_factor: float = 1.5) -> dict[str, tuple[int, int]]:
    """{part: (host bytes per node, GPU bytes per GPU)} for LoRA/QLoRA under ZeRO ``stage``.

    Assumptions: the frozen base (4-bit weights packed in bf16 storage, or bf16 weights) and the
    bf16 embeddings/norms/head are ZeRO-3 partitions; nf4 quantisation constants are not
    parameters, so every GPU keeps all of them. Trainable parameters (LoRA A/B, plus the
    classification head for sequence classification) carry DeepSpeed's 2 + 18 bytes each, sharded
    like full fine-tuning (ZeRO-2: all but the bf16 copy; ZeRO-3: everything). Offloaded parts are
    counted on the host with the same margin DeepSpeed's estimators use.
    """
    frozen_linear = shape.num_hidden_layers * shape.block_linear_params()
    bf16_layers = shape.unquantised_params(num_labels)
    trainable = shape.lora_params(adapter.rank, adapter.targets) + (shape.head_params(num_labels) if num_labels else 0)
    trainable += shape.dora_magnitudes(adapter.targets) if adapter.dora else 0
    if num_labels:  # the classification head is trainable, not frozen
        bf16_layers -= shape.head_params(num_labels)
    base_bytes = frozen_linear * (0.5 if adapter.quantized else BF16)
    constants = frozen_linear * (nf4_bytes_per_param(adapter.double_quant) - 0.5) if adapter.quantized else 0
    weights_split = gpus if stage == 3 else 1
    states_split = gpus if stage >= 1 else 1
    per_node = gpus // nodes
    parts: dict[str, tuple[int, int]] = {}

    def put(name, total_bytes, split, offloaded):
        on_gpu = total_bytes / split
        if offloaded:  # host holds this node's GPUs' shares
            parts[name] = (int(on_gpu * per_node * additional_buffer_factor), 0)
        else:
            parts[name] = (0, int(on_gpu))

    put("frozen base weights (nf4)" if adapter.quantized else "frozen base weights (bf16)", base_bytes,
        weights_split, offload_param)
    if constants:
        put("nf4 quantisation constants", constants, 1, False)
    put("bf16 embeddings, norms" + (", head" if not num_labels else ""), bf16_layers * BF16, weights_split,
        offload_param)
    put("trainable weights (bf16)", trainable * DS_PARAM16, weights_split, offload_param)
    put("trainable grads + Adam states", trainable * DS_STATES, states_split, offload_optimizer)
    return parts
