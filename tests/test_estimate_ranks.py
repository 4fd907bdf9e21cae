"""The first-order estimate's whole-model gradient error against the exact measurement, on HF
GPT-2 and HF Llama: it must rank the layers of each format as the measurement does (issue 22:
carried upstream unattenuated it grew with depth while the measured error fell, Spearman
-0.70 on the GPT-2 example), and the weights it rounds must be the ones the kernels multiply.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2, tiny_llama
from scipy.stats import spearmanr
from test_sensitivity import matmul_layers
from transformers.pytorch_utils import Conv1D

from autoprec.formats import Format
from autoprec.measure.sensitivity import measure_sensitivity
from autoprec.policy import Policy
from autoprec.runtime import rewrite

FORMATS = ["bf16", "fp8", "fp8:rowwise"]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_estimated_gradient_error_ranks_each_formats_layers_like_the_exact_one(name, gpt2_batch):
    model = tiny_gpt2() if name == "gpt2" else tiny_llama()
    layers = matmul_layers(model)
    fast = measure_sensitivity(model, layers, FORMATS, batches=[gpt2_batch], mode="fast")
    exact = measure_sensitivity(model, layers, FORMATS, batches=[gpt2_batch], mode="exact")
    for fmt in map(Format.parse, FORMATS):
        xs = [exact[n][fmt].grad_rel_error for n in layers]
        ys = [fast[n][fmt].grad_rel_error for n in layers]
        report = "\n".join(f"  {n:36s} exact {x:.3e} est {y:.3e}"
                           for n, x, y in zip(layers, xs, ys))
        rho = float(spearmanr(xs, ys)[0])
        assert rho >= 0.8, f"{name} {fmt}: Spearman {rho:.3f} over {len(layers)} layers\n{report}"
        # and the level, not only the order: the old estimate was up to 20x (the example) and
        # 11x (these models) high, and 50x low on a CNN
        for n, x, y in zip(layers, xs, ys):
            assert 0.5 * x <= y <= 2 * x, f"{name} {fmt} {n}: est {y:.3e} exact {x:.3e}\n{report}"


@pytest.mark.filterwarnings("ignore:.*can only emulate")
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8", "fp8:rowwise"])
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_the_weights_the_estimate_rounds_are_the_ones_the_kernel_multiplies(fmt, kind):
    from autoprec.measure.estimate import _RoundWeights

    # one-hot inputs are exact in every format (and their FP8 scale is a power of two), so
    # the layer's output in `fmt` is its rounded weights themselves, to its output's BF16
    # rounding; rounding along the wrong dimension or to the wrong dtype is far off that
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 48) if kind == "linear" else Conv1D(48, 32)
    with torch.no_grad():
        layer.weight.mul_(torch.logspace(-3, 3, 32 * 48).reshape(layer.weight.shape))
        layer.bias.zero_()
    model = torch.nn.Sequential(layer)
    x = torch.eye(32).repeat(2, 1)  # 64 rows: a shape the FP8 kernel takes
    f = Format.parse(fmt)
    rewrite.apply(model, Policy(default=Format.FP32, layers={"0": f}, engine="autoprec"),
                  strict=False)
    try:
        kernel = model(x).float()
    finally:
        rewrite.remove(model)
    mode = _RoundWeights(f, {id(p): i for i, p in enumerate(model.parameters())}, [])
    with mode:
        mine = model(x)
    assert mode.found, "the weight was not recognised as a rounded operand"
    assert not torch.equal(mine, model(x)), "nothing was rounded"
    scale = mine.abs().clamp(min=1e-30)
    rel = ((kernel - mine).abs() / scale).max().item()
    assert rel <= 2**-8, f"{fmt} {kind}: kernel and estimate differ by {rel:.2e} relative"
