"""The call registry's contract: for every registered matmul-like call, the FP8 router, the
sensitivity's range statistics, the per-layer timing probe, capture (its products and calls),
the profile's fp8 blocker and the cost model all agree on what the call computes and whether
FP8 takes it. Routing one more op means adding it to the registry; this test then checks every
stage reads it the same way."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import ComputeProbe
from torch import nn
from torch.overrides import TorchFunctionMode

import autoprec
from autoprec.costmodel import estimate_layer
from autoprec.formats import Format
from autoprec.measure.capture import capture
from autoprec.measure.sensitivity import _ReferenceProbe, _RoundedCallCounter
from autoprec.measure.timing import _fp8_note, _Inputs
from autoprec.profiling import LayerProfile
from autoprec.runtime import calls


class _Call(nn.Module):
    """One module whose own forward runs one call (its parameters, if any, are its own)."""

    def __init__(self, fn, *shapes):
        super().__init__()
        self.fn = fn
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(*s) / s[-1] ** 0.5)
                                    for s in shapes])

    def forward(self, x):
        return self.fn(x, *self.ws)


def _conv1d_hf():
    from transformers.pytorch_utils import Conv1D

    return Conv1D(48, 32)


# name -> (module factory, input shape, the registered call it must run, FP8 takes it)
CASES = {
    "nn.Linear": (lambda: nn.Linear(32, 48), (4, 8, 32), "linear", True),
    "F.linear odd K": (lambda: _Call(lambda x, w: F.linear(x, w), (48, 30)), (4, 8, 30),
                       "linear", False),
    "HF Conv1D (addmm)": (_conv1d_hf, (4, 8, 32), "addmm", True),
    "torch.mm": (lambda: _Call(lambda x, w: torch.mm(x, w), (32, 16)), (64, 32), "mm", True),
    "torch.matmul 2-D weight": (lambda: _Call(lambda x, w: torch.matmul(x, w), (32, 16)),
                                (4, 8, 32), "matmul", True),
    "@ (q @ k.T)": (lambda: _Call(lambda x: x @ x.transpose(-1, -2)), (2, 16, 32), "matmul",
                    True),
    "torch.bmm": (lambda: _Call(lambda x, w: torch.bmm(x, w.expand(2, 32, 16)), (32, 16)),
                  (2, 16, 32), "bmm", True),
    "torch.baddbmm": (lambda: _Call(lambda x, w: torch.baddbmm(torch.zeros(2, 16, 16), x,
                                                               w.expand(2, 32, 16)), (32, 16)),
                      (2, 16, 32), "baddbmm", False),
    "nn.Conv2d": (lambda: nn.Conv2d(16, 32, 3, padding=1), (2, 16, 8, 8), "conv", False),
    "F.sdpa": (lambda: _Call(lambda x: F.scaled_dot_product_attention(x, x, x)), (2, 4, 16, 32),
               "sdpa", False),
}


class _Truth(TorchFunctionMode):
    """What the registry says about each call the module runs, seen at run time."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, list, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        call = calls.lookup(func)
        if call is not None:
            form = calls.matmul_form(call, args, kwargs)
            quantized = form is not None and calls.fp8_shape_supported(
                *calls.product_of(form[0].shape, form[1].shape)[1:])[0]
            self.seen.append((call.name, call.products(args, kwargs, out), quantized))
        return out


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        yield


@pytest.mark.parametrize("case", list(CASES))
def test_every_stage_agrees_on_every_registered_call(case):
    make, shape, name, fp8 = CASES[case]
    torch.manual_seed(0)
    model = make()
    x = torch.randn(*shape)
    with torch.no_grad(), _Truth() as truth:
        model(x)
    assert [s[0] for s in truth.seen] == [name], f"{case}: ran {truth.seen}"
    _, products, quantized = truth.seen[0]
    assert quantized is fp8, f"{case}: the registry says FP8 {'takes' if quantized else 'skips'} it"

    # capture: the same call and the same products, by every tracer that can take it
    for method in ("export", "hooks"):
        layer = capture(model, x, method=method).layer("")
        assert layer.calls == (name,) * len(products) and list(layer.matmuls) == products, \
            (method, layer)
    layer = capture(model, x).layer("")

    # the router: FP8 casts exactly where the registry says FP8 takes the call
    autoprec.apply(model, autoprec.Policy(default="fp8"))
    with torch.no_grad(), ComputeProbe(model) as probe:
        model(x)
    autoprec.remove(model)
    assert (probe.fp8_casts.get("", 0) > 0) is fp8, f"{case}: {probe.fp8_casts}"

    # sensitivity: range statistics count the call for fp16 (autocast rounds it) and for fp8
    # only where it is quantized
    active: list = []
    ref = _ReferenceProbe(model, [Format.FP16, Format.FP8], active)
    with torch.enable_grad(), _RoundedCallCounter(active, {id(p) for p in model.parameters()},
                                                  False):
        model(x)
    ref.close()
    assert ref.act[Format.FP16].total > 0, case
    assert (ref.act[Format.FP8].total > 0) is fp8, case

    # the timing probe, the profile's blocker and the cost model give the same answer
    note = _fp8_note(model, _Inputs((x,), {}))
    blocker = LayerProfile(layer=layer).fp8_blocker
    priced = estimate_layer(layer, "fp8", "h100").note
    assert (note == "") is fp8, f"{case}: timing note {note!r}"
    assert (blocker == "") is fp8, f"{case}: profile blocker {blocker!r}"
    assert ("priced as bf16" not in priced) is fp8, f"{case}: cost model {priced!r}"


def test_layer_kind_is_one_rule_for_capture_and_the_guard():
    class Mixer(nn.Module):  # no attention-like name, a matmul of its own
        def forward(self, x):
            return x @ x.transpose(-1, -2)

    assert calls.layer_kind(Mixer(), {"matmul"}) == "matmul"
    assert calls.layer_kind(Mixer(), set()) is None
    assert calls.layer_kind(nn.Linear(2, 2)) == "linear"
    assert calls.layer_kind(nn.LayerNorm(2)) == "norm"
    assert calls.layer_kind(nn.Conv2d(2, 2, 1), {"conv"}) == "conv"
    graph = capture(nn.Sequential(nn.Linear(8, 8), Mixer()), torch.randn(2, 4, 8))
    assert graph.layer("1").kind == "matmul"


def test_registry_lookups():
    assert calls.lookup(torch.Tensor.__matmul__).name == "matmul"
    assert calls.from_aten("addmm").name == "addmm"
    assert calls.from_aten("convolution").name == "conv"
    assert calls.from_name("sdpa").fp8 is False and calls.from_name("nope") is None
    assert calls.lookup(print) is None
    assert calls.product_of((4, 8, 32), (32, 16)) == (1, 32, 32, 16)
    assert calls.product_of((2, 16, 32), (2, 32, 16)) == (2, 16, 32, 16)
    assert calls.product_of((32,), (32, 16)) == (1, 1, 32, 16)
    ok, reason = calls.fp8_shape_supported(32, 30, 16)
    assert not ok and "K=30" in reason
