"""The GPU check's CPU version end to end: every case runs its recipe's own train.py and configs at
a tiny width (the fp16 case needs a GPU and is skipped with its reason), and each record describes
the model that actually ran. This keeps `make gpu-check` from rotting between GPU runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from finetune_tools.gpu_check.cases import BY_NAME, CASES
from finetune_tools.gpu_check.synthetic import check_shape
from tests.harness import REPO, launch_env

pytestmark = pytest.mark.recipe


@pytest.fixture(scope="module")
def summary(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check")
    # --gpu-memory-gib: every rank holds its GPU to 80 GiB, as on an 80 GB H100; on CPU nothing is held, and the
    # memory plan, the rows and the records still carry it
    proc = subprocess.run([sys.executable, "-m", "finetune_tools.gpu_check", "--tiny", "--no-save", "--out", str(out),
                           "--gpu-memory-gib", "80"], cwd=REPO,
                          capture_output=True, text=True, timeout=1800, env=launch_env())
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(r"\d+ of \d+ passed, 0 failed", proc.stdout)
    summary = json.loads((out / "summary.json").read_text())
    summary["out"], summary["stdout"] = out, proc.stdout
    return summary


def test_the_memory_cap_reaches_every_rank_row_and_record(summary):
    from finetune_kit.metering.run_record import RunRecord

    ran = [row for row in summary["cases"] if row["status"] == "ok"]
    assert ran and all(row["gpu_memory_cap_GiB"] == 80 for row in ran)
    assert all(RunRecord.read(row["record"]).hardware.gpu_memory_cap_GiB == 80 for row in ran)
    assert "each rank held to 80 GiB" in summary["stdout"] and "(GPU held to 80 GiB)" in summary["stdout"]
    log = (summary["out"] / ran[0]["case"] / "run.log").read_text()
    assert "FINETUNE_GPU_MEMORY_GIB=80: no GPU here, nothing held" in log  # said by the ranks themselves


def test_no_save_leaves_no_model_or_adapter(summary):
    ran = [row["case"] for row in summary["cases"] if row["status"] == "ok"]
    assert ran and all((summary["out"] / name / "run_record.json").is_file() for name in ran)
    assert not [p for name in ran for p in (summary["out"] / name).iterdir() if p.name in ("model", "adapter")]


def test_every_case_runs_except_fp16_on_cpu(summary):
    status = {row["case"]: row["status"] for row in summary["cases"]}
    assert summary["tiny"] is True and set(status) == {case.name for case in CASES}  # the default --cases
    assert status.pop("llama2-13b-zero2-fp16") == "skipped"
    assert set(status.values()) == {"ok"}, status


def test_records_describe_the_model_that_ran(summary):
    from finetune_kit.metering.run_record import RunRecord

    for row in summary["cases"]:
        if row["status"] != "ok":
            continue
        case = BY_NAME[row["case"]]
        record = RunRecord.read(row["record"])
        num_labels = 2 if case.data == "reviews" else None
        assert record.model.params_total == check_shape(case.arch, row["layers"], tiny=True).total_params(num_labels)
        assert record.label == f"gpu check: {case.name}" and record.training.seq_len == row["seq_len"]
        # synthetic reviews fill every sequence; conversations end at a turn, one short exchange before the end
        assert record.measured.padding_fraction < (0.15 if case.data == "instructions" else 1e-9)
        assert row["tokens_per_s_per_device"] > 0 and row["mfu_percent"] is None  # no MFU on a CPU
        assert row["predicted_gpu_GiB"] > 0 and row["software"]["libraries"]["deepspeed"]
