"""A model trained with activation checkpointing is measured as it trains, with the numbers it
gives without checkpointing.

Checkpointing runs a region's forward again in the backward. The measurements' forward hooks
used to take that replay for new calls: the exact comparison's output SQNR concatenated a
batch's replayed outputs into the next batch's (0.02-0.05 dB off here); a replay that the
checkpoint stops early (once it has what it needs) left its layers on the stack of running
layers, so the range statistics counted the next batch's calls in the wrong layer (fp8
underflow of a down projection 2.6e-5 against 1.6e-4); and each probe pass of the first-order estimate copied every replayed layer input, held to the end
of the batch (a fast profile of a checkpointed Llama took more memory than of the same Llama
without checkpointing). A reentrant checkpoint cannot give the gradients of chosen tensors: a
one-line error says what to change, not a traceback from inside torch."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_llama
from test_checkpointing import _checkpointed
from test_sensitivity import matmul_layers

from autoprec.measure.checkpointing import recomputing
from autoprec.measure.sensitivity import measure_sensitivity
from examples.data import byte_batches

FIELDS = ("loss_rel_change", "grad_rel_error", "layer_grad_rel_error", "output_sqnr_db",
          "act_overflow", "act_underflow", "grad_overflow", "grad_underflow", "finite")
WRAPPED = "._checkpoint_wrapped_module"


def _assert_same(want, got, names) -> None:
    """Every field of every pair bit for bit (``names``: the checkpointed model's names)."""
    assert len(want) == len(got)
    for (layer, per), name in zip(want.items(), names):
        assert per.keys() == got[name].keys()
        for fmt, a in per.items():
            b = got[name][fmt]
            for key in FIELDS:
                x, y = getattr(a, key), getattr(b, key)
                same = x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
                assert same, f"{layer} {fmt} {key}: {x!r} without checkpointing, {y!r} with"


@pytest.mark.parametrize("mode", ["fast", "exact"])
@pytest.mark.parametrize("how", ["hf non-reentrant", "torch checkpoint_wrapper"])
def test_a_checkpointed_llama_measures_as_it_does_without(mode, how):
    batches = byte_batches(2, 2, 32, seed=1)
    plain = tiny_llama().train()
    layers = matmul_layers(plain)
    want = measure_sensitivity(plain, layers, ["bf16", "fp8"], batches=batches, mode=mode)
    model = _checkpointed(tiny_llama().train(), how, type(plain.model.layers[0]))
    names = matmul_layers(model)
    assert [n.replace(WRAPPED, "") for n in names] == layers
    got = measure_sensitivity(model, names, ["bf16", "fp8"], batches=batches, mode=mode)
    _assert_same(want, got, names)


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_a_layer_shared_by_checkpointed_regions_measures_as_without(mode):
    """ALBERT calls one shared layer once per depth: checkpointed, each call is a region of
    its own, replayed in the backward in the reverse order."""
    from transformers import AlbertConfig, AlbertForMaskedLM
    from transformers.models.albert.modeling_albert import AlbertLayer

    def albert():
        torch.manual_seed(0)
        return AlbertForMaskedLM(AlbertConfig(
            vocab_size=300, embedding_size=32, hidden_size=64, num_hidden_layers=3,
            num_attention_heads=4, intermediate_size=128, max_position_embeddings=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).train()

    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 300, (2, 16), generator=g),
                "labels": torch.randint(0, 300, (2, 16), generator=g)} for _ in range(2)]
    plain = albert()
    layers = matmul_layers(plain)
    want = measure_sensitivity(plain, layers, ["bf16", "fp8"], batches=batches, mode=mode)
    model = _checkpointed(albert(), "torch checkpoint_wrapper", AlbertLayer)
    names = matmul_layers(model)
    assert any(WRAPPED in n for n in names)
    got = measure_sensitivity(model, names, ["bf16", "fp8"], batches=batches, mode=mode)
    _assert_same(want, got, names)


def test_a_reentrant_checkpoint_is_a_one_line_error():
    model = _checkpointed(tiny_llama().train(), "hf reentrant")
    with pytest.raises(ValueError, match=r"use_reentrant=True") as info:
        measure_sensitivity(model, matmul_layers(model)[:2], ["bf16"],
                            batches=byte_batches(1, 2, 16, seed=1), mode="fast")
    assert "\n" not in str(info.value) and "use_reentrant=False" in str(info.value)


def test_recomputing_is_true_only_while_a_checkpoint_replays_its_region():
    from torch.utils.checkpoint import checkpoint

    seen = []
    lin = torch.nn.Linear(4, 4)
    lin.register_forward_pre_hook(lambda *_: seen.append(recomputing()))
    x = torch.randn(3, 4, requires_grad=True)
    checkpoint(lin, x, use_reentrant=False).sum().backward()
    lin(x)
    with torch.autograd.graph.save_on_cpu():
        lin(x)
    assert seen == [False, True, False, False]
