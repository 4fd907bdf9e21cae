"""Export a policy to another training stack: torchao's float8 training, Megatron-Core's
``--te-precision-config-file``, or a plain JSON map of module name -> format.

    exported = autoprec.export("policies/llama.yaml", "torchao", model=model)
    exported.convert(model)              # torchao: each fp8 nn.Linear gets its recipe
    print(exported.text)                 # what `autoprec export ... --to torchao` writes

A target expresses less than a policy does, and an export never pretends otherwise: what a
target cannot express is an :class:`ExportError` that names the layer and the fix, or, with
``strict=False``, a note (``Exported.notes``) saying what the target will run instead. Given a
model, patterns are resolved to its concrete module names (a model built on the ``meta`` device
is enough: only names, classes and weight shapes are read, see :func:`structure_of`).

**torchao.** One ``convert_to_float8_training(model, config=Float8LinearConfig
.from_recipe_name(recipe), module_filter_fn=...)`` per recipe the policy uses; the filters select
what :meth:`Policy.module_filter_fn` selects (the layers ``apply`` gives torchao). Checked in
torchao 0.18: its fqn -> config mapping, ``torchao.quantization.FqnToConfig`` (alias
``ModuleFqnToConfig``), is applied by ``quantize_`` and takes ``AOBaseConfig`` values only;
``Float8LinearConfig`` (the training config) is not one, so it cannot carry float8 *training*
recipes. The one float8 training config ``quantize_`` accepts is a prototype,
``torchao.prototype.moe_training.Float8TrainingOpConfig(float8_linear_recipe=...)`` (it wraps
parameters in a tensor subclass, aimed at MoE grouped GEMMs); hence one filter per recipe,
torchao's stable API. torchao sets the format of the fp8 layers only: everything else
runs in the training loop's own precision (one format: autocast or none), so a policy whose
other layers are in more than one format, or whose fp8 layers are not ``nn.Linear`` (HF
``Conv1D``, attention matmuls), cannot be expressed exactly.

**Megatron-Core.** ``megatron/core/extensions/TransformerEngineMixedPrecision.md``: a YAML file
with ``configs`` (name -> ``{transformer_engine_config_type: TEQuantizationParams,
training_recipe: {...}}``) and ordered ``matchers`` (name -> ``{config, type: glob, pattern,
enabled}``; the first enabled matcher whose ``fnmatch`` pattern matches a module path picks
the config). It chooses, per Transformer Engine linear, an FP8 recipe (``tensorwise``,
``blockwise``, ``mxfp8``) or BF16 (``training_recipe: {}``). So: ``fp8:tensorwise`` ->
``tensorwise`` with the ``hybrid`` format (E4M3 forward, E5M2 gradients: autoprec's and
torchao's tensorwise); ``bf16`` -> ``{}``; torchao's rowwise recipes have no Transformer Engine
counterpart (an error); fp32 and fp16 layers are not per-layer choices in Megatron (an error,
or bf16 with a note). Module names are Megatron's own (``decoder.layers.3.mlp.linear_fc1``),
mapped from HF names by :data:`MEGATRON_NAMES` (Llama-family and GPT-2) or a user's map; q/k/v
(and gate/up) are one fused GEMM there, so they must share a format.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import yaml
from torch import nn

from autoprec._util import atomic_write, escape_line
from autoprec.formats import FP4_E2M1, Format, Support
from autoprec.host import supported_formats
from autoprec.policy import Policy, PolicyError, load_policy
from autoprec.runtime.calls import class_kind, layer_kind
from autoprec.runtime.engines import blackwell, mxfp8_config
from autoprec.scaling import shape_multiple

__all__ = [
    "ExportError",
    "Exported",
    "TorchaoRecipe",
    "TorchaoExport",
    "export",
    "structure_of",
    "load_name_map",
]

TARGETS = ("torchao", "megatron", "fqn")

# HF module name (regex, full match) -> Megatron-Core GPTModel module path (a re.sub template),
# or None for a module Megatron has but its precision file cannot reach: the output layer is
# tensor_parallel.ColumnParallelLinear and core attention TEDotProductAttention, neither a
# Transformer Engine linear, so they compute in the run's dtype (bf16 with --bf16).
MEGATRON_NAMES: tuple[tuple[str, str | None], ...] = (
    # HF Llama / Mistral / Qwen2 naming
    (r"model\.layers\.(\d+)\.self_attn\.[qkv]_proj", r"decoder.layers.\1.self_attention.linear_qkv"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj", r"decoder.layers.\1.self_attention.linear_proj"),
    (r"model\.layers\.(\d+)\.mlp\.(?:gate|up)_proj", r"decoder.layers.\1.mlp.linear_fc1"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj", r"decoder.layers.\1.mlp.linear_fc2"),
    (r"model\.layers\.\d+\.self_attn", None),
    # HF GPT-2 naming
    (r"transformer\.h\.(\d+)\.attn\.c_attn", r"decoder.layers.\1.self_attention.linear_qkv"),
    (r"transformer\.h\.(\d+)\.attn\.c_proj", r"decoder.layers.\1.self_attention.linear_proj"),
    (r"transformer\.h\.(\d+)\.mlp\.c_fc", r"decoder.layers.\1.mlp.linear_fc1"),
    (r"transformer\.h\.(\d+)\.mlp\.c_proj", r"decoder.layers.\1.mlp.linear_fc2"),
    (r"transformer\.h\.\d+\.attn", None),
    (r"lm_head", None),
)

# A format's Megatron-Core Fp8Recipe (megatron/core/enums.py: delayed, tensorwise, blockwise,
# mxfp8, custom) is its Numerics.megatron_recipe: only tensorwise computes the same as one of
# autoprec's (dynamic per-tensor scales, Transformer Engine's Float8CurrentScaling).


class ExportError(PolicyError):
    """A policy that the export target cannot express as written; the message says the fix."""


@dataclass(frozen=True)
class _Layer:
    """A module whose format the export speaks about."""

    fqn: str
    # "linear" (nn.Linear, HF Conv1D), "conv" or "attention" (matmuls in its own forward)
    kind: str
    module: nn.Module = field(compare=False, repr=False)
    # The policy's format, and what autoprec computes it in (fp8 that the FP8 kernels cannot
    # take runs in bf16)
    fmt: Format = Format.BF16
    runs: Format = Format.BF16

    @property
    def what(self) -> str:
        return f"`{self.fqn}` ({type(self.module).__name__})"


@dataclass(frozen=True)
class Exported:
    """A policy in another stack's terms."""

    target: str
    # fqn: the JSON document; megatron: the YAML document; torchao: recipe -> fqns (None
    # without a model)
    data: Any
    # What `autoprec export` writes; None where the target needs a model to name layers.
    text: str | None
    # What the target runs differently from the policy (strict=False), and how to run it.
    notes: tuple[str, ...] = ()

    def save(self, path: str | os.PathLike) -> str:
        if self.text is None:
            raise ExportError(f"The {self.target} export names concrete layers: export with a "
                              "model (--model TASK_SPEC) to write it.")
        return atomic_write(path, self.text)


@dataclass(frozen=True)
class TorchaoRecipe:
    """One ``convert_to_float8_training`` call: a torchao recipe and the layers it converts."""

    recipe: str
    # The layers, when the export had a model; None: the filter decides by the policy's patterns
    fqns: tuple[str, ...] | None
    module_filter_fn: Callable[[nn.Module, str], bool] = field(compare=False, repr=False)

    @property
    def mx(self) -> bool:
        """An MXFP8 recipe (torchao's ``MXFP8TrainingRecipe``), applied by ``quantize_``."""
        return _torchao_format(self.recipe).numerics.is_block_scaled

    def config(self, *, emulate: bool = False):
        """torchao's ``Float8LinearConfig.from_recipe_name(recipe)`` (``emulate=True`` where the
        device has no FP8 kernels), or for an MXFP8 recipe
        ``MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(recipe))`` (``emulate``:
        torchao's emulated kernels, ``KernelPreference.EMULATED``)."""
        if self.mx:
            return mxfp8_config(self.recipe, emulate=emulate)
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        return replace(config, emulate=True) if emulate else config


@dataclass(frozen=True)
class TorchaoExport(Exported):
    """The torchao export: one conversion per recipe; the rest runs in ``rest``."""

    recipes: tuple[TorchaoRecipe, ...] = ()
    # The format every layer torchao does not convert runs in (the training loop's).
    rest: Format = Format.BF16

    def convert(self, model: nn.Module, *, emulate: bool | None = None) -> nn.Module:
        """Convert ``model`` in place as the export says (``emulate`` None: emulate the
        recipes this model's device has no kernels for, as ``apply`` does)."""
        from torchao.float8 import convert_to_float8_training
        from torchao.quantization import quantize_

        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        for r in self.recipes:
            fmt = _torchao_format(r.recipe)
            native = blackwell(device) if r.mx else \
                supported_formats(device)[fmt] is Support.NATIVE
            config = r.config(emulate=emulate if emulate is not None else not native)
            if r.mx:  # torchao's MXFP8 training config for nn.Linear goes through quantize_
                quantize_(model, config, filter_fn=r.module_filter_fn)
            else:
                convert_to_float8_training(model, config=config,
                                           module_filter_fn=r.module_filter_fn)
        return model


def export(policy: Policy | str | os.PathLike, to: str, *, model: nn.Module | None = None,
           strict: bool = True, names: Mapping[str, str | None] | None = None,
           phase: int | None = None) -> Exported:
    """Express ``policy`` for the stack ``to``.

    A policy with phases: the fqn export lists each phase's layers with where it starts;
    torchao's and Megatron's configurations hold one precision per layer for the whole run,
    so they take one phase (``phase``) and refuse the whole policy.

    Args:
        policy: a :class:`~autoprec.policy.Policy` or a path to a policy YAML file.
        to: the stack, one of :data:`TARGETS` (``"torchao"``, ``"megatron"``, ``"fqn"``).
        model: resolves patterns to its module names (megatron and fqn need it).
        strict: ``strict=False`` turns what the target cannot express exactly into notes
            instead of errors.
        names: (megatron only) HF-name regex -> Megatron module path template, tried before
            :data:`MEGATRON_NAMES`.
        phase: the one phase to export (0 is the first).

    Returns:
        An ``Exported``: the target, its ``data``, the ``text`` ``autoprec export`` writes
        (``save(path)`` writes it) and the ``notes`` on what the target runs differently.

    Raises:
        ExportError: a ``PolicyError`` for what the target cannot express as written (an
            unknown target, a missing model, a policy with phases and no ``phase``); the
            message says the fix.
    """
    if not isinstance(policy, Policy):
        policy = load_policy(policy)
    if to not in TARGETS:
        raise ExportError(f"Unknown export target {to!r}; expected one of {', '.join(TARGETS)}.")
    policy = _one_phase(policy, to, phase)
    if names is not None and to != "megatron":
        raise ExportError(f"A module name map is for --to megatron only, not {to}.")
    if model is None and to != "torchao":
        raise ExportError(f"The {to} export names the model's modules: give the model "
                          "(--model TASK_SPEC; a model built on the meta device will do).")
    layers = None
    if model is not None:
        policy.check_model(model, strict=strict)
        layers = _layers(policy, model)
    if to == "torchao":
        return _torchao(policy, layers, strict)
    if to == "megatron":
        return _megatron(policy, layers, strict, _rules(names))
    return _fqn(policy, model, layers)


def _one_phase(policy: Policy, to: str, phase: int | None) -> Policy:
    """The policy to export: one phase of it when asked, the whole of it where ``to`` can
    express phases (fqn), else a refusal that says how to export one phase."""
    if phase is not None:
        if isinstance(phase, bool) or not isinstance(phase, int) or \
                not 0 <= phase <= len(policy.phases):
            raise ExportError(f"--phase {phase!r}: the policy has phases 0 to "
                              f"{len(policy.phases)} (0: from step 0).")
        return policy.phase(phase)
    if not policy.phases or to == "fqn":
        return policy
    first = policy.phases[0].describe()
    raise ExportError(
        f"The policy has {len(policy.phases)} later phase(s) (phase 1 {first}) and {to} sets "
        "each layer's precision once for the whole run (its modules are converted before "
        "training): export one phase with --phase N (0: from step 0), or train with autoprec's "
        "integrations, which switch at the step.")


def structure_of(task) -> nn.Module:
    """The task's model, or its factory's output built on the ``meta`` device: the names,
    classes and weight shapes an export reads, without memory for the weights."""
    if isinstance(task.model, nn.Module):
        return task.model
    from autoprec.runtime.engines import torchao_available

    torchao_available()  # transformers imports torchao as it builds a model: import it quietly
    with torch.device("meta"):
        model = task.model()
    if not isinstance(model, nn.Module):
        raise ExportError(f"The task's model factory returned {type(model).__name__}, not an "
                          "nn.Module.")
    return model


# ------------------------------------------------------------------ the model's layers
def _layers(policy: Policy, model: nn.Module) -> list[_Layer]:
    """The modules whose format a target could express: linear and conv layers, and attention
    cores (by layer_kind's class-name rule: they run matmuls in their own forward). A module
    of another class that runs matmuls itself cannot be told apart without running the model;
    it is not listed."""
    out = []
    for fqn, module in model.named_modules():
        kind = class_kind(module)
        # what the module would be if its own forward ran a matmul: attention by class name
        if fqn and kind not in ("linear", "conv") and \
                layer_kind(module, ("matmul",)) == "attention":
            kind = "attention"
        if not fqn or kind not in ("linear", "conv", "attention"):
            continue
        fmt = policy.format_for(fqn)
        out.append(_Layer(fqn, kind, module, fmt, _runs(module, kind, fmt)))
    return out


def _runs(module: nn.Module, kind: str, fmt: Format) -> Format:
    """What autoprec computes the module's own work in under ``fmt``."""
    if not fmt.is_scaled or kind == "attention":
        return fmt
    if kind == "linear":
        # the FP8 kernels take K and N in multiples of 16 (MX: 32); autoprec runs the rest in
        # bf16
        weight = getattr(module, "weight", None)
        ok = weight is not None and all(d % shape_multiple(fmt.numerics) == 0
                                        for d in weight.shape)
        return fmt if ok else Format.BF16
    return Format.BF16  # PyTorch has no FP8 convolution: autoprec runs it in bf16


def _problems(problems: list[str], strict: bool, fix: str) -> tuple[str, ...]:
    """Raise the first of ``problems`` (strict), or return them all as notes."""
    if problems and strict:
        more = f" (and {len(problems) - 1} more like it)" if len(problems) > 1 else ""
        raise ExportError(f"{problems[0]}{more}. {fix}")
    return tuple(problems)


# ------------------------------------------------------------------ torchao
def _torchao_format(recipe: str) -> Format:
    """The format torchao's recipe ``recipe`` computes (Numerics.torchao_recipe)."""
    return next(f for f in Format if f.numerics.torchao_recipe == recipe)


def _unnamed_recipes(policy: Policy) -> list[str]:
    """The policy's FP8 formats torchao has no recipe for, as problems."""
    named = ", ".join(f.numerics.torchao_recipe for f in Format if f.numerics.torchao_recipe)
    where = {"the policy's default": policy.default,
             **{f"layer pattern `{p}`": f for p, f in policy.layers.items()}}
    return [f"{what} is {f.label}, which torchao's float8 training has no recipe for (it has "
            f"{named})" for what, f in where.items()
            if f.is_scaled and f.numerics.torchao_recipe is None]


def _torchao(policy: Policy, layers: list[_Layer] | None, strict: bool) -> TorchaoExport:
    used = [f for f in [policy.default, *policy.layers.values()] if f.is_scaled]
    recipes = list(dict.fromkeys(f.numerics.torchao_recipe for f in used
                                 if f.numerics.torchao_recipe is not None))
    rest = _rest(policy, layers)
    problems = _unnamed_recipes(policy)
    unnamed = bool(problems)
    if layers is None:
        problems += [f"layer pattern `{p}` is {f.label}" for p, f in policy.layers.items()
                     if not f.is_scaled and f is not rest]
        out = tuple(TorchaoRecipe(r, None, policy.module_filter_fn(r)) for r in recipes)
        notes = ("without a model the filters select nn.Linear layers by the policy's patterns; "
                 "fp8 layers torchao cannot convert are not checked",)
    else:
        out, taken = [], set()
        for r in recipes:
            keep = policy.module_filter_fn(r)
            fqns = tuple(x.fqn for x in layers if keep(x.module, x.fqn))
            taken.update(fqns)
            out.append(TorchaoRecipe(r, fqns, lambda m, fqn, names=frozenset(fqns): fqn in names))
        out = tuple(r for r in out if r.fqns)
        for layer in layers:
            if layer.runs.is_scaled and layer.fqn not in taken and \
                    layer.runs.numerics.torchao_recipe is not None:
                problems.append(f"{layer.what} is {layer.runs.label}, but torchao's float8 "
                                f"training converts nn.Linear only: it would run in {rest}")
            elif not layer.runs.is_scaled and layer.runs is not rest:
                problems.append(f"{layer.what} is {layer.runs}, but torchao sets the format of "
                                f"fp8 layers only: it would run in {rest} with the rest")
        notes = ()
    fix = _TORCHAO_RECIPE_FIX if unnamed else \
        _TORCHAO_LINEAR_FIX if problems and "nn.Linear only" in problems[0] else _TORCHAO_FIX
    notes += _problems(problems, strict, fix.format(rest=rest))
    notes += (_rest_note(rest),)
    data = {r.recipe: None if r.fqns is None else list(r.fqns) for r in out}
    text = None if layers is None else _torchao_script(policy, out, rest, notes)
    return TorchaoExport("torchao", data, text, notes, recipes=out, rest=rest)


_TORCHAO_RECIPE_FIX = ("re-tune with formats torchao has (e.g. --formats {rest} fp8), or pass "
                       "strict=False (--no-strict) to export anyway with those layers in {rest}")
_TORCHAO_LINEAR_FIX = ("autoprec.apply runs such layers in FP8 on its own engine; or pass "
                       "strict=False (--no-strict) to export anyway with them in {rest}")
_TORCHAO_FIX = ("torchao's float8 training gives fp8 nn.Linear layers their recipe and leaves "
                "every other layer to the training loop's one precision: re-tune with fewer "
                "formats (e.g. --formats {rest} fp8), or pass strict=False (--no-strict) to "
                "export anyway with those layers in {rest}")


def _rest(policy: Policy, layers: list[_Layer] | None) -> Format:
    """The one format torchao's users train every unconverted layer in: the policy's default,
    or (an fp8 default) the format most of its other layers run in."""
    if not policy.default.is_scaled:
        return policy.default
    runs = [x.runs for x in layers] if layers is not None else list(policy.layers.values())
    counts = Counter(f for f in runs if not f.is_scaled)
    return counts.most_common(1)[0][0] if counts else Format.BF16


def _rest_note(rest: Format) -> str:
    if rest.autocast_dtype is None:
        how = f"without autocast ({rest})"
    else:
        how = f"under torch.autocast(dtype={rest.autocast_dtype})"
        if rest.needs_loss_scaling:
            how += " with a GradScaler (policy.grad_scaler())"
    return f"train with every layer torchao does not convert {how}"


def _torchao_script(policy: Policy, recipes: tuple[TorchaoRecipe, ...], rest: Format,
                    notes: tuple[str, ...]) -> str:
    layers = "".join(f"    {r.recipe!r}: [\n" + "".join(f"        {n!r},\n" for n in r.fqns)
                     + "    ],\n" for r in recipes)
    # user text (the policy's file name, module names in the notes) enters the script only as
    # repr() literals or escaped comment text: it can neither end a string nor start a line
    comments = "".join(f"# note: {escape_line(n)}\n" for n in notes)
    return f'''"""torchao float8 training exported by autoprec from the policy POLICY names.

Each fp8 layer gets its recipe: convert(model) runs convert_to_float8_training once per recipe
with a filter selecting exactly that recipe's layers. Layers not listed run in {rest}.
"""
{comments}
import dataclasses

from torchao.float8 import Float8LinearConfig, convert_to_float8_training

# The policy file this was exported from (None: a policy built in Python)
POLICY = {policy.source!r}

FP8_LAYERS = {{
{layers}}}


def convert(model, *, emulate=False):
    """Swap the listed nn.Linear layers for torchao's Float8Linear, each with its recipe, or
    give their weights torchao's MXFP8 training tensor (emulate=True where the device has no
    kernels for the recipe: FP8 before sm_89, MXFP8 before sm_100)."""
    present = {{fqn for fqn, _ in model.named_modules()}}
    for recipe, names in FP8_LAYERS.items():
        missing = sorted(set(names) - present)
        if missing:
            raise ValueError(f"the model has no module {{missing[0]}}: this conversion was "
                             "exported for another model")
        keep = frozenset(names)
        if recipe.startswith("mxfp8"):  # torchao's MXFP8 training config, via quantize_
            from torchao.prototype.moe_training.config import (
                MXFP8TrainingOpConfig, MXFP8TrainingRecipe)
            from torchao.quantization import quantize_
            from torchao.quantization.quantize_.common.kernel_preference import (
                KernelPreference)

            config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(recipe))
            if emulate:
                config = dataclasses.replace(config,
                                             kernel_preference=KernelPreference.EMULATED)
            quantize_(model, config, filter_fn=lambda m, fqn, keep=keep: fqn in keep)
            continue
        config = Float8LinearConfig.from_recipe_name(recipe)
        if emulate:
            config = dataclasses.replace(config, emulate=True)
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda m, fqn, keep=keep: fqn in keep)
    return model
'''


# ------------------------------------------------------------------ Megatron-Core
def _rules(names: Mapping[str, str | None] | None) -> list[tuple[Any, str | None]]:
    import regex  # a dependency of autoprec (and of transformers): matches with a deadline

    rules = []
    for pattern, template in [*(names or {}).items(), *MEGATRON_NAMES]:
        try:
            rules.append((regex.compile(pattern), template))
        except (regex.error, re.error) as e:
            raise ExportError(f"Name map key {pattern!r} is not a regular expression ({e}); "
                              "write a Python regex matching HF module names.") from None
    return rules


def _megatron_path(fqn: str, rules) -> tuple[bool, str | None]:
    for rx, template in rules:
        try:
            match = rx.fullmatch(fqn, timeout=NAME_MAP_MATCH_SECONDS)
        except TimeoutError:
            raise ExportError(
                f"Name map regex {rx.pattern!r} took over {NAME_MAP_MATCH_SECONDS:g} s to match "
                f"the module name {fqn!r}: it backtracks (nested or overlapping repeats such "
                "as `(a+)+`); write it without repeats inside repeats, e.g. `(\\d+)`.") from None
        if match:
            try:
                return True, None if template is None else match.expand(template)
            except (IndexError, re.error) as e:
                raise ExportError(f"Name map path {template!r} for {rx.pattern!r} refers to a "
                                  f"group the regex does not have ({e}).") from None
    return False, None


_MEGATRON_FIX = ("Megatron's precision file chooses bf16 or an FP8 recipe per Transformer "
                 "Engine linear layer only: re-tune with --formats bf16 fp8:tensorwise, or pass "
                 "strict=False (--no-strict) to export these layers as bf16")


def _megatron_config(fmt: Format, what: str) -> str:
    """The config name a format becomes (``fp8_<recipe>``, ``fp4_nvfp4``); an error for a
    scaled format Megatron does not have."""
    if fmt.is_scaled:
        if fmt.numerics.megatron_recipe is None:
            raise ExportError(
                f"{what} is {fmt.label}: Megatron-Core's FP8 recipes are tensorwise, blockwise "
                f"and mxfp8, its FP4 recipe nvfp4, and none computes {fmt.label} (Transformer "
                "Engine has no rowwise recipe; its precision file has no high-precision weight "
                "gradient and no NVFP4 without the Hadamard transform and stochastic "
                "rounding). Re-tune with --formats bf16 fp8:tensorwise mxfp8 nvfp4 to export to "
                "Megatron.")
        four = fmt.compute_dtype is FP4_E2M1
        return f"{'fp4' if four else 'fp8'}_{fmt.numerics.megatron_recipe}"
    return "bf16"


def _megatron_configs(names) -> dict[str, dict]:
    out = {}
    for name in names:
        recipe: dict[str, Any] = {}
        kind, _, which = name.partition("_")
        # override the non-quantized context so the layer is FP8 (FP4) even when the run has
        # no --fp8 (--fp4)
        if kind == "fp4":
            recipe = {"fp4_quantization_recipe": which, "override_nonquantized_autocast": True}
        elif kind == "fp8":
            # hybrid: E4M3 forward, E5M2 gradients (torchao's tensorwise); MXFP8 is E4M3
            # everywhere (Transformer Engine's MXFP8BlockScaling refuses E5M2)
            recipe = {"fp8_quantization_recipe": which,
                      "fp8_format": "e4m3" if which == "mxfp8" else "hybrid",
                      "override_nonquantized_autocast": True}
        out[name] = {"transformer_engine_config_type": "TEQuantizationParams",
                     "training_recipe": recipe}
    return out


def _megatron(policy: Policy, layers: list[_Layer], strict: bool, rules) -> Exported:
    groups: dict[str, list[_Layer]] = {}
    problems = []
    for layer in layers:
        known, path = _megatron_path(layer.fqn, rules)
        if not known:
            problems.append(f"{layer.what} has no Megatron-Core module name (give a name map: "
                            "--name-map FILE); it is left out")
        elif path is not None:
            groups.setdefault(path, []).append(layer)
        elif layer.runs is not Format.BF16:
            if layer.runs.is_scaled:
                raise ExportError(f"{layer.what} is {layer.runs.label}, but its Megatron-Core "
                                  "counterpart is not a Transformer Engine linear: the precision "
                                  "file cannot put it in FP8. Make it bf16 in the policy.")
            problems.append(f"{layer.what} is {layer.runs}; Megatron computes it in the run's "
                            "dtype (bf16) and its precision file cannot change that")
    configs: dict[str, str] = {}
    for path, members in groups.items():
        formats = dict.fromkeys(m.runs for m in members)
        if len(formats) > 1:
            raise ExportError(_fused_error(path, members))
        fmt = next(iter(formats))
        if not (fmt.is_scaled or fmt is Format.BF16):
            problems.append(f"{members[0].what} is {fmt}")
        configs[path] = _megatron_config(fmt, members[0].what)
    default = _megatron_config(policy.default, "The policy's default")
    if not (policy.default.is_scaled or policy.default is Format.BF16):
        problems.append(f"the policy's default is {policy.default}")
    notes = _problems(problems, strict, _MEGATRON_FIX)
    doc = _megatron_doc(configs, default)
    return Exported("megatron", doc, _megatron_text(policy, doc, notes), notes)


def _fused_error(path: str, members: list[_Layer]) -> str:
    formats = ", ".join(f"{m.fqn} {m.runs.label}" for m in members)
    siblings = ",".join(m.fqn.rpartition(".")[2] for m in members)
    return (f"Megatron-Core computes {path} as one fused GEMM, but the policy gives its parts "
            f"different formats ({formats}). Re-tune with --couple {siblings} so they share "
            "one, or make them the same in the policy.")


def _glob_escape(name: str) -> str:
    """A module name as a literal fnmatch pattern."""
    return re.sub(r"([*?\[])", r"[\1]", name)


_LAYER_INDEX = re.compile(r"(^|\.)layers\.\d+\.")


def _megatron_doc(configs: dict[str, str], default: str) -> dict[str, Any]:
    """configs + ordered matchers. A role every layer gives the same config becomes one glob
    (decoder.layers.*.mlp.linear_fc1: independent of how pipeline stages number their layers);
    the others one matcher per module; the policy's default matches everything else last."""
    roles: dict[str, list[str]] = {}
    for path in configs:
        roles.setdefault(_LAYER_INDEX.sub(r"\1layers.*.", _glob_escape(path)), []).append(path)
    entries = []
    for role, paths in roles.items():
        if len({configs[p] for p in paths}) == 1 and len(paths) > 1:
            entries.append((role, configs[paths[0]]))
        else:
            entries += [(_glob_escape(p), configs[p]) for p in paths]
    entries.append(("*", default))
    used = dict.fromkeys(config for _, config in entries)
    matchers = {}
    for i, (pattern, config) in enumerate(entries):
        name = "default" if pattern == "*" else f"m{i}_{config}"
        matchers[name] = {"config": config, "type": "glob", "pattern": pattern, "enabled": True}
    return {"configs": _megatron_configs(used), "matchers": matchers}


def _megatron_text(policy: Policy, doc: dict, notes: tuple[str, ...]) -> str:
    per_layer = any(_LAYER_INDEX.search(m["pattern"]) for m in doc["matchers"].values())
    # user text (the policy's file name, module names in the notes) is comment text escaped
    # to one line; everything else is the document, written by yaml.safe_dump
    lines = [f"# Megatron-Core --te-precision-config-file exported by autoprec from "
             f"{escape_line(policy.source or 'a policy')}",
             "# (megatron/core/extensions/TransformerEngineMixedPrecision.md). Module paths are",
             "# Megatron-Core GPTModel's; FP8 layers override the run's context (FP8 with or "
             "without --fp8),",
             "# bf16 layers need --bf16."]
    if per_layer:
        lines.append("# Per-layer entries number layers as a model without pipeline "
                     "parallelism does.")
    lines += [f"# note: {escape_line(n)}" for n in notes]
    return "\n".join(lines) + "\n" + yaml.safe_dump(doc, sort_keys=False, width=100)


MAX_NAME_MAP_BYTES = 2 ** 20
MAX_NAME_MAP_PATTERN = 512
# A user's regex runs on every module name; Python's `re` backtracks without limit (`(a+)+$`
# on a 30-character name takes minutes), so name-map regexes run on the `regex` engine with a
# deadline per match: the first one past it is an error naming the pattern.
NAME_MAP_MATCH_SECONDS = 0.25


class _NameMapLoader(yaml.SafeLoader):
    """SafeLoader refusing anchors/aliases and any nesting: a name map is one flat mapping, and
    refusing as events arrive keeps a deeply nested file from reaching the recursive composer."""

    def __init__(self, stream: str, source: str):
        super().__init__(stream)
        self.source, self.depth = source, 0

    def get_event(self):
        event = super().get_event()
        line = getattr(getattr(event, "start_mark", None), "line", -1) + 1
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise ExportError(f"Name map {self.source} line {line} uses a YAML anchor or alias; "
                              "write each regex and path out.")
        if isinstance(event, yaml.CollectionStartEvent):
            self.depth += 1
            if self.depth > 1:
                raise ExportError(f"Name map {self.source} line {line} nests a list or mapping; "
                                  "a name map is one mapping of regex -> Megatron module path.")
        elif isinstance(event, yaml.CollectionEndEvent):
            self.depth -= 1
        return event


def load_name_map(path: str | os.PathLike) -> dict[str, str | None]:
    """A YAML mapping of HF module name regex -> Megatron module path template (``\\1`` for a
    group), or null for a module the precision file cannot reach. Untrusted: at most
    MAX_NAME_MAP_BYTES, one flat mapping, each regex at most MAX_NAME_MAP_PATTERN characters
    and matched under a deadline (see NAME_MAP_MATCH_SECONDS)."""
    from autoprec._util import read_bounded

    path = os.fspath(path)
    try:
        raw = read_bounded(path, MAX_NAME_MAP_BYTES, "name map")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise ExportError(f"Name map {path} does not exist.") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise ExportError(f"Name map {path} cannot be read as UTF-8 text "
                          f"({type(e).__name__}).") from None
    except ValueError as e:
        raise ExportError(str(e)) from None
    loader = _NameMapLoader(text, path)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise ExportError(f"Malformed YAML in name map {path}{line}: "
                          f"{getattr(e, 'problem', None) or e}.") from None
    finally:
        loader.dispose()
    if not isinstance(data, Mapping) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in data.items()):
        raise ExportError(f"Name map {path} must map regexes to Megatron module paths, e.g. "
                          "'model\\.layers\\.(\\d+)\\.mlp\\.down_proj': "
                          "'decoder.layers.\\1.mlp.linear_fc2' (null: not reachable).")
    for key, value in data.items():
        if len(key) > MAX_NAME_MAP_PATTERN or len(value or "") > MAX_NAME_MAP_PATTERN:
            raise ExportError(f"Name map {path}: the entry {key[:60]!r}... is longer than "
                              f"{MAX_NAME_MAP_PATTERN} characters; module names are far shorter.")
    _rules(data)  # compiles every pattern: a bad regex is a one-line error naming its key
    return dict(data)


# ------------------------------------------------------------------ fqn
def _fqn(policy: Policy, model: nn.Module, layers: list[_Layer]) -> Exported:
    shape = [x.fqn for x in layers if x.fmt.is_scaled and not x.runs.is_scaled]
    notes = (f"{len(shape)} fp8 layer(s) the FP8 kernels cannot take are listed as bf16, as "
             f"autoprec runs them (first: {shape[0]})",) if shape else ()
    doc = {"autoprec_export": "fqn", "version": 1, "policy": policy.source,
           "model": type(model).__name__, "default": policy.default.label,
           "layers": {x.fqn: x.runs.label for x in layers}, "notes": list(notes)}
    if policy.phases:
        # each later phase: where it starts and every layer's format in it
        doc["phases"] = [{**{k: v for k, v in ph.to_dict(str).items()
                             if k in ("name", "from_step", "from_fraction")},
                          "layers": {x.fqn: x.runs.label
                                     for x in _layers(policy.phase(i), model)}}
                         for i, ph in enumerate(policy.phases, start=1)]
    return Exported("fqn", doc, json.dumps(doc, indent=2) + "\n", notes)
