"""torchao as the FP8 engine of nn.Linear layers: chosen per layer, numerically the same recipes
as autoprec's own FP8 matmul, and removed without a trace (modules, names, values). Under
torch.compile: tests/test_rewrite.py; under DDP: tests/test_ddp.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import poison_and_train
from torch import nn

import autoprec
from autoprec import Policy
from autoprec.policy import PolicyError
from autoprec.runtime import engines, rewrite

pytest.importorskip("torchao", reason="the torchao extra: pip install -e '.[torchao]'")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@pytest.fixture(autouse=True)
def _no_emulation_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        yield


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(lin: nn.Linear, policy: Policy, x: torch.Tensor, g: torch.Tensor):
    model = nn.Sequential(lin)
    autoprec.apply(model, policy)
    lin.zero_grad()
    xi = x.clone().requires_grad_()
    y = model(xi)
    y.backward(g.to(y.dtype))
    out = (y.detach(), lin.weight.grad.clone(), xi.grad.clone())
    engine = "torchao" if type(model[0]).__name__ == "Float8Linear" else "autoprec"
    autoprec.remove(model)
    return out, engine


@pytest.mark.parametrize("recipe", RECIPES)
def test_torchao_and_autoprec_compute_the_same_recipe(recipe):
    """The same layer, input and gradient through both engines: they differ by no more than
    BF16 output rounding, while each is ~3% (FP8 rounding) from the float64 product."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 128)
    x = torch.randn(4, 32, 256).to(torch.bfloat16)
    g = torch.randn(4, 32, 128)
    outs = {}
    for engine in ("autoprec", "torchao"):
        outs[engine], used = _run(lin, Policy(default=f"fp8:{recipe}", engine=engine), x, g)
        assert used == engine
    exact = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    fp8_error = _rel(outs["autoprec"][0], exact)
    assert 0.01 < fp8_error < 0.1, f"not FP8 rounding: {fp8_error:.3g} from float64"
    for name, ours, theirs in zip(("output", "weight grad", "input grad"),
                                  outs["autoprec"], outs["torchao"]):
        assert ours.dtype == theirs.dtype or name == "weight grad"
        diff = _rel(ours, theirs)
        assert diff < 2 ** -8, f"{recipe} {name}: engines differ by {diff:.3g}"
        assert diff < 0.2 * fp8_error


def test_auto_engine_sends_linear_to_torchao_and_the_rest_to_autoprec(gpt2, gpt2_batch):
    """GPT-2's blocks are HF Conv1D (addmm) and its attention products are matmuls: torchao
    cannot take them, so they stay on autoprec's FP8; lm_head is an nn.Linear."""
    policy = Policy(default="fp8")
    autoprec.apply(gpt2, policy)
    by_fqn = {r.fqn: r.engine for r in rewrite.regions(gpt2)}
    assert by_fqn["lm_head"] == "torchao"
    assert type(gpt2.lm_head).__name__ == "Float8Linear"
    assert by_fqn[""] == "autoprec"  # the model-wide region routes Conv1D and attention
    loss = gpt2(**gpt2_batch).loss
    loss.backward()
    assert torch.isfinite(loss) and gpt2.lm_head.weight.grad.abs().sum() > 0
    autoprec.remove(gpt2)
    assert type(gpt2.lm_head) is nn.Linear


def test_remove_restores_modules_state_dict_and_optimizer_state(llama, gpt2_batch):
    originals = dict(llama.named_modules())
    state = {k: v.clone() for k, v in llama.state_dict().items()}
    params = list(llama.parameters())
    opt = torch.optim.AdamW(llama.parameters(), lr=1e-3)
    policy = Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8:rowwise",
                                            "model.layers.*.self_attn.*": "fp8"})
    autoprec.apply(llama.train(), policy)
    swapped = [fqn for fqn, m in llama.named_modules() if type(m).__name__ == "Float8Linear"]
    assert len(swapped) == 2 * (3 + 4)
    # the same Parameter objects under the same names: optimizers and checkpoints see no change
    assert list(llama.parameters()) == params
    assert list(llama.state_dict()) == list(state)
    for _ in range(2):
        llama(**gpt2_batch).loss.backward()
        opt.step()
        opt.zero_grad()
    trained = {k: v.clone() for k, v in llama.state_dict().items()}
    assert any(not torch.equal(trained[k], state[k]) for k in state)
    autoprec.remove(llama)
    for fqn, module in llama.named_modules():
        assert module is originals[fqn], fqn
    after = llama.state_dict()
    assert list(after) == list(state)
    for k in state:
        assert after[k].dtype == state[k].dtype and torch.equal(after[k], trained[k]), k
    assert not hasattr(llama, rewrite._SWAPS_ATTR) and not rewrite.regions(llama)


def test_the_policy_or_apply_chooses_the_engine(llama):
    for engine, expect in (("autoprec", "Linear"), ("torchao", "Float8Linear")):
        model = copy.deepcopy(llama)
        autoprec.apply(model, Policy(default="fp8", engine=engine))
        assert type(model.model.layers[0].mlp.up_proj).__name__ == expect
        autoprec.remove(model)
        assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    # apply's engine= overrides the policy's, and is checked like the file's
    model = copy.deepcopy(llama)
    autoprec.apply(model, Policy(default="fp8", engine="torchao"), engine="autoprec")
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    assert rewrite.applied_policy(model).engine == "autoprec"
    autoprec.remove(model)
    with pytest.raises(PolicyError, match="Unknown engine 'cuda'"):
        autoprec.apply(model, Policy(default="fp8"), engine="cuda")


def test_asking_for_torchao_without_it_is_one_line(monkeypatch, llama):
    monkeypatch.setattr(engines, "torchao_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"torchao is not installed: pip install") as e:
        autoprec.apply(llama, Policy(default="fp8", engine="torchao"))
    assert "\n" not in str(e.value)
    assert not rewrite.regions(llama)  # nothing half-applied
    autoprec.apply(llama, Policy(default="fp8"))  # auto falls back to autoprec's own
    assert all(r.engine == "autoprec" for r in rewrite.regions(llama))


def test_a_llama_trains_with_torchao_layers(llama):
    from examples.data import byte_batches

    model = llama.train()
    autoprec.apply(model, Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8:rowwise",
                                                         "lm_head": "fp32"}))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for batch in byte_batches(12, 4, 32, seed=3):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3]), losses


def test_the_guard_demotes_a_torchao_layer_back_to_a_plain_linear(llama, gpt2_batch):
    from autoprec import get_guard
    from autoprec.formats import Format

    layer = "model.layers.1.mlp.up_proj"
    model = llama.train()
    autoprec.apply(model, Policy(default="bf16", layers={layer: "fp8:rowwise"}), guard=True)
    guard = get_guard(model)
    assert guard.watched[layer] is Format.FP8_ROWWISE
    assert type(model.get_submodule(layer)).__name__ == "Float8Linear"
    poison_and_train(model, layer, gpt2_batch, guard, 3)
    assert [(e.fqn, e.old, e.new) for e in guard.events] == [
        (layer, Format.FP8_ROWWISE, Format.BF16)]
    assert type(model.get_submodule(layer)) is nn.Linear  # torchao's module is gone
    assert guard.watched[layer] is Format.BF16
