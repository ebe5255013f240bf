"""What tokenisation made of a source's rows (:class:`DataCounts`): in the run record under ``data``, read
where torch is not installed (``make results``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataCounts:
    """What tokenisation made of the rows; in the run record under ``data``."""

    source: str
    format: str
    chat_template: str
    rows: int  # read from the source
    examples: int  # sequences kept (before the validation split and packing)
    truncated: int  # kept, with turns from the end removed to fit max_seq_len
    dropped_too_long: int  # the first answer alone does not fit max_seq_len
    dropped_no_answer: int  # no assistant turn with text
    tokens: int  # in the kept sequences
    learnt_tokens: int  # of those, carrying loss

    def summary(self) -> str:
        return (f"data: {self.rows} rows of {self.source} ({self.format}, chat template {self.chat_template}) -> "
                f"{self.examples} examples, {self.truncated} truncated at a turn, {self.dropped_too_long} dropped "
                f"as too long, {self.dropped_no_answer} without an answer; {self.learnt_tokens}/{self.tokens} "
                "tokens carry loss")
