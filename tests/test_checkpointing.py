"""Activation checkpointing under a mixed policy (bf16 + fp8 + fp32 layers) on real HF models:
the forward that checkpointing recomputes during backward runs every matmul in its policy
format, and the gradients equal those of the same model without checkpointing.

Checkpointing enters the recomputation outside the region that enclosed the checkpointed
layer in the forward (HF's ``gradient_checkpointing_enable`` checkpoints a layer's class
forward, inside the instance forward a region replaces): these tests failed before the rewrite
pass gave the modules inside fp8 regions a way back in (``rewrite._Reentry``); without
reentrant the recomputation then saved other tensors (a CheckpointError), with reentrant the
gradients differed by 7%."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from conftest import tiny_gpt2, tiny_llama
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import autoprec
from autoprec import Policy
from examples.data import byte_batches

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}

# model, policy; each has fp8 layers both in a region of their own and inheriting fp8 from an
# enclosing region (the root or a block), bf16 layers and fp32 layers
CASES = {
    "gpt2 fp8 default": (tiny_gpt2, Policy(default="fp8", layers={
        "transformer.h.1": "bf16", "transformer.h.0.mlp.c_proj": "fp32", "lm_head": "fp32"})),
    "gpt2 fp8 block": (tiny_gpt2, Policy(default="bf16", layers={
        "transformer.h.1": "fp8", "transformer.h.0.attn": "fp8:rowwise",
        "transformer.h.0.mlp.c_proj": "fp32", "lm_head": "fp32"})),
    "llama fp8 default": (tiny_llama, Policy(default="fp8", engine="autoprec", layers={
        "model.layers.1": "bf16", "model.layers.0.mlp.down_proj": "fp32", "lm_head": "fp32"})),
    # the MLP's nn.Linear layers on torchao's Float8Linear where it is installed
    "llama fp8 mlp torchao": (tiny_llama, Policy(default="bf16", layers={
        "model.layers.*.mlp.*": "fp8", "model.layers.1.self_attn": "fp8:rowwise_with_gw_hp",
        "model.layers.0.self_attn.o_proj": "fp32", "lm_head": "fp32"})),
}
# how the blocks are checkpointed: HF's switch, both variants, or torch's own module wrapper
HOW = ("hf non-reentrant", "hf reentrant", "torch checkpoint_wrapper")


def _block_class(model):
    return type(model.transformer.h[0] if hasattr(model, "transformer") else model.model.layers[0])


def _checkpointed(model, how: str, block: type | None = None):
    """``model`` with each transformer block (``block``: the class checkpointed by torch's
    wrapper; HF's switch knows its own) checkpointed as ``how`` says."""
    if how.startswith("hf"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": how == "hf reentrant"})
    else:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        block = block or _block_class(model)
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block))
    return model


def _policy_applied(case: str):
    make, policy = CASES[case]
    if "torchao" in case:
        pytest.importorskip("torchao", reason="the torchao extra: pip install -e '.[torchao]'")
    model = make().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp8 is emulated on this CPU: said once, known here
        autoprec.apply(model, policy)
    return model


class _Probe(TorchDispatchMode):
    """Records, per innermost running module, each matmul-like aten op with its operand dtypes
    and each cast to an FP8 dtype, in the phase set by ``phase`` ("forward" or "backward";
    ops outside any module forward, i.e. the gradient computation itself, are not recorded).
    In "backward" what is recorded is what checkpointing recomputes."""

    def __init__(self, model):
        super().__init__()
        self.phase = "forward"
        self.ops: dict[str, dict[str, list]] = {"forward": {}, "backward": {}}
        self._stack: list[str | None] = [None]
        names = {id(m): n for n, m in model.named_modules()}
        # a checkpoint wrapper's inner module is the same layer under another name
        self._handles = [h for m in model.modules() for h in (
            m.register_forward_pre_hook(functools.partial(self._push, names[id(m)])),
            m.register_forward_hook(self._pop))]

    def _push(self, fqn, module, args):
        self._stack.append(fqn.replace("._checkpoint_wrapped_module", ""))

    def _pop(self, module, args, output):
        self._stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        fqn = self._stack[-1]
        if fqn is not None:
            record = None
            if name in MATMUL_OPS:
                first = 1 if name in ("addmm", "baddbmm") else 0  # the bias comes first
                record = (name, tuple(a.dtype for a in args[first:first + 2]))
            elif name == "_to_copy" and kwargs.get("dtype") in FP8_DTYPES:
                record = ("to fp8", kwargs["dtype"])
            if record is not None:
                self.ops[self.phase].setdefault(fqn, []).append(record)
        return func(*args, **kwargs)

    def close(self):
        for h in self._handles:
            h.remove()


def _loss_and_grads(model, batch, probe: _Probe | None = None):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    if probe is not None:
        probe.phase = "backward"
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_gradients_equal_uncheckpointed(case, how):
    batch = byte_batches(1, 4, 32, seed=0)[0]
    plain = _policy_applied(case)
    ckpt = _policy_applied(case)
    ckpt.load_state_dict(plain.state_dict())
    _checkpointed(ckpt, how)
    loss, grads = _loss_and_grads(plain, batch)
    loss_c, grads_c = _loss_and_grads(ckpt, batch)
    assert torch.equal(loss, loss_c), (loss.item(), loss_c.item())
    grads_c = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in grads_c.items()}
    assert grads_c.keys() == grads.keys()
    diff = {n: ((grads[n] - grads_c[n]).norm() / grads[n].norm()).item() for n in grads
            if not torch.equal(grads[n], grads_c[n])}
    # the recomputation runs the same kernels on the same inputs: equal to the bit
    assert not diff, f"gradients with checkpointing differ (relative L2): {diff}"


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("case", list(CASES))
def test_recomputed_matmuls_run_in_their_policy_format(case, reentrant):
    batch = byte_batches(1, 4, 32, seed=0)[0]
    model = _checkpointed(_policy_applied(case), "hf reentrant" if reentrant else "hf")
    probe = _Probe(model)
    # early stop ends a recomputation once it has what backward needs: run it to the end so
    # that every op of the forward has its recomputed twin to compare with
    with set_checkpoint_early_stop(False), probe:
        _loss_and_grads(model, batch, probe)
    probe.close()
    fwd, rec = probe.ops["forward"], probe.ops["backward"]
    blocks = [n for n, m in model.named_modules() if isinstance(m, _block_class(model))]
    in_blocks = {f for f in fwd if any(f.startswith(b + ".") for b in blocks)}
    assert in_blocks and set(rec) == in_blocks, sorted(set(rec) ^ in_blocks)
    for fqn in in_blocks:
        assert rec[fqn] == fwd[fqn], f"{fqn}: forward ran {fwd[fqn]}, recomputation {rec[fqn]}"
    # the forward itself computes as the policy says, so the comparison above is meaningful
    policy = autoprec.runtime.applied_policy(model)
    for fqn in in_blocks:
        fmt = policy.format_for(fqn)
        ran = fwd[fqn]
        fp8_casts = [r for r in ran if r[0] == "to fp8"]
        low = {d for op, dts in ran if op in MATMUL_OPS for d in dts}
        if fmt.is_scaled:
            assert fp8_casts, f"{fqn} is {fmt.value} but cast nothing to fp8: {ran}"
        elif fmt.value == "bf16":
            assert not fp8_casts and low == {torch.bfloat16}, f"{fqn} (bf16) ran {ran}"
        else:
            assert not fp8_casts and low == {torch.float32}, f"{fqn} (fp32) ran {ran}"


class _HandWritten(nn.Module):
    """A model that checkpoints its blocks itself with ``torch.utils.checkpoint``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(2))
        self.head = nn.Linear(64, 16)
        self.ckpt: bool | None = None  # None: no checkpointing; else use_reentrant

    def forward(self, x):
        for block in self.blocks:
            x = x + (block(x) if self.ckpt is None else
                     checkpoint(block, x, use_reentrant=self.ckpt))
        return self.head(x)


def test_torch_checkpoint_in_a_hand_written_model_recomputes_in_policy_formats():
    torch.manual_seed(0)
    model = _HandWritten()
    policy = Policy(default="fp8", engine="autoprec",
                    layers={"blocks.1.2": "bf16", "head": "fp32"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autoprec.apply(model, policy)
    x = torch.randn(4, 32, 64, requires_grad=True)
    grads = {}
    for ckpt in (None, False, True):
        model.zero_grad(set_to_none=True)
        x.grad = None
        model.ckpt = ckpt
        model(x).square().mean().backward()
        grads[ckpt] = [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
    for ckpt in (False, True):
        same = [torch.equal(a, b) for a, b in zip(grads[None], grads[ckpt])]
        assert all(same), f"use_reentrant={ckpt}: gradients differ at {same}"


def test_reentry_regions_are_removed_and_not_listed(gpt2):
    autoprec.apply(gpt2, CASES["gpt2 fp8 default"][1])
    # they change no format: the regions the policy names are what is listed
    assert autoprec.applied_formats(gpt2) == {"": autoprec.Format.FP8,
                                              "transformer.h.1": autoprec.Format.BF16,
                                              "transformer.h.0.mlp.c_proj": autoprec.Format.FP32,
                                              "lm_head": autoprec.Format.FP32}
    assert "forward" in gpt2.transformer.h[0].attn.__dict__  # inherits fp8: a way back in
    assert "forward" not in gpt2.transformer.h[1].attn.__dict__  # inherits bf16: none needed
    copy.deepcopy(gpt2)  # regions rebind to the copy, as Region's docstring promises
    autoprec.remove(gpt2)
    assert all("forward" not in m.__dict__ for m in gpt2.modules())
