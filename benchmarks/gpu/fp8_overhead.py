"""Where an eager FP8 nn.Linear's fixed cost goes (issue 40's run measured ~2-4 ms per forward +
backward above the GEMMs' price on an H200, at every size): torch.profiler over a few
forward + backward calls of one lone linear per engine, with the host-device syncs and copies
counted. Usage: python benchmarks/gpu/fp8_overhead.py [--device cpu] (CPU: emulated path)."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from autoprec import Policy, apply  # noqa: E402

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaMemcpyAsync", "aten::item", "aten::_local_scalar_dense")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="8192x768x768")
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device(args.device)
    m, k, n = (int(v) for v in args.shape.split("x"))
    warnings.simplefilter("ignore")
    lin = torch.nn.Linear(k, n).to(dev)
    x = torch.randn(m, k, device=dev, requires_grad=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for fmt, engine in (("bf16", "autoprec"), ("fp8", "autoprec"), ("fp8", "torchao")):
        model = torch.nn.Sequential(copy.deepcopy(lin))
        apply(model, Policy(default=fmt, engine=engine))

        def call(model=model):
            model(x).sum().backward()
        for _ in range(5):
            call()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        cpu_issue = (time.perf_counter() - t0) / args.calls
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.calls
        with profile(activities=acts) as prof:
            for _ in range(args.calls):
                call()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        events = prof.key_averages()
        counts = {e.key: e.count // args.calls for e in events if e.key in SYNCS}
        kernels = sum(e.count for e in events if e.device_type.name == "CUDA") // args.calls
        print(f"\n== {fmt} engine {engine}, {args.shape}: {wall * 1e3:.3f} ms per call "
              f"(host returns after {cpu_issue * 1e3:.3f} ms), GPU kernels per call {kernels}, "
              f"syncs/copies per call {counts or 'none'}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
