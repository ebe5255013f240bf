"""The classifier route (70B recipe): a sequence classifier as an lm-eval model, ``finetune-classifier``.

The 70B recipe trains ``AutoModelForSequenceClassification`` (a Llama with a 2-way ``score`` head instead of its
language-model head), so there is no next-token distribution to score. lm-eval's multiple-choice tasks need
only a log-likelihood per (context, continuation) request; here the context is the review text and the
continuation a label name, and its log-likelihood is the log-softmax of the head's logits at that label. The
task's ``acc`` (argmax over the choices) is then the classifier's accuracy and ``f1`` its F1 of ``positive``.
Each review is run once, whatever the number of choices asking about it.

The review is tokenised as training tokenised it (finetune_kit.data.reviews: the tokenizer's special tokens added,
cut at the run's ``--max-seq-len``), padded on the right with the run's pad token; the head reads the last
token that is not padding.

Weights: ``merged/`` as it is, or the base with ``adapter/`` (LoRA + the trained head) through
``PeftModel.from_pretrained``. Training kept the 70B base in 4-bit nf4; here it loads in ``--dtype`` (bf16), as
``make merge`` does: the adapter then runs over the original weights instead of their 4-bit approximation it
trained against, which is how a merged or served model runs it too. The cost is memory: ~140 GB for 70B (two
80 GB GPUs; ``device_map="auto"`` spreads the layers over the visible ones).
"""

from __future__ import annotations

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from finetune_kit.errors import UserInputError

GENERATIVE = ("it has no language-model head, only a classification head over its labels: give it multiple-choice "
              "tasks whose choices are the label names (the heldout task of a classifier run)")


@register_model("finetune-classifier")
class SequenceClassifierLM(LM):
    """lm-eval's view of a sequence classifier. ``pretrained``: a sequence-classification model folder, or the
    base of ``adapter``; ``labels``: the label names in head order (a list, or comma-separated; default the 70B
    recipe's, finetune_kit.data.reviews.LABELS)."""

    def __init__(self, pretrained: str, adapter: str | None = None, labels=None,
                 dtype: str = "bfloat16", device: str = "cpu", batch_size: int | str = 8,
                 max_length: int | None = None, **_lm_eval_extras) -> None:
        super().__init__()
        if labels is None:
            from finetune_kit.data.reviews import LABELS

            labels = [LABELS[i] for i in sorted(LABELS)]
        self.labels = [name.strip() for name in (labels.split(",") if isinstance(labels, str) else labels)]
        self.batch_size = int(batch_size)
        self.max_length = int(max_length) if max_length else None
        self.model, self.tokenizer = load(pretrained, adapter, num_labels=len(self.labels), dtype=dtype,
                                          device=device)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-probability of the label, whether it is the head's argmax) for each (text, label name) request."""
        contexts = list(dict.fromkeys(req.args[0] for req in requests))
        logprobs = dict(zip(contexts, self.label_logprobs(contexts), strict=True))
        out = []
        for req in requests:
            context, continuation = req.args[0], req.args[1]
            name = continuation.strip()  # lm-eval puts its target delimiter (a space) before each choice
            if name not in self.labels:
                raise UserInputError(f"task '{req.task_name}' asks the classifier about '{continuation}', which is "
                                     f"not one of its labels ({', '.join(self.labels)}): {GENERATIVE}.")
            scores, index = logprobs[context], self.labels.index(name)
            out.append((float(scores[index]), int(scores.argmax()) == index))
        return out

    def label_logprobs(self, texts: list[str]):
        """Log-softmax of the head's logits (float32, one row per text, one column per label)."""
        import torch

        encoded = [self.tokenizer(text, truncation=self.max_length is not None, max_length=self.max_length)
                   ["input_ids"] for text in texts]
        order = sorted(range(len(texts)), key=lambda i: -len(encoded[i]))  # similar lengths batch together
        out: list = [None] * len(texts)
        device = self.model.device
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            width = max(len(encoded[i]) for i in batch)
            ids = torch.tensor([encoded[i] + [self.tokenizer.pad_token_id] * (width - len(encoded[i])) for i in batch])
            mask = torch.tensor([[1] * len(encoded[i]) + [0] * (width - len(encoded[i])) for i in batch])
            with torch.no_grad():
                logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            for i, row in zip(batch, torch.log_softmax(logits.float(), dim=-1).cpu(), strict=True):
                out[i] = row
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError(f"finetune-classifier cannot score whole texts (loglikelihood_rolling): "
                                  f"{GENERATIVE}.")

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError(f"finetune-classifier cannot generate text (generate_until): {GENERATIVE}.")


def load(pretrained: str, adapter: str | None, *, num_labels: int, dtype: str, device: str):
    """(classifier in eval mode, tokenizer with the run's pad token). The tokenizer is the adapter's when there is
    one (training saved it there, pad token included), else the model folder's."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from finetune_kit.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(adapter or pretrained))
    placement = {"device_map": "auto"} if device == "cuda" else {}
    model = AutoModelForSequenceClassification.from_pretrained(str(pretrained), num_labels=num_labels,
                                                               dtype=getattr(torch, dtype), **placement)
    model.config.pad_token_id = tokenizer.pad_token_id  # the head reads the last token that is not padding
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval(), tokenizer
