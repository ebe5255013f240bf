"""The one-GPU command of the levers most likely to lift the 8B shape's MFU (``ablation.MFU_ROWS``): what
each row changes, that every row's speed-up is against ``8b-mb2-ga4``, and that the command is predicted
within 9 minutes with its set-up."""

from __future__ import annotations

import pytest

from finetune_tools.gpu_check import ablation, runner
from tests.harness import REPO

ROWS = [ablation.BY_NAME[name] for name in ablation.MFU_ROWS]


def _row(name: str, tps: float | None) -> dict:
    v = ablation.BY_NAME[name]
    return {"run": name, "case": v.case, "seq_len": 4096, "tokens_per_s_per_device": tps}


def test_the_rows_are_the_baseline_then_each_lever_once():
    assert ROWS[0].name == "8b-mb2-ga4" and (ROWS[0].micro_batch, ROWS[0].grad_accum) == (2, 4)
    levers = {v.name: (v.case, v.micro_batch, v.grad_accum, v.flags, v.data) for v in ROWS}
    assert levers["8b-mb4-ga4-nockpt"][1:4] == (4, 4, ("--no-gradient-checkpointing",))
    assert levers["8b-mb4-ga4-nockpt-liger"][3] == ("--no-gradient-checkpointing", "--loss-kernel", "liger")
    assert levers["8b-mb4-ga4-ckpt2"][1:4] == (4, 4, ("--recompute-every", "2"))
    assert levers["8b-fsdp2-mb4-ga4-nockpt-compile"][0] == "llama3-8b-zero3-fsdp2"
    assert set(levers["8b-fsdp2-mb4-ga4-nockpt-compile"][3]) == {"--no-gradient-checkpointing", "--compile"}
    # packed against padded: the same short examples, only --pack between them
    padded, packed = ablation.BY_NAME["8b-padded"], ablation.BY_NAME["8b-packed-varlen"]
    assert padded.data == packed.data == "short-instructions" and padded.flags == () and packed.flags == ("--pack",)
    assert packed.baseline == "8b-padded"


def test_every_row_is_against_the_named_row_except_one_that_names_its_own():
    rows = [_row("8b-mb2-ga4", 20000.0), _row("8b-mb4-ga4-nockpt", 26000.0),
            _row("8b-fsdp2-mb4-ga4-nockpt-compile", 30000.0), _row("8b-padded", 5000.0),
            _row("8b-packed-varlen", 15000.0)]
    out = {r["run"]: r for r in ablation.speedups(rows, against="8b-mb2-ga4")}
    assert {k: r["speedup"] for k, r in out.items()} == pytest.approx(
        {"8b-mb2-ga4": 1.0, "8b-mb4-ga4-nockpt": 1.3, "8b-fsdp2-mb4-ga4-nockpt-compile": 1.5, "8b-padded": 0.25,
         "8b-packed-varlen": 3.0})
    assert out["8b-packed-varlen"]["baseline"] == "8b-padded"
    # negative control: without it, the FSDP2 row is its own case's first row
    plain = {r["run"]: r for r in ablation.speedups(rows)}
    assert plain["8b-fsdp2-mb4-ga4-nockpt-compile"]["speedup"] == 1.0


def test_an_unknown_row_to_compare_against_is_refused_before_anything_runs(capsys, tmp_path):
    code = runner.main(["--ablation", "--variants", "8b-mb2-ga4,8b-mb4-ga4-nockpt", "--speedup-against", "8b-mb4-ga4",
                        "--out", str(tmp_path / "out"), "--root", str(REPO)])
    err = capsys.readouterr().err
    assert code == 2 and "--speedup-against 8b-mb4-ga4" in err and "8b-mb4-ga4-nockpt" in err
    assert not (tmp_path / "out").exists()


def test_the_first_seven_rows_are_predicted_within_nine_minutes_with_their_set_up():
    seven = ROWS[:7]
    total = ablation.setup_seconds(seven) + sum(ablation.expected_seconds(v, ablation.MFU_STEPS) for v in seven)
    assert total <= 540
    # the eighth is predicted past it: the command starts it only where the others ran faster (--time-budget)
    assert total + ablation.expected_seconds(ROWS[7], ablation.MFU_STEPS) > 540
    assert ablation.setup_seconds(seven) == ablation.ONE_MODEL_SETUP_SECONDS  # one model, fused Adam alone


def test_a_rows_time_grows_with_its_tokens_and_steps_from_the_measured_step():
    base, mb4 = ablation.BY_NAME["8b-mb2-ga4"], ablation.BY_NAME["8b-mb4-ga4-nockpt"]
    assert ablation.expected_seconds(base) == pytest.approx(ablation.SECONDS_ON_H100[base.case])  # as measured
    step = ablation.STEP_SECONDS_ON_H100[base.case]
    assert ablation.expected_seconds(mb4) - ablation.expected_seconds(base) == pytest.approx(8 * step)
    assert ablation.expected_seconds(base) - ablation.expected_seconds(base, steps=6) == pytest.approx(2 * step)
    # a case with no measured step keeps the accumulation scaling
    qlora = ablation.BY_NAME["70b-qlora-mb4-ga4"]
    assert ablation.expected_seconds(qlora, steps=3) == ablation.SECONDS_ON_H100[qlora.case]
