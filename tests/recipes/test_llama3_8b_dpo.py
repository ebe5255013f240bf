"""The Llama 3 8B DPO recipe end to end: its own train.py and configs, TRL's DPOTrainer, real DeepSpeed ZeRO-3.

The runs use a copy of the recipe folder outside the repository, as a user who copies a recipe would, on a tiny
Llama 3 and the shipped preference sample. Against the README commands, only the model, the data, step counts and
sizes change -- plus --learning_rate: a randomly initialised tiny model needs a larger step than a pretrained 8B to
show its preferences move.

The README command (`make recipe-8b-dpo CPU=1`, full weights: the optimizer-offload config on 2 ranks, reference
log-probs precomputed) is the quick run. The guarantees of the precomputed reference run in fp32 (configs/zero3.json
with bf16 off, written by :func:`fp32_config`), where "the policy equals the reference at the first step" holds to
fp32's rounding. In bf16 it holds only within bf16's rounding (measured on the tiny model: step 1's loss 0.69780 instead
of 0.69315, an accuracy of 0.25 from that difference alone; the cause is not pinned down, see the README). A
reference whose forward runs on the same batch as the policy's (LoRA with the adapters off; a sharded copy) gives
ln 2 in bf16: both are tested in bf16, with the configs as shipped.
"""

from __future__ import annotations

import json
import math
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.harness import (
    REPO,
    SAMPLES,
    assert_finished,
    free_port,
    losses,
    make_target,
    read_metrics,
    read_run_info,
    run_and_signal,
    script_command,
    wait_all,
    warm_run,
)

pytestmark = pytest.mark.recipe

RECIPE = REPO / "recipes/llama3-8b-dpo"
PAIRS = SAMPLES / "preferences.jsonl"
STEPS, SAVE_EVERY = 6, 3
LN2 = math.log(2)
# Step 1 in fp32 (warm-up: the first update has learning rate 0, so steps 1 and 2 see the initial weights).
# Measured: |loss - ln 2| 6e-8, |rewards| 5e-8 (full, 2 ranks, fp32); LoRA in bf16: 0 (the same forward).
FIRST_STEP_ATOL = 1e-6
# 1 x 4 x 1 against 2 x 2 x 1 (ranks x pairs per micro-batch x accumulation), fp32, the same pairs per step.
# Measured (2-core Xeon): losses within 2.4e-7; the saved bf16 weights after 4 steps equal (largest |difference| 0).
# The negative control (another data order) must differ by 10x each tolerance.
SPLIT_ATOL = 1e-5
WEIGHTS_ATOL = 1e-4
PREFERENCE_KEYS = ("reward_chosen", "reward_rejected", "reward_margin", "preference_accuracy", "logps_chosen",
                   "logps_rejected")


def sizes(model: Path, micro: int = 2, accum: int = 2, lr: str = "1e-3") -> list[str]:
    """2 pairs x 2 micro-batches x 2 ranks: 8 pairs a step."""
    return ["--model", str(model), "--data", str(PAIRS), "--max_seq_len", "128",
            "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", str(accum),
            "--learning_rate", lr, "--samples", "0"]


def fp32_config(folder: Path) -> str:
    """configs/zero3.json with bf16 off, next to the shipped configs: what the exact guarantees run in."""
    config = json.loads((folder / "configs/zero3.json").read_text())
    config["bf16"]["enabled"] = False
    path = folder / "configs/zero3-fp32.json"
    path.write_text(json.dumps(config, indent=2))
    return "configs/zero3-fp32.json"


def launch(cwd: Path, *args: str, config: str = "configs/zero3.json", nproc: int = 2):
    """The README's launch command with its ranks forked from a warm process (tests/warm_launch.py)."""
    return warm_run(script_command("--deepspeed", config, *args, nproc=nproc), cwd)


def held_out(output: Path) -> tuple[dict, dict]:
    """run_info.json's held-out preference figures before the first step and after the last."""
    evals = read_run_info(output)["evals"]
    assert [e["step"] for e in evals][0] == 0, evals
    return evals[0], evals[-1]


@pytest.fixture(scope="module")
def made(recipe_copy, tiny_llama3, tmp_path_factory) -> Path:
    """`make recipe-8b-dpo` as the README gives it, on 2 CPU ranks: full weights, zero3-offload.json."""
    output = tmp_path_factory.mktemp("runs") / "readme"
    args = sizes(tiny_llama3)[4:]
    train_args = [*args[:-2], "--samples", "2", "--sample_before", "true", "--max_steps", str(STEPS),
                  "--save_strategy", "no"]
    port = f"MAIN_PORT={free_port()}"  # not deepspeed's 29500, which a launch of a session beside this one may hold
    proc, = wait_all([make_target("recipe-8b-dpo", "NUM_GPUS=2", f"MODEL={tiny_llama3}", f"DATA={PAIRS}",
                                  f"OUTPUT={output}", port, "TRAIN_ARGS=" + " ".join(train_args))], timeout=900)
    assert_finished(proc, STEPS)
    assert "--deepspeed configs/zero3-offload.json" in proc.stderr  # the command, echoed by set -x
    return output


@pytest.mark.quick
def test_the_readme_run_logs_the_preference_figures_every_step(made):
    metrics = read_metrics(made)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert all(key in m for key in PREFERENCE_KEYS), m
        assert 0 <= m["preference_accuracy"] <= 1
        assert m["reward_margin"] == pytest.approx(m["reward_chosen"] - m["reward_rejected"], abs=1e-5)
        assert m["logps_chosen"] < 0 and m["logps_rejected"] < 0 and m["tokens_per_s"] > 0
    assert metrics[-1]["loss"] < LN2 - 0.05, [m["loss"] for m in metrics]


@pytest.mark.quick
def test_held_out_preference_accuracy_rises_and_the_card_says_how(made):
    before, after = held_out(made)
    assert after["eval_preference_accuracy"] >= before["eval_preference_accuracy"] + 0.25, (before, after)
    assert after["eval_reward_margin"] > 0.1 > abs(before["eval_reward_margin"]), (before, after)
    info = read_run_info(made)
    assert info["details"]["dpo"] == {"method": "DPO", "beta": 0.1, "loss_type": ["sigmoid"],
                                      "reference": "precomputed", "reference_model": info["model"]}
    card = (made / "model/README.md").read_text()
    assert "| preference tuning | DPO, loss sigmoid, beta 0.1 |" in card
    assert "| DPO reference | precomputed" in card
    assert f"| 0 | {before['eval_preference_accuracy']:.3f} |" in card
    assert f"| {STEPS} | {after['eval_preference_accuracy']:.3f} |" in card
    samples = [json.loads(line) for line in (made / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["answer"] and s["before"] and s["before"] != s["answer"] for s in samples)
    assert not (made / "README.md").exists()  # TRL's own card is not written beside ours


@pytest.mark.quick
def test_the_saved_model_loads_back(made):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(made / "model")
    tokenizer = AutoTokenizer.from_pretrained(made / "model")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    assert torch.isfinite(model(**ids).logits).all()


@pytest.mark.quick
def test_make_eval_scores_the_saved_model(made):
    """`make eval` on the run: lm-evaluation-harness over the held-out prompts with their chosen answers."""
    proc, = wait_all([make_target("eval", f"RUN={made}")], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((made / "eval/summary.json").read_text())
    assert summary["tasks"]["heldout"]["loss"] > 0, summary


@pytest.fixture(scope="module")
def fp32_runs(recipe_copy, tiny_llama3, tmp_path_factory) -> dict[str, Path]:
    """The same 4 steps of 4 pairs in fp32 split two ways: 1 rank x 4 pairs x 1, and 2 ranks x 2 pairs x 1."""
    config = fp32_config(recipe_copy)
    runs = {}
    for name, nproc, micro in (("1x4x1", 1, 4), ("2x2x1", 2, 2)):
        output = tmp_path_factory.mktemp("runs") / name
        assert_finished(launch(recipe_copy, *sizes(tiny_llama3, micro=micro, accum=1), "--output_dir", str(output),
                               "--max_steps", "4", "--save_strategy", "no", config=config, nproc=nproc), 4)
        runs[name] = output
    return runs


def test_the_first_step_is_ln2_with_zero_rewards_and_accuracy(fp32_runs):
    """The policy equals the reference before its first update: sigmoid loss ln 2, rewards and margin 0, accuracy 0
    (strict >), on the training pairs and on the held-out ones."""
    for output in fp32_runs.values():
        first = read_metrics(output)[0]
        assert first["loss"] == pytest.approx(LN2, abs=FIRST_STEP_ATOL)
        for key in ("reward_chosen", "reward_rejected", "reward_margin"):
            assert abs(first[key]) < FIRST_STEP_ATOL, first
        assert first["preference_accuracy"] == 0.0
        before, _ = held_out(output)
        assert before["eval_loss"] == pytest.approx(LN2, abs=FIRST_STEP_ATOL)
        assert before["eval_preference_accuracy"] == 0.0 and abs(before["eval_reward_margin"]) < FIRST_STEP_ATOL


def test_one_model_however_the_pairs_are_split(fp32_runs):
    """1 x 4 x 1 and 2 x 2 x 1 train on the same pairs each step and give the same losses and weights; the
    negative control, the same split with the pairs in another order (--data_seed), differs by far more."""
    from safetensors.torch import load_file

    one, two = (losses(fp32_runs[name]) for name in ("1x4x1", "2x2x1"))
    assert two == pytest.approx(one, abs=SPLIT_ATOL)
    a, b = (load_file(fp32_runs[name] / "model/model.safetensors") for name in ("1x4x1", "2x2x1"))
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"1x4x1 vs 2x2x1: losses within {max(abs(x - y) for x, y in zip(one, two, strict=True)):.2e}, weights within "
          f"{worst:.2e}")
    assert worst < WEIGHTS_ATOL


@pytest.fixture(scope="module")
def other_order(recipe_copy, tiny_llama3, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("runs") / "other-order"
    assert_finished(launch(recipe_copy, *sizes(tiny_llama3, micro=2, accum=1), "--output_dir", str(output),
                           "--max_steps", "4", "--save_strategy", "no", "--data_seed", "7",
                           config=fp32_config(recipe_copy)), 4)
    return output


def test_the_split_tolerances_bite(fp32_runs, other_order):
    from safetensors.torch import load_file

    one, other = losses(fp32_runs["1x4x1"]), losses(other_order)
    assert max(abs(x - y) for x, y in zip(one[2:], other[2:], strict=True)) > 10 * SPLIT_ATOL, (one, other)
    a, b = (load_file(path / "model/model.safetensors") for path in (fp32_runs["1x4x1"], other_order))
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) > 10 * WEIGHTS_ATOL


def test_a_killed_job_resumes_bit_for_bit_with_its_precomputed_reference(recipe_copy, tiny_llama3, fp32_runs,
                                                                           tmp_path):
    """SIGKILL to every process once step 4 is logged (checkpoint-3 saved); the same command resumes from it,
    reads the reference log-probs from the cache instead of recomputing them, and steps 4-6 equal an uninterrupted
    run's exactly."""
    config = fp32_config(recipe_copy)
    args = ("--deepspeed", config, *sizes(tiny_llama3, accum=1), "--max_steps", str(STEPS),
            "--save_steps", str(SAVE_EVERY), "--save_total_limit", "0")
    straight = tmp_path / "straight"
    assert_finished(launch(recipe_copy, *args[2:], "--output_dir", str(straight), config=config), STEPS)
    killed = tmp_path / "killed"
    run_and_signal([script_command(*args, "--output_dir", str(killed))], recipe_copy, killed, after_step=4,
                   sig=signal.SIGKILL)
    assert (killed / "checkpoint-3/trainer_state.json").is_file() and not (killed / "model").exists()
    resumed = launch(recipe_copy, *args[2:], "--output_dir", str(killed), config=config)
    assert_finished(resumed, STEPS, "resumed run")
    assert "Computing reference log probs" not in resumed.stdout + resumed.stderr  # the cache, keyed by reference
    assert losses(killed)[-3:] == losses(straight)[-3:]  # bit for bit
    before_straight, _ = held_out(straight)
    before_resumed, _ = held_out(killed)  # the resumed run's "before" comes from its checkpoint's log
    assert before_resumed == before_straight


@pytest.fixture(scope="module")
def lora_run(recipe_copy, tiny_llama3, tmp_path_factory):
    """--peft lora in bf16 (the shipped zero3.json), dropout 0 (its masks would follow the split)."""
    output = tmp_path_factory.mktemp("runs") / "lora"
    proc = launch(recipe_copy, *sizes(tiny_llama3, lr="1e-2"), "--peft", "lora", "--lora_dropout", "0",
                  "--output_dir", str(output), "--max_steps", str(STEPS), "--save_strategy", "no")
    assert_finished(proc, STEPS)
    return output, proc


def test_lora_reference_is_the_base_with_adapters_off(lora_run, tiny_llama3):
    """Step 1 is ln 2 exactly (the reference is the same forward with the adapters disabled), held-out accuracy
    rises from 0, and adapter/ loads over the base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    output, proc = lora_run
    assert "reference adapters-off" in proc.stdout
    first = read_metrics(output)[0]
    assert first["loss"] == pytest.approx(LN2, abs=FIRST_STEP_ATOL) and first["preference_accuracy"] == 0.0
    before, after = held_out(output)
    assert before["eval_preference_accuracy"] == 0.0 and after["eval_preference_accuracy"] >= 0.5, (before, after)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama3), output / "adapter")
    assert any("lora_B" in name and p.abs().sum() > 0 for name, p in model.named_parameters())


def test_an_sft_adapter_starts_and_references_its_merged_model(recipe_copy, lora_run, tiny_llama3, fp32_runs,
                                                               tmp_path, token_cache_of_this_session):
    """--model an SFT run's adapter/ (here the LoRA run's): the run merges it into its base once (the cache's
    merged/ entry, equal to peft's merge), starts from that model and takes it as the reference -- step 1 is ln 2
    against it, while its log-probs differ from the base's (a run from the base beneath would not see the SFT)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter = lora_run[0] / "adapter"
    output = tmp_path / "from-adapter"
    proc = launch(recipe_copy, *sizes(adapter, accum=1), "--output_dir", str(output), "--max_steps", "1",
                  "--save_strategy", "no", "--save_model", "false", config=fp32_config(recipe_copy))
    assert_finished(proc, 1)
    merged = [p for p in (token_cache_of_this_session / "merged").iterdir() if p.is_dir()]
    assert len(merged) == 1 and read_run_info(output)["details"]["dpo"]["merged_into"] == str(merged[0])
    expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama3), adapter).merge_and_unload()
    saved = load_file(merged[0] / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in expected.state_dict().items() if k in saved)
    first, base_first = read_metrics(output)[0], read_metrics(fp32_runs["2x2x1"])[0]
    assert first["loss"] == pytest.approx(LN2, abs=FIRST_STEP_ATOL) and first["preference_accuracy"] == 0.0
    assert abs(first["logps_chosen"] - base_first["logps_chosen"]) > 0.1, (first, base_first)


def test_an_sft_model_is_its_own_reference(recipe_copy, tiny_llama3, fp32_runs, tmp_path):
    """--model an SFT run's model/ (here the 1x4x1 run's, a full model folder with its chat template): the
    reference is that model, not the base it came from -- its log-probs are computed afresh (another reference,
    another cache entry), and step 1 is ln 2 against it while the base's log-probs differ."""
    sft = fp32_runs["1x4x1"] / "model"
    output = tmp_path / "from-sft"
    proc = launch(recipe_copy, *sizes(sft, accum=1), "--output_dir", str(output), "--max_steps", "1",
                  "--save_strategy", "no", config=fp32_config(recipe_copy))
    assert_finished(proc, 1)
    assert re.search(r"Computing reference log probs for train", proc.stdout + proc.stderr)
    first, base_first = read_metrics(output)[0], read_metrics(fp32_runs["2x2x1"])[0]
    # log-probs of the reference pass (its own batches) equal the policy's to rounding, not always to the bit: a
    # margin of 1e-7 counts as a won pair, so the step is held to a zero margin within the tolerance instead
    assert first["loss"] == pytest.approx(LN2, abs=FIRST_STEP_ATOL) and abs(first["reward_margin"]) < FIRST_STEP_ATOL
    assert abs(first["logps_chosen"] - base_first["logps_chosen"]) > 0.1, (first, base_first)


def test_a_sharded_reference_in_bf16_equals_the_policy_at_the_first_step(recipe_copy, tiny_llama3, tmp_path):
    """--dpo_reference sharded: a second model, partitioned by zero.Init like the policy, in TRL's inference engine;
    its forward runs on the policy's batch, so step 1 (and the held-out pairs before training) are ln 2 in bf16."""
    output = tmp_path / "sharded"
    proc = launch(recipe_copy, *sizes(tiny_llama3), "--dpo_reference", "sharded", "--output_dir", str(output),
                  "--max_steps", "2", "--save_strategy", "no", "--save_model", "false")
    assert_finished(proc, 2)
    assert "reference sharded" in proc.stdout and "Computing reference log probs" not in proc.stdout + proc.stderr
    first = read_metrics(output)[0]
    assert first["loss"] == pytest.approx(LN2, abs=FIRST_STEP_ATOL) and first["preference_accuracy"] == 0.0
    before, _ = held_out(output)
    assert before["eval_preference_accuracy"] == 0.0


@pytest.mark.parametrize("case, pattern", [
    ("precompute_contradicts_reference", r"--precompute_ref_log_probs False contradicts --dpo_reference precomputed"),
    ("precomputed_without_a_cache", r"--dpo_reference precomputed keeps the reference log-probs with the tokenised "
                                    r"pairs, and --data_cache none keeps nothing"),
    ("adapters_off_for_full_weights", r"DPO reference 'adapters-off' without adapters"),
    ("sharded_with_lora", r"DPO reference 'sharded' with LoRA adapters"),
    ("same_answers", r"chosen and rejected are the same"),
])
def test_bad_input_fails_early_with_a_clear_message(case, pattern, recipe_main, tiny_llama3, tmp_path):
    """Each refused in one line before a process group, data loading or weights (docs/bad-input.md)."""
    from finetune_kit.errors import UserInputError

    args = {"--deepspeed": "configs/zero3.json", "--model": str(tiny_llama3), "--data": str(PAIRS),
            "--output_dir": str(tmp_path / "out"), "--max_seq_len": "128"}
    if case == "precompute_contradicts_reference":
        args["--precompute_ref_log_probs"] = "false"
    elif case == "precomputed_without_a_cache":
        args["--data_cache"] = "none"
    elif case == "adapters_off_for_full_weights":
        args["--dpo_reference"] = "adapters-off"
    elif case == "sharded_with_lora":
        args.update({"--peft": "lora", "--dpo_reference": "sharded"})
    elif case == "same_answers":
        rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
        rows[2]["rejected"] = rows[2]["chosen"]
        (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        args["--data"] = str(tmp_path / "pairs.jsonl")
    with pytest.raises(UserInputError, match=pattern):
        recipe_main([x for k, v in args.items() for x in (k, v)])
    assert not (tmp_path / "out").exists()
