"""Shared fixtures: real models nobody here wrote (HF GPT-2, the pretrained MiniLM BERT, HF
ResNet) at sizes that keep the suite fast on 2 CPU cores."""

from __future__ import annotations

import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import cnn, gpt2_bytes, minilm  # noqa: E402
from examples.data import byte_batches  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def tiny_gpt2(n_layer: int = 2, n_embd: int = 64, seq_len: int = 32, attn: str = "eager"):
    torch.manual_seed(0)
    return gpt2_bytes.make_model(n_layer=n_layer, n_embd=n_embd, n_head=2, seq_len=seq_len,
                                 attn_implementation=attn).eval()


@pytest.fixture
def gpt2():
    return tiny_gpt2()


@pytest.fixture
def gpt2_batch():
    return byte_batches(1, 4, 32, seed=0)[0]


@pytest.fixture(scope="session")
def _minilm_cached():
    torch.manual_seed(0)
    return minilm.make_model().eval()


@pytest.fixture
def minilm_model(_minilm_cached):
    import copy

    return copy.deepcopy(_minilm_cached)


@pytest.fixture(scope="session")
def minilm_batch():
    return minilm.snippet_batches(1, batch_size=4, seq_len=32, seed=0)[0]


@pytest.fixture
def cnn_model():
    torch.manual_seed(0)
    return cnn.make_model(width=16).eval()


@pytest.fixture
def cnn_batch():
    return cnn.image_batches(1, batch_size=4, seed=0)[0]
