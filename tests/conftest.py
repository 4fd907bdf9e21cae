"""Shared fixtures: real models nobody here wrote (HF GPT-2, the pretrained MiniLM BERT, HF
ResNet) at sizes that keep the suite fast on 2 CPU cores."""

from __future__ import annotations

import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import cnn, gpt2_bytes, llama_bytes, minilm  # noqa: E402
from examples.data import byte_batches  # noqa: E402


def pytest_report_header(config):
    # which host ran the suite: what it is fast at decides what speed tests and tunes expect
    from autoprec.host import cpu_features

    return [f"autoprec host: {cpu_features().describe()}"]


def host_bf16_is_fast() -> bool:
    """Whether this CPU has BF16 dot-product instructions, i.e. whether bf16 matmuls can beat
    fp32 here. Tests about speed ask this first and assert what the answer implies."""
    from autoprec.host import cpu_features

    return cpu_features().bf16_dot


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (``pytestmark = usefixtures("one_thread")``): on
    two noisy shared cores, one thread each is 10x faster than two fighting others."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_gpt2(n_layer: int = 2, n_embd: int = 64, seq_len: int = 32, attn: str = "eager"):
    torch.manual_seed(0)
    return gpt2_bytes.make_model(n_layer=n_layer, n_embd=n_embd, n_head=2, seq_len=seq_len,
                                 attn_implementation=attn).eval()


@pytest.fixture
def gpt2():
    return tiny_gpt2()


def train_mlps_in(fmt, n_embd: int = 64, seq_len: int = 32):
    """A tiny GPT-2 in training mode with its MLPs in ``fmt`` (a registered format that the host
    emulates, so ``apply`` warns), one forward and backward on random ids: the loss and every
    gradient must be finite. Returns the model."""
    import autoprec

    model = tiny_gpt2(n_embd=n_embd, seq_len=seq_len)
    model.train()
    policy = autoprec.Policy(default="bf16", layers={"transformer.h.*.mlp.*": fmt.value})
    with pytest.warns(UserWarning, match="emulate"):
        autoprec.apply(model, policy)
    assert autoprec.applied_formats(model)["transformer.h.0.mlp.c_fc"] is fmt
    ids = torch.randint(0, model.config.vocab_size, (2, seq_len))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    return model


@pytest.fixture
def gpt2_batch():
    return byte_batches(1, 4, 32, seed=0)[0]


@pytest.fixture(scope="session")
def _minilm_cached():
    torch.manual_seed(0)
    return minilm.make_model().eval()


@pytest.fixture
def minilm_model(_minilm_cached):
    import copy

    return copy.deepcopy(_minilm_cached)


@pytest.fixture(scope="session")
def minilm_batch():
    return minilm.snippet_batches(1, batch_size=4, seq_len=32, seed=0)[0]


def tiny_llama(n_layer: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               intermediate: int = 128):
    """HF Llama (grouped-query attention, SwiGLU, RMSNorm, rotary) at a test size, with the
    byte vocabulary of examples.data, so byte_batches feed it."""
    torch.manual_seed(0)
    return llama_bytes.make_model(n_layer, hidden, intermediate, heads, kv_heads,
                                  seq_len=128).eval()


@pytest.fixture
def llama():
    return tiny_llama()


@pytest.fixture
def cnn_model():
    torch.manual_seed(0)
    return cnn.make_model(width=16).eval()


@pytest.fixture
def cnn_batch():
    return cnn.image_batches(1, batch_size=4, seed=0)[0]


class ComputeProbe:
    """Observes, inside each module's forward, the dtypes the matmul-like aten ops really run in.

    A TorchDispatchMode sees every aten op after autocast and the FP8 router have done their
    work; forward pre/post hooks track the innermost running module. Records, per module fqn,
    a list of (op name, operand dtypes) and the number of casts to an FP8 dtype.
    """

    MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm"}

    def __init__(self, model):
        self.model = model
        self.ops: dict[str, list] = {}
        self.fp8_casts: dict[str, int] = {}
        self._stack = [None]  # None: outside every forward (e.g. in backward): not recorded
        self._handles = []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        probe = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func.overloadpacket.__name__
                fqn = probe._stack[-1]
                if fqn is None:
                    return func(*args, **kwargs)
                if name in probe.MATMUL_OPS:
                    # the two multiplied operands: addmm/baddbmm take the bias first
                    first = 1 if name in ("addmm", "baddbmm") else 0
                    dtypes = tuple(a.dtype for a in args[first:first + 2])
                    probe.ops.setdefault(fqn, []).append((name, dtypes))
                if name in ("_to_copy", "to") and kwargs.get("dtype") in (
                        torch.float8_e4m3fn, torch.float8_e5m2):
                    probe.fp8_casts[fqn] = probe.fp8_casts.get(fqn, 0) + 1
                return func(*args, **kwargs)

        for fqn, mod in self.model.named_modules():
            self._handles.append(mod.register_forward_pre_hook(
                lambda m, a, fqn=fqn: self._stack.append(fqn)))
            self._handles.append(mod.register_forward_hook(self._pop))
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def _pop(self, module, args, output):
        self._stack.pop()  # returns None: a forward hook's return value replaces the output

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for h in self._handles:
            h.remove()
        return False

    def matmul_dtypes(self, fqn: str) -> set:
        """Operand dtypes of the matmul-like ops run directly inside module ``fqn``."""
        return {d for _, dts in self.ops.get(fqn, []) for d in dts}


def poison_and_train(model, layer: str, batch, guard, steps: int) -> None:
    """Put an inf in ``layer``'s weight, then run ``steps`` guarded training steps."""
    with torch.no_grad():
        model.get_submodule(layer).weight[0, 0] = float("inf")
    for _ in range(steps):
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        guard.step()
