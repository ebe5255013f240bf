"""Every supported row shape becomes the same chat messages; bad rows are named before training."""

import pytest

from finetune_kit.data import formats
from finetune_kit.errors import DataError

USER_ASSISTANT = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]


def convert(row: dict, **fields) -> list[dict]:
    return formats.detect(list(row), **fields).to_messages(row)


def test_messages_pass_through_with_a_system_turn():
    row = {"messages": [{"role": "system", "content": "Be brief."}, *USER_ASSISTANT]}
    assert formats.detect(list(row)).name == "messages" and convert(row) == row["messages"]


def test_sharegpt_roles_are_mapped():
    row = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                             {"from": "gpt", "value": "Hello."}]}
    assert convert(row) == [{"role": "system", "content": "Be brief."}, *USER_ASSISTANT]


@pytest.mark.parametrize(("extra", "user"), [("", "Translate."), (None, "Translate."), ("chat", "Translate.\n\nchat")])
def test_alpaca_joins_the_input_to_the_instruction(extra, user):
    row = {"instruction": "Translate.", "input": extra, "output": "Unterhaltung"}
    assert convert(row) == [{"role": "user", "content": user}, {"role": "assistant", "content": "Unterhaltung"}]


def test_prompt_completion_as_text_and_as_messages():
    assert convert({"prompt": "Hi?", "completion": "Hello."}) == USER_ASSISTANT
    conversational = {"prompt": [USER_ASSISTANT[0]], "completion": [USER_ASSISTANT[1]]}
    assert formats.detect(list(conversational)).name == "prompt-completion"
    assert convert(conversational) == USER_ASSISTANT


def test_prompt_response_with_renamed_fields():
    row = {"question": "Hi?", "answer": "Hello."}
    assert convert(row, prompt_field="question", response_field="answer") == USER_ASSISTANT


def test_detection_order_and_forcing():
    both = ["messages", "prompt", "completion"]
    assert formats.detect(both).name == "messages"
    assert formats.detect(both, forced="prompt-completion").name == "prompt-completion"
    with pytest.raises(DataError, match=r"--data-format alpaca, which needs .*'instruction', 'output'.*has no "
                                        r"'instruction', 'output'"):
        formats.detect(both, forced="alpaca")
    with pytest.raises(DataError, match=r"data format 'chatml' is unknown; choose one of auto, messages"):
        formats.detect(both, forced="chatml")


def test_a_review_csv_is_named_as_the_classifiers_data():
    """Columns of no instruction format that are a review CSV's: the message names the classifier recipe; a review
    CSV that also has instruction columns is read in that format."""
    with pytest.raises(DataError, match=r"data 'r.csv' is a review CSV \(columns \['rating', 'title', 'text'\].*"
                                        r"with the llama3-70b-qlora recipe"):
        formats.detect(["rating", "title", "text"], source="r.csv")
    with pytest.raises(DataError, match=r"which match no known format"):
        formats.detect(["stars", "text"])
    assert formats.detect(["rating", "text", "prompt", "response"]).name == "prompt-response"


@pytest.mark.parametrize(("turns", "message"), [
    ("hello", r"'messages' is str, not a list of turns"),
    ([{"role": "user"}], r"turn 1 of 'messages' is not a \{'role', 'content'\} object"),
    ([{"role": "bot", "content": "x"}], r"turn 1 of 'messages' has role 'bot'; known: assistant, system, tool, user"),
    ([{"role": "user", "content": 3}], r"turn 1 of 'messages' has content of type int, not text"),
    ([{"role": "assistant", "content": "x"}], r"the conversation opens with an assistant turn"),
    ([*USER_ASSISTANT, {"role": "system", "content": "x"}], r"a system turn is allowed only first"),
])
def test_bad_rows_are_numbered_with_the_rule(turns, message):
    rows = [{"messages": USER_ASSISTANT}, {"messages": turns}]
    with pytest.raises(DataError, match=r"(?s)1 row\(s\) cannot be read as a conversation:\n  row 2: " + message):
        formats.check_rows(rows, formats.detect(["messages"]))


def test_many_bad_rows_show_five_and_the_count():
    rows = [{"messages": "x"}] * 7
    with pytest.raises(DataError, match=r"(?s)7 row\(s\).*row 5: .*\n  \.\.\.") as err:
        formats.check_rows(rows, formats.detect(["messages"]))
    assert "row 6" not in str(err.value)
