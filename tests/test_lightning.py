"""PyTorch Lightning: ``L.Trainer(callbacks=[AutoprecCallback(policy)], precision="32-true")``
trains real HF models (GPT-2, Llama) in the policy's formats, the guard demotes a planted
overflow and writes the amended policy, and Lightning checkpoints carry the demotions."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import ComputeProbe, tiny_gpt2, tiny_llama

import autoprec
from autoprec import Format, Policy, PolicyError
from examples import train_lightning
from examples.data import byte_batches
from examples.train_plain import PLANT_LAYER

L = pytest.importorskip("lightning")

from autoprec.lightning import AutoprecCallback  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POLICY = Policy(default="bf16", layers={
    "lm_head": "fp32",
    "transformer.h.0.mlp.c_fc": "fp16",   # tiny: FP16 matmuls are slow on this CPU
    "transformer.h.1.attn": "fp8",
})
CHECKED = ["lm_head", "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj",
           "transformer.h.1.attn", "transformer.h.1.attn.c_attn"]
DTYPE = {Format.FP32: torch.float32, Format.BF16: torch.bfloat16, Format.FP16: torch.float16}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        warnings.filterwarnings("ignore", message=".*training_step. returned .None.*")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*modules? in eval mode.*")
        warnings.filterwarnings("ignore", message=".*scales no loss.*")  # asserted where it counts
        warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # Lightning's, on torch 2.13
        yield


class ProbeOneStep(L.Callback):
    """Watches, with conftest's ComputeProbe, the dtypes the HF model's matmuls run in during
    one training step inside ``fit`` (after the callbacks before it applied the policy)."""

    def __init__(self, at: int = 1):
        self.at, self.probe, self._open = at, None, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            self.probe = ComputeProbe(pl_module.model).__enter__()
            self._open = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._open:
            self.probe.__exit__(None, None, None)
            self._open = False


def _fmt_check(probe: ComputeProbe, policy: Policy, fqns: list[str]) -> None:
    for fqn in fqns:
        fmt = policy.format_for(fqn)
        if fmt is Format.FP8:
            assert probe.fp8_casts.get(fqn, 0) >= 2, f"{fqn} is fp8 but cast nothing to FP8"
        else:
            assert probe.matmul_dtypes(fqn) == {DTYPE[fmt]}, (fqn, probe.matmul_dtypes(fqn))


def test_trainer_trains_gpt2_in_the_policys_formats(tmp_path):
    probe = ProbeOneStep(at=1)
    # module=None: the callback finds the LightningModule's child the policy's names fit
    with pytest.warns(UserWarning, match="fp16 but Trainer.precision='32-true'. scales no loss"):
        trainer, lit, callback = train_lightning.train(
            tiny_gpt2(), POLICY, byte_batches(4, 4, 32, seed=5), steps=8, module=None,
            root_dir=str(tmp_path), callbacks=[probe])
    assert callback.target is lit.model
    assert autoprec.applied_formats(lit.model)[""] is Format.BF16
    _fmt_check(probe.probe, POLICY, CHECKED)
    losses = lit.losses
    assert len(losses) == 8 and all(map(math.isfinite, losses)), losses
    assert sum(losses[-2:]) / 2 < losses[0] - 0.1, losses
    assert callback.guard is None and not os.path.exists(tmp_path / "autoprec.amended.yaml")


def test_guard_demotes_a_planted_overflow_and_writes_the_amended_policy(tmp_path):
    policy = POLICY.with_layers({PLANT_LAYER: "fp16"})
    amended = tmp_path / "policies" / "amended.yaml"
    probe = ProbeOneStep(at=6)
    trainer, lit, callback = train_lightning.train(
        tiny_gpt2(), policy, byte_batches(4, 4, 32, seed=5), steps=8, guard=True, plant_at=2,
        amended_to=str(amended), root_dir=str(tmp_path), callbacks=[probe])
    losses = lit.losses
    # the overflow made steps 2 and 3 non-finite (skipped), the guard demoted the layer after
    # those two steps, and every later step is finite again
    assert all(map(math.isfinite, losses[:2])) and not any(map(math.isfinite, losses[2:4])), losses
    assert all(map(math.isfinite, losses[4:])), losses
    [event] = callback.guard.events
    assert (event.fqn, event.old, event.new, event.step) == (PLANT_LAYER, Format.FP16, Format.FP32, 4)
    assert probe.probe.matmul_dtypes(PLANT_LAYER) == {torch.float32}
    written = autoprec.load_policy(amended)
    assert written.format_for(PLANT_LAYER) is Format.FP32
    assert written.format_for("transformer.h.0.mlp.c_fc") is Format.FP16  # the rest kept
    assert [e["layer"] for e in written.tuned["guard"]] == [PLANT_LAYER]


def test_without_the_guard_the_planted_overflow_never_recovers(tmp_path):
    # the counterpart of the test above: the same run, no guard
    policy = POLICY.with_layers({PLANT_LAYER: "fp16"})
    _, lit, callback = train_lightning.train(
        tiny_gpt2(), policy, byte_batches(4, 4, 32, seed=5), steps=6, plant_at=2,
        root_dir=str(tmp_path))
    assert not any(map(math.isfinite, lit.losses[2:])), lit.losses
    assert callback.guard is None


def test_lightning_checkpoint_carries_the_guards_demotions(tmp_path):
    policy = POLICY.with_layers({PLANT_LAYER: "fp16"})
    batches = byte_batches(4, 4, 32, seed=5)
    trainer, lit, callback = train_lightning.train(
        tiny_gpt2(), policy, batches, steps=5, guard=True, plant_at=1, root_dir=str(tmp_path))
    assert [e.fqn for e in callback.guard.events] == [PLANT_LAYER]
    ckpt = str(tmp_path / "demoted.ckpt")
    trainer.save_checkpoint(ckpt)
    # A fresh model and callback with the original policy (c_proj fp16) resume from it: the
    # planted weight comes back with the checkpoint, and so must the demotion, or the first
    # resumed steps overflow again.
    _, lit2, callback2 = train_lightning.train(
        tiny_gpt2(), policy, batches, steps=8, guard=True, root_dir=str(tmp_path / "resumed"),
        ckpt_path=ckpt)
    assert len(lit2.losses) == 3 and all(map(math.isfinite, lit2.losses)), lit2.losses
    assert autoprec.applied_formats(lit2.model)[PLANT_LAYER] is Format.FP32
    assert [e.fqn for e in callback2.guard.events] == [PLANT_LAYER]
    # the premise: the planted weight did come back (in fp16 its outputs would overflow)
    assert lit2.model.get_submodule(PLANT_LAYER).weight.abs().max() > 1e4
    assert autoprec.load_policy(tmp_path / "resumed" / "autoprec.amended.yaml") \
        .format_for(PLANT_LAYER) is Format.FP32


def test_policy_applied_after_configure_model_and_before_the_optimizer(tmp_path):
    # The LightningModule builds its Llama in configure_model (Lightning's place for large
    # models); the policy's fp8 MLP goes to torchao's Float8Linear, which must be in place
    # before configure_optimizers and the strategy see the model.
    pytest.importorskip("torchao")
    policy = Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8", "lm_head": "fp32"},
                    engine="torchao")
    seen = {}

    class LitLlama(L.LightningModule):
        def configure_model(self):
            if not hasattr(self, "model"):
                self.model = tiny_llama().train()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            seen["swapped"] = type(self.model.model.layers[0].mlp.up_proj).__name__
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    lit = LitLlama()
    trainer = L.Trainer(max_steps=2, precision="32-true", accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[AutoprecCallback(policy, module="model")])
    loader = torch.utils.data.DataLoader(byte_batches(2, 2, 32, seed=3), batch_size=None)
    trainer.fit(lit, loader)
    assert seen["swapped"] == "Float8Linear"
    assert "configure_model" not in lit.__dict__  # the callback's wrapper is gone after fit


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_precisions_that_cast_the_parameters_are_refused_in_one_line(tmp_path, precision):
    lit = train_lightning.lit_module(tiny_gpt2())
    trainer = L.Trainer(max_steps=1, precision=precision, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=str(tmp_path), callbacks=[AutoprecCallback(POLICY)])
    with pytest.raises(PolicyError, match="precision='32-true'") as info:
        trainer.fit(lit, torch.utils.data.DataLoader(byte_batches(1, 2, 32), batch_size=None))
    assert precision in str(info.value) and "\n" not in str(info.value)


def test_a_module_the_policy_does_not_fit_is_named_in_one_line(tmp_path):
    batches = torch.utils.data.DataLoader(byte_batches(1, 2, 32), batch_size=None)
    for kwargs, expect in (({"module": "net"}, "has no submodule `net` (its children: model)"),
                           ({}, "match no module of LitCausalLM nor of any of its children")):
        lit = train_lightning.lit_module(tiny_gpt2())
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            default_root_dir=str(tmp_path),
                            callbacks=[AutoprecCallback(
                                POLICY.with_layers({"encoder.layer.0": "fp32"}), **kwargs)])
        with pytest.raises(PolicyError, match=re.escape(expect)) as info:
            trainer.fit(lit, batches)
        assert "\n" not in str(info.value)


def test_import_autoprec_does_not_load_lightning_and_its_absence_is_one_line():
    code = ("import sys, autoprec, autoprec.integrations\n"
            "print('lightning' in sys.modules)\n"
            "sys.modules['lightning'] = sys.modules['lightning.pytorch'] = None\n"
            "import autoprec.lightning\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "ImportError: autoprec.lightning needs Lightning, which is not installed: pip "
        "install lightning"), out.stderr[-2000:]
