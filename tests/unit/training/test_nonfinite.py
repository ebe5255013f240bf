"""The non-finite step guard's decisions on real values (the recipes' launches provoke the fault for real)."""

import math

import pytest
import torch

from finetune_kit.errors import ConfigError
from finetune_kit.training import nonfinite
from finetune_kit.training.loop import Step


class OneRank:
    num_processes, is_main_process = 1, True


def step(number: int, rows=(0, 4)) -> Step:
    return Step(number=number, epoch=0, micro_batches=[], labelled=torch.tensor(1), backward_scale=1.0,
                example_ids=list(rows), lr=0.0, started=0.0, last=False, ends_epoch=False, after=None)


def record(loss, grad_norm=1.0):
    return {"loss": loss, **({"grad_norm": grad_norm} if grad_norm is not None else {})}


def test_finite_reads_floats_tensors_and_no_figure():
    assert nonfinite.finite(None) and nonfinite.finite(2.5) and nonfinite.finite(torch.tensor(3.0))
    assert not nonfinite.finite(float("nan")) and not nonfinite.finite(torch.tensor(float("inf")))
    assert not nonfinite.finite(torch.tensor(float("nan"), dtype=torch.bfloat16))


def test_stop_names_the_step_the_values_and_the_rows_counted_from_one():
    guard = nonfinite.Guard(OneRank(), nonfinite.STOP, "d.jsonl")
    assert guard.check(step(1), record(2.0)) is True
    with pytest.raises(nonfinite.NonfiniteStep, match=r"^step 2 is not finite \(loss nan, gradient norm inf\); its "
                                                      r"micro-batches held rows 1, 5 \(2\) of data 'd\.jsonl'\. "
                                                      r"Stopped there \(--on-nonfinite stop\): its update was not "
                                                      r"applied and no checkpoint was taken after it"):
        guard.check(step(2), record(math.nan, math.inf))


def test_a_finite_loss_with_a_non_finite_norm_is_caught_and_skip_stops_at_its_limit(capsys):
    guard = nonfinite.Guard(OneRank(), nonfinite.Policy("skip", 2), "d.jsonl")
    assert guard.check(step(1), record(2.0, math.inf)) is False  # the norm alone
    assert guard.check(step(2), record(2.0)) is True  # a finite step ends the run of skips
    assert guard.check(step(3), record(math.inf, None)) is False  # the loss alone, no norm reported
    with pytest.raises(nonfinite.NonfiniteStep, match=r"^step 4 is not finite .*Stopped there \(2 in a row "
                                                      r"\(--max-nonfinite-skips 2\)\)"):
        guard.check(step(4), record(math.nan, math.nan))
    out = capsys.readouterr().out
    assert "skipped: step 1 is not finite (loss 2, gradient norm inf)" in out and "(1 in a row" in out
    assert "skipped: step 3 is not finite (loss inf, gradient norm none)" in out
    assert guard.skipped == [1, 3, 4]


@pytest.mark.parametrize(("action", "limit", "pattern"), [
    pytest.param("halt", 3, r"--on-nonfinite halt: the choices are stop", id="unknown_action"),
    pytest.param("skip", 0, r"--max-nonfinite-skips 0: .*a whole number from 1\. Pass --max-nonfinite-skips 3",
                 id="no_skips"),
])
def test_a_policy_that_cannot_work_is_refused(action, limit, pattern):
    class Args:
        on_nonfinite, max_nonfinite_skips = action, limit

    with pytest.raises(ConfigError, match=pattern):
        nonfinite.decide(Args())
