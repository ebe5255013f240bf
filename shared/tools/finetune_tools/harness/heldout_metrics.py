"""The held-out task's metrics, as lm-evaluation-harness aggregates them over a conversation's answer tokens.

lm-eval's own ``perplexity`` metric is per document (``exp`` of minus the mean of each document's
log-likelihood), so a long answer weighs as much as a short one. Here each document carries the number of
tokens its answer has (``answer_tokens``, counted when the task was written, by the same tokenisation the
model scores: :mod:`finetune_tools.harness.causal`), and the aggregates are per token:

    loss       = -sum(log-likelihood of each answer) / sum(answer tokens)   (nats/token)
    perplexity = exp(loss)
    acc        = share of answers that are the model's greedy continuation, token for token

This file is copied next to the task's YAML as ``utils.py`` (``!function utils.process_results``): the task
folder then loads with the plain ``lm_eval`` command too, so it imports nothing but the standard library.
"""

from __future__ import annotations

import math


def process_results(doc: dict, results: list) -> dict:
    """One document's contributions: (log-likelihood in nats, answer tokens) for loss and perplexity; whether
    the answer is the greedy continuation for acc."""
    loglikelihood, is_greedy = results[0]
    scored = (float(loglikelihood), int(doc["answer_tokens"]))
    return {"perplexity": scored, "loss": scored, "acc": int(is_greedy)}


def token_loss(items: list) -> float:
    """Mean negative log-likelihood per answer token (nats/token) over ``(log-likelihood, tokens)`` pairs."""
    return -sum(ll for ll, _ in items) / sum(n for _, n in items)


def token_perplexity(items: list) -> float:
    """exp(mean negative log-likelihood per answer token): the answers' token perplexity."""
    return math.exp(token_loss(items))
