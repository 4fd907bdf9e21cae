"""Task: what a user hands autoprec — a model, calibration batches and a loss.

```python
task = autoprec.Task(model=lambda: GPT2LMHeadModel(cfg), batches=[...],
                     loss_fn=lambda model, batch: model(**batch).loss)
```

``model`` is a module or a zero-argument factory; autoprec works on fresh copies
(:meth:`Task.build_model`) so the user's module is never modified. ``loss_fn`` defaults to the
output's ``.loss`` (HF models called with labels) or the output itself when it is a scalar.
``train_batches`` (a stream for training runs) and ``eval_batches`` (held-out batches) are what
validation trains and judges on; without them it reuses the calibration batches. The CLI loads
a task from ``path/to/file.py:function`` or ``package.module:function``; the function takes no
arguments and returns a Task.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec._util import ModelCall, call_model, loss_of, move_to, split_batch
from autoprec.runtime.engines import torchao_available

__all__ = ["Task", "TaskError", "load_task", "task_file", "check_batches", "default_loss",
           "move_to"]


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Call the model on the batch (``**dict``, ``*tuple`` or the tensor) and return the loss
    in its output (:func:`autoprec._util.loss_of`: ``.loss``, ``["loss"]``, a tuple's scalar
    first element, or the output itself when it is a scalar tensor)."""
    out = call_model(model, batch)
    loss = loss_of(out)
    if loss is None:
        raise ValueError(
            f"The model returned {type(out).__name__}, which has no `.loss` and is not a "
            "scalar: pass loss_fn=lambda model, batch: ... to Task, or give the model labels.")
    return loss


@dataclass
class Task:
    """A model, the batches to measure it on, and its loss.

    Args:
        model: an ``nn.Module`` (copied before use, never modified) or a zero-argument factory.
        batches: calibration batches: tensors, tuples or dicts of tensors, as the model takes
            them.
        loss_fn: ``loss_fn(model, batch)`` -> scalar tensor; None uses ``default_loss``.
        name: shown in progress output and written into the policy's provenance.
        device: where measurements run; None picks CUDA when available, else CPU.
        optimizer: builds the optimizer for training steps (timing a step, validation);
            default AdamW.
        seed: seed for model construction and anything random in measurements.
        train_batches: a stream of training batches for training runs (validation):
            ``train_batches(n, seed)`` returns n batches, a different order for each seed.
            None: the calibration batches in a seeded order.
        eval_batches: held-out batches the trained models are judged on. None: the last two
            calibration batches.
        extras: free-form extras a task file wants to carry; autoprec does not read them.
        shape_batch: a batch at production size, for tuning with a cost model (``target=``):
            its shapes price the layers, while numerics are measured on the (smaller)
            calibration batches. Only its shapes matter; capture traces it without heavy
            compute.

    Raises:
        TypeError: ``model`` is neither an ``nn.Module`` nor a callable.
        TaskError: ``batches`` is empty or a single tensor or dict, a batch is one autoprec
            cannot measure, or ``device`` cannot be used here.
    """

    model: nn.Module | Callable[[], nn.Module]
    batches: Sequence[Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
    name: str | None = None
    device: str | torch.device | None = None
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    seed: int = 0
    train_batches: Callable[[int, int], Sequence[Any]] | None = None
    eval_batches: Sequence[Any] | None = None
    extras: dict = field(default_factory=dict)
    shape_batch: Any = None

    def __post_init__(self):
        if not (isinstance(self.model, nn.Module) or callable(self.model)):
            raise TypeError("Task(model=...) needs an nn.Module or a zero-argument callable "
                            f"returning one, got {type(self.model).__name__}.")
        if isinstance(self.batches, (torch.Tensor, Mapping)) or len(self.batches) == 0:
            raise TaskError("Task(batches=...) needs a non-empty list of batches "
                            "(one batch per element), not a single tensor or dict.")
        # what autoprec cannot measure is refused here, when the task is built: before any
        # profiling, and as one line naming the batch, not a traceback from deep in a run
        check_batches(self.batches, "batch")
        if self.eval_batches is not None:
            check_batches(self.eval_batches, "eval_batches[{}]")
        if self.shape_batch is not None:
            # only its shapes are read: a meta batch (production size, no memory) is fine
            _check_batch(self.shape_batch, "shape_batch", meta_ok=True)
        self.device = _usable_device(self.device)
        if self.name is None:
            self.name = type(self.model).__name__ if isinstance(self.model, nn.Module) else \
                getattr(self.model, "__name__", "task")

    def build_model(self) -> nn.Module:
        """A fresh FP32 model on the task's device: the factory's output (seeded), or a deep
        copy of the given module."""
        if isinstance(self.model, nn.Module):
            model = copy.deepcopy(self.model)
        else:
            # transformers imports torchao (when installed) as it builds a model; import it
            # first, quietly, so its warnings about CUDA extensions stay out of our output
            torchao_available()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = self.model()
            if not isinstance(model, nn.Module):
                raise TypeError(f"The task's model factory returned {type(model).__name__}, "
                                "not an nn.Module.")
        return model.to(self.device)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar loss of ``model`` on ``batch`` (moved to the task's device)."""
        batch = move_to(batch, self.device)
        fn = self.loss_fn or default_loss
        return fn(model, batch)

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self.optimizer(params)
        return torch.optim.AdamW(params, lr=1e-3)

    def example_batch(self) -> Any:
        return move_to(self.batches[0], self.device)

    def model_call(self, model: nn.Module, batch: Any) -> ModelCall:
        """What the task's loss function calls ``model`` with on ``batch``: with a custom
        ``loss_fn`` (``model(inputs)`` on ``(inputs, labels)`` batches, say), found by running
        it until the model's forward begins; else what :func:`default_loss` passes."""
        batch = move_to(batch, self.device)
        if self.loss_fn is None:
            return ModelCall(*split_batch(batch))
        seen: list[ModelCall] = []

        def hook(module, args, kwargs):
            seen.append(ModelCall(tuple(args), dict(kwargs)))
            raise _Called

        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                self.loss_fn(model, batch)
        except _Called:
            pass
        finally:
            handle.remove()
        if not seen:
            raise ValueError(f"The loss function of task {self.name!r} never called the model "
                             "on a batch; it must run model(...) itself.")
        return seen[0]


def check_batches(batches: Sequence[Any], label: str = "batch") -> None:
    """Raise :class:`TaskError` for the first batch autoprec cannot measure on: one with a
    tensor of 0 rows (batch dimension 0), or one on the ``meta`` device (shapes, no data).
    ``label`` names a batch: ``"batch"`` gives ``batch 3``; a ``{}`` in it takes the index."""
    for i, batch in enumerate(batches):
        _check_batch(batch, label.format(i) if "{}" in label else f"{label} {i}")


def _check_batch(batch: Any, label: str, *, meta_ok: bool = False) -> None:
    for where, t in _named_tensors(batch, ""):
        what = f"{label}{f' ({where})' if where else ''}"
        if t.dim() >= 1 and t.shape[0] == 0:
            raise TaskError(
                f"Task {what} has 0 rows (shape {tuple(t.shape)}): every batch needs at least "
                "one example; drop empty batches (a split's empty last batch, say) before "
                "building the Task.")
        if t.is_meta and not meta_ok:
            raise TaskError(
                f"Task {what} is a tensor on the meta device: batches must hold real data; "
                "meta tensors have none. Build the batches on the CPU (autoprec moves them to "
                "the task's device).")


def _named_tensors(obj: Any, where: str, depth: int = 0):
    """(where, tensor) for each tensor in a batch: ``where`` is its key path (`labels`,
    item 1); nesting deeper than any batch has (or a list holding itself) is not searched."""
    if isinstance(obj, torch.Tensor):
        yield where, obj
        return
    if depth > 16:
        return
    if isinstance(obj, ModelCall):
        yield from _named_tensors(tuple(obj.args), where, depth + 1)
        yield from _named_tensors(dict(obj.kwargs), where, depth + 1)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _named_tensors(value, f"{where} `{key}`".strip(), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _named_tensors(value, f"{where} item {i}".strip(), depth + 1)


def _usable_device(device: Any) -> torch.device:
    """``device`` as a torch.device this build and host can compute on (None: CUDA where
    there is a GPU, else the CPU); a :class:`TaskError` saying why not, and the fix."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shown = repr(str(device)) if isinstance(device, torch.device) else repr(device)
    fix = 'pass device="cpu", or leave device out to use CUDA where there is a GPU'
    try:
        dev = torch.device(device)
    except Exception:  # noqa: BLE001 - torch says RuntimeError or TypeError, by the value
        raise TaskError(f"Task device {shown} is not a device torch knows "
                        f'(e.g. "cpu", "cuda", "cuda:1"): {fix}.') from None
    if dev.type == "meta":
        raise TaskError(f"Task device {shown} cannot be used: measurements need real data, and "
                        f"meta tensors have none; {fix}.")
    if dev.type == "cuda":
        # asked without initializing CUDA: building a Task must not claim a GPU
        if not torch.cuda.is_available():
            why = ("this build of torch has no CUDA (a CPU-only build)" if torch.version.cuda
                   is None else "this host has no CUDA GPU torch can use")
            raise TaskError(f"Task device {shown} cannot be used: {why}; {fix}.")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise TaskError(f"Task device {shown} cannot be used: this host has {count} CUDA "
                            f"GPU(s), cuda:0 to cuda:{count - 1}; {fix}.")
    elif dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except Exception as e:  # noqa: BLE001 - whatever the backend says, it is not usable
            raise TaskError(f"Task device {shown} cannot be used here ({type(e).__name__}: "
                            f"{_first_line(e)}); {fix}.") from None
    return dev


class _Called(Exception):
    """Stops a loss function once the model's forward has been entered."""


class TaskError(ValueError):
    """A task spec that cannot be loaded; the message names the file or module and the fix."""


def load_task(spec: str) -> Task:
    """Load a Task from ``path/to/file.py:function`` or ``package.module:function``.

    Args:
        spec: ``path/to/file.py:function`` or ``package.module:function``; the function is
            called with no arguments and must return a :class:`Task`.

    Returns:
        The :class:`Task` the function returns.

    Raises:
        TaskError: every way this can fail, naming the file, module or function.
    """
    target, sep, attr = str(spec).rpartition(":")
    if not sep or not target or not attr:
        raise TaskError(f"Task spec {spec!r} must look like `path/to/file.py:function` or "
                        "`package.module:function`.")
    module = _import_task_module(target, spec)
    if not hasattr(module, attr):
        public = [n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise TaskError(f"{target} has no function {attr!r} (from task spec {spec!r}); "
                        f"callables there: {', '.join(public[:10]) or 'none'}.")
    fn = getattr(module, attr)
    if not callable(fn):
        raise TaskError(f"{target}:{attr} is a {type(fn).__name__}, not a function; a task spec "
                        "names a function that takes no arguments and returns autoprec.Task.")
    try:
        # a call that cannot bind is the spec's mistake; a TypeError raised inside the
        # function is the task's own, reported with the rest below
        inspect.signature(fn).bind()
    except TypeError as e:
        raise TaskError(f"{spec} cannot be called without arguments ({e}); a task function "
                        "takes no arguments and returns autoprec.Task.") from None
    except ValueError:
        pass  # no signature to read (a builtin): the call itself will tell
    try:
        task = fn()
    except Exception as e:  # noqa: BLE001 - whatever the task raised, say what and where
        raise TaskError(_raised(spec, fn, module, e)) from e
    if not isinstance(task, Task):
        raise TaskError(f"{spec} returned {type(task).__name__}; a task function must return "
                        "autoprec.Task.")
    return task



def task_file(spec: str) -> str | None:
    """The file a task spec loads, found without importing anything (the commands check their
    outputs against it before any work): ``path/to/file.py`` itself when it is a file; for
    ``package.module``, its ``.py`` or ``__init__.py`` in the working directory, else in the
    first ``sys.path`` folder that has one (where :func:`load_task` imports it from once the
    commands have put the working directory first). None when not found: loading the task
    reports that."""
    target, sep, _ = str(spec).rpartition(":")
    if not sep or not target:
        return None
    if target.endswith(".py") or os.sep in target or "/" in target:
        return target if os.path.isfile(target) else None
    parts = target.split(".")
    for folder in [os.getcwd(), *sys.path]:
        base = os.path.join(folder or ".", *parts)
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None

def _import_task_module(target: str, spec: str):
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise TaskError(f"Task file {target} (from {spec!r}) does not exist.")
        name = "_autoprec_task_" + os.path.splitext(os.path.basename(path))[0]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        where = f"task file {target}"
        load = lambda: module_spec.loader.exec_module(module)  # noqa: E731
    else:
        where = f"task module {target}"
        module = None

        def load():
            nonlocal module
            module = importlib.import_module(target)
    try:
        load()
    except Exception as e:  # noqa: BLE001 - any failure to import is the spec's to report
        raise TaskError(f"Could not import {where} (from {spec!r}): {type(e).__name__}: "
                        f"{_first_line(e)}") from None
    return module


def _raised(spec: str, fn: Callable, module: Any, e: Exception) -> str:
    """One line for an exception from a task function: what it raised, and the line of the
    task's own file it came through (the innermost frame there: the call into the helper
    or library that raised, or the raise itself)."""
    files = {os.path.abspath(f) for f in (getattr(module, "__file__", None),
                                          getattr(getattr(fn, "__code__", None), "co_filename",
                                                  None)) if f}
    frames = traceback.extract_tb(e.__traceback__)[1:]  # [0] is the call in load_task
    own = [f for f in frames if os.path.abspath(f.filename) in files]
    frame = (own or frames or [None])[-1]
    at = f" at {_shown_path(frame.filename)}:{frame.lineno}" if frame is not None else ""
    if isinstance(e, TaskError):  # autoprec's check of the Task the function built
        return f"{spec} built a Task autoprec cannot use{at}: {_first_line(e)}"
    message = _first_line(e)
    return (f"The task function {spec} raised {type(e).__name__}{at}"
            f"{': ' + message if message else ''} (calling it in Python shows the traceback).")


def _shown_path(path: str) -> str:
    """``path`` relative to the working directory when it is under it (as users type it)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith(os.pardir) else rel


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""
