"""The GPU smoke's plan and bookkeeping: its rows fit one 9-minute command, each runs with flags its recipe
accepts, a row is run, skipped or left out for a stated reason, and a failed row's note is the error itself.
(The smoke end to end, at the tiny width on CPU from the offline bundle: tests/offline/test_gpu_bundle.py.)"""

from __future__ import annotations

import pytest

from finetune_tools.gpu_check import smoke
from finetune_tools.gpu_check.cases import recipe_flags
from tests.harness import REPO, load_script

# The end of a real failure's log (make eval on the H100, 2026-11-26), trimmed: the error, then lm-eval's progress bar.
OOM_LOG = """\
Running loglikelihood requests:   0%|          | 0/4 [00:00<?, ?it/s]Traceback (most recent call last):
  File "/tmp/site/lm_eval/models/huggingface.py", line 1503, in _loglikelihood_tokens
    multi_logits = F.log_softmax(
                   ^^^^^^^^^^^^^^
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 33.70 GiB. GPU 0 has a total capacity of 79.18 GiB
Running loglikelihood requests:   0%|          | 0/4 [00:01<?, ?it/s]
"""
# A rank's one-line refusal, then what accelerate's launcher prints about its child.
LAUNCHER_LOG = """\
error: --loss-kernel liger: Liger-Kernel's fused loss is a Triton kernel for CUDA GPUs
Traceback (most recent call last):
  File "/usr/bin/accelerate", line 8, in <module>
    sys.exit(main())
subprocess.CalledProcessError: Command '['/usr/bin/python3', 'train.py']' returned non-zero exit status 1.
"""


def test_the_smoke_fits_one_command_of_nine_minutes():
    assert smoke.expected_total(smoke.ROWS) <= smoke.TIME_BUDGET == 9 * 60
    assert len(smoke.BY_ROW) == len(smoke.ROWS)
    for row in smoke.ROWS:  # a row after training reads one that saves and runs before it
        assert bool(row.case) != bool(row.command)
        if row.reads:
            assert smoke.ROWS.index(smoke.BY_ROW[row.reads]) < smoke.ROWS.index(row) and smoke.BY_ROW[row.reads].save


@pytest.mark.parametrize("row", [r for r in smoke.ROWS if r.case], ids=lambda r: r.name)
def test_every_training_row_passes_its_recipes_own_flag_parser(row, monkeypatch):
    case = smoke.CASES[row.case]
    monkeypatch.chdir(REPO / "recipes" / case.recipe)
    flags = recipe_flags(case, model="m", data="d.jsonl", output="o", steps=smoke.STEPS, seq_len=row.seq_len or 128,
                         micro_batch=row.micro_batch or case.micro_batch, save=row.save)
    parsed = load_script(REPO / "recipes" / case.recipe / "train.py").parse_args(
        [*flags, "--meter-warmup-steps", str(row.warmup), *row.flags])
    assert parsed.max_steps == smoke.STEPS and parsed.meter_warmup_steps == row.warmup < smoke.STEPS
    assert parsed.save_model is row.save


def test_an_error_line_is_the_error_not_the_launchers_report():
    assert smoke.error_line(OOM_LOG).startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 33.70")
    assert smoke.error_line(LAUNCHER_LOG) == ("error: --loss-kernel liger: Liger-Kernel's fused loss is a Triton "
                                              "kernel for CUDA GPUs")
    assert smoke.error_line("") == "(no output)" and smoke.error_line("step 1\nSegfault here\n") == "Segfault here"


def why(name, results=None, *, tiny=False, capability=(9, 0), elapsed=0.0, budget=540.0):
    return smoke.why_not(smoke.BY_ROW[name], results or {}, tiny=tiny, capability=capability, elapsed=elapsed,
                         budget=budget)


def test_a_row_runs_only_if_it_can_and_is_expected_to_end_within_the_budget():
    assert why("8b-packed-varlen") is None
    expected = smoke.BY_ROW["8b-packed-varlen"].seconds
    assert why("8b-packed-varlen", elapsed=540 - expected) is None
    late = why("8b-packed-varlen", elapsed=541 - expected)
    assert late["status"] == "not run" and "budget" in late["reason"]
    assert why("8b-packed-varlen", elapsed=10_000, budget=None) is None  # no budget on a CPU
    assert why("8b-zero3-fp8-rowwise", capability=(8, 0))["status"] == "not applicable"
    assert why("8b-zero3-fp8-rowwise", capability=(8, 9)) is None
    assert why("8b-liger", tiny=True)["reason"].startswith("on a CPU:") and why("8b-liger") is None
    failed = {"8b-zero3-samples": {"status": "out of memory"}}
    assert "8b-zero3-samples" in why("8b-eval-cuda", failed)["reason"]
    assert why("8b-eval-cuda", {"8b-zero3-samples": {"status": "ok"}}) is None


def test_the_table_notes_why_a_row_did_not_pass_and_what_a_command_made():
    rows = [{"name": "a", "status": "failed", "error": "RuntimeError: boom"},
            {"name": "b", "status": "ok", "result": {"tasks": {"heldout": {"loss": 11.65251}}}, "seconds": 18.1},
            {"name": "c", "status": "ok", "result": {"merged_files": ["model.safetensors"], "merged_GiB": 5.12}},
            {"name": "d", "status": "not run", "reason": "expected 25 s, 3 s of the 500 s budget left"}]
    text = smoke.table(rows)
    assert "RuntimeError: boom" in text and "heldout loss 11.6525" in text and "5.1 GiB" in text
    assert "3 s of the 500 s budget left" in text
