"""Review CSVs: the label rule, the shipped sample, and the checks on ratings and columns."""

from __future__ import annotations

import pytest

from finetune_kit.data import reviews
from finetune_kit.errors import DataError


@pytest.mark.parametrize("rating, label", [(1, 0), (2, 0), (3, None), (4, 1), (5, 1)])
def test_label_rule(rating, label):
    assert reviews.label_for(rating) == label


def test_shipped_sample_is_balanced_and_drops_neutral_reviews():
    rows, counts = reviews.load_reviews([str(reviews.SAMPLE_REVIEWS)])
    assert counts["rows"] == 360 and counts["neutral_dropped"] == 30
    assert len(rows) == counts["negative"] + counts["positive"] == 330
    assert 0.4 < counts["positive"] / len(rows) < 0.6
    assert rows.column_names == ["text", "label", "example_id"]


def test_several_files_are_concatenated_with_traceable_ids(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("rating,text\n5,great\n3,meh\n")
    b.write_text("text,rating\nawful,1\n")
    rows, counts = reviews.load_reviews([str(a), str(b)])
    assert rows["example_id"] == [0, 2] and rows["label"] == [1, 0] and counts["neutral_dropped"] == 1


@pytest.mark.parametrize("value", ["0", "6", "4.5", "", "five"])
def test_bad_rating_names_file_line_and_value(tmp_path, value):
    path = tmp_path / "r.csv"
    path.write_text(f"rating,text\n5,great\n{value},hmm\n")
    with pytest.raises(DataError, match=rf"r\.csv', line 3 \(data row 2\): rating = '{value}'"):
        reviews.load_reviews([str(path)])


def test_one_sided_data_is_refused(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("rating,text\n5,great\n4,good\n")
    with pytest.raises(DataError, match="needs both negative"):
        reviews.load_reviews([str(path)])


def test_collator_pads_right_and_keeps_ids():
    batch = reviews.ReviewCollator(pad_token_id=9, pad_to_multiple_of=4)(
        [{"input_ids": [1, 2, 3], "label": 1, "example_id": 7}, {"input_ids": [4], "label": 0, "example_id": 8}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 9], [4, 9, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [1, 0] and batch["example_ids"] == [7, 8]
