"""The ``autoprec`` command: profile, tune, validate, show, diff, export.

    autoprec profile examples/gpt2_bytes.py:task -o gpt2.profile.json
    autoprec tune examples/gpt2_bytes.py:task -o policies/gpt2_bytes.yaml [--target h100]
    autoprec validate policies/gpt2_bytes.yaml --task examples/gpt2_bytes.py:task --steps 200
    autoprec show policies/gpt2_bytes.yaml
    autoprec diff policies/a.yaml policies/b.yaml
    autoprec export policies/llama.yaml --to megatron --model examples/llama_bytes.py:gpu_task
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _profile_path(policy_path: str) -> str:
    return os.path.splitext(policy_path)[0] + ".profile.json"


def _load_task(spec: str):
    from autoprec.task import load_task

    # models come from configs or shipped packages: never wait on a hub download
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # task files in the working directory (examples/...) import their siblings as a package
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return load_task(spec)


def _cmd_profile(args) -> int:
    from autoprec.profiling import profile

    if args.output:
        _writable_output(args.output)
    task = _load_task(args.task)
    prof = profile(task, formats=args.formats, target=args.target, n_batches=args.batches,
                   sensitivity=args.sensitivity)
    print(prof.table())
    print(f"\nprofiled {len(prof.layers)} layers in {prof.elapsed:.1f} s "
          f"(capture: {prof.capture_method})")
    if args.output:
        prof.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _writable_output(path: str) -> None:
    """Refuse an output the tune could not write, before any work (and before the study file
    beside it is created)."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"-o {path} is a directory; give the policy's file path, e.g. "
                                f"{os.path.join(path, 'policy.yaml')}.")
    folder = os.path.dirname(os.path.abspath(path))
    probe = folder
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK):
        raise PermissionError(f"Cannot write {path}: {probe} is not writable. Choose another -o.")


def _cmd_tune(args) -> int:
    from autoprec.policy import Budget
    from autoprec.tuning import TuneConfig, tune, validate_front

    _writable_output(args.output)
    config = TuneConfig(formats=tuple(args.formats),
                        budget=Budget(args.max_loss_increase, args.max_grad_error),
                        n_trials=args.n_trials, timeout=args.timeout, storage=args.storage,
                        study_name=args.study, target=args.target, seed=args.seed,
                        grouping=args.groups, output=args.output,
                        couple=tuple(tuple(names) for names in args.couple),
                        max_memory=args.max_memory, sensitivity=args.sensitivity)
    task = _load_task(args.task)
    result = tune(task, config)
    print(result.summary())
    if args.validate_steps:
        result = validate_front(result, task, steps=args.validate_steps)
        if result.validation is None or not result.validation.passed:
            print("no policy on the Pareto front passed validation; writing all-fp32",
                  file=sys.stderr)
    written = result.save(args.output)
    if result.profile is not None:
        result.profile.save(_profile_path(args.output))
        written.append(_profile_path(args.output))
    print("wrote " + ", ".join(written))
    print(f"study: {result.study_name} in {result.storage}")
    return 0


def _cmd_validate(args) -> int:
    from autoprec.policy import load_policy
    from autoprec.validation import validate

    policy = load_policy(args.policy)
    task = _load_task(args.task)
    res = validate(task, policy, steps=args.steps, tolerance=args.tolerance,
                   strict=not args.no_strict)
    print(res.report())
    return 0 if res.passed else 1


def _cmd_show(args) -> int:
    from autoprec.policy import load_policy
    from autoprec.profiling import Profile

    # everything is read (and checked) before anything is printed
    policy = load_policy(args.policy)
    prof_path = args.profile or _profile_path(args.policy)
    prof = Profile.load(prof_path) if os.path.exists(prof_path) else None
    lines = [f"policy {args.policy}"]
    if policy.model_name:
        lines.append(f"  model: {policy.model_name}  fingerprint {policy.fingerprint or '-'}")
    lines.append(f"  default: {policy.default.label}")
    lines += [f"  {pattern}: {fmt.label}" for pattern, fmt in policy.layers.items()]
    if any(f.is_fp8 for f in policy.formats_used()):
        lines.append(f"  fp8: default recipe {policy.fp8_recipe}, engine {policy.fp8_engine}")
    if policy.tuned:
        lines += ["provenance:", _provenance_text(policy.provenance)]
    if prof is not None:
        lines.append(_layer_reasons(policy, prof, prof_path))
    else:
        lines.append(f"\n(no profile at {prof_path}: per-layer reasons need the profile `tune` "
                     "writes)")
    print("\n".join(lines))
    return 0


def _provenance_text(prov) -> str:
    lines = []
    for key in ("device", "torch", "task"):
        if getattr(prov, key):
            lines.append(f"  {key}: {getattr(prov, key)}")
    if prov.budget is not None:
        grad = prov.budget.max_grad_error
        lines.append(f"  budget: loss change <= {prov.budget.max_loss_increase:.2%}, gradient "
                     f"error <= {'-' if grad is None else f'{grad:g}'}")
    if prov.speedup is not None:
        rounds = f" ({prov.speedup.rounds} timing rounds)" if prov.speedup.rounds else ""
        lines.append(f"  speed-up vs fp32: {prov.speedup}{rounds}")
    if prov.loss_increase is not None:
        lines.append(f"  loss change vs fp32: {prov.loss_increase:+.3%}; gradient error "
                     f"{prov.grad_error if prov.grad_error is not None else float('nan'):.3g}")
    for note in prov.verdict:
        lines.append(f"  verdict: {note}")
    extra = dict(prov.extra)
    study = extra.pop("study", None)
    if isinstance(study, dict):
        lines.append(f"  study: {study.get('name')} ({study.get('trials')} trials, "
                     f"{study.get('distinct', '?')} distinct policies)")
    memory = extra.pop("memory", None)
    if isinstance(memory, dict) and memory.get("predicted_peak_bytes") is not None:
        from autoprec.memory import format_size

        lines.append("  peak training memory (predicted, one step on the calibration batch): "
                     f"{format_size(memory['predicted_peak_bytes'])}")
    timing = extra.pop("timing", None)
    if isinstance(timing, dict):
        drift = timing.get("fp32_drift")
        lines.append(f"  timing: {timing.get('rounds')} rounds; fp32 against itself within "
                     f"{timing.get('aa_noise', float('nan')):.1%}"
                     + (f"; fp32 steps during the search {drift[0]:.2f}-{drift[1]:.2f}x"
                        if drift else "")
                     + ("; too noisy to decide" if timing.get("too_noisy") else ""))
    for key, value in extra.items():
        lines.append(f"  {key}: {value}")
    return "\n".join(lines)


def _layer_reasons(policy, prof, prof_path: str) -> str:
    from autoprec._util import text_table

    budget = policy.provenance.budget
    limit = budget.max_loss_increase if budget is not None else 0.01
    rows = []
    mix: dict[str, float] = {}
    for lp in prof.layers:
        fmt = policy.format_for(lp.fqn)
        why = prof.fp8_reason(lp.fqn, fmt, max_loss_change=limit)
        rows.append((lp.fqn, lp.layer.kind, fmt.label, f"{lp.layer.flops / 1e9:.3f}", why,
                     _sources(lp)))
        mix[fmt.label] = mix.get(fmt.label, 0.0) + lp.layer.flops
    total = max(sum(mix.values()), 1)
    where = f"cost model {prof.target}" if prof.target else f"measured on {prof.device}"
    shares = ", ".join(f"{name} {flops / total:.1%}" for name, flops in
                       sorted(mix.items(), key=lambda kv: -kv[1]))
    return (f"\nper layer (profile {prof_path}, {where}):\n"
            + text_table(("layer", "kind", "format", "GFLOP", "why not fp8 / why this recipe",
                          "sensitivity"), rows, indent="  ", rule=False)
            + "\n  (recipes: speed vs bf16 as profiled, loss change with the layer alone in it;"
            + "\n  sensitivity: est = first-order estimate, meas = measured exactly)"
            + f"\n  {prof.sensitivity_summary()}"
            + f"\n\nmatmul FLOPs by format: {shares}")


def _sources(lp) -> str:
    """Which of a layer's numbers were estimated and which measured, and why measured."""
    parts = []
    for fmt, err in lp.sensitivity.items():
        why = lp.exact_why.get(fmt)
        parts.append(f"{fmt.label} {'est' if err.source == 'estimated' else 'meas'}"
                     + (f" ({why})" if why else ""))
    return ", ".join(parts) or "-"


def _cmd_diff(args) -> int:
    from autoprec.policy import load_policy
    from autoprec.profiling import Profile

    a, b = load_policy(args.a), load_policy(args.b)
    prof_path = next((p for p in (_profile_path(args.a), _profile_path(args.b))
                      if os.path.exists(p)), None)
    prof = Profile.load(prof_path) if prof_path is not None else None
    lines = []
    if a.default != b.default:
        lines.append(f"default: {a.default.label} -> {b.default.label}")
    for pattern in dict.fromkeys([*a.layers, *b.layers]):
        fa, fb = a.layers.get(pattern), b.layers.get(pattern)
        if fa != fb:
            lines.append(f"{pattern}: {fa.label if fa else '(default ' + a.default.label + ')'}"
                         f" -> {fb.label if fb else '(default ' + b.default.label + ')'}")
    differ = bool(lines)
    if prof is not None:
        changed = [(lp.fqn, a.format_for(lp.fqn), b.format_for(lp.fqn)) for lp in prof.layers
                   if a.format_for(lp.fqn) is not b.format_for(lp.fqn)]
        differ = differ or bool(changed)
        lines.append(f"resolved per layer ({len(changed)} of {len(prof.layers)} differ):")
        lines += [f"  {f}: {x.label} -> {y.label}" for f, x, y in changed]
    if not differ:
        lines.insert(0, "the two policies are the same")
    print("\n".join(lines))
    return 1 if differ else 0


def _cmd_export(args) -> int:
    from autoprec.exporting import ExportError, export, load_name_map, structure_of
    from autoprec.policy import load_policy

    if args.output:
        _writable_output(args.output)
    policy = load_policy(args.policy)
    names = load_name_map(args.name_map) if args.name_map else None
    if args.model is None:
        raise ExportError(f"autoprec export --to {args.to} names the model's modules: give "
                          "--model TASK_SPEC (the task the policy was tuned on; its model is "
                          "built on the meta device, without memory).")
    model = structure_of(_load_task(args.model))
    result = export(policy, args.to, model=model, strict=not args.no_strict, names=names)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.output:
        result.save(args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    return 0


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if len(names) < 2:
        raise argparse.ArgumentTypeError(f"{text!r} names fewer than two layers; give sibling "
                                         "names separated by commas, e.g. q_proj,k_proj,v_proj")
    return names


def _number(cast, what: str, ok, rule: str):
    """An argparse type: ``cast`` the text, and check it (``rule`` says what ``ok`` wants)."""
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    return parse


_positive_int = _number(int, "an integer", lambda v: v >= 1, "at least 1")
_nonneg_float = _number(float, "a number", lambda v: 0 <= v < float("inf"),
                        "a finite number >= 0")
_positive_float = _number(float, "a number", lambda v: 0 < v < float("inf"),
                          "a finite number greater than 0")


def _size(text: str) -> int:
    """An argparse type: bytes from 2GiB, 512MB or a plain number of bytes."""
    from autoprec.memory import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tune_parser(sub, fmts: dict, target: dict, sens: dict) -> None:
    p = sub.add_parser("tune", help="search a per-layer policy and write it as YAML")
    p.add_argument("task")
    p.add_argument("--sensitivity", **sens)
    p.add_argument("-o", "--output", required=True, help="policy path, e.g. policies/NAME.yaml")
    p.add_argument("--formats", **fmts)
    p.add_argument("--target", **target)
    p.add_argument("--max-loss-increase", type=_nonneg_float, default=0.01,
                   help="relative loss change allowed vs FP32 (default 0.01 = 1%%)")
    p.add_argument("--max-grad-error", type=_nonneg_float, default=0.25,
                   help="relative gradient error allowed vs FP32 (default 0.25)")
    p.add_argument("--n-trials", type=_positive_int, default=40,
                   help="distinct policies to measure, warm starts included (default 40)")
    p.add_argument("--timeout", type=_positive_float, default=None,
                   help="seconds for this worker")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL (sqlite:///, postgresql://, journal:PATH); "
                        "default: SQLite beside the output, so a rerun resumes")
    p.add_argument("--study", default=None, help="study name (share it between workers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", choices=["auto", "layer", "role"], default="auto",
                   help="one choice per layer, per role (transformer.h.*.mlp.c_fc) or auto")
    p.add_argument("--couple", type=_names, action="append", default=[], metavar="A,B,...",
                   help="sibling layers that share one choice because the model fuses them, "
                        "e.g. --couple q_proj,k_proj,v_proj (repeatable)")
    p.add_argument("--max-memory", type=_size, default=None, metavar="SIZE",
                   help="peak training-step memory the policy may need, as predicted for the "
                        "task's calibration batch: bytes or 2GiB, 512MB (default: no limit)")
    p.add_argument("--validate-steps", type=int, default=0,
                   help="train this many steps to validate the winner; fall back along the "
                        "Pareto front if it fails")
    p.set_defaults(fn=_cmd_tune)


def _parser() -> argparse.ArgumentParser:
    from autoprec.costmodel import DEVICES
    from autoprec.formats import FP8_RECIPES
    from autoprec.measure.sensitivity import SENSITIVITY_MODES

    ap = argparse.ArgumentParser(prog="autoprec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fmts = dict(nargs="+", default=["fp32", "bf16", "fp16", "fp8"],
                choices=["fp32", "bf16", "fp16", "fp8", *(f"fp8:{r}" for r in FP8_RECIPES)],
                help="formats to consider (default: all; fp8 means every FP8 recipe, "
                     "fp8:<recipe> one of them)")
    target = dict(default=None, choices=list(DEVICES),
                  help="price speed with the cost model of this device instead of measuring "
                       f"here: {', '.join(DEVICES)}")

    sens = dict(choices=list(SENSITIVITY_MODES), default="auto",
                help="how each layer x format's sensitivity is obtained: auto (default: "
                     "first-order estimates from one reference pass, those near the budget or "
                     "doubtful measured exactly), fast (estimates only), exact (all measured)")
    p = sub.add_parser("profile", help="each layer's error and speed in each format")
    p.add_argument("task", help="path/file.py:function or package.module:function")
    p.add_argument("-o", "--output", help="write the profile as JSON")
    p.add_argument("--formats", **fmts)
    p.add_argument("--target", **target)
    p.add_argument("--batches", type=_positive_int, default=2,
                   help="calibration batches (default 2)")
    p.add_argument("--sensitivity", **sens)
    p.set_defaults(fn=_cmd_profile)

    _tune_parser(sub, fmts, target, sens)

    p = sub.add_parser("validate", help="train with a policy and in FP32; compare loss curves")
    p.add_argument("policy")
    p.add_argument("--task", required=True)
    p.add_argument("--steps", type=_positive_int, default=100)
    p.add_argument("--tolerance", type=_nonneg_float, default=None,
                   help="allowed loss gap beyond FP32's run-to-run noise (default: the "
                        "policy's max_loss_increase, else 0.01)")
    p.add_argument("--no-strict", action="store_true",
                   help="apply a policy made for another model anyway (warn, do not refuse)")
    p.set_defaults(fn=_cmd_validate)

    p = sub.add_parser("show", help="a policy's layers, formats, provenance and reasons")
    p.add_argument("policy")
    p.add_argument("--profile", default=None, help="profile JSON (default: beside the policy)")
    p.set_defaults(fn=_cmd_show)

    p = sub.add_parser("diff", help="what differs between two policies (exit 0 same, 1 differ, "
                                    "2 error)")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(fn=_cmd_diff)

    p = sub.add_parser("export", help="write a policy for torchao, Megatron-Core or any stack "
                                      "(a JSON map of module name -> format)")
    p.add_argument("policy")
    p.add_argument("--to", required=True, choices=["torchao", "megatron", "fqn"],
                   help="torchao: a Python module whose convert(model) gives each fp8 layer "
                        "its recipe; megatron: a --te-precision-config-file; fqn: JSON")
    p.add_argument("--model", default=None, metavar="TASK_SPEC",
                   help="the task whose model names the layers (path/file.py:function)")
    p.add_argument("-o", "--output", default=None, help="write here (default: stdout)")
    p.add_argument("--name-map", default=None, metavar="FILE",
                   help="megatron: YAML of HF-name regex -> Megatron module path, tried before "
                        "the built-in Llama and GPT-2 names")
    p.add_argument("--no-strict", action="store_true",
                   help="export what the target cannot express exactly anyway, with notes")
    p.set_defaults(fn=_cmd_export)
    return ap


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)  # imports torch: a Ctrl-C may come here already
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    from autoprec.policy import PolicyError
    from autoprec.task import TaskError

    try:
        return args.fn(args)
    except KeyboardInterrupt:
        tail = (": completed trials are kept in the study; rerun the same command to resume"
                if args.cmd == "tune" else "")
        print(f"interrupted{tail}", file=sys.stderr)
        return 130
    except (PolicyError, TaskError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        print(f"autoprec: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except ValueError as e:
        # errors of input (our own ValueErrors, a storage that will not open); a ValueError
        # subclass from deep inside a library is a bug and keeps its traceback
        if type(e) is not ValueError and type(e).__name__ != "StorageError":
            raise
        print(f"autoprec: error: {_one_line(e)}", file=sys.stderr)
        return 2


def run() -> None:
    """The console script: :func:`main`, then exit at once. Everything is written and flushed
    by then; skipping the interpreter's shutdown means no thread or connection pool left by a
    library can keep the process alive, and a Ctrl-C cannot land in a finalizer."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
