"""Resuming a run whose ZeRO-3 optimizer is offloaded to NVMe: what DeepSpeed's own load leaves out."""

from __future__ import annotations

from pathlib import Path

from finetune_kit.training.checkpointing.checkpoints import DS_TAG


def restore_nvme_optimizer(engine, path: Path) -> None:
    """Finish DeepSpeed's load of a ZeRO-3 checkpoint whose optimizer is offloaded to NVMe.

    DeepSpeed 0.19.8 (``engine.load_checkpoint``) copies the checkpoint's swap files back into the
    swap folder, but skips the rank's optimizer state file. Left there, the resumed run differs
    from the uninterrupted one:

    * the optimizer's hyperparameters keep their initial values until the schedule steps again: the
      first update after the resume is made with the schedule's first learning rate (0 in warm-up);
    * Adam's step count restarts, and the fresh optimizer does not know the moment files that were
      copied back: the moments restart at zero;
    * sub-groups too small to swap (DeepSpeed keeps tensors under 1 MiB in memory) lose their fp32
      weights and moments.

    This restores the hyperparameters and step counts from the state file, registers the copied
    moment files with the swapper (read at the next swap-in), and restores the in-memory sub-groups
    and their 16-bit weights. Call it on every rank right after ``accelerator.load_state``.
    """
    import torch

    opt = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3; opt.optimizer is the CPU Adam
    [saved_file] = (Path(path) / DS_TAG).glob(f"*zero_pp_rank_{engine.global_rank}_mp_rank_00_optim_states.pt")
    saved = torch.load(saved_file, weights_only=False, map_location="cpu")["optimizer_state_dict"]
    inner = saved["optimizer_state_dict"]
    for group, saved_group in zip(opt.optimizer.param_groups, inner["param_groups"], strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    swapper = opt.optimizer_swapper
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        state = inner["state"].get(i)
        if not state:
            continue
        if opt._swappable_optimizer_subgroup(i):
            # Placeholders of the right size (no memory); the next swap-in points them at the files' contents.
            numel = opt.fp16_partitioned_groups_flat_numel[i]
            opt.optimizer.state[fp32] = {k: torch.zeros(1, dtype=fp32.dtype).expand(numel) if torch.is_tensor(v)
                                         else v for k, v in state.items()}
            swap_info = swapper._get_param_swap_info(fp32)
            swap_info.tensors, swap_info.has_state_tensors = swap_info.tensors[:1], False
            swapper._update_param_state_info(swap_info, fp32)  # exp_avg-<id>.tensor.swp, ...: the copied files
        else:
            fp32.data.copy_(saved["fp32_flat_groups"][i].data)
            opt.optimizer.state[fp32] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            opt._reassign_or_swap_out_partitioned_parameters(i)  # the 16-bit weights from the fp32 ones
