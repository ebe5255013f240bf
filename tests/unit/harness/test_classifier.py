"""The classifier route: a LoRA adapter over a sequence classifier (the 70B recipe's output, on the tiny Llama 3)
scored through the lm-eval model ``finetune-classifier``; acc and f1 equal the adapter's own argmax, exactly."""

from __future__ import annotations

import json

import pytest
from sklearn.metrics import f1_score

from tests.unit.harness.conftest import REVIEWS, run_harness, summary


def expected(run) -> dict:
    """acc and f1 of the predictions the adapter made in memory, before it was saved (conftest.classifier_run)."""
    predictions = json.loads((run / "predictions.json").read_text())
    labels = [label for _, label in REVIEWS]
    assert 0 < sum(predictions) < len(predictions)  # both labels predicted: f1 is not trivially 0 or 1
    return {"acc": sum(p == y for p, y in zip(predictions, labels, strict=True)) / len(labels),
            "f1": float(f1_score(labels, predictions))}


@pytest.mark.parametrize("folder", ["adapter", "merged"])
def test_acc_and_f1_equal_the_classifiers_own_predictions(classifier_run, folder):
    proc = run_harness(str(classifier_run), "--model", str(classifier_run / folder), "--device", "cpu",
                       "--batch-size", "5")
    got = summary(classifier_run)
    assert got["tasks"] == {"heldout": expected(classifier_run)}
    described = f"{classifier_run / 'adapter'} over " if folder == "adapter" else str(classifier_run / "merged")
    assert got["model"].startswith(described)
    assert "heldout  f1" in proc.stdout
    row = f"| heldout | f1 | {got['tasks']['heldout']['f1']:.4g} |"  # the model cards show the summary
    assert all(row in (classifier_run / card / "README.md").read_text() for card in ("adapter", "merged"))
    task = (classifier_run / "eval/tasks/heldout.yaml").read_text()
    assert "output_type: multiple_choice" in task and '["negative", "positive"]' in task


def test_the_default_model_of_a_run_with_merged_and_adapter_is_merged(classifier_run):
    from finetune_tools.harness import inputs

    evaluation = inputs.check(str(classifier_run), device="cpu")
    assert evaluation.model == inputs.ModelSource(classifier_run / "merged", inputs.CLASSIFIER)
    assert len(evaluation.heldout) == len(REVIEWS) and evaluation.dtype == "float32"


def test_the_classifier_answers_label_names_only_and_no_generation(classifier_run):
    """Registered with lm-eval as ``finetune-classifier``; a request whose continuation is no label, and the two
    request types a classifier cannot serve, are refused with what it can do."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from finetune_kit.errors import UserInputError
    from finetune_tools.harness.classifier import SequenceClassifierLM

    assert get_model("finetune-classifier") is SequenceClassifierLM
    model = SequenceClassifierLM.create_from_arg_string(f"pretrained={classifier_run / 'merged'},dtype=float32")

    def request(continuation):
        return Instance("loglikelihood", doc={}, arguments=("Broke after two days.", continuation), idx=0,
                        metadata=("reviews", 0, 1))

    (negative, greedy_n), (positive, greedy_p) = model.loglikelihood([request(" negative"), request(" positive")])
    assert negative < 0 and positive < 0 and greedy_n != greedy_p
    assert pytest.approx(1.0) == 2.718281828459045 ** negative + 2.718281828459045 ** positive
    with pytest.raises(UserInputError, match="which is not one of its labels"):
        model.loglikelihood([request(" maybe")])
    with pytest.raises(NotImplementedError, match="no language-model head"):
        model.generate_until([request("x")])
    with pytest.raises(NotImplementedError, match="cannot score whole texts"):
        model.loglikelihood_rolling([request("x")])
