"""The rewriting pass on inline modules and on real models (HF GPT-2, pretrained MiniLM BERT,
HF ResNet): each layer is observed computing in its format, the state_dict never changes,
and training matches plain torch.autocast."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from conftest import ComputeProbe, tiny_gpt2, tiny_llama
from torch import nn

import autoprec
from autoprec import Format, Policy
from autoprec._util import optimizer_step
from autoprec.runtime.calls import fp8_shape_supported
from autoprec.runtime.rewrite import applied_policy

DTYPE = {Format.FP32: torch.float32, Format.BF16: torch.bfloat16, Format.FP16: torch.float16}


@pytest.fixture(autouse=True)
def _quiet_fp8_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        yield


class Inline(nn.Module):
    """A linear layer, a functional matmul and a nested block."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.block = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.mix = nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x):
        h = self.proj(x)
        h = torch.matmul(h, self.mix)
        return self.block(h).sum(-1)


def expected_matmul_dtypes(policy, fqn, shapes_ok=True):
    fmt = policy.format_for(fqn)
    if fmt is Format.FP8:
        # emulated FP8 multiplies dequantized FP32 operands; unsupported shapes run bf16
        return {torch.float32} if shapes_ok else {torch.bfloat16}
    return {DTYPE[fmt]}


def check_observed(model, policy, run, *, outer_autocast=None):
    """Run ``run()`` under a probe and check every module's matmuls ran in its format."""
    with ComputeProbe(model) as probe:
        if outer_autocast is not None:
            with torch.autocast("cpu", dtype=outer_autocast):
                run()
        else:
            run()
    assert probe.ops, "the probe saw no matmul at all"
    checked = []
    for fqn, ops in probe.ops.items():
        fmt = policy.format_for(fqn)
        got = probe.matmul_dtypes(fqn)
        casts = probe.fp8_casts.get(fqn, 0)
        if fmt is Format.FP8 and casts == 0:
            # the kernel cannot take this shape: the layer must have run in bf16
            assert got == {torch.bfloat16}, f"{fqn}: fp8 layer without FP8 casts ran {got}"
        else:
            assert got == expected_matmul_dtypes(policy, fqn), \
                f"{fqn}: policy says {fmt}, matmuls ran with {got}"
        if fmt is Format.FP8 and casts:
            assert casts >= 2 * len([o for o in ops if o[0] != "convolution"]), \
                f"{fqn}: {casts} FP8 casts for {len(ops)} matmuls"
        else:
            assert casts == 0, f"{fqn} is {fmt} but cast to FP8 {casts} times"
        checked.append((fqn, fmt))
    return probe, checked


# ----------------------------------------------------------------------------- inline
def test_fp32_policy_is_eager_exactly_and_remove_restores():
    torch.manual_seed(0)
    m = Inline()
    x = torch.randn(8, 32)
    eager = m(x)
    autoprec.apply(m, Policy(default="fp32"))
    assert autoprec.applied_formats(m) == {"": Format.FP32}
    assert torch.equal(m(x), eager)
    assert "forward" in m.__dict__
    autoprec.remove(m)
    assert "forward" not in m.__dict__ and autoprec.applied_formats(m) == {}
    assert torch.equal(m(x), eager)
    autoprec.remove(m)  # removing twice is a no-op


def test_regions_nest_innermost_wins_and_redundant_ones_are_skipped():
    torch.manual_seed(0)
    m = Inline()
    # autoprec's own FP8 engine: with torchao's, the nn.Linear `proj` gets a region of its own
    policy = Policy(default="fp8", layers={"block": "fp32", "block.2": "bf16", "proj": "fp8"},
                    engine="autoprec")
    autoprec.apply(m, policy)
    # `proj` inherits fp8 from the root: no region of its own
    assert autoprec.applied_formats(m) == {"": Format.FP8, "block": Format.FP32,
                                           "block.2": Format.BF16}
    x = torch.randn(16, 32)
    probe, checked = check_observed(m, policy, lambda: m(x))
    assert {f for f, _ in checked} == {"", "proj", "block.0", "block.2"}
    assert probe.fp8_casts[""] >= 2 and probe.fp8_casts["proj"] >= 2  # functional matmul too


def test_outer_autocast_does_not_override_an_fp32_layer():
    torch.manual_seed(0)
    m = Inline()
    policy = Policy(default="bf16", layers={"block": "fp32"})
    autoprec.apply(m, policy)
    x = torch.randn(16, 32)
    check_observed(m, policy, lambda: m(x), outer_autocast=torch.bfloat16)
    # and inputs arriving in bf16 are upcast at the fp32 boundary
    out = m.block(x.to(torch.bfloat16))
    assert out.dtype == torch.float32


def test_apply_twice_replaces_and_accepts_a_path(tmp_path):
    m = Inline()
    autoprec.apply(m, Policy(default="bf16", layers={"block": "fp32"}))
    path = tmp_path / "p.yaml"
    Policy(default="fp16").save(path)
    autoprec.apply(m, str(path))
    assert autoprec.applied_formats(m) == {"": Format.FP16}
    with pytest.raises(TypeError, match="needs an nn.Module"):
        autoprec.apply(lambda x: x, Policy())


def test_deepcopy_of_an_applied_model_is_independent():
    torch.manual_seed(0)
    m = Inline()
    autoprec.apply(m, Policy(default="bf16", layers={"proj": "fp32"}))
    x = torch.randn(4, 32)
    before = m(x)
    c = copy.deepcopy(m)
    with torch.no_grad():
        c.proj.weight.zero_()
    assert torch.equal(m(x), before)
    assert not torch.equal(c(x), before)
    assert autoprec.applied_formats(c) == autoprec.applied_formats(m)


# ----------------------------------------------------------------------------- real models
GPT2_POLICY = Policy(default="bf16", layers={
    "lm_head": "fp32",
    "transformer.h.*.mlp.c_fc": "fp8",
    "transformer.h.0.attn": "fp16",
    "transformer.h.1.attn": "fp8",      # Conv1D children and the functional matmuls
    "transformer.h.1.attn.c_proj": "fp32",
})


def test_gpt2_each_layer_computes_in_its_format(gpt2, gpt2_batch):
    autoprec.apply(gpt2, GPT2_POLICY)

    def step():
        gpt2(**gpt2_batch).loss.backward()

    probe, checked = check_observed(gpt2, GPT2_POLICY, step)
    fmts = dict(checked)
    # every kind of layer was seen: Conv1D in each format, attention matmuls, the head
    assert fmts["lm_head"] is Format.FP32
    assert fmts["transformer.h.0.mlp.c_fc"] is Format.FP8
    assert fmts["transformer.h.0.attn"] is Format.FP16          # eager q@k, attn@v
    assert fmts["transformer.h.1.attn"] is Format.FP8
    assert fmts["transformer.h.1.attn.c_attn"] is Format.FP8
    assert fmts["transformer.h.1.attn.c_proj"] is Format.FP32
    assert fmts["transformer.h.0.mlp.c_proj"] is Format.BF16
    assert len([o for o in probe.ops["transformer.h.1.attn"] if o[0] in ("bmm", "mm")]) >= 2
    # parameters stay FP32 master weights with FP32 gradients
    assert all(p.dtype == torch.float32 for p in gpt2.parameters())
    assert all(p.grad.dtype == torch.float32 for p in gpt2.parameters() if p.grad is not None)


@pytest.mark.parametrize("outer,inner", [("fp16", "bf16"), ("bf16", "fp16"), ("fp8", "fp16")])
def test_a_16_bit_region_inside_the_other_16_bit_dtype_trains(outer, inner, gpt2_batch):
    # Llama's attention in one 16-bit dtype with q/k projections in the other: rotary's
    # torch.cat promotes under autocast and rejected the other dtype ("Unexpected floating
    # ScalarType in at::autocast::prioritize"); an Optuna search proposed exactly this.
    model = tiny_llama()
    policy = Policy(default=Format.FP32, layers={"model.layers.*.self_attn": outer,
                                                 "model.layers.*.self_attn.q_proj": inner,
                                                 "model.layers.*.self_attn.k_proj": inner})
    autoprec.apply(model, policy)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        loss = model(**gpt2_batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_minilm_each_layer_computes_in_its_format(minilm_model, minilm_batch):
    policy = Policy(default="fp32", layers={
        "bert.encoder.layer.*.intermediate.dense": "fp8",
        "bert.encoder.layer.*.attention.self": "bf16",
        "bert.encoder.layer.0.output.dense": "fp16",
        "classifier": "fp8",            # N = 4 labels: the FP8 kernel can't take it -> bf16
    }, engine="autoprec")  # the router's work is observed (torchao's: tests/test_engines.py)
    autoprec.apply(minilm_model, policy)
    assert not fp8_shape_supported(minilm_batch["labels"].numel(), 384, 4)[0]
    probe, checked = check_observed(
        minilm_model, policy, lambda: minilm_model(**minilm_batch).loss.backward())
    fmts = dict(checked)
    assert fmts["bert.encoder.layer.3.intermediate.dense"] is Format.FP8
    assert probe.fp8_casts.get("bert.encoder.layer.3.intermediate.dense", 0) >= 2
    assert fmts["bert.encoder.layer.0.attention.self.query"] is Format.BF16
    assert fmts["bert.encoder.layer.0.output.dense"] is Format.FP16
    assert fmts["bert.encoder.layer.1.output.dense"] is Format.FP32
    assert probe.matmul_dtypes("classifier") == {torch.bfloat16}
    assert "classifier" not in probe.fp8_casts


def test_cnn_convolutions_follow_the_policy(cnn_model, cnn_batch):
    policy = Policy(default="bf16", layers={
        "resnet.embedder": "fp32", "resnet.encoder.stages.1": "fp8", "classifier": "fp32"})
    autoprec.apply(cnn_model, policy)
    probe, checked = check_observed(cnn_model, policy,
                                    lambda: cnn_model(**cnn_batch).loss.backward())
    convs = {f: probe.matmul_dtypes(f) for f, _ in checked if "convolution" in f}
    assert convs["resnet.embedder.embedder.convolution"] == {torch.float32}
    assert convs["resnet.encoder.stages.0.layers.0.layer.0.convolution"] == {torch.bfloat16}
    # no FP8 convolution kernels exist: convs in an fp8 region run bf16
    assert convs["resnet.encoder.stages.1.layers.0.layer.0.convolution"] == {torch.bfloat16}


@pytest.mark.parametrize("which", ["gpt2", "minilm"])
def test_state_dict_unchanged_by_apply_and_remove(which, gpt2, minilm_model, gpt2_batch,
                                                  minilm_batch):
    model, batch = (gpt2, gpt2_batch) if which == "gpt2" else (minilm_model, minilm_batch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    autoprec.apply(model, Policy(default="fp8", layers={"**.dense": "bf16", "lm_head": "fp32"}),
                   strict=False)
    after_apply = model.state_dict()
    with torch.no_grad():
        model(**batch)
    autoprec.remove(model)
    after_remove = model.state_dict()
    for sd in (after_apply, after_remove):
        assert list(sd) == list(before)
        for k in before:
            assert sd[k].dtype == before[k].dtype and torch.equal(sd[k], before[k]), k
    # and the plain model loads it back unchanged
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(after_apply)


def _train(model, batches, steps, *, autocast=False, scaler=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i in range(steps):
        batch = batches[i % len(batches)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        optimizer_step(loss, opt, scaler)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_all_bf16_policy_matches_autocast_step_for_step():
    from examples.data import byte_batches

    batches = byte_batches(4, 8, 32, seed=3)
    ref_model = tiny_gpt2().train()
    pol_model = copy.deepcopy(ref_model)
    ref = _train(ref_model, batches, 20, autocast=True)
    autoprec.apply(pol_model, Policy(default="bf16"))
    got = _train(pol_model, batches, 20)
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    assert worst < 1e-3, f"losses differ by up to {worst:.2e} relative: {ref} vs {got}"
    assert ref[-1] < ref[0]  # it really trained
    for (n, a), (_, b) in zip(ref_model.named_parameters(), pol_model.named_parameters()):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-4), n


def test_fp16_layers_train_with_the_policys_grad_scaler():
    from examples.data import byte_batches

    model = tiny_gpt2().train()
    policy = Policy(default="bf16", layers={"transformer.h.*.mlp.*": "fp16"},
                    loss_scaling={"init_scale": 1024.0, "growth_interval": 2})
    autoprec.apply(model, policy)
    scaler = policy.grad_scaler("cpu")
    assert scaler.is_enabled()
    losses = _train(model, byte_batches(2, 8, 32, seed=4), 6, scaler=scaler)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert scaler.get_scale() >= 1024.0  # no overflow backed the scale off; it grew
    assert losses[-1] < losses[0]


# model, policy, the layer whose weight gradient is compared
COMPILE_CASES = {
    "gpt2 bf16": (tiny_gpt2, Policy(default="bf16", layers={"lm_head": "fp32"}),
                  "transformer.h.0.mlp.c_fc"),
    "gpt2 fp8": (tiny_gpt2, Policy(default="fp8", layers={"lm_head": "fp32"}),
                 "transformer.h.0.mlp.c_fc"),
    # the MLP's nn.Linear layers on torchao's Float8Linear
    "llama fp8 torchao": (tiny_llama, Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8"},
                                             engine="torchao"), "model.layers.0.mlp.up_proj"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_compiled_model_matches_eager(case, gpt2_batch):
    make, policy, layer = COMPILE_CASES[case]
    if "torchao" in case:
        pytest.importorskip("torchao", reason="the torchao extra: pip install -e '.[torchao]'")
    torch._dynamo.reset()
    eager = make().train()
    autoprec.apply(eager, policy)
    compiled_src = copy.deepcopy(eager)
    compiled = torch.compile(compiled_src)
    le = eager(**gpt2_batch).loss
    le.backward()
    lc = compiled(**gpt2_batch).loss
    lc.backward()
    assert torch.allclose(le, lc, rtol=2e-3), (le.item(), lc.item())
    ge = eager.get_submodule(layer).weight.grad
    gc = compiled_src.get_submodule(layer).weight.grad
    rel = ((ge - gc).norm() / ge.norm()).item()
    assert rel < 0.05, f"compiled vs eager {layer} gradient differ by {rel:.3g}"
    # the compiled model really runs in the format: it differs from an fp32 run
    plain = make().train()
    lf = plain(**gpt2_batch).loss
    assert lf.item() != lc.item()


# ----------------------------------------------------------------------------- wrappers
# A pattern and the fingerprint name modules as the unwrapped model does; a wrapper prefixes
# them (torch.compile's `_orig_mod.`, (D)DP's `module.`), and `apply` on the wrapper used to
# say the pattern matched no module. It applies to the wrapped module now.
def _wrapper_policy(model, layers):
    from autoprec.fingerprint import model_fingerprint

    return Policy(default="bf16", layers=layers, fingerprint=model_fingerprint(model))


def test_apply_through_torch_compile_takes_effect_and_remove_undoes_it(gpt2_batch):
    torch._dynamo.reset()
    model = tiny_gpt2()
    policy = _wrapper_policy(model, {"transformer.h.0.mlp": "fp32"})
    reference = autoprec.apply(tiny_gpt2(), policy)(**gpt2_batch).logits  # eager, same weights
    plain = model(**gpt2_batch).logits
    compiled = torch.compile(model, backend="eager")  # dynamo's graphs, run as eager torch
    assert torch.equal(compiled(**gpt2_batch).logits, plain)  # compiled before the policy
    assert autoprec.apply(compiled, policy) is compiled
    assert autoprec.applied_formats(compiled) == autoprec.applied_formats(model) == {
        "": Format.BF16, "transformer.h.0.mlp": Format.FP32}
    assert applied_policy(compiled) is applied_policy(model) is not None
    # dynamo recompiles with the regions: the compiled model computes as the eager policy does
    out = compiled(**gpt2_batch).logits
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), reference.float()), \
        (out.dtype, (out.float() - reference.float()).abs().max().item())
    autoprec.remove(compiled)
    assert "forward" not in model.__dict__ and autoprec.applied_formats(compiled) == {}
    assert torch.equal(compiled(**gpt2_batch).logits, plain)
    torch._dynamo.reset()


def _gloo_world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"file://{tmp_path / 'store'}")
    return dist


@pytest.mark.parametrize("wrap", ["DataParallel", "DistributedDataParallel"])
def test_apply_through_data_parallel_wrappers(wrap, cnn_model, cnn_batch, tmp_path):
    layers = {"resnet.embedder": "fp32", "classifier": "fp32"}
    policy = _wrapper_policy(cnn_model, layers)
    reference = autoprec.apply(copy.deepcopy(cnn_model), policy)(**cnn_batch).logits
    dist = _gloo_world_of_one(tmp_path) if wrap == "DistributedDataParallel" else None
    wrapped = None
    try:
        wrapped = getattr(nn.parallel, wrap)(cnn_model)
        autoprec.apply(wrapped, policy, guard=True)
        assert autoprec.applied_formats(wrapped) == {"": Format.BF16, **{
            k: Format.FP32 for k in layers}}
        # the guard watches the module the policy is on, under the model's own names
        assert autoprec.get_guard(cnn_model) is not None
        assert autoprec.get_guard(cnn_model).model is cnn_model
        assert autoprec.get_guard(wrapped) is autoprec.get_guard(cnn_model)  # through the wrapper too
        out = wrapped(**cnn_batch)
        assert torch.allclose(out.logits, reference, atol=1e-6), \
            (out.logits - reference).abs().max().item()
        # the convolutions between the fp32 embedder and head ran in bf16: not an fp32 run
        plain = autoprec.remove(copy.deepcopy(cnn_model))(**cnn_batch).logits
        assert not torch.allclose(out.logits, plain, atol=1e-4)
        out.loss.backward()  # DDP's reducer hooks see the gradients of the wrapped module
        assert all(p.grad is not None for p in cnn_model.parameters())
        autoprec.remove(wrapped)
        assert autoprec.applied_formats(wrapped) == {} and autoprec.get_guard(cnn_model) is None
        assert not any("forward" in m.__dict__ for m in cnn_model.modules())
    finally:
        # as test_ddp's _quiesce: DDP's reducer freed while the group lives, then a barrier
        # (it waits without the GIL, so gloo's worker threads finish freeing the broadcast's
        # tensors). Without them one CI run hung here for good: ~ProcessGroupGloo, run with
        # the GIL held when the reducer was freed, joined a gloo thread waiting for the GIL.
        del wrapped
        gc.collect()
        if dist is not None:
            dist.barrier()
            dist.destroy_process_group()


def test_data_parallel_over_several_devices_is_refused(cnn_model):
    # DataParallel copies every module's __dict__ onto each device per step, regions included,
    # and a region runs the forward of the module it was made for: every replica would compute
    # on the first device's layers. (Set by hand: this host has no two GPUs to build one on.)
    dp = nn.DataParallel(cnn_model)
    dp.device_ids = [0, 1]
    with pytest.raises(autoprec.PolicyError, match=r"DataParallel over 2 devices.*"
                                                   r"DistributedDataParallel"):
        autoprec.apply(torch.compile(dp), Policy(default="bf16"))
    assert autoprec.applied_formats(cnn_model) == {}
