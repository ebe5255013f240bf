"""results/gpu-smoke.md from the smoke summaries: each row's latest result and the run that ran it, a rerun's own
rows only, and a failure's note its error line."""

from __future__ import annotations

import json

from finetune_tools.results import smoke_page
from tests.harness import REPO

RESULTS = REPO / "results"


def summary(rows, *, rerun=False, date="2026-11-26", started_at=0) -> dict:
    return {"date": date, "started_at": started_at, "device": "NVIDIA H100 80GB HBM3", "commit": "abc", "rerun": rerun,
            "layers": 2, "steps": 3, "rows": rows}


def test_a_rerun_replaces_only_the_rows_it_ran(tmp_path):
    folder = tmp_path / smoke_page.FOLDER
    folder.mkdir(parents=True)
    ok = {"name": "a", "path": "p", "status": "ok", "tokens_per_s_per_device": 100.0}
    failed = {"name": "b", "path": "q", "status": "failed", "error": "RuntimeError: " + "x" * 300}
    fixed = {**failed, "status": "ok", "error": None}
    (folder / "first.json").write_text(json.dumps(summary([ok, failed], started_at=10)))
    (folder / "again.json").write_text(json.dumps(summary([ok, fixed], rerun=True, started_at=20)))  # ran b only
    runs = smoke_page.load(tmp_path)
    assert [stem for stem, _ in runs] == ["first", "again"]  # by start, not by name
    assert [(row["status"], stem) for row, stem in smoke_page.latest(runs)] == [("ok", "first"), ("ok", "again")]
    assert [[row["name"] for row in fresh] for _, _, fresh in smoke_page.ran(runs)] == [["a", "b"], ["b"]]
    page = smoke_page.render(tmp_path)
    assert "a rerun of 1 row(s)" in page and len(smoke_page.note(failed)) == smoke_page.NOTE_CHARS


def test_the_committed_page_shows_every_path_of_the_h100_smoke():
    runs = smoke_page.load(RESULTS)
    assert runs and all(s["device"].startswith("NVIDIA H100") for _, s in runs)
    latest = {row["name"]: (row, stem) for row, stem in smoke_page.latest(runs)}
    from finetune_tools.gpu_check import smoke

    assert set(latest) == set(smoke.BY_ROW) and {row["status"] for row, _ in latest.values()} == {"ok"}
    first = dict(runs)["2026-11-26-h100-1"]
    eval_row = next(r for r in first["rows"] if r["name"] == "8b-eval-cuda")
    assert eval_row["status"] == "out of memory" and "Tried to allocate 33.70 GiB" in smoke_page.note(eval_row)
    assert smoke_page.note(latest["8b-eval-cuda"][0]).startswith("heldout loss ")
    assert (RESULTS / smoke_page.FILE).read_text() == smoke_page.render(RESULTS)
