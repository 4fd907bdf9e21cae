"""torchtitan 0.3 with a policy (autoprec.torchtitan), on CPU as torchtitan's own unit tests run
it (its trainer needs CUDA): the converted config tree, names matched without substring traps,
torchtitan's command line, a plain training loop with every layer in its format, FSDP2 on 2
gloo ranks with torchtitan's BF16 parameters (fp32 layers gathered and computed in fp32),
the start-up refusals, and a tune of a model from torchtitan's registry."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import autoprec
from autoprec import Format, Policy, PolicyError
from autoprec.torchtitan import (
    AutoprecTrainer,
    PolicyConverter,
    build_model,
    fp8_linears,
    policy_spec,
    with_policy,
)
from torchtitan.components.quantization import Float8Linear
from torchtitan.components.quantization.utils import module_filter_fn
from torchtitan.config import CompileConfig, ConfigManager, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.linear import Linear
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8, ROWWISE = Format.parse("fp8"), Format.parse("fp8:rowwise")
# torchtitan's llama3 debug model: 6 blocks, dim 256, vocab 2048
POLICY = Policy(default="bf16", layers={
    "layers.1.feed_forward.*": "fp8",           # tensorwise
    "layers.*.attention.wo": "fp8:rowwise",
    "layers.2.feed_forward.w2": "fp32",         # inside a block torchtitan gathers in bf16
    "lm_head": "fp32",                          # called by torchtitan's loss, outside forward
})
FP8_LAYERS = {"layers.1.feed_forward.w1": FP8, "layers.1.feed_forward.w2": FP8,
              "layers.1.feed_forward.w3": FP8,
              **{f"layers.{i}.attention.wo": ROWWISE for i in range(6)}}
FP32_LAYERS = ("layers.2.feed_forward.w2", "lm_head")
BF16_LAYERS = ("layers.0.feed_forward.w1", "layers.2.feed_forward.w1",
               "layers.3.attention.qkv_linear.wqkv")


def _cpu_attention(model_config):
    # torchtitan's flex/varlen attention needs its trainer's masks and compile; causal SDPA
    # holds no parameters either (what autoprec.torchtitan.build_model does for tuning)
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return model_config


def _no_parallelism(model, **_):
    return model


def _torchao_config(fmt: Format):
    from torchao.float8 import Float8LinearConfig

    # this CPU has no FP8 kernels: torchao emulates, the recipe otherwise as torchao names it
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(fmt.numerics.torchao_recipe),
                               emulate=True)


def _write(tmp_path, policy: Policy, name: str = "policy.yaml") -> str:
    path = tmp_path / name
    policy.save(path)
    return str(path)


# ---------------------------------------------------------------------------- the config tree
def test_config_tree_holds_float8linear_with_its_recipe_exactly_where_the_policy_says_fp8():
    spec = model_registry("debugmodel")
    plain = copy.deepcopy(spec.model)
    converted = policy_spec(spec, POLICY).model
    assert spec.model.to_dict() == plain.to_dict()  # the spec handed in is left as it was
    linears = {fqn: c for fqn, c, _, _ in converted.traverse(Linear.Config)}
    float8 = {fqn: c for fqn, c in linears.items() if isinstance(c, Float8Linear.Config)}
    assert set(float8) == set(FP8_LAYERS)
    for fqn, config in float8.items():
        assert config._torchao_config == _torchao_config(FP8_LAYERS[fqn]), fqn
    # every other Linear stays torchtitan's Linear.Config, and nothing else in the tree
    # changed: a Float8Linear.Config writes the same fields as the Linear.Config it replaced
    assert all(type(c) is Linear.Config for f, c in linears.items() if f not in float8)
    assert converted.to_dict() == plain.to_dict()
    # the converter is torchtitan's own kind, usable in model_registry(converters=[...])


def test_converter_in_torchtitans_model_registry(tmp_path):
    path = _write(tmp_path, POLICY)
    spec = model_registry("debugmodel", converters=[PolicyConverter.Config(policy=path)])
    float8 = {f for f, c, _, _ in spec.model.traverse(Linear.Config)
              if isinstance(c, Float8Linear.Config)}
    assert float8 == set(FP8_LAYERS)


def test_layers_1_and_layers_10_get_their_own_formats_never_a_substring_match():
    config = model_registry("debugmodel").model
    config.layers = [copy.deepcopy(config.layers[i % 6]) for i in range(12)]
    policy = Policy(default="bf16", layers={"layers.1.feed_forward.w1": "fp8",
                                            "layers.10.feed_forward.w1": "fp8:rowwise",
                                            "layers.1?.feed_forward.w3": "fp8"})
    assert fp8_linears(policy, config) == {
        "layers.1.feed_forward.w1": FP8, "layers.10.feed_forward.w1": ROWWISE,
        "layers.10.feed_forward.w3": FP8, "layers.11.feed_forward.w3": FP8}
    # the trap this avoids: torchtitan's filter_fqns is a substring match, so excluding
    # `layers.1` excludes `layers.10` too
    w1 = config.layers[10].feed_forward.w1
    assert not module_filter_fn(w1, "layers.10.feed_forward.w1", filter_fqns=["layers.1"])


def test_engine_autoprec_builds_no_float8linear():
    policy = dataclasses.replace(POLICY, engine="autoprec")
    assert fp8_linears(policy, model_registry("debugmodel").model) == {}


# ---------------------------------------------------------------------------- command line
def test_torchtitans_command_line_takes_the_policy(tmp_path):
    path = _write(tmp_path, POLICY)
    config = ConfigManager().parse_args(["--module", "autoprec.torchtitan", "--config",
                                         "llama3_debugmodel", "--autoprec.policy", path,
                                         "--training.steps", "3"])
    assert isinstance(config, AutoprecTrainer.Config) and type(config)._owner is AutoprecTrainer
    assert config.autoprec.policy == path and config.autoprec.strict
    assert config.training.steps == 3
    ours, theirs = config.to_dict(), llama3_debugmodel().to_dict()
    assert ours.pop("autoprec") == {"policy": path, "strict": True}
    # the model config is converted when the trainer starts, not before
    assert not any(isinstance(c, Float8Linear.Config)
                   for _, c, _, _ in config.model_spec.model.traverse(Linear.Config))
    assert ours.pop("model_spec")["flavor"] == theirs.pop("model_spec")["flavor"] == "debugmodel"
    theirs["training"]["steps"] = 3
    assert ours == theirs
    # a user's own config function: with_policy(config) adds the section
    assert with_policy(llama3_debugmodel(), path).autoprec.policy == path


def test_an_unknown_config_name_is_torchtitans_one_line_error():
    with pytest.raises(ValueError, match="Config function 'llama3_nope' not found"):
        ConfigManager().parse_args(["--module", "autoprec.torchtitan", "--config", "llama3_nope"])


def test_bad_policies_are_refused_in_one_line(tmp_path):
    spec = model_registry("debugmodel")
    with pytest.raises(PolicyError) as e:
        policy_spec(spec, str(tmp_path / "missing.yaml"))
    assert "missing.yaml" in str(e.value) and "\n" not in str(e.value)
    path = tmp_path / "phased.yaml"
    path.write_text("autoprec: 3\ndefault: bf16\nlayers: {lm_head: fp8}\n"
                    "phases: [{from_step: 5, formats: {fp8: bf16}}]\n")
    with pytest.raises(PolicyError, match="has phases, which torchtitan cannot follow") as e:
        policy_spec(spec, path)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- plain loop
def _plain_model(policy: Policy, param: str = "float32"):
    spec = dataclasses.replace(model_registry("debugmodel"), parallelize_fn=_no_parallelism)
    spec = policy_spec(spec, policy)
    _cpu_attention(spec.model)
    with torch.device("meta"):
        model = spec.model.build()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    model = spec.parallelize_fn(model, parallel_dims=dims,
                                training=TrainingConfig(mixed_precision_param=param),
                                parallelism=ParallelismConfig())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _check_formats(probe, fqns_fp8, fqns_bf16, fqns_fp32) -> None:
    for fqn in fqns_fp8:
        assert probe.fp8_casts.get(fqn, 0) >= 2, f"{fqn} is fp8 but cast nothing to FP8"
    for fqn in fqns_bf16:
        assert probe.matmul_dtypes(fqn) == {torch.bfloat16}, (fqn, probe.matmul_dtypes(fqn))
        assert probe.fp8_casts.get(fqn, 0) == 0, fqn
    for fqn in fqns_fp32:
        assert probe.matmul_dtypes(fqn) == {torch.float32}, (fqn, probe.matmul_dtypes(fqn))


def test_a_plain_loop_trains_with_every_layer_in_its_format():
    from conftest import ComputeProbe

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # built on meta: nothing is said about emulation yet
        model = _plain_model(POLICY)
    assert all(isinstance(model.get_submodule(f), Float8Linear) for f in FP8_LAYERS)
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(4):
        with ComputeProbe(model) as probe, warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                     tokens[:, 1:].flatten())
        emulated = [w for w in said if "can only emulate" in str(w.message)]
        assert len(emulated) == (1 if step == 0 else 0), [str(w.message) for w in said]
        _check_formats(probe, FP8_LAYERS, BF16_LAYERS, FP32_LAYERS)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_lm_head_keeps_its_format_when_torchtitans_loss_calls_it():
    from conftest import ComputeProbe

    model = _plain_model(POLICY)
    model._skip_lm_head = True  # what the trainer sets for its ChunkedLossWrapper
    tokens = torch.randint(0, 2048, (2, 64))
    with ComputeProbe(model) as probe:
        hidden = model(tokens)
        model.lm_head(hidden)  # outside the model's forward, as the wrapper calls it
    assert probe.matmul_dtypes("lm_head") == {torch.float32}
    bf16 = _plain_model(POLICY.with_layers({"lm_head": "bf16"}))
    bf16._skip_lm_head = True
    with ComputeProbe(bf16) as probe:
        bf16.lm_head(bf16(tokens))
    assert probe.matmul_dtypes("lm_head") == {torch.bfloat16}


def test_a_float8linear_torchtitan_built_runs_as_linear_when_a_reapply_demotes_it():
    from conftest import ComputeProbe

    model = _plain_model(POLICY)
    w1 = model.get_submodule("layers.1.feed_forward.w1")
    demoted = POLICY.with_layers({"layers.1.feed_forward.w1": "bf16"})
    autoprec.apply(model, demoted, standalone=("lm_head",))  # what a guard's demotion does
    tokens = torch.randint(0, 2048, (2, 64))
    with ComputeProbe(model) as probe, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(tokens)
    assert isinstance(w1, Float8Linear) and model.get_submodule("layers.1.feed_forward.w1") is w1
    _check_formats(probe, ["layers.1.feed_forward.w2"], ["layers.1.feed_forward.w1"], ["lm_head"])
    autoprec.apply(model, POLICY)  # back in its recipe
    with ComputeProbe(model) as probe:
        model(tokens)
    _check_formats(probe, ["layers.1.feed_forward.w1"], [], ["lm_head"])
    autoprec.remove(model)  # its own forward again: torchao's
    assert "forward" not in w1.__dict__


# ---------------------------------------------------------------------------- refusals
def _refusal(spec, policy: Policy, tp: int = 1) -> str:
    """The one-line PolicyError torchtitan's parallelize step with ``policy`` stops at, on the
    meta model, under its default BF16 parameters."""
    spec = policy_spec(dataclasses.replace(spec, parallelize_fn=_no_parallelism), policy)
    with torch.device("meta"):
        model = spec.model.build()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, world_size=tp)
    with pytest.raises(PolicyError) as e:
        spec.parallelize_fn(model, parallel_dims=dims, training=TrainingConfig(),
                            parallelism=ParallelismConfig())
    # fp32 parameters everywhere: nothing to refuse
    spec.parallelize_fn(model, parallel_dims=dims,
                        training=TrainingConfig(mixed_precision_param="float32"),
                        parallelism=ParallelismConfig())
    return str(e.value)


def test_fp32_layers_under_bf16_params_with_tensor_parallel_are_refused_at_start_up():
    msg = _refusal(model_registry("debugmodel"), POLICY, tp=2)
    assert "`layers.2.feed_forward.w2` is fp32" in msg and "\n" not in msg
    assert "--training.mixed_precision_param float32" in msg


def test_an_fp32_lm_head_tied_to_bf16_embeddings_is_refused_at_start_up():
    # torchtitan's 1B flavor ties lm_head to tok_embeddings (one block kept: built on meta only)
    spec = model_registry("1B")
    spec.model.layers = spec.model.layers[:1]
    msg = _refusal(spec, Policy(default="bf16", layers={"lm_head": "fp32"}))
    assert "`lm_head` is fp32 under the policy but shares its weight with `tok_embeddings`" in msg
    assert "\n" not in msg


def test_pipeline_parallel_is_refused_at_start_up():
    spec = policy_spec(dataclasses.replace(model_registry("debugmodel"),
                                           parallelize_fn=_no_parallelism), POLICY)
    with torch.device("meta"):
        model = spec.model.build()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, world_size=2)
    with pytest.raises(PolicyError, match="pipeline_parallel_degree 1") as e:
        spec.parallelize_fn(model, parallel_dims=dims,
                            training=TrainingConfig(mixed_precision_param="float32"),
                            parallelism=ParallelismConfig())
    assert "\n" not in str(e.value) and autoprec.applied_formats(model) == {}


# ---------------------------------------------------------------------------- FSDP2, 2 ranks
def _sharded_run(rank: int) -> dict:
    from conftest import ComputeProbe
    from torch.distributed.fsdp import FSDPModule

    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.trainer import Trainer

    parallel_dims.device_type = "cpu"  # torchtitan assumes CUDA where no accelerator is found
    spec = policy_spec(model_registry("debugmodel"), POLICY)  # torchtitan's parallelize_llama
    _cpu_attention(spec.model)
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    training = TrainingConfig()  # torchtitan's default: FSDP2 gathers parameters in bf16
    spec.model.update_from_config(config=Trainer.Config(model_spec=spec, training=training,
                                                        parallelism=parallelism))
    with torch.device("meta"):
        model = spec.model.build()
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    model = spec.parallelize_fn(model, parallel_dims=dims, training=training,
                                parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                                dump_folder="")
    for module in model.modules():
        if isinstance(module, FSDPModule):  # gloo has no PREMUL_SUM: the same sum, unscaled
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(
        global_vocab_size=2048)).build()
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    gathered = {}
    for fqn in (*FP32_LAYERS, *BF16_LAYERS):
        model.get_submodule(fqn).register_forward_pre_hook(
            lambda m, args, fqn=fqn: gathered.__setitem__(fqn, str(m.weight.dtype)))
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(rank))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model.layers["2"].feed_forward.w2.weight.full_tensor().clone()
    out = {"losses": []}
    for _ in range(2):
        with ComputeProbe(model) as probe:
            loss, _ = loss_fn(model(tokens[:, :-1]), tokens[:, 1:],
                              global_valid_tokens=torch.tensor(tokens[:, 1:].numel()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    _check_formats(probe, FP8_LAYERS, BF16_LAYERS, FP32_LAYERS)
    after = model.layers["2"].feed_forward.w2.weight.full_tensor()
    out.update(gathered=gathered, moved=float((after - before).abs().max()),
               units=sorted(f for f, m in model.named_modules() if isinstance(m, FSDPModule)))
    return out


def _worker(rank: int, world: int, port: int, out_dir: str, cases: list) -> None:
    from test_fsdp import _init, _save_results, _teardown

    _init(rank, world, port)
    warnings.filterwarnings("ignore")
    results = _sharded_run(rank)
    dist.barrier()
    _save_results(results, out_dir, rank)
    _teardown(rank)


@pytest.mark.slow
def test_fsdp2_with_bf16_params_gathers_and_computes_fp32_layers_in_fp32(tmp_path):
    from test_fsdp import run_ranks

    runs = run_ranks(tmp_path, [], worker=_worker)
    for rank, r in enumerate(runs):
        # (the formats are checked in each rank's last step: _check_formats raised otherwise)
        assert r["gathered"] == {**{f: "torch.float32" for f in FP32_LAYERS},
                                 **{f: "torch.bfloat16" for f in BF16_LAYERS}}, (rank, r)
        # the fp32 layers are FSDP2 units of their own; the rest of their block is one unit
        assert {"lm_head", "layers.2.feed_forward.w2", "layers.2", "norm"} <= set(r["units"])
        assert r["moved"] > 0 and all(map(lambda x: x == x, r["losses"])), r
    assert runs[0]["losses"] != runs[1]["losses"]  # each rank its own tokens


# ---------------------------------------------------------------------------- tuning
def test_build_model_is_the_trainers_model_for_the_policy():
    model = build_model("llama3", "debugmodel")
    spec = policy_spec(dataclasses.replace(model_registry("debugmodel"),
                                           parallelize_fn=_no_parallelism), POLICY)
    with torch.device("meta"):
        built = spec.model.build()  # Float8Linear where the policy says fp8
    names = lambda m: [n for n, p in m.named_parameters()]  # noqa: E731
    assert names(model) == names(built)
    assert autoprec.model_fingerprint(model) == autoprec.model_fingerprint(built)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    short = build_model("llama3", "debugmodel", n_layers=2)
    assert list(short.layers) == ["0", "1"] and names(short) == [
        n for n in names(model) if not n.startswith("layers.") or n.split(".")[1] in "01"]
    with pytest.raises(PolicyError, match="torchtitan has no model 'nope'"):
        build_model("nope")


def _expect(probe, model, policy: Policy) -> int:
    """Check that every Linear computes in the policy's format; returns how many are fp8."""
    fp8, low = [], {Format.BF16: [], Format.FP32: []}
    for fqn, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            fmt = policy.format_for(fqn)
            (fp8 if fmt.is_scaled else low[fmt]).append(fqn)
    _check_formats(probe, fp8, low[Format.BF16], low[Format.FP32])
    return len(fp8)


@pytest.mark.slow
def test_tune_a_torchtitan_model_then_train_it_with_the_policy(tmp_path):
    from conftest import ComputeProbe

    out = tmp_path / "titan.yaml"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "autoprec.cli", "tune",
                        "examples/torchtitan_llama3.py:task", "-o", str(out), "--target", "h100",
                        "--formats", "fp32", "bf16", "fp8", "--n-trials", "8", "--seed", "1"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    tuned = autoprec.load_policy(out)
    assert tuned.model_name == "Llama3Model" and "torchtitan-llama3-debugmodel" in r.stderr + r.stdout
    # strict: the fingerprint (made on build_model's model) and every pattern hold on the
    # model torchtitan builds from the converted config, Float8Linear layers included
    model = _plain_model(tuned)
    converted = fp8_linears(tuned, model_registry("debugmodel").model)
    assert {f for f, m in model.named_modules() if isinstance(m, Float8Linear)} == set(converted)
    tokens = torch.randint(0, 2048, (2, 33))
    with ComputeProbe(model) as probe, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten())
    assert _expect(probe, model, tuned) == len(converted)
    loss.backward()
    assert torch.isfinite(loss)


def test_fp16_layers_are_refused_torchtitan_scales_no_loss():
    with pytest.raises(PolicyError, match="torchtitan's trainer scales no loss") as e:
        policy_spec(model_registry("debugmodel"), POLICY.with_layers({"lm_head": "fp16"}))
    assert "--formats fp32 bf16 fp8" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------- Blackwell formats
def test_blackwell_formats_become_torchtitans_mxfp8_and_nvfp4_linears_only_on_blackwell(
        monkeypatch):
    """On a Blackwell GPU an mxfp8 Linear is torchtitan's MXFP8Linear.Config and an nvfp4 one
    its NVFP4Linear.Config (the recipes they compute); mxfp8:gw_hp and nvfp4:plain, which they
    cannot say, and every block format off Blackwell stay Linear.Config for autoprec's
    regions (emulated here)."""
    from torchtitan.components.quantization import MXFP8Linear, NVFP4Linear

    import autoprec.torchtitan as titan

    policy = Policy(default="bf16", layers={"layers.0.feed_forward.w1": "mxfp8",
                                            "layers.0.feed_forward.w3": "mxfp8:gw_hp",
                                            "layers.1.feed_forward.*": "nvfp4",
                                            "layers.2.feed_forward.w1": "nvfp4:plain"})
    here = {fqn: type(c) for fqn, c, _, _ in
            policy_spec(model_registry("debugmodel"), policy).model.traverse(Linear.Config)}
    assert set(here.values()) == {Linear.Config}
    monkeypatch.setattr(titan, "blackwell", lambda device: True)
    spec = model_registry("debugmodel")
    built = {fqn: type(c) for fqn, c, _, _ in policy_spec(spec, policy).model.traverse(
        Linear.Config)}
    assert built["layers.0.feed_forward.w1"] is MXFP8Linear.Config
    assert built["layers.0.feed_forward.w3"] is Linear.Config
    sizes = {fqn: (c.in_features, c.out_features)
             for fqn, c, _, _ in spec.model.traverse(Linear.Config)}
    for name in ("w1", "w2", "w3"):  # NVFP4's kernels take multiples of 128 only
        fqn = f"layers.1.feed_forward.{name}"
        fits = not (sizes[fqn][0] % 128 or sizes[fqn][1] % 128)
        assert built[fqn] is (NVFP4Linear.Config if fits else Linear.Config), fqn
    assert built["layers.2.feed_forward.w1"] is Linear.Config
    assert NVFP4Linear.Config in built.values()


# ---------------------------------------------------------------------------- start-up in one line
@pytest.mark.slow
@pytest.mark.parametrize("case", ["phases", "fp16", "missing"])
def test_torchtitans_trainer_refuses_a_bad_policy_in_one_line(tmp_path, case):
    """torchtitan's train.py re-raises what stops its trainer: a policy refused at start-up
    ends in autoprec's one line, not ~20 lines of traceback before it."""
    policy = tmp_path / f"{case}.yaml"
    if case == "phases":
        policy.write_text("autoprec: 3\ndefault: bf16\nlayers: {lm_head: fp8}\n"
                          "phases: [{from_step: 5, formats: {fp8: bf16}}]\n")
    elif case == "fp16":
        policy.write_text("autoprec: 2\ndefault: bf16\nlayers: {lm_head: fp16}\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "torchtitan.train", "--module", "autoprec.torchtitan",
                        "--config", "llama3_debugmodel", "--autoprec.policy", str(policy),
                        "--dump-folder", str(tmp_path / "out")], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    ours = [line for line in r.stderr.splitlines() if line.startswith("autoprec: error: ")]
    assert len(ours) == 1 and f"{case}.yaml" in ours[0], r.stderr[-3000:]
    assert {"phases": "has phases", "fp16": "scales no loss", "missing": "does not exist"}[case] \
        in ours[0] or case == "missing", ours[0]
