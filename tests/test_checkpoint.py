"""autoprec.checkpoint: checkpoints read as untrusted files. Real ones (torch.save of HF GPT-2
and Llama state dicts, an AdamW training checkpoint, HF folders) load; hostile ones (a pickle
bomb, nesting, a FIFO, links out of the folder, crafted globals, meta/sparse/non-finite
tensors) are one-line errors in bounded time. CLI cases run the real `autoprec` script."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile

import pytest
import torch
from torch import nn

from autoprec import checkpoint
from autoprec.checkpoint import (
    CHECKPOINT_FACTOR,
    CHECKPOINT_SLACK,
    MAX_EXPANDED,
    MAX_KEY_WORK,
    MAX_PICKLE_DEPTH,
    MAX_PICKLE_OPS,
    STATE_DICT_KEYS,
    WRAPPER_COMPONENTS,
    load_checkpoint,
    read_state_dict,
    scan_pickle,
)
from autoprec.policy import Policy
from examples import llama_bytes
from examples.data import byte_batches
from examples.gpt2_bytes import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUTOPREC = shutil.which("autoprec", path=os.path.dirname(sys.executable)) or "autoprec"
TARGET = "transformer.wte.weight"


def _gpt2(seed=1):
    torch.manual_seed(seed)
    return make_model(2, 64, 1, 64)


def _llama(seed=1):
    torch.manual_seed(seed)
    return llama_bytes.make_model(2, 64, 128, 4, 2, 64)


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _refused(path, *needles, model=None, error=ValueError):
    """Loading ``path`` is a one-line error naming it (and each needle); nothing is loaded."""
    target = model if model is not None else make_model(2, 64, 1, 64)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(error) as info:
        load_checkpoint(target, path)
    msg = str(info.value)
    assert type(info.value) is error, (type(info.value), msg)
    assert "\n" not in msg and "\x1b" not in msg and str(path) in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    return msg


@contextlib.contextmanager
def deadline(seconds):
    """Fail instead of hanging: a blocking open() is interrupted by the alarm."""
    def expired(signum, frame):
        raise TimeoutError(f"still reading after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _torch_zip(path, pickled, *, compression=zipfile.ZIP_STORED, prefix=b""):
    """A file laid out as torch.save's archive, holding ``pickled`` as its data.pkl."""
    with zipfile.ZipFile(path, "w", compression) as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    if prefix:
        path.write_bytes(prefix + path.read_bytes())
    return path


def _data_pkl(path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _bomb(depth=40) -> bytes:
    """A dict keyed by a tuple nested ``depth`` deep, each level holding the one below twice
    (shared through the memo): the weights-only unpickler hashes 2**depth items in C."""
    level = b"h\x01\x86q\x01"  # BINGET 1, TUPLE2 (with the copy on the stack), BINPUT 1
    return b"\x80\x02}q\x00K\x00K\x00\x86q\x01" + level * depth + b"K\x01s."


# ------------------------------------------------------------------------------ real ones load
def _training_checkpoint(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    model(**byte_batches(1, 2, 32, seed=0)[0]).loss.backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LinearLR(opt)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "scaler": torch.amp.GradScaler("cpu").state_dict(),
            "step": 7, "rng": torch.get_rng_state(), "py_rng": random.getstate(),
            "args": {"lr": 1e-3, "betas": (0.9, 0.999), "name": "run", "resume": None}}


def _save_real(kind, source, folder):
    """Write ``source``'s weights as ``kind``; returns the path to load."""
    sd = source.state_dict()
    if kind in ("gpt2", "llama"):
        torch.save(sd, folder / "ckpt.pt")  # an OrderedDict with _metadata; GPT-2's tied head
        return folder / "ckpt.pt"
    if kind == "training":
        torch.save(_training_checkpoint(source), folder / "train.pt")
        return folder / "train.pt"
    if kind == "parameters":
        torch.save(dict(source.named_parameters()), folder / "params.pt")
        return folder / "params.pt"
    hf = folder / "hf"
    hf.mkdir()
    source.config.save_pretrained(hf)
    if kind == "hf_bin":
        torch.save(sd, hf / "pytorch_model.bin")
    elif kind == "hf_bin_shards":
        names = list(sd)
        shards = {"pytorch_model-00001-of-00002.bin": names[:len(names) // 2],
                  "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
        for shard, keys in shards.items():
            torch.save({k: sd[k] for k in keys}, hf / shard)
        (hf / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}))
    else:  # a link to another file inside the folder is fine
        (hf / "weights").mkdir()
        torch.save(sd, hf / "weights" / "real.bin")
        os.symlink(os.path.join("weights", "real.bin"), hf / "pytorch_model.bin")
    return hf


@pytest.mark.parametrize("kind", ["gpt2", "llama", "training", "parameters", "hf_bin",
                                  "hf_bin_shards", "link_inside"])
def test_real_checkpoints_still_load(tmp_path, kind):
    source = _llama(1) if kind == "llama" else _gpt2(1)
    path = _save_real(kind, source, tmp_path)
    target = _llama(2) if kind == "llama" else _gpt2(2)
    assert not _same_weights(source, target)
    load_checkpoint(target, path)
    assert _same_weights(source, target)
    if kind != "llama":  # tied weights stay tied
        assert target.lm_head.weight.data_ptr() == target.transformer.wte.weight.data_ptr()


def test_the_scan_accepts_what_torch_save_writes(tmp_path):
    # every pickle of a real training run passes the scan, with room to spare on each bound
    gpt2, llama = _gpt2(), _llama()
    objects = {"gpt2_training": _training_checkpoint(gpt2),
               "llama_training": _training_checkpoint(llama),
               "llama_optimizer": torch.optim.AdamW(llama.parameters()).state_dict(),
               "llama_parameters": dict(llama.named_parameters()),
               "views": {"a": torch.arange(10.0), "b": torch.arange(10.0)[2:5]},
               "bf16_aliases": {k: v.bfloat16() for k, v in gpt2.state_dict().items()}}
    for name, obj in objects.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        scan_pickle(_data_pkl(tmp_path / f"{name}.pt"), name)
    # and what it refuses, it refuses naming what it was told
    with pytest.raises(ValueError, match="^Checkpoint the bomb was refused unread"):
        scan_pickle(_bomb(), "the bomb")


@pytest.mark.parametrize("key", STATE_DICT_KEYS)
@pytest.mark.parametrize("wrapper", ("",) + WRAPPER_COMPONENTS)
def test_training_checkpoints_under_each_key_and_wrapper(tmp_path, key, wrapper):
    source = _gpt2(1)
    prefix = f"{wrapper}." if wrapper else ""
    torch.save({key: {prefix + k: v for k, v in source.state_dict().items()}, "epoch": 3},
               tmp_path / "ckpt.pt")
    target = _gpt2(2)
    load_checkpoint(target, tmp_path / "ckpt.pt")
    assert _same_weights(source, target)


def test_size_is_bounded_before_reading(tmp_path):
    model = _gpt2()
    weights = sum(v.numel() * v.element_size() for k, v in model.state_dict().items()
                  if k != "lm_head.weight")  # tied to the embedding: counted once
    limit = CHECKPOINT_FACTOR * weights + CHECKPOINT_SLACK
    torch.save({"model": model.state_dict(), "junk": torch.zeros(limit // 4 + 1)},
               tmp_path / "big.pt")
    _refused(tmp_path / "big.pt", f"more than the {limit / 2 ** 20:.1f} MiB",
             f"{CHECKPOINT_FACTOR}x its weights", model=model)


# ------------------------------------------------------------------------------ 1. bounded time
def test_pickle_bomb_is_refused_in_milliseconds(tmp_path):
    # 26 levels: without the scan, torch.load hashes 2**26 items (a second; 40 take hours)
    bomb = _torch_zip(tmp_path / "bomb.pt", _bomb(26))
    assert bomb.stat().st_size < 1200
    start = time.perf_counter()
    _refused(bomb, "refused unread", f"more than {MAX_EXPANDED:,} parts")
    assert time.perf_counter() - start < 0.5


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


TASK_FILE = '''
import autoprec
from examples.data import byte_batches
from examples.gpt2_bytes import make_model


def task():
    return autoprec.Task(model=lambda: make_model(2, 64, 1, 64),
                         batches=byte_batches(2, 4, 64, seed=1), name="tiny")
'''


@pytest.fixture()
def cli_files(tmp_path):
    (tmp_path / "tiny_task.py").write_text(TASK_FILE)
    Policy(default="fp32", layers={"transformer.h.*.mlp.c_fc": "fp16"}).save(tmp_path / "p.yaml")
    return f"{tmp_path / 'tiny_task.py'}:task", tmp_path / "p.yaml", tmp_path


def _recheck(cli_files, ckpt, *, interrupt_after=None, timeout=120):
    """Run ``autoprec recheck`` on ``ckpt``: (exit code, stderr, seconds from its "loading"
    line to its exit, seconds in all). A run still going after ``timeout`` is killed and the
    test fails; ``interrupt_after``: send SIGINT that long after the "loading" line."""
    task, policy, tmp = cli_files
    start = time.monotonic()
    proc = subprocess.Popen([AUTOPREC, "recheck", task, "--policy", str(policy), "--checkpoint",
                             str(ckpt), "-o", str(tmp / "report.yaml")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp)
    lines, loading = [], threading.Event()
    when = {}

    def read():
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("recheck: loading") and not loading.is_set():
                when["loading"] = time.monotonic()
                loading.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if interrupt_after is not None:
        assert loading.wait(timeout), "".join(lines)[-3000:]
        time.sleep(interrupt_after)
        when["interrupt"] = time.monotonic()
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # SIGINT and SIGTERM would not end a hash running in C
        proc.wait()
        pytest.fail(f"autoprec recheck {ckpt} still ran after {timeout} s")
    end = time.monotonic()
    reader.join(10)
    stderr = "".join(lines)
    assert "loading" in when, stderr[-3000:]
    return proc.returncode, stderr, end - when.get("interrupt", when["loading"]), end - start


def _one_line_error(code, stderr, *needles):
    assert code == 2, (code, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("autoprec: error: ")]
    assert len(errors) == 1, stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.mark.slow  # a subprocess: the real console script (about 5 s, most of it starting)
def test_pickle_bomb_through_the_cli_is_one_line_in_bounded_time(cli_files):
    # before the scan, torch.load hashed for hours, deaf to SIGINT and SIGTERM
    bomb = _torch_zip(cli_files[2] / "bomb.pt", _bomb())
    code, stderr, reading, total = _recheck(cli_files, bomb, timeout=60)
    _one_line_error(code, stderr, "bomb.pt", "refused unread")
    # the bomb refused as soon as it is read; and nothing before the "loading" line reads
    # it either (a bomb hashes for hours): the whole run is the CLI's start-up, which read
    # 13 s once on 2 cores shared with two benchmarks (under 10 s alone)
    assert reading < 2 and total < 30, (reading, total)


@pytest.mark.slow
def test_ctrl_c_while_reading_a_large_checkpoint(cli_files):
    # just under MAX_PICKLE_OPS: seconds of scanning (then of unpickling), all of it Python
    big = cli_files[2] / "big.pt"
    torch.save({"w": [i % 200 for i in range(MAX_PICKLE_OPS - 10_000)]}, big)
    code, stderr, after, _ = _recheck(cli_files, big, interrupt_after=0.5, timeout=60)
    assert code == 130 and "interrupted" in stderr and "Traceback" not in stderr, (
        code, stderr[-3000:])
    assert after < 3, after


def _nested(depth):
    value = torch.ones(1)
    for _ in range(depth):
        value = [value]
    return value


def _shared_then_changed() -> bytes:
    # a list L, a list holding L twice, then L changed: the count of the outer list is stale
    return (b"\x80\x02}q\x00X\x01\x00\x00\x00wq\x01]q\x02](h\x02h\x02e"  # {"w": [L, L]
            b"h\x02K\x05a0" b"s.")                                     # L.append(5)


def _deflated(tmp_path):
    torch.save({"a": torch.ones(3)}, tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "plain.pt") as src, \
            zipfile.ZipFile(tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return tmp_path / "deflated.pt"


def _duplicated(tmp_path):
    # torch's reader finds names without regard to case: which data.pkl would it unpickle?
    path = _torch_zip(tmp_path / "dup.pt", pickle.dumps({"a": 1}, protocol=2))
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("archive/DATA.pkl", pickle.dumps({"b": 2}, protocol=2))
    return path


def _list_bomb(path):
    shared = [0]
    for _ in range(40):
        shared = [shared, shared]
    torch.save({"w": shared}, path)


HOSTILE_STRUCTURES = {
    "deep": (lambda p: torch.save({"w": _nested(MAX_PICKLE_DEPTH + 10)}, p),
             f"deeper than {MAX_PICKLE_DEPTH} levels"),
    "list_bomb": (_list_bomb, "parts out of shared references"),
    "tuple_keys": (lambda p: torch.save({(i, i): 1 for i in range(MAX_KEY_WORK // 3 + 1)}, p),
                   "keys dicts by tuples"),
    # (2**64 + i * (2**61 - 1) would all share one hash: building that dict takes seconds)
    "wide_int_keys": (lambda p: torch.save({2 ** 64 + i: 1 for i in range(MAX_KEY_WORK + 1)}, p),
                      "keys dicts by tuples or wide integers"),
    "shared_then_changed": (lambda p: _torch_zip(p, _shared_then_changed()),
                            "changes an object after referring to it elsewhere"),
    "protocol_4": (lambda p: torch.save({"a": torch.ones(2)}, p, pickle_protocol=4),
                   "uses the instruction"),
    "malformed": (lambda p: _torch_zip(p, b"\x80\x02}q\x00(X\x01\x00\x00\x00a"),
                  "is malformed"),
    "append_to_a_string": (lambda p: _torch_zip(p, b"\x80\x02X\x01\x00\x00\x00x]a."),
                           "adds to an object that is not a container"),
    "legacy": (lambda p: torch.save({"a": torch.ones(2)}, p,
                                    _use_new_zipfile_serialization=False), "legacy format"),
    "prepended": (lambda p: _torch_zip(p, pickle.dumps({"a": 1}, protocol=2),
                                       prefix=b"PK\x03\x04" + b"\0" * 60),
                  "central directory is not where"),
    "duplicate_records": (_duplicated, "two records of one name"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_STRUCTURES))
def test_hostile_pickles_and_archives_are_refused_before_torch_reads_them(tmp_path, case):
    build, needle = HOSTILE_STRUCTURES[case]
    path = tmp_path / f"{case}.pt"
    if case == "duplicate_records":
        path = build(tmp_path)
    else:
        build(path)
    start = time.perf_counter()
    _refused(path, needle)
    assert time.perf_counter() - start < 5


def test_compressed_and_torchscript_archives_are_refused(tmp_path):
    _refused(_deflated(tmp_path), "compressed")
    torch.jit.save(torch.jit.trace(nn.Linear(2, 2), torch.ones(1, 2)), tmp_path / "ts.pt")
    msg = _refused(tmp_path / "ts.pt", "TorchScript archive")
    assert "weights_only" not in msg


def test_instruction_count_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "MAX_PICKLE_OPS", 5000)
    torch.save({"w": list(range(10000))}, tmp_path / "long.pt")
    _refused(tmp_path / "long.pt", "more than 5,000 instructions")


# ------------------------------------------------------------------------------ 2. regular files
@pytest.mark.slow
def test_fifo_checkpoint_through_the_cli_is_refused_without_blocking(cli_files):
    fifo = cli_files[2] / "ckpt.pt"
    os.mkfifo(fifo)  # no writer: open() without O_NONBLOCK would wait for one forever
    code, stderr, reading, _ = _recheck(cli_files, fifo, timeout=60)
    _one_line_error(code, stderr, "ckpt.pt", "FIFO", "not a regular file")
    assert reading < 2, reading


def _hf_folder_with(tmp_path, where):
    """An HF checkpoint folder of the tiny GPT-2 whose ``where`` file is not a regular file."""
    hf = tmp_path / "hf"
    hf.mkdir()
    sd = _gpt2().state_dict()
    if where in ("index", "shard"):
        torch.save(sd, hf / "pytorch_model-00001.bin")
        (hf / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"weight_map": {k: "pytorch_model-00001.bin" for k in sd}}))
    victim = {"index": "pytorch_model.bin.index.json", "shard": "pytorch_model-00001.bin",
              "model_bin": "pytorch_model.bin", "model_safetensors": "model.safetensors"}[where]
    with contextlib.suppress(FileNotFoundError):
        os.remove(hf / victim)
    os.mkfifo(hf / victim)
    return hf, victim


@pytest.mark.parametrize("where", ["index", "shard", "model_bin", "model_safetensors"])
def test_fifo_in_an_hf_folder_is_refused_without_blocking(tmp_path, where):
    hf, victim = _hf_folder_with(tmp_path, where)
    with deadline(20):
        msg = _refused(hf, victim, "FIFO")
    assert "not a regular file" in msg


def test_devices_and_sockets_are_refused(tmp_path):
    with deadline(20), pytest.raises(ValueError, match="is a character device, not a regular"):
        read_state_dict(os.devnull, max_bytes=2 ** 20)
    with deadline(20):
        _refused(os.devnull, "character device")
        server = socket.socket(socket.AF_UNIX)
        try:
            server.bind(str(tmp_path / "sock.pt"))
            _refused(tmp_path / "sock.pt", "cannot be opened")
        finally:
            server.close()


# ------------------------------------------------------------------------------ 3. odd tensors
@pytest.mark.parametrize("kind, says", [("meta", "a meta tensor"),
                                        ("sparse", "a sparse tensor (sparse_coo)"),
                                        ("csr", "a sparse tensor (sparse_csr)")])
def test_meta_and_sparse_tensors_are_one_line_errors(tmp_path, kind, says):
    sd = _gpt2().state_dict()
    w = sd[TARGET]
    sd[TARGET] = {"meta": lambda: torch.empty(w.shape, device="meta"),
                  "sparse": lambda: w.to_sparse(), "csr": lambda: w.to_sparse_csr()}[kind]()
    torch.save(sd, tmp_path / f"{kind}.pt")
    _refused(tmp_path / f"{kind}.pt", says, f"`{TARGET}`")


# ------------------------------------------------------------------------------ 4. links
def _outside_links(tmp_path, which, outside_bytes=None):
    """An HF folder whose ``which`` file is a link to a file outside it (a checkpoint of the
    right model, or ``outside_bytes``)."""
    sd = _gpt2().state_dict()
    outside = tmp_path / ("outside.safetensors" if which == "single_safetensors" else
                          "outside.json" if which == "index" else "outside.bin")
    hf = tmp_path / "hf"
    hf.mkdir()
    if which == "index":
        torch.save(sd, hf / "pytorch_model-00001.bin")
        outside.write_text(json.dumps({"weight_map": {k: "pytorch_model-00001.bin"
                                                      for k in sd}}))
        link = hf / "pytorch_model.bin.index.json"
    elif which == "shard":
        (hf / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"weight_map": {k: "pytorch_model-00001.bin" for k in sd}}))
        torch.save(sd, outside)
        link = hf / "pytorch_model-00001.bin"
    elif which == "single_safetensors":
        from safetensors.torch import save_file
        save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, outside)
        link = hf / "model.safetensors"
    else:
        torch.save(sd, outside)
        link = hf / "pytorch_model.bin"
    if outside_bytes is not None:
        outside.write_bytes(outside_bytes)
    os.symlink(os.path.relpath(outside, hf), link)
    return hf, link.name


@pytest.mark.parametrize("which", ["shard", "index", "single_bin", "single_safetensors"])
def test_links_out_of_the_checkpoint_folder_are_not_followed(tmp_path, which):
    hf, link = _outside_links(tmp_path, which)
    _refused(hf, link, "leads out of the checkpoint folder")


def test_errors_never_echo_the_files_contents(tmp_path):
    # the weights-only unpickler named the first byte it refused ("Unsupported operand 27")
    secret = b"\x1b]0;SECRET-TOKEN\x07\x1b[2J" + b"S" * 4000
    hf, _ = _outside_links(tmp_path, "single_bin", outside_bytes=secret)
    msg = _refused(hf, "leads out of the checkpoint folder")
    assert "SECRET" not in msg and "operand" not in msg, msg
    (tmp_path / "junk.bin").write_bytes(secret)
    (tmp_path / "junk.safetensors").write_bytes(len(secret).to_bytes(8, "little") + secret)
    for junk in ("junk.bin", "junk.safetensors"):
        msg = _refused(tmp_path / junk)
        assert "SECRET" not in msg and "SSSS" not in msg and "operand" not in msg, msg


# ------------------------------------------------------------------------------ 5. messages
class _Call:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _crafted_global(path, module: bytes, name: bytes):
    # {"w": module.name()} with the global's name exactly as given (escape bytes and all)
    _torch_zip(path, b"\x80\x02}q\x00X\x01\x00\x00\x00wc" + module + b"\n" + name +
               b"\n)Rs.")


@pytest.mark.parametrize("case", ["os.system", "subprocess.call", "escapes"])
def test_code_in_a_pickle_is_refused_without_torchs_advice(tmp_path, case):
    path = tmp_path / f"{case}.pt"
    touched = tmp_path / "pwned"
    if case == "escapes":
        _crafted_global(path, b"\x1b[2J\x1b[31mevil", b"system\x1b]0;title\x07")
    else:
        fn = os.system if case == "os.system" else subprocess.call
        torch.save({TARGET: _Call(fn, f"touch {touched}")}, path)
    msg = _refused(path, "Python objects other than tensors", "nothing of it was run")
    for advice in ("weights_only", "can still be loaded", "safe_globals", "allowlist",
                   "if you trust"):
        assert advice not in msg, (advice, msg)
    if case == "escapes":
        assert "\\x1b[2J\\x1b[31mevil.system\\x1b]0;title\\x07" in msg, msg
        assert "\x07" not in msg
    else:
        assert ("system" if case == "os.system" else "subprocess.call") in msg, msg
    assert not touched.exists()


@pytest.mark.parametrize("bad, dtype", [(float("nan"), torch.float32),
                                        (float("inf"), torch.bfloat16)])
def test_non_finite_checkpoints_are_refused(tmp_path, bad, dtype):
    sd = {k: v.to(dtype) for k, v in _gpt2().state_dict().items()}
    sd["transformer.h.1.mlp.c_fc.weight"][3, 5] = bad
    sd["transformer.h.1.mlp.c_proj.weight"][0, 0] = bad
    torch.save(sd, tmp_path / "diverged.pt")
    _refused(tmp_path / "diverged.pt", "non-finite", "`transformer.h.1.mlp.c_fc.weight`")


def test_names_from_the_file_are_bounded_and_escaped(tmp_path):
    sd = _gpt2().state_dict()
    torch.save({**sd, "\x1b[2Jevil\nkey": torch.ones(1), "k" * 5000: torch.ones(1)},
               tmp_path / "names.pt")
    msg = _refused(tmp_path / "names.pt", "are not the model's", "\\x1b[2Jevil\\nkey")
    assert len(msg) < 1000, len(msg)
    torch.save({("x",) * 5000: torch.ones(1), "y": 3}, tmp_path / "keys.pt")
    assert len(_refused(tmp_path / "keys.pt", "is not a state dict")) < 1000
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "\x1b[31mshard\u202e.safetensors"}}))
    msg = _refused(hf, "\\x1b[31mshard\\u202e.safetensors", error=FileNotFoundError)
    assert "\u202e" not in msg
