"""A resumed DeepSpeed CPU Adam takes the same steps as one that was never stopped
(training/checkpointing/adam_resume.py)."""

from __future__ import annotations

import pytest
import torch

from finetune_kit.training.checkpointing.adam_resume import replay_bias_correction

STEPS, RESUME_AT = 60, 10  # early: beta2**t is still far from 0, so its last bit reaches the update
BETAS = (0.9, 0.95)


SIZE = 2**16  # enough weights for some updates to land next to a rounding boundary


def start() -> torch.nn.Parameter:
    return torch.nn.Parameter(0.02 * torch.randn(SIZE, generator=torch.Generator().manual_seed(0)))


def grads(step: int) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(step))


def adam(kind: str, param):
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    if kind == "cpu_adam":  # optimizer offload
        return DeepSpeedCPUAdam([param], lr=1e-3, betas=BETAS, weight_decay=0.1, adamw_mode=True)
    return FusedAdam([param], lr=1e-3, betas=BETAS, weight_decay=0.1)  # a CPU-only machine, no offload


def train(opt, param, steps) -> None:
    for step in steps:
        param.grad = grads(step)
        opt.step()


def relaunched(opt) -> None:
    """The native optimizer as a new process has it. FusedAdam's is one per process (per AdamW mode),
    created with placeholder betas: a call with other betas makes its next step take the path of a
    first call, as after a relaunch. DeepSpeedCPUAdam makes a new one per instance."""
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.ops.adam.fused_adam import multi_tensor_applier

    if isinstance(opt, FusedAdam):
        e = torch.empty(0)
        multi_tensor_applier(opt.multi_tensor_adam, opt._dummy_overflow_buf, [[e], [e], [e], [e]], 0.0, 0.0, 0.0,
                             0.0, 1, opt.adam_w_mode, 1, 0.0)


def resumed(kind: str, replay: bool) -> torch.Tensor:
    """Steps 1..RESUME_AT, then a new optimizer loads the state (a relaunch) and takes the rest."""
    param = start()
    first = adam(kind, param)
    train(first, param, range(1, RESUME_AT + 1))
    saved = first.state_dict()
    param = torch.nn.Parameter(param.detach().clone())
    second = adam(kind, param)
    relaunched(second)
    second.load_state_dict(saved)
    if replay:
        assert replay_bias_correction(second) == RESUME_AT
    train(second, param, range(RESUME_AT + 1, STEPS + 1))
    return param.detach()


@pytest.mark.parametrize("kind", ["fused_adam", "cpu_adam"])
def test_a_resumed_native_adam_is_bit_identical_once_its_steps_are_replayed(kind):
    param = start()
    train(adam(kind, param), param, range(1, STEPS + 1))
    straight = param.detach()
    assert torch.equal(resumed(kind, replay=True), straight)
    # negative control: without the replay, beta**t is recomputed with pow at the resume and drifts
    assert not torch.equal(resumed(kind, replay=False), straight)


def test_torch_adam_needs_no_replay():
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([param])
    param.grad = torch.ones(4)
    opt.step()
    assert replay_bias_correction(opt) == 0  # torch's Adam computes beta**t from its step count
