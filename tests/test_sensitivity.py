"""Sensitivity: each layer switched alone, measured against the FP32 reference, on real models
(HF GPT-2, the pretrained MiniLM BERT)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import tiny_gpt2
from torch import nn

from autoprec.formats import FP8_E5M2, Format
from autoprec.measure.sensitivity import LayerSensitivity, measure_sensitivity

F32, BF16, F16, F8 = Format.FP32, Format.BF16, Format.FP16, Format.FP8


def matmul_layers(model: nn.Module) -> list[str]:
    """Modules that own a matmul: nn.Linear and HF's Conv1D (GPT-2)."""
    from transformers.pytorch_utils import Conv1D

    return [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))]


def table(results) -> str:
    rows = []
    for layer, per in results.items():
        for fmt, e in per.items():
            rows.append(f"  {layer:32s} {fmt!s:5s} {e.verdict:10s} loss {e.loss_rel_change:+.2e} "
                        f"grad {e.grad_rel_error:.2e} sqnr {e.output_sqnr_db:6.1f} dB "
                        f"act_over {e.act_overflow} grad_under {e.grad_underflow}")
    return "\n".join(rows)


# --------------------------------------------------------------------------- planted fault
PLANTED = "transformer.h.1.mlp.c_proj"


def test_planted_fp16_overflow_is_flagged_in_that_layer_only(gpt2, gpt2_batch):
    # Like T5's `wo` (66246 > 65504, transformers#5651): the last MLP projection's outputs
    # exceed FP16's range, while ln_f renormalises them so that nothing downstream sees large
    # values. (Scaling c_fc instead would also flag c_proj, whose *input* would be huge.)
    with torch.no_grad():
        gpt2.get_submodule(PLANTED).weight.mul_(1e7)
        out = gpt2(**gpt2_batch)
    assert torch.isfinite(out.loss), "the plant must keep the FP32 model finite"

    layers = [*matmul_layers(gpt2), "transformer.h.1.mlp"]
    assert PLANTED in layers and len(layers) == 10
    results = measure_sensitivity(gpt2, layers, ["bf16", "fp16"], batches=[gpt2_batch])

    bad = results[PLANTED][F16]
    assert not bad.finite and bad.verdict == "non-finite", table(results)
    assert math.isnan(bad.loss_rel_change) or math.isinf(bad.loss_rel_change)
    assert bad.act_overflow > 0.05, f"measured act_overflow={bad.act_overflow}"
    good = results[PLANTED][BF16]
    assert good.finite and good.verdict in ("ok", "lossy"), table(results)

    wrongly_flagged = [
        f"{layer} {fmt}: {e.verdict} (act_overflow={e.act_overflow}, "
        f"grad_overflow={e.grad_overflow})"
        for layer, per in results.items() for fmt, e in per.items()
        if (layer, fmt) != (PLANTED, F16)
        and (not e.finite or e.verdict in ("non-finite", "overflow")
             or (e.act_overflow or 0) > 0 or (e.grad_overflow or 0) > 0)]
    assert not wrongly_flagged, "flagged besides the planted layer:\n" + \
        "\n".join(wrongly_flagged) + "\n" + table(results)

    # A parent of the planted layer, measured with its children listed too, covers only what
    # it computes itself (the GELU between them): not flagged above. Switched as a whole
    # subtree, it contains the overflow.
    mlp = "transformer.h.1.mlp"
    subtree = measure_sensitivity(gpt2, [mlp, PLANTED], ["fp16"], batches=[gpt2_batch],
                                  include_children=True)
    assert not subtree[mlp][F16].finite and subtree[mlp][F16].layer_grad_rel_error is not None
    assert results[mlp][F16].finite and results[mlp][F16].layer_grad_rel_error is None

    # Non-finite numbers survive JSON (which has no inf/NaN literal) and come back.
    text = json.dumps(bad.to_dict(), allow_nan=False)
    back = LayerSensitivity.from_dict(json.loads(text))
    assert back.to_dict() == bad.to_dict() and back.format is F16 and not back.finite


# --------------------------------------------------------------------------- determinism
def _gpt2_with_dropout(p: float) -> nn.Module:
    from transformers import GPT2LMHeadModel

    from examples.gpt2_bytes import gpt2_config

    cfg = gpt2_config(n_layer=2, n_embd=64, n_head=2, seq_len=32, dropout=p)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def test_two_runs_are_identical_and_dropout_is_off(gpt2_batch):
    layers = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"]
    formats = ["fp32", "bf16", "fp16", "fp8"]
    model = _gpt2_with_dropout(0.3)
    before = copy.deepcopy(model.state_dict())
    ticks = []
    first = measure_sensitivity(model, layers, formats, batches=[gpt2_batch],
                                progress=lambda done, total, label: ticks.append((done, total)))
    second = measure_sensitivity(model, layers, formats, batches=[gpt2_batch])
    dump = lambda r: {k: {str(f): e.to_dict() for f, e in v.items()} for k, v in r.items()}
    assert dump(first) == dump(second)
    assert ticks[0] == (1, 13) and ticks[-1] == (13, 13), ticks

    # With dropout at 0.3 the numbers equal those of the same weights without dropout: the
    # measurement switched it off (a dropout mask would make every error large and the fp32
    # self-comparison only zero by seed luck).
    plain = _gpt2_with_dropout(0.0)
    plain.load_state_dict(before)
    assert dump(measure_sensitivity(plain, layers, formats, batches=[gpt2_batch])) == dump(first)

    # The caller's model is untouched: weights, mode, dropout, no gradients.
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not model.training and model.transformer.drop.p == 0.3
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", ["exact", "auto", "fast"])
def test_in_place_measures_what_a_copy_measures_and_puts_the_model_back(gpt2_batch, mode):
    # the profile measures on its own model (no copy of it): the same numbers as on a copy,
    # bit for bit, in every mode (auto and fast keep no reference gradients and run the
    # reference again for an exact pair), and the model's weights, mode and dropout after
    layers = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"]
    formats = ["bf16", "fp16", "fp8"]
    model = _gpt2_with_dropout(0.3).train()
    before = copy.deepcopy(model.state_dict())
    dump = lambda r: {k: {str(f): e.to_dict() for f, e in v.items()} for k, v in r.items()}
    kw = dict(batches=[gpt2_batch, gpt2_batch], mode=mode)
    copied = measure_sensitivity(model, layers, formats, **kw)
    in_place = measure_sensitivity(model, layers, formats, in_place=True, **kw)
    assert dump(in_place) == dump(copied)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training and model.transformer.drop.p == 0.3
    assert model.config.resid_pdrop == 0.3 and model.transformer.h[0].attn.attn_dropout.p == 0.3
    assert all(p.grad is None for p in model.parameters())


def test_reference_gradients_kept_recomputed_or_spilled_give_the_same_numbers(monkeypatch,
                                                                             capsys):
    """The exact comparisons get the FP32 reference's gradients kept, recomputed beside each
    comparison or spilled outside memory (a temporary file on CPU): the same numbers, bit for
    bit, on an HF Llama (fp16's loss-scaled reading included), in "exact" and in "auto" (its
    budget set where one pair's estimate is near it, so that pair is measured). "auto"
    recomputes them where keeping them would take over a quarter of the free memory (1 KiB
    here). A way that is none of these is a one-line error naming them, in the profile and
    the CLI too."""
    from conftest import tiny_llama

    import autoprec
    from autoprec import cli
    from autoprec.measure import deviation
    from examples.data import byte_batches

    model = tiny_llama()
    layers = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    fmts = ["bf16", "fp16", "fp8"]
    dump = lambda r: {k: {str(f): e.to_dict() for f, e in v.items()} for k, v in r.items()}  # noqa: E731
    batches = byte_batches(2, 2, 16, seed=4)
    fast = measure_sensitivity(model, layers, fmts, batches=batches, mode="fast", in_place=True)
    near = abs(fast["lm_head"][Format.BF16].loss_rel_change)
    meters = []
    init = deviation.DeviationMeter.__init__

    def noting(self, *a, **k):
        init(self, *a, **k)
        meters.append((self.per_batch, self.spill))

    monkeypatch.setattr(deviation.DeviationMeter, "__init__", noting)
    for mode in ("exact", "auto"):
        kw = dict(batches=batches, mode=mode, in_place=True,
                  budget=autoprec.Budget(max_loss_increase=near, max_grad_error=1e9))
        meters.clear()
        got = {how: measure_sensitivity(model, layers, fmts, reference_gradients=how, **kw)
               for how in ("kept", "recomputed", "spilled")}
        assert meters == [(False, False), (True, False), (False, True)]
        assert dump(got["recomputed"]) == dump(got["kept"]) == dump(got["spilled"])
        assert got["kept"]["lm_head"][Format.BF16].source == "measured"
        monkeypatch.setattr(deviation, "free_memory", lambda device: 1024)
        assert dump(measure_sensitivity(model, layers, fmts, **kw)) == dump(got["kept"])
        assert meters[-1] == (True, False)
        monkeypatch.undo()
        monkeypatch.setattr(deviation.DeviationMeter, "__init__", noting)
    with pytest.raises(ValueError, match=r"^reference_gradients must be one of auto, kept, "
                                         r"recomputed, spilled; got 'some'\.$"):
        measure_sensitivity(model, layers, ["bf16"], batches=batches, reference_gradients="some")
    with pytest.raises(ValueError, match="reference_gradients must be one of"):
        autoprec.profile(None, reference_gradients="kep")
    with pytest.raises(SystemExit):
        cli.main(["profile", "x.py:task", "--reference-gradients", "some"])
    assert "invalid choice: 'some'" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["exact", "auto", "fast"])
def test_a_layer_left_no_format_is_watched_but_not_measured(gpt2, gpt2_batch, mode):
    # the profile's only_winnable can leave a layer no format to measure (on a Zen 4, tiny
    # layers whose bf16 and fp16 times do not beat fp32): it is still captured (its parameters'
    # gradients still count), reported with nothing, and the other layers' numbers are those
    # of a run without it
    layers = ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "lm_head"]
    kw = dict(batches=[gpt2_batch], mode=mode)
    none = {"transformer.h.0.attn.c_attn": [], "lm_head": ["bf16"],
            "transformer.h.1.mlp.c_fc": ["bf16"]}
    got = measure_sensitivity(gpt2, layers, ["bf16"], only=none, **kw)
    assert not got.get("transformer.h.0.attn.c_attn")
    full = measure_sensitivity(gpt2, layers, ["bf16"], **kw)
    for name in ("transformer.h.1.mlp.c_fc", "lm_head"):
        assert got[name][Format.BF16].to_dict() == full[name][Format.BF16].to_dict()


def test_in_place_refuses_a_model_with_a_policy_applied(gpt2_batch):
    import autoprec

    model = _gpt2_with_dropout(0.0)
    autoprec.apply(model, autoprec.Policy(default="bf16"))
    with pytest.raises(ValueError, match="policy is applied") as e:
        measure_sensitivity(model, ["lm_head"], ["bf16"], batches=[gpt2_batch], in_place=True)
    assert "\n" not in str(e.value)
    assert autoprec.runtime.rewrite.applied_policy(model) is not None  # left as it was


# --------------------------------------------------------------------------- numerics
MINILM_ENCODER = [f"bert.encoder.layer.{i}.{part}" for i in (0, 5) for part in (
    "attention.self.query", "attention.self.key", "attention.self.value",
    "attention.output.dense", "intermediate.dense", "output.dense")]
# Their matmuls see only the [CLS] rows: M = batch = 4, not a multiple of 16, so fp8 falls
# back to bf16 (autoprec.fp8's shape rule, the same on CPU and GPU).
MINILM_HEAD = ["bert.pooler.dense", "classifier"]


@pytest.mark.slow
def test_minilm_errors_are_ordered_fp32_bf16_fp8(minilm_model, minilm_batch):
    embedding = "bert.embeddings.word_embeddings"
    results = measure_sensitivity(minilm_model, [*MINILM_ENCODER, *MINILM_HEAD, embedding],
                                  ["fp32", "bf16", "fp8"], batches=[minilm_batch])
    report = table(results)
    for layer in MINILM_ENCODER + MINILM_HEAD:
        ref, bf, f8 = (results[layer][f] for f in (F32, BF16, F8))
        # FP32 against itself: the same computation, bit for bit.
        assert ref.loss_rel_change == 0 and ref.grad_rel_error == 0, f"{layer}\n{report}"
        assert ref.layer_grad_rel_error == 0 and ref.output_sqnr_db == math.inf, layer
        # BF16: small but real errors (8 mantissa bits: ~40-50 dB on a matmul output).
        assert bf.finite and bf.output_sqnr_db >= 25.0, \
            f"{layer} bf16 output SQNR {bf.output_sqnr_db:.1f} dB < 25 dB\n{report}"
        assert 0 < bf.grad_rel_error < 0.05, f"{layer} bf16 grad error {bf.grad_rel_error}"
        assert 0 < bf.layer_grad_rel_error < 0.05, layer
        assert bf.act_overflow is None and f8.act_overflow == 0.0 and f8.grad_overflow == 0.0
    for layer in MINILM_ENCODER:
        bf, f8 = results[layer][BF16], results[layer][F8]
        # FP8 E4M3 (3 mantissa bits): lossier than BF16 on every layer, but not broken.
        assert f8.finite and 15.0 <= f8.output_sqnr_db < bf.output_sqnr_db - 10, \
            f"{layer} fp8 SQNR {f8.output_sqnr_db:.1f} dB vs bf16 {bf.output_sqnr_db:.1f}\n" \
            f"{report}"
    for layer in MINILM_HEAD:
        bf, f8 = results[layer][BF16], results[layer][F8]
        assert f8.to_dict() | {"format": "bf16"} == bf.to_dict() | {"act_overflow": 0.0,
            "act_underflow": f8.act_underflow, "grad_overflow": 0.0,
            "grad_underflow": f8.grad_underflow}, f"{layer}: fp8 fallback is not bf16\n{report}"
    mean = lambda fmt: sum(results[n][fmt].grad_rel_error for n in MINILM_ENCODER) / \
        len(MINILM_ENCODER)
    assert mean(F8) > 3 * mean(BF16), f"fp8 {mean(F8):.2e} vs bf16 {mean(BF16):.2e}\n{report}"
    # An embedding lookup has no matmul for a format to change: measured, and exactly zero.
    emb = results[embedding][BF16]
    assert emb.output_sqnr_db == math.inf and emb.grad_rel_error == 0.0, report


def test_cnn_batchnorm_stays_put_and_convs_are_measured(cnn_model, cnn_batch):
    from autoprec.measure.deviation import prepare_for_measurement

    # Train-mode BatchNorm normalises with batch statistics, as in training, but must not
    # drift its running statistics between runs: momentum 0 keeps them where they were.
    probe = prepare_for_measurement(copy.deepcopy(cnn_model))
    bn = probe.get_submodule("resnet.embedder.embedder.normalization")
    before = bn.running_mean.clone()
    probe(**cnn_batch)
    assert probe.training and torch.equal(bn.running_mean, before)

    convs = ["resnet.embedder.embedder.convolution",
             "resnet.encoder.stages.1.layers.0.layer.0.convolution", "classifier.1"]
    results = measure_sensitivity(cnn_model, convs, ["fp32", "bf16", "fp16"], batches=[cnn_batch])
    for layer in convs:
        ref, bf, f16 = (results[layer][f] for f in (F32, BF16, F16))
        assert ref.grad_rel_error == 0 and ref.output_sqnr_db == math.inf, table(results)
        assert bf.finite and 25.0 <= bf.output_sqnr_db < f16.output_sqnr_db, table(results)
        # Outputs are as good as a Linear's (~50 dB), yet in this random-init ResNet a conv's
        # weight gradient comes out 25-40% off in bf16 (also in eval mode and at batch 32, so
        # not BatchNorm's batch statistics; a lone conv on random data is off by 0.3%).
        # FP16's 3 extra mantissa bits cut it several-fold. Measured, not assumed.
        assert 0 < f16.layer_grad_rel_error < bf.layer_grad_rel_error, table(results)


# --------------------------------------------------------------------------- underflow
def _tiny_grad_loss(model, batch):
    # A loss this small gives every activation gradient a magnitude near 1e-10: FP16's
    # smallest subnormal is 2**-24 = 6e-8, so without loss scaling they flush to zero.
    return model(**batch).loss * 1e-6


def _output_grad(model, batch, layer):
    grads = []

    def hook(module, args, out):
        out.register_hook(grads.append)  # returns None: the output itself is unchanged

    model.get_submodule(layer).register_forward_hook(hook)
    model.train()
    _tiny_grad_loss(model, batch).backward()
    return grads[0].detach()


def test_fp16_underflow_of_tiny_gradients_and_fp8_scaling(gpt2, gpt2_batch):
    layer = "transformer.h.1.mlp.c_fc"
    results = measure_sensitivity(gpt2, [layer], ["fp16", "fp8"], batches=[gpt2_batch],
                                  loss_fn=_tiny_grad_loss, loss_scale=1.0)
    f16, f8 = results[layer][F16], results[layer][F8]
    assert f16.grad_underflow > 0.9, f"fp16 grad underflow {f16.grad_underflow}"
    # Dynamic per-tensor scaling moves the gradient into E5M2's range before rounding.
    assert f8.grad_underflow < 0.02 and f8.grad_underflow < f16.grad_underflow / 20, \
        f"fp8 grad underflow {f8.grad_underflow} vs fp16 {f16.grad_underflow}"
    # The activations themselves are ordinary: the statistic separates the two.
    assert f16.act_underflow < 0.01 and f16.act_overflow == 0.0

    # The same fractions, counted here independently on the gradient at the layer's output.
    g = _output_grad(copy.deepcopy(gpt2), gpt2_batch, layer).abs()
    want16 = float(((g > 0) & (g < 2.0**-24)).float().mean())
    e5m2 = torch.finfo(FP8_E5M2)
    scaled = g * (e5m2.max / g.max())
    want8 = float(((g > 0) & (scaled < e5m2.smallest_normal * e5m2.eps)).float().mean())
    assert f16.grad_underflow == pytest.approx(want16, abs=1e-6)
    assert f8.grad_underflow == pytest.approx(want8, abs=1e-6)


def test_fp16_loss_scaling_recovers_gradients_and_backs_off(gpt2, gpt2_batch):
    layer = "transformer.h.1.mlp.c_fc"
    kw = dict(batches=[gpt2_batch], loss_fn=_tiny_grad_loss)
    unscaled = measure_sensitivity(gpt2, [layer], ["fp16"], loss_scale=1.0, **kw)[layer][F16]
    scaled = measure_sensitivity(gpt2, [layer], ["fp16"], loss_scale=2.0**30, **kw)[layer][F16]
    # Underflowed gradients through the fp16 layer lose the weight gradient; a loss scale
    # (as GradScaler applies in fp16 training) brings it back to FP16's rounding error.
    assert unscaled.layer_grad_rel_error > 0.2, unscaled
    assert scaled.layer_grad_rel_error < 0.01, scaled
    # A scale far too large overflows the scaled gradients: the measurement halves it, as
    # GradScaler would, instead of reporting the layer as non-finite.
    huge = measure_sensitivity(gpt2, [layer], ["fp16"], batches=[gpt2_batch],
                               loss_scale=2.0**60)[layer][F16]
    assert huge.finite and huge.layer_grad_rel_error < 0.01, huge


# --------------------------------------------------------------------------- API edges
def test_unknown_layer_names_similar_ones(gpt2, gpt2_batch):
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.mlp\.c_fc") as info:
        measure_sensitivity(gpt2, ["transformer.h.1.mlp.cfc"], ["bf16"], batches=[gpt2_batch])
    assert "not a module of GPT2LMHeadModel" in str(info.value)
    with pytest.raises(ValueError, match="fp9"):
        measure_sensitivity(gpt2, ["lm_head"], ["fp9"], batches=[gpt2_batch])
    with pytest.raises(ValueError, match="without batches"):
        measure_sensitivity(gpt2, ["lm_head"], ["bf16"])


def test_layer_error_json_and_validation():
    e = LayerSensitivity(layer="lm_head", format="fp8", loss_rel_change=1e-3, grad_rel_error=0.02,
                   layer_grad_rel_error=None, output_sqnr_db=math.inf, act_overflow=0.0,
                   act_underflow=0.25, grad_overflow=0.0, grad_underflow=0.0, finite=True,
                   n_batches=2)
    data = json.loads(json.dumps(e.to_dict(), allow_nan=False))
    assert data["output_sqnr_db"] == "inf" and data["format"] == "fp8"
    assert LayerSensitivity.from_dict(data) == e
    with pytest.raises(ValueError, match="'speed'"):
        LayerSensitivity.from_dict({**data, "speed": 1.0})
    with pytest.raises(ValueError, match="act_underflow"):
        LayerSensitivity(**{**LayerSensitivity.from_dict(data).__dict__, "act_underflow": 1.5})
    assert e.verdict == "ok" and e.judge(max_loss_change=1e-4) == "lossy"


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_measurement_noise_floor_and_ordering(gpt2_batch):
    # On CUDA, fp8 runs torch._scaled_mm where the GPU has it (sm_89+), and some backward
    # kernels (embedding) accumulate with atomics: fp32 against itself is the noise floor,
    # which must sit far below what bf16 costs.
    from autoprec.task import move_to

    model = tiny_gpt2().cuda()
    batch = move_to(gpt2_batch, "cuda")
    layers = ["transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_attn"]
    results = measure_sensitivity(model, layers, ["fp32", "bf16", "fp8"], batches=[batch])
    for layer in layers:
        ref, bf, f8 = (results[layer][f] for f in (F32, BF16, F8))
        assert ref.grad_rel_error < 1e-5 and ref.output_sqnr_db > 100, ref
        assert bf.output_sqnr_db >= 25.0 and f8.output_sqnr_db < bf.output_sqnr_db, table(results)
        assert bf.grad_rel_error > 10 * ref.grad_rel_error, table(results)
