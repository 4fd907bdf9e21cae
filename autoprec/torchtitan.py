"""torchtitan: train with a tuned policy in torchtitan's own trainer (torchtitan 0.3).

The one command (``pip install 'autoprec[torchtitan]'``)::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module autoprec.torchtitan --config llama3_8b --autoprec.policy llama3_8b.yaml

``--config`` names any of torchtitan's own config functions (``llama3_debugmodel``,
``llama3_8b``, ``qwen3_...``): this module hands the trainer that config with one section more,
``--autoprec.policy`` (and ``--autoprec.no-strict``). For a config function of your own, return
``with_policy(your_config())`` from it. What the policy then changes, and how:

- **FP8 Linears, in torchtitan's own config tree.** :class:`PolicyConverter` (a torchtitan
  ``ModelConfigConverter``) replaces each ``Linear.Config`` the policy puts in an FP8 recipe by
  torchtitan's ``Float8Linear.Config`` carrying that layer's torchao recipe, before the model
  is built, so torchtitan's compile, FSDP2 and tensor parallelism treat them as their own. On
  a Blackwell GPU an ``mxfp8`` layer becomes torchtitan's ``MXFP8Linear.Config`` and an
  ``nvfp4`` one its ``NVFP4Linear.Config``; elsewhere (and for ``mxfp8:gw_hp``,
  ``nvfp4:plain``) the regions below compute them.
  Every other field of the layer's config is kept. Names are matched as the policy matches
  them (exact fqns and its globs), never by substring: torchtitan's own ``filter_fqns``
  matches ``layers.1`` inside ``layers.10``.
- **Everything else, in autoprec's regions.** When the trainer parallelises the model (still
  on the meta device), :func:`autoprec.apply` gives the rest of the policy its regions: fp8
  matmuls that are not Linears (attention), bf16 and fp32 layers. ``lm_head`` gets a region of
  its own, since torchtitan's ChunkedLossWrapper calls it outside the model's forward.
- **fp32 layers under torchtitan's BF16 parameters.** With ``mixed_precision_param``
  ``bfloat16`` (torchtitan's default), FSDP2 would gather a layer the policy keeps in fp32 in
  bf16. Each such layer gets an FSDP2 unit of its own whose ``MixedPrecisionPolicy`` gathers in
  fp32 (the rest of its block still in bf16). Where that cannot be done (tensor parallel, a
  weight tied to a layer in another format), the trainer stops at start-up with a one-line
  error naming the layer and the fix. Pipeline parallelism is refused the same way (each
  stage holds part of the model the policy names).

A policy with ``phases:`` is refused: torchtitan builds each layer's precision once, and
changes precision by restarting from a checkpoint with another config (its NVFP4 docs). So is
one with fp16 layers: torchtitan's trainer scales no loss (tune with ``--formats fp32 bf16
fp8``).

The task helper :func:`task` builds a model from torchtitan's registry for ``autoprec tune``
(``examples/torchtitan_llama3.py``), so that the policy is tuned on the model that is trained.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec._util import shown
from autoprec.formats import Format, torchao_takes
from autoprec.policy import Policy, PolicyError, load_policy
from autoprec.runtime import apply
from autoprec.runtime.engines import blackwell, float8_linear_config, torchao_available
from autoprec.task import Task

torchao_available()  # imports torchao (before torchtitan does) without its CUDA-less noise
try:
    import torchtitan  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"autoprec.torchtitan needs torchtitan ({e}): pip install "
                      "'autoprec[torchtitan]'") from e
from torchtitan.components.quantization import (  # noqa: E402
    Float8Linear,
    MXFP8Linear,
    NVFP4Linear,
)
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.protocols.model import ModelConfigConverter  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

__all__ = ["PolicyConverter", "AutoprecOptions", "AutoprecTrainer", "with_policy", "policy_spec",
           "fp8_linears", "build_model", "task"]

# the modules torchtitan's ChunkedLossWrapper calls itself, after the model's forward
_CALLED_BY_THE_LOSS = ("lm_head",)


def _one_line_refusal(hook: Callable, kind: type, value: BaseException, tb: Any) -> None:
    """``sys.excepthook`` while this module is loaded: torchtitan's ``train.py`` re-raises
    whatever stops its trainer, so a policy the trainer refuses at start-up (phases, fp16, a
    missing file, a layout it cannot shard) would end in its traceback; a :class:`PolicyError`
    is bad input, and ends in one line instead, as in ``autoprec``'s own commands (exit 1, as
    any uncaught exception). Everything else keeps its traceback."""
    if isinstance(value, PolicyError):
        sys.stderr.write(f"autoprec: error: {shown(' '.join(str(value).split()), 2000)}\n")
        sys.stderr.flush()
        return
    hook(kind, value, tb)


if not isinstance(sys.excepthook, functools.partial) or \
        sys.excepthook.func is not _one_line_refusal:
    sys.excepthook = functools.partial(_one_line_refusal, sys.excepthook)


def _load(policy: Policy | str | os.PathLike) -> Policy:
    policy = policy if isinstance(policy, Policy) else load_policy(policy)
    if policy.phases:
        raise PolicyError(
            f"Policy{' ' + policy.source if policy.source else ''} has phases, which "
            "torchtitan cannot follow: it builds each layer's precision once. Train each phase "
            "from its own policy without `phases:`, restarting from a checkpoint between them.")
    if policy.needs_loss_scaling:
        raise PolicyError(
            f"Policy{' ' + policy.source if policy.source else ''} puts layers in fp16, whose "
            "gradients need loss scaling, and torchtitan's trainer scales no loss: re-tune "
            "with `autoprec tune ... --formats fp32 bf16 fp8`.")
    return policy


# NVFP4Linear's Triton kernels need every GEMM dimension a multiple of 128
_NVFP4_MULTIPLE = 128


def _titan_builds(fmt: Format, config) -> bool:
    """Whether torchtitan has a Linear that computes ``fmt`` for this ``Linear.Config``: a
    torchao FP8 recipe (Float8Linear, features multiples of 16); on a Blackwell GPU, mxfp8
    (MXFP8Linear: torchao's defaults, RCEIL, no high-precision weight gradient) and nvfp4
    (NVFP4Linear: the Hadamard transform and stochastic rounding, features multiples of 128).
    Elsewhere autoprec's regions emulate the block-scaled formats (and on Blackwell
    ``mxfp8:gw_hp``, which MXFP8Linear.Config cannot say, runs on torchao's MXFP8Linear
    through ``apply``)."""
    if not fmt.numerics.is_block_scaled:
        return torchao_takes(fmt, linear=True, in_features=config.in_features,
                             out_features=config.out_features)
    if not blackwell(torch.device("cuda")):
        return False
    linear = fmt.numerics.torchtitan_linear
    if linear == "MXFP8Linear":
        return MXFP8Linear is not None and torchao_takes(
            fmt, linear=True, in_features=config.in_features, out_features=config.out_features)
    return linear == "NVFP4Linear" and NVFP4Linear is not None and not (
        config.in_features % _NVFP4_MULTIPLE or config.out_features % _NVFP4_MULTIPLE)


def fp8_linears(policy: Policy, model_config) -> dict[str, Format]:
    """fqn -> scaled format of each ``Linear.Config`` in torchtitan's ``model_config`` tree
    that the policy puts in a format torchtitan has a Linear for (:func:`_titan_builds`): the
    layers :class:`PolicyConverter` builds as ``Float8Linear`` (``MXFP8Linear``,
    ``NVFP4Linear``). A policy whose engine is ``autoprec`` gets none (its own kernels run
    them all)."""
    if policy.engine == "autoprec":
        return {}
    found = {}
    for fqn, config, _, _ in model_config.traverse(Linear.Config):
        fmt = policy.format_for(fqn)
        if _titan_builds(fmt, config):
            found[fqn] = fmt
    return found


def _convert(model_config, policy: Policy):
    """``model_config`` with the policy's FP8 Linears as Float8Linear.Config (each with its
    recipe), every other field of theirs and every other config as it was."""
    targets = fp8_linears(policy, model_config)
    if not targets:
        return model_config
    if Float8Linear is None:
        raise PolicyError(
            f"Policy{' ' + policy.source if policy.source else ''} puts Linear layers in fp8, "
            "which torchtitan builds with torchao: pip install 'autoprec[torchao]'.")
    model_config = copy.deepcopy(model_config)  # the caller's tree is left as it was
    # emulated where the machine the trainer runs on has no FP8 kernels for the recipe
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    recipes = {fmt: float8_linear_config(fmt, device) for fmt in set(targets.values())
               if not fmt.numerics.is_block_scaled}
    if any(fmt.numerics.torchao_recipe == "rowwise" for fmt in recipes):
        # what torchtitan's own float8 converter sets for rowwise (pytorch/pytorch#150859)
        import torch._inductor.config as inductor

        inductor.emulate_precision_casts = True
    for fqn, config, parent, attr in list(model_config.traverse(Linear.Config)):
        fmt = targets.get(fqn)
        if fmt is None:
            continue
        kept = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                if f.name != "_torchao_config"}
        linear = {"MXFP8Linear": MXFP8Linear, "NVFP4Linear": NVFP4Linear}.get(
            fmt.numerics.torchtitan_linear)
        if linear is not None:
            new = linear.Config(**kept)
        else:
            new = Float8Linear.Config(**kept, _torchao_config=recipes[fmt])
        if parent is None:
            model_config = new
        elif isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return model_config


class PolicyConverter(ModelConfigConverter):
    """torchtitan's config converter for a policy: its FP8 Linears become ``Float8Linear.Config``
    with each layer's recipe (see :func:`fp8_linears`). Only the config-tree half of a policy:
    :func:`with_policy` adds the regions and fp32 units; on its own, in
    ``model_registry(flavor, converters=[PolicyConverter.Config(policy=PATH)])``, it takes the
    place of torchtitan's ``Float8LinearConverter`` and its ``filter_fqns``, layer by layer (the
    policy's other layers then run as torchtitan runs them)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        policy: str = ""
        """Path of the autoprec policy YAML file."""

    def __init__(self, config: Config):
        if not config.policy:
            raise PolicyError("PolicyConverter.Config(policy=...) needs the path of a policy "
                              "YAML file (written by `autoprec tune`).")
        self.config = config
        self.policy = _load(config.policy)

    def convert(self, model_config):
        return _convert(model_config, self.policy)


def _owns_params(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _fp32_owners(model: nn.Module, policy: Policy) -> dict[int, str]:
    """id -> fqn of each module that owns parameters itself and computes in fp32. A parameter
    an fp32 layer shares with a layer in another format (tied embeddings and ``lm_head``) cannot
    be gathered both ways: refused."""
    owners = {id(m): fqn for fqn, m in model.named_modules()
              if _owns_params(m) and policy.format_for(fqn) is Format.FP32}
    holders: dict[int, list[str]] = {}
    for fqn, m in model.named_modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), []).append(fqn)
    for fqn, m in model.named_modules():
        if id(m) not in owners:
            continue
        for p in m.parameters(recurse=False):
            other = next((h for h in holders[id(p)] if policy.format_for(h) is not Format.FP32),
                         None)
            if other is not None:
                raise PolicyError(
                    f"`{fqn}` is fp32 under the policy but shares its weight with `{other}` "
                    f"({policy.format_for(other)}), which torchtitan gathers with it in 16 bits: "
                    "give both one format, or pass --training.mixed_precision_param float32.")
    return owners


class _Units:
    """Wraps ``fully_shard`` while torchtitan parallelises: a unit torchtitan gathers in 16 bits
    that holds fp32 layers of the policy gets those layers as units of their own, gathered in
    fp32, first (their parameters are then left out of the enclosing unit); a unit made only
    of fp32 layers is gathered in fp32 itself."""

    def __init__(self, real: Callable, owners: dict[int, str]):
        self.real = real
        self.owners = owners
        self.covered: set[str] = set()
        self.low = False  # whether any unit was gathered in 16 bits

    def __call__(self, module, **kwargs):
        mp = kwargs.get("mp_policy")
        if mp is None or mp.param_dtype in (None, torch.float32):
            return self.real(module, **kwargs)
        self.low = True
        fp32 = dict(kwargs, mp_policy=dataclasses.replace(mp, param_dtype=torch.float32))
        many = isinstance(module, (list, tuple))
        group = list(module) if many else [module]
        if all(self._all_fp32(m) for m in group):  # (tied weights stay in one unit)
            self._shard_fp32(module, group, fp32)
            return module
        rest = [m for m in group if not self._split(m, fp32)]
        if rest:
            self.real(rest if many else rest[0], **kwargs)
        return module

    def _all_fp32(self, module: nn.Module) -> bool:
        owning = [m for m in module.modules() if _owns_params(m)]
        return bool(owning) and all(id(m) in self.owners for m in owning)

    def _shard_fp32(self, unit, modules: list[nn.Module], fp32: dict) -> None:
        """Shard ``unit`` (``modules``, one or a group) gathered in fp32: its fp32 layers are
        covered."""
        self.real(unit, **fp32)
        self.covered.update(o for m in modules for s in m.modules()
                            if (o := self.owners.get(id(s))) is not None)

    def _split(self, module: nn.Module, fp32: dict) -> bool:
        """Give ``module``'s fp32 layers their own fp32 units; True when that was all of it."""
        if self._all_fp32(module):
            self._shard_fp32(module, [module], fp32)
            return True
        done: list[str] = []
        for name, m in module.named_modules():
            fqn = self.owners.get(id(m))
            if fqn is None or fqn in self.covered or any(name.startswith(d + ".") for d in done):
                continue
            if m is module:
                raise PolicyError(
                    f"`{fqn}` is fp32 under the policy but holds layers in other formats, and "
                    "torchtitan gathers it as one FSDP2 unit in 16 bits: put its sub-layers in "
                    "fp32 too, or pass --training.mixed_precision_param float32.")
            self._shard_fp32(m, [m], fp32)
            done.append(name)
        return False


@contextlib.contextmanager
def _fp32_units(owners: dict[int, str]):
    """Inside: torchtitan's FSDP2 (``apply_fsdp_to_decoder``) makes the units of :class:`_Units`."""
    from torchtitan.distributed import fsdp

    units = _Units(fsdp.fully_shard, owners)
    fsdp.fully_shard = units
    try:
        yield units
    finally:
        fsdp.fully_shard = units.real


class _Parallelize:
    """torchtitan's ``parallelize_fn`` with the policy: regions on the meta model first, then
    torchtitan's parallelisms, with fp32 units of their own for the policy's fp32 layers."""

    def __init__(self, inner: Callable, policy: Policy, strict: bool):
        self.inner = inner
        self.policy = policy
        self.strict = strict

    def __call__(self, model: nn.Module, *, parallel_dims, training, **rest):
        from torchtitan.config import TORCH_DTYPE_MAP

        if parallel_dims.pp_enabled:
            # each stage holds part of the model: the policy's fingerprint and patterns are
            # the whole model's
            raise PolicyError("autoprec.torchtitan does not run under pipeline parallelism "
                              "yet (each stage would be checked against the whole model's "
                              "policy): train with --parallelism.pipeline_parallel_degree 1.")
        standalone = tuple(n for n in _CALLED_BY_THE_LOSS if hasattr(model, n))
        apply(model, self.policy, strict=self.strict, standalone=standalone)
        low = TORCH_DTYPE_MAP[training.mixed_precision_param] != torch.float32
        owners = _fp32_owners(model, self.policy) if low else {}
        if owners and parallel_dims.tp_enabled:
            raise PolicyError(
                f"`{next(iter(owners.values()))}` is fp32 under the policy, but with tensor "
                "parallelism autoprec cannot give it an FSDP2 unit of its own, and torchtitan "
                "would gather it in bfloat16: pass --training.mixed_precision_param float32, "
                "or put the layer in bf16.")
        with _fp32_units(owners) as units:
            model = self.inner(model, parallel_dims=parallel_dims, training=training, **rest)
        missing = [fqn for fqn in owners.values() if fqn not in units.covered]
        if units.low and missing:
            raise PolicyError(
                f"`{missing[0]}` is fp32 under the policy, but this model's parallelize function "
                "gathered it in 16 bits outside torchtitan's apply_fsdp_to_decoder: pass "
                "--training.mixed_precision_param float32, or put the layer in bf16.")
        return model


def policy_spec(spec, policy: Policy | str | os.PathLike, *, strict: bool = True):
    """torchtitan's ``ModelSpec`` with ``policy``: its model config converted
    (:class:`PolicyConverter`) and its ``parallelize_fn`` giving the rest of the policy."""
    policy = _load(policy)
    return dataclasses.replace(spec, model=_convert(spec.model, policy),
                               parallelize_fn=_Parallelize(spec.parallelize_fn, policy, strict))


@dataclass
class AutoprecOptions:
    """The trainer config's ``autoprec`` section (``--autoprec.policy PATH``)."""

    policy: str = ""
    """Path of the autoprec policy YAML file to train with (empty: train without one)."""
    strict: bool = True
    """Refuse a policy made for another model (fingerprint) or naming no layer of this one."""


class AutoprecTrainer(Trainer):
    """torchtitan's Trainer, training its model under ``config.autoprec.policy``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        autoprec: AutoprecOptions = field(default_factory=AutoprecOptions)

    def __init__(self, config: Config):
        if config.autoprec.policy:
            config.model_spec = policy_spec(config.model_spec, config.autoprec.policy,
                                            strict=config.autoprec.strict)
        super().__init__(config)


def with_policy(config: Trainer.Config, policy: str | os.PathLike | None = None, *,
                strict: bool = True) -> AutoprecTrainer.Config:
    """``config`` (a torchtitan ``Trainer.Config``) as the config of :class:`AutoprecTrainer`:
    the same fields, and the ``autoprec`` section, whose policy ``--autoprec.policy`` sets on
    the command line (``policy`` here is its default)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config)}
    options = AutoprecOptions(policy=os.fspath(policy) if policy else "", strict=strict)
    return AutoprecTrainer.Config(**fields, autoprec=options)


def _registry_function(name: str) -> Callable | None:
    from torchtitan.models import _supported_models

    # the model whose name starts the config's (llama3_8b: llama3), longest first
    for model in sorted(_supported_models, key=lambda m: (not name.startswith(m), -len(m))):
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        fn = getattr(registry, name, None)
        if callable(fn):
            return fn
    return None


def __getattr__(name: str):
    # `--module autoprec.torchtitan --config NAME`: torchtitan's config function NAME, with the
    # autoprec section (torchtitan's ConfigManager looks the function up with getattr)
    if name.startswith("_"):
        raise AttributeError(name)
    fn = _registry_function(name)
    if fn is None:
        raise AttributeError(f"module 'autoprec.torchtitan' has no attribute {name!r} (and "
                             f"torchtitan has no config function {name!r})")

    def config() -> AutoprecTrainer.Config:
        return with_policy(fn())

    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"torchtitan's {name}, trained under --autoprec.policy."
    return config


# ---------------------------------------------------------------------------- tuning
def _registry(module: str) -> Callable:
    try:
        return importlib.import_module(f"torchtitan.models.{module}").model_registry
    except (ImportError, AttributeError):
        raise PolicyError(f"torchtitan has no model {module!r} with a model_registry "
                          "(torchtitan.models.<module>.model_registry).") from None


def build_model(module: str = "llama3", flavor: str = "debugmodel", *, n_layers: int | None = None,
                device: str | torch.device = "cpu", seed: int = 0,
                shard: bool = False) -> nn.Module:
    """torchtitan's ``module`` model of ``flavor``, built as its trainer builds it (meta, then
    materialised on ``device`` and initialised by its ``init_weights``), names and shapes as
    its trainer's, for tuning. Attention is plain causal SDPA: torchtitan's flex and varlen
    backends need the trainer's document masks and compile (they hold no parameters, so the
    policy's names and fingerprint are the trainer's). ``n_layers`` keeps the first blocks only
    (a model too large to tune whole: its policy's fingerprint is then the shorter model's).

    ``shard=True`` (every rank of a ``torchrun``): sharded over the default process group by
    torchtitan's own FSDP2 units (``apply_fsdp_to_decoder``: the embedding, the norm with the
    head, each block, the root) while still on the meta device, with FP32 parameters and
    reductions (the measurement's reference is FP32), so each rank materialises and
    initialises its shards only: for ``tune(task, model=...)`` of a model no process holds."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = _registry(module)(flavor).model
    if n_layers is not None:
        config.layers = config.layers[:n_layers]
    for layer in config.layers:
        attention = getattr(layer, "attention", None)
        if attention is not None and hasattr(attention, "inner_attention"):
            attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = config.build()
    if shard:
        _shard(model, torch.device(device))
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model


def _shard(model: nn.Module, device: torch.device) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("build_model(shard=True) shards over the ranks of a torchrun: "
                         "initialise the default process group first "
                         "(torch.distributed.init_process_group).")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                          pp_enabled=False)


def _next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                       tokens[:, 1:].flatten())


def task(batches: Sequence[torch.Tensor], module: str = "llama3", flavor: str = "debugmodel", *,
         n_layers: int | None = None, shape_batch: Any = None, **extra) -> Task:
    """An :class:`autoprec.Task` of torchtitan's ``module``/``flavor`` model (:func:`build_model`)
    on token batches (``[batch, seq]`` int64 tensors), next-token loss. ``shape_batch``: a
    batch at production size (a meta tensor is fine), to price with ``--target``; ``extra``
    goes to ``Task`` (``eval_batches``, ``train_batches``, ``device``)."""
    name = f"torchtitan-{module}-{flavor}" + (f"-{n_layers}layers" if n_layers else "")
    device = extra.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    return Task(model=lambda: build_model(module, flavor, n_layers=n_layers, device=device),
                batches=list(batches), loss_fn=_next_token_loss, name=name,
                shape_batch=shape_batch, **{**extra, "device": device})
