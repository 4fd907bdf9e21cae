"""A task that cannot be loaded, or that holds what autoprec cannot measure, is a one-line
error naming the spec, what went wrong and where: a task function that raises (what it raised,
the line in the task file), a task function that wants arguments, batches with no rows or no
data (meta), a device this build or host does not have. Through the real `autoprec` command
(exit 2, `autoprec: error: ...`) and through :func:`autoprec.load_task` (a TaskError)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import autoprec
from autoprec.task import Task, TaskError, load_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUTOPREC = os.path.join(os.path.dirname(sys.executable), "autoprec")

# A tiny task file's header: a real (tiny) model, so that a task that gets past loading would
# profile; every case below must stop before that.
HEADER = """\
import torch
from torch import nn
import autoprec

def model():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

def batches(n=2, rows=4):
    return [torch.randn(rows, 16) for _ in range(n)]

def loss(model, batch):
    return model(batch).pow(2).mean()
"""


def task_file(tmp_path, body: str, name: str = "mytask.py") -> str:
    path = tmp_path / name
    path.write_text(HEADER + "\n" + textwrap.dedent(body))
    return str(path)


def line_of(path: str, needle: str) -> int:
    with open(path) as f:
        return next(i for i, line in enumerate(f, 1) if needle in line)


def profile_cli(spec: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([AUTOPREC, "profile", spec, "-o", str(cwd / "p.json"), "--target",
                           "h100"], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    err = r.stderr.strip()
    assert err.startswith("autoprec: error: ") and "\n" not in err, err
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# ----------------------------------------------------------------------------- the task raises
RAISING = {
    "runtime": ("raise RuntimeError('the dataset shard is missing')",
                ["RuntimeError", "the dataset shard is missing"]),
    "keyerror": ("cfg = {}\n    return cfg['n_layer']", ["KeyError", "'n_layer'"]),
    # a TypeError raised inside the task function is not a signature problem
    "typeerror": ("return autoprec.Task(model=model, batches=batches(), loss_fn=loss, "
                  "device='cpu', no_such_field=1)", ["TypeError", "no_such_field"]),
}


@pytest.mark.parametrize("case", sorted(RAISING))
def test_a_task_function_that_raises_says_what_it_raised_and_where(tmp_path, case):
    statement, needles = RAISING[case]
    path = task_file(tmp_path, f"def task():\n    {statement}\n")
    where = f"mytask.py:{line_of(path, statement.splitlines()[-1].strip())}"
    err = one_line_error(profile_cli(f"{path}:task", tmp_path), f"{path}:task", where, *needles)
    assert "takes no arguments" not in err
    assert not (tmp_path / "p.json").exists()

    with pytest.raises(TaskError) as e:
        load_task(f"{path}:task")
    assert where in str(e.value) and "\n" not in str(e.value)
    # the task's own exception is kept, traceback and all, for whoever wants it
    assert type(e.value.__cause__).__name__ == needles[0]


def test_the_line_is_the_task_files_own_even_when_the_error_is_deeper(tmp_path):
    # the exception is raised in a helper module; the line named is where the task file
    # called into it (the innermost frame in the task's file)
    (tmp_path / "helper_data.py").write_text("def shard(i):\n    raise OSError(f'no shard {i}')\n")
    path = task_file(tmp_path, """\
        import sys, os
        sys.path.insert(0, os.path.dirname(__file__))
        import helper_data

        def task():
            data = helper_data.shard(3)
            return data
        """)
    with pytest.raises(TaskError) as e:
        load_task(f"{path}:task")
    msg = str(e.value)
    assert f"mytask.py:{line_of(path, 'helper_data.shard(3)')}" in msg, msg
    assert "OSError" in msg and "no shard 3" in msg


def test_a_task_function_that_wants_arguments_is_told_it_takes_none(tmp_path):
    path = task_file(tmp_path, """\
        def task(size):
            return autoprec.Task(model=model, batches=batches(), loss_fn=loss, device="cpu")
        """)
    one_line_error(profile_cli(f"{path}:task", tmp_path), f"{path}:task", "takes no arguments",
                   "size")


def test_a_task_function_with_defaults_still_loads(tmp_path):
    path = task_file(tmp_path, """\
        def task(rows=4, *, seed=0):
            return autoprec.Task(model=model, batches=batches(rows=rows), loss_fn=loss,
                                 device="cpu", seed=seed)
        """)
    task = load_task(f"{path}:task")
    assert isinstance(task, Task) and task.batches[0].shape == (4, 16)


# ----------------------------------------------------------------------------- batches
def test_a_batch_with_no_rows_is_refused_naming_it(tmp_path):
    path = task_file(tmp_path, """\
        def task():
            data = batches(3)
            data[1] = torch.empty(0, 16)
            return autoprec.Task(model=model, batches=data, loss_fn=loss, device="cpu")
        """)
    err = one_line_error(profile_cli(f"{path}:task", tmp_path), "batch 1", "0 rows")
    assert "no linear" not in err and "captured layers" not in err
    assert not (tmp_path / "p.json").exists()

    # a dict batch, one of whose tensors is empty; and the held-out batches
    ids = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(TaskError, match=r"batch 0 .*`labels`.*0 rows"):
        Task(model=torch.nn.Linear(8, 8), batches=[{"input_ids": ids, "labels": ids[:0]}])
    with pytest.raises(TaskError, match=r"eval_batches\[1\].*0 rows"):
        Task(model=torch.nn.Linear(16, 16), batches=[torch.randn(4, 16)],
             eval_batches=[torch.randn(2, 16), torch.randn(0, 16)])


def test_meta_batches_are_refused(tmp_path):
    path = task_file(tmp_path, """\
        def task():
            data = [torch.empty(4, 16, device="meta") for _ in range(2)]
            return autoprec.Task(model=model, batches=data, loss_fn=loss, device="cpu")
        """)
    one_line_error(profile_cli(f"{path}:task", tmp_path), "batch 0", "meta",
                   "batches must hold real data")
    with pytest.raises(TaskError, match="meta tensors have none"):
        Task(model=torch.nn.Linear(16, 16),
             batches=[(torch.randn(4, 16), torch.empty(4, device="meta"))])


def test_a_shape_batch_may_be_meta_but_not_empty():
    # only its shapes are read (a production-size batch needs no memory)
    big = torch.empty(64, 16, device="meta")
    assert Task(model=torch.nn.Linear(16, 16), batches=[torch.randn(4, 16)],
                shape_batch=big).shape_batch is big
    with pytest.raises(TaskError, match="shape_batch.*0 rows"):
        Task(model=torch.nn.Linear(16, 16), batches=[torch.randn(4, 16)],
             shape_batch=torch.empty(0, 16, device="meta"))


# ----------------------------------------------------------------------------- devices
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_on_a_host_without_it_is_refused(tmp_path):
    path = task_file(tmp_path, """\
        def task():
            return autoprec.Task(model=model, batches=batches(), loss_fn=loss, device="cuda")
        """)
    one_line_error(profile_cli(f"{path}:task", tmp_path), "device 'cuda'", "no CUDA",
                   'device="cpu"')
    with pytest.raises(TaskError, match="no CUDA"):
        Task(model=torch.nn.Linear(16, 16), batches=[torch.randn(4, 16)],
             device=torch.device("cuda", 0))
    # None picks what the host has
    assert Task(model=torch.nn.Linear(16, 16), batches=[torch.randn(4, 16)]).device.type == "cpu"


def test_a_cuda_index_past_the_last_gpu_is_refused():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(TaskError, match=f"cuda:{n + 3}"):
        Task(model=torch.nn.Linear(16, 16), batches=[torch.randn(4, 16)], device=f"cuda:{n + 3}")


@pytest.mark.parametrize("device", ["gpu", "cpu:x", "", "meta", 3.5])
def test_a_device_torch_cannot_use_is_refused(tmp_path, device):
    with pytest.raises(TaskError) as e:
        Task(model=torch.nn.Linear(16, 16), batches=[torch.randn(4, 16)], device=device)
    msg = str(e.value)
    assert repr(device) in msg and "\n" not in msg and 'device="cpu"' in msg, msg


def test_a_bad_device_through_the_command(tmp_path):
    path = task_file(tmp_path, """\
        def task():
            return autoprec.Task(model=model, batches=batches(), loss_fn=loss, device="gpu")
        """)
    line = line_of(path, 'device="gpu"')
    one_line_error(profile_cli(f"{path}:task", tmp_path), f"{path}:task", "device 'gpu'",
                   f"mytask.py:{line}")


def test_a_good_task_still_profiles(tmp_path):
    path = task_file(tmp_path, """\
        def task():
            return autoprec.Task(model=model, batches=batches(), loss_fn=loss, device="cpu")
        """)
    task = load_task(f"{path}:task")
    prof = autoprec.profile(task, formats=("fp32", "bf16"), target="h100", progress=False)
    assert {L.fqn for L in prof.layers} >= {"0", "2"}


def test_batches_given_to_profile_are_checked_like_the_tasks():
    task = Task(model=torch.nn.Sequential(torch.nn.Linear(16, 16)), batches=[torch.randn(4, 16)],
                loss_fn=lambda out, batch: out.square().mean(), device="cpu")
    with pytest.raises(TaskError, match=r"profile\(batches=\.\.\.\) batch 1 .*0 rows"):
        autoprec.profile(task, batches=[torch.randn(4, 16), torch.randn(0, 16)],
                         target="h100", progress=False)


def test_the_default_loss_reads_every_output_form_of_a_real_hf_model():
    # one reading of "the loss in a model's output" (autoprec._util.loss_of) for the task's
    # default loss and the training integrations' held batches: ModelOutput, a tuple
    # (return_dict=False), a scalar; an output without a loss is a one-line error
    from transformers import GPT2Config, GPT2LMHeadModel

    from autoprec.task import default_loss

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                       n_head=2)).eval()  # no dropout: one loss per batch
    ids = torch.randint(0, 64, (2, 16))
    expected = model(input_ids=ids, labels=ids).loss
    assert torch.equal(default_loss(model, {"input_ids": ids, "labels": ids}), expected)
    plain = {"input_ids": ids, "labels": ids, "return_dict": False}
    assert torch.equal(default_loss(model, plain), expected)
    assert torch.equal(default_loss(lambda x: x.sum(), torch.ones(3)), torch.tensor(3.0))
    with pytest.raises(ValueError, match="no `.loss`") as e:
        default_loss(model, {"input_ids": ids})
    assert "\n" not in str(e.value)
