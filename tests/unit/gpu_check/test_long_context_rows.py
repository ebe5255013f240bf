"""The ablation's long-context rows (8B shape, 32K-512K tokens, one GPU), checked on CPU: each row
carries the levers its name says, its flags parse with the recipe's own parser, the rows fit the
10-minute commands, the synthetic data is as long as a row asks, and a row that runs out of GPU
memory is a result in the summary, not a crash of the check."""

from __future__ import annotations

import dataclasses
import json

import pytest

from finetune_tools.gpu_check import ablation, runner
from finetune_tools.gpu_check.cases import EVERY_CASE, LONG, LONG_CASES, LONG_EXTENDED, positions, recipe_flags
from finetune_tools.gpu_check.synthetic import build_model, check_config, write_data
from tests.harness import REPO, load_script
from tests.unit.gpu_check.documented import assert_documented_total

K = 1024
LONG_ROWS = ablation.LONG_VARIANTS
PROBE = [v for v in LONG_ROWS if v.probe == ablation.LONGEST]
COMMAND_S = 540  # one GPU command: 10 minutes, less a minute for the machine's start and the copies


def test_the_probe_climbs_from_32k_to_512k_with_every_long_context_lever():
    assert [v.seq_len for v in PROBE] == [32 * K, 64 * K, 128 * K, 256 * K, 512 * K]
    for v in PROBE:
        assert {"--tiled-mlp", "--offload-activations"} <= set(v.flags) and "--no-gradient-checkpointing" not in v.flags
        assert v.micro_batch == 1 and v.grad_accum == 1
    assert [v.name for v in ablation.VARIANTS[-len(PROBE):]] == [v.name for v in PROBE]  # last, shortest first


@pytest.mark.parametrize("k", [32, 128])
def test_32k_and_128k_each_measure_the_levers_apart_and_together(k):
    rows = {v.name: set(v.flags) for v in LONG_ROWS if v.seq_len == k * K and not v.data}
    levers = {"--tiled-mlp", "--offload-activations"}
    assert sorted(tuple(sorted(flags & levers)) for flags in rows.values()) == [
        (), ("--offload-activations",), ("--offload-activations", "--tiled-mlp"), ("--tiled-mlp",)]
    first = next(v for v in LONG_ROWS if v.seq_len == k * K)  # the baseline of its speed-ups
    assert not set(first.flags) & levers


@pytest.mark.parametrize("variant", LONG_ROWS, ids=lambda v: v.name)
def test_every_long_row_is_one_gpu_micro_batch_1_with_the_loss_in_4k_chunks(variant):
    case = EVERY_CASE[variant.case]
    assert case.arch == "llama3.1-8b" and "configs/zero3-offload.yaml" in case.launcher
    assert case.flags == ("--sequence-parallel", "1") and "--num_processes" in case.launcher
    assert case.launcher[case.launcher.index("--num_processes") + 1] == "1"
    flags = list(variant.flags)
    assert int(flags[flags.index("--loss-chunks") + 1]) * ablation.LOSS_CHUNK_TOKENS == variant.seq_len
    assert variant.seq_len <= positions(case)
    assert variant.case == (LONG if variant.seq_len <= 128 * K else LONG_EXTENDED)
    assert "planner's prediction" in variant.note and f"{case.layers} decoder layers" in variant.note
    assert variant.steps in (ablation.LONG_STEPS, ablation.LONGEST_STEPS)


def test_long_cases_are_left_out_of_the_plain_check():
    from finetune_tools.gpu_check.cases import BY_NAME, CASES

    assert not {c.name for c in LONG_CASES} & set(BY_NAME)
    assert runner.parse_args([]).cases.split(",") == [c.name for c in CASES]


def test_the_extended_model_takes_512k_and_the_published_one_refuses_it():
    """Past 128K the recipe's own check refuses the published config: hence the second long case."""
    from transformers import LlamaConfig

    from finetune_kit.errors import ConfigError
    from finetune_kit.models.loading import check_seq_len

    published = LlamaConfig(**check_config("llama3.1-8b", 2))
    extended = LlamaConfig(**check_config("llama3.1-8b", 2, max_positions=EVERY_CASE[LONG_EXTENDED].max_positions))
    check_seq_len(128 * K, published, "m")
    check_seq_len(512 * K, extended, "m")
    with pytest.raises(ConfigError, match="above the limit"):
        check_seq_len(256 * K, published, "m")


@pytest.mark.parametrize("variant", LONG_ROWS, ids=lambda v: v.name)
def test_every_long_row_passes_the_recipes_own_flag_parser(variant, monkeypatch):
    case = EVERY_CASE[variant.case]
    monkeypatch.chdir(REPO / "recipes" / case.recipe)
    script = load_script(REPO / "recipes" / case.recipe / "train.py")
    flags = [*recipe_flags(case, model="m", data="d.jsonl", output="o", steps=variant.steps, seq_len=variant.seq_len,
                           micro_batch=variant.micro_batch, grad_accum=variant.grad_accum), *variant.flags]
    parsed = script.parse_args(flags)
    assert (parsed.max_seq_len, parsed.micro_batch_size, parsed.sequence_parallel) == (variant.seq_len, 1, 1)
    assert parsed.tiled_mlp is ("--tiled-mlp" in variant.flags)
    assert parsed.offload_activations is ("--offload-activations" in variant.flags)
    assert parsed.gradient_checkpointing and parsed.pack is ("--pack" in variant.flags)
    assert parsed.max_steps == variant.steps
    # a row of several steps leaves its first out of the medians; a one-step row measures that step
    assert parsed.meter_warmup_steps == (1 if variant.steps > 1 else 0) < variant.steps


def test_long_rows_fit_the_commands_and_take_longer_the_longer_the_sequence():
    for variant in LONG_ROWS:
        assert ablation.setup_seconds([variant]) + ablation.expected_seconds(variant) <= COMMAND_S, variant.name
    groups = ablation.batches(ablation.VARIANTS, COMMAND_S)
    assert [v for g in groups for v in g] == ablation.VARIANTS
    assert all(ablation.setup_seconds(g) + sum(map(ablation.expected_seconds, g)) <= COMMAND_S for g in groups)
    probe_s = [ablation.expected_seconds(v) for v in PROBE]
    launch = ablation.LONG_LAUNCH_SECONDS  # past 128K one step a row, up to it three; attention grows with length
    assert probe_s == sorted(probe_s) and probe_s[-1] - launch > 2 * (probe_s[2] - launch)
    # tiled MLP costs a second MLP forward; checkpoints in host memory cost no FLOPs
    tiled, plain = (ablation.step_flops_per_token("llama3.1-8b", 2, 128 * K, t)["matmul"] for t in (True, False))
    assert 1.05 < tiled / plain < 1.15  # the head's FLOPs are the same in both


def test_the_documented_predicted_total_is_the_codes():
    """docs/gpu.md states the long-context rows' predicted total; it must not drift from ablation.py."""
    assert_documented_total(LONG_ROWS, "long-context")


@pytest.fixture(scope="module")
def long_tokenizer(tmp_path_factory):
    from finetune_kit.models import loading

    folder = build_model("llama3.1-8b", "llama3", 1, tmp_path_factory.mktemp("long") / "m", tiny=True,
                         max_positions=512 * K)
    assert json.loads((folder / "config.json").read_text())["max_position_embeddings"] == 512 * K
    return loading.load_tokenizer(str(folder))


def test_a_long_conversation_fills_one_32k_sequence(long_tokenizer, tmp_path):
    """One conversation per sequence: truncated at a turn to within one exchange (1/256 of the
    sequence, and the template's headers) of 32K tokens, nearly every token an answer's."""
    from finetune_kit.data import instructions

    seq_len = 32 * K
    path = write_data("instructions", tmp_path / "long.jsonl", rows=2, seq_len=seq_len)
    examples, counts = instructions.tokenize_rows(instructions.load_rows(str(path)), long_tokenizer, seq_len)
    assert counts.truncated == 2 and counts.dropped_too_long == 0
    assert all(seq_len - seq_len // 64 <= len(ids) <= seq_len for ids in examples["input_ids"])
    assert counts.learnt_tokens > 0.95 * counts.tokens


def test_long_documents_are_an_eighth_to_a_half_of_the_sequence_and_pack(long_tokenizer, tmp_path):
    from finetune_kit.data import batching, instructions

    seq_len = 16 * K
    rows = 3 * runner.EXAMPLES_PER_SEQUENCE["long-documents"]
    path = write_data("long-documents", tmp_path / "docs.jsonl", rows=rows, seq_len=seq_len)
    examples, counts = instructions.tokenize_rows(instructions.load_rows(str(path)), long_tokenizer, seq_len)
    assert counts.examples == rows and counts.dropped_too_long == 0  # none cut, none dropped
    assert all(seq_len // 10 <= len(ids) <= seq_len * 6 // 10 for ids in examples["input_ids"])
    packed = batching.pack(examples, seq_len)
    assert 1 < len(packed) < rows and all(len(row["input_ids"]) <= seq_len for row in packed)


def _stub_case(name: str, script: str):
    return dataclasses.replace(EVERY_CASE[LONG], name=name, launcher=("bash", "-c", script, "stub"))


def test_a_row_out_of_gpu_memory_is_a_row_with_the_message(tmp_path):
    message = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 GiB. GPU 0 has 79.1 GiB"
    case = _stub_case("oom", f"echo '{message}'; echo 'Traceback of the launcher'; exit 1")
    row = runner.run_case(case, REPO, tmp_path, tmp_path / "m", layers=2, steps=1, seq_len=64, micro_batch=1)
    assert (row["status"], row["exit"], row["oom"]) == ("out of memory", 1, message)
    plain = runner.run_case(_stub_case("fails", "echo boom; exit 1"), REPO, tmp_path, tmp_path / "m", layers=2,
                            steps=1, seq_len=64, micro_batch=1)
    assert plain["status"] == "failed" and "oom" not in plain


def fake_recipe_runs(monkeypatch, *, out_of_memory_above: int) -> list[str]:
    """The ablation loop's recipe runs replaced: rows longer than ``out_of_memory_above`` tokens run out of GPU memory,
    the others finish; the names of the rows run, in order, are appended to the list returned."""
    ran = []

    def run_case(case, root, out, model, *, name, seq_len, **kwargs):
        ran.append(name)
        status = {"status": "out of memory", "oom": "CUDA out of memory"} if seq_len > out_of_memory_above else \
            {"status": "ok", "tokens_per_s_per_device": 1000.0}
        return {"run": name, "case": case.name, "seq_len": seq_len, "micro_batch": 1, "grad_accum": 1, **status}

    monkeypatch.setattr(runner, "run_case", run_case)
    monkeypatch.setattr(runner, "build_models", lambda specs, out, tiny: {spec: out / "m" for spec in specs})
    monkeypatch.setattr(runner.host_check, "problems", lambda *args, **kwargs: [])
    return ran


def test_the_probe_records_its_first_out_of_memory_and_runs_nothing_longer(monkeypatch, tmp_path):
    """The whole ablation loop with the recipe runs replaced: 128K fits, 256K runs out of GPU memory,
    512K is not run; the command passes (running out is what the probe measures)."""
    ran = fake_recipe_runs(monkeypatch, out_of_memory_above=128 * K)
    names = [v.name for v in PROBE[2:]]
    code = runner.main(["--ablation", "--variants", ",".join(names), "--tiny", "--out", str(tmp_path),
                        "--root", str(REPO)])
    rows = json.loads((tmp_path / "summary.json").read_text())["cases"]
    assert code == 0 and ran == names[:2]
    assert [r["status"] for r in rows] == ["ok", "out of memory", "not run"]
    assert rows[2]["reason"] == "8b-longest-256k (262,144 tokens) ran out of GPU memory"
    assert all(r["note"] == v.note and r["lever"] == v.lever for r, v in zip(rows, PROBE[2:], strict=True))


def test_a_row_names_the_allocator_its_ranks_run_with(tmp_path, monkeypatch):
    """The recipe sets expandable segments at long context where the variable is unset; a row says so, and says the
    user's own value where one is exported."""
    from finetune_kit.launch.cuda_allocator import EXPANDABLE, VARIABLE

    monkeypatch.delenv(VARIABLE, raising=False)
    run = dict(layers=2, steps=1, seq_len=64, micro_batch=1)
    long = runner.run_case(_stub_case("long", "exit 1"), REPO, tmp_path, tmp_path / "m", extra=("--tiled-mlp",), **run)
    short = runner.run_case(dataclasses.replace(_stub_case("short", "exit 1"), flags=()), REPO, tmp_path,
                            tmp_path / "m", **run)
    monkeypatch.setenv(VARIABLE, "max_split_size_mb:256")
    own = runner.run_case(_stub_case("own", "exit 1"), REPO, tmp_path, tmp_path / "m", extra=("--tiled-mlp",), **run)
    assert (long["cuda_alloc_conf"], "cuda_alloc_conf" in short, own["cuda_alloc_conf"]) == (
        EXPANDABLE, False, "max_split_size_mb:256")


def test_a_shorter_probe_row_after_a_longer_one_out_of_memory_still_runs(monkeypatch, tmp_path):
    """Longest first: 512K runs out of GPU memory, then 256K brackets the limit; 512K after a 256K
    out-of-memory would not run."""
    ran = fake_recipe_runs(monkeypatch, out_of_memory_above=256 * K)
    names = ["8b-longest-512k", "8b-longest-256k"]
    assert runner.main(["--ablation", "--variants", ",".join(names), "--tiny", "--out", str(tmp_path),
                        "--root", str(REPO)]) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())["cases"]
    assert ran == names and [r["status"] for r in rows] == ["out of memory", "ok"]
    assert ablation.probe_stopped(ablation.BY_NAME["8b-longest-512k"], [{**rows[0], "run": "8b-longest-256k"}])


def test_speed_ups_are_against_the_first_row_of_the_same_sequence_length():
    rows = [{"case": LONG, "seq_len": 32 * K, "tokens_per_s_per_device": 4000.0},
            {"case": LONG, "seq_len": 128 * K, "tokens_per_s_per_device": 1000.0},
            {"case": LONG, "seq_len": 128 * K, "tokens_per_s_per_device": 900.0}]
    assert [r["speedup"] for r in ablation.speedups(rows)] == [1.0, 1.0, 0.9]


def test_the_long_context_model_has_llama_3_1s_rope_scaling():
    """The check model of llama3.1-8b rotates positions as Llama 3.1 does (128K from 8K-trained frequencies)."""
    from transformers import LlamaConfig

    from finetune_tools.gpu_check.synthetic import check_config

    rope = LlamaConfig(**check_config("llama3.1-8b", 2, tiny=True, max_positions=524288)).rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert rope["original_max_position_embeddings"] == 8192


BRACKETS = ablation.BRACKET_VARIANTS
UNDER_80 = [v for v in BRACKETS if v.probe == ablation.H100_BRACKET]
ON_H200 = [v for v in BRACKETS if v.probe == ablation.H200_BRACKET]
BRACKET_BUDGET_S = 400  # --time-budget of a bracket command: no row starts after it (docs/gpu.md)


def test_the_brackets_aim_at_alsts_500k_and_1_2m_and_stay_out_of_the_full_ablation():
    assert [v.seq_len // K for v in UNDER_80] == [448, 480, 384]  # the first, then the longer or the shorter
    assert [v.seq_len // K for v in ON_H200] == [1024, 1228, 768]
    assert not set(BRACKETS) & set(ablation.VARIANTS) and all(ablation.BY_NAME[v.name] is v for v in BRACKETS)
    assert {v.case for v in UNDER_80} == {LONG_EXTENDED} and {EVERY_CASE[v.case].layers for v in ON_H200} == {1}
    for v in BRACKETS:
        assert {"--tiled-mlp", "--offload-activations"} <= set(v.flags) and v.seq_len <= positions(EVERY_CASE[v.case])
        assert v.seq_len % ablation.LOSS_CHUNK_TOKENS == 0 and f"{EVERY_CASE[v.case].layers} decoder layer" in v.note


@pytest.mark.parametrize("rows", [UNDER_80, ON_H200], ids=["80gib", "h200"])
def test_a_bracket_command_fits_nine_minutes_whichever_way_its_first_row_goes(rows):
    """The first row, and the next one when the first fit and the budget was not spent when it ended: predicted
    within one command with the set-up (a row that runs out of memory stops sooner than its prediction)."""
    setup, first, second = ablation.setup_seconds(rows), *map(ablation.expected_seconds, rows[:2])
    worst = setup + first + (second if setup + first < BRACKET_BUDGET_S else 0)
    print(f"{rows[0].probe}: set-up {setup:.0f} s, {rows[0].name} {first:.0f} s, {rows[1].name} {second:.0f} s: at "
          f"most {worst:.0f} s")
    assert worst <= COMMAND_S


@pytest.mark.parametrize("variant", BRACKETS, ids=lambda v: v.name)
def test_every_bracket_row_passes_the_recipes_own_flag_parser(variant, monkeypatch):
    test_every_long_row_passes_the_recipes_own_flag_parser(variant, monkeypatch)


def test_a_bracket_whose_first_row_runs_out_tries_the_shorter_one(monkeypatch, tmp_path):
    from finetune_kit.launch import memory_cap

    monkeypatch.setenv(memory_cap.ENV, "80")  # what --gpu-memory-gib exports, undone after the test
    ran = fake_recipe_runs(monkeypatch, out_of_memory_above=400 * K)
    code = runner.main(["--ablation", "--variants", ",".join(v.name for v in UNDER_80), "--tiny", "--out",
                        str(tmp_path), "--root", str(REPO), "--gpu-memory-gib", "80"])
    rows = json.loads((tmp_path / "summary.json").read_text())["cases"]
    assert code == 0 and ran == ["8b-longest-448k", "8b-longest-384k"]
    assert [r["status"] for r in rows] == ["out of memory", "not run", "ok"]
