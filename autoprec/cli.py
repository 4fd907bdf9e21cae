"""The ``autoprec`` command: profile, tune, validate, show, diff, export, recheck.

    autoprec profile examples/gpt2_bytes.py:task -o gpt2.profile.json
    autoprec tune examples/gpt2_bytes.py:task -o policies/gpt2_bytes.yaml [--target h100]
    autoprec validate policies/gpt2_bytes.yaml --task examples/gpt2_bytes.py:task -o cert.yaml
    autoprec show policies/gpt2_bytes.yaml
    autoprec diff policies/a.yaml policies/b.yaml
    autoprec export policies/llama.yaml --to megatron --model examples/llama_bytes.py:gpu_task
    autoprec recheck examples/gpt2_bytes.py:task --policy P.yaml --checkpoint C.pt -o R.yaml
"""

from __future__ import annotations

import _thread
import argparse
import dataclasses
import functools
import math
import os
import signal
import sys
import threading

from autoprec import profile_view
from autoprec._util import EscapingStream, distinct_files, shown
from autoprec.task import task_file

__all__ = ["main"]


def _profile_path(policy_path: str) -> str:
    """The profile `tune` writes beside a policy."""
    from autoprec.tuning.config import TunePaths

    return TunePaths.from_output(policy_path).profile


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that it unwinds like a Ctrl-C: a tune's running
    trial is marked failed (a rerun measures it again) instead of left RUNNING."""


def _on_sigterm(signum, frame) -> None:
    # a second SIGTERM while this one unwinds kills at once, as SIGTERM normally does
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise _Terminated


def _load_task(spec: str):
    from autoprec.task import load_task

    # models come from configs or shipped packages: never wait on a hub download
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # task files in the working directory (examples/...) import their siblings as a package
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return load_task(spec)


def _more_than_fp32(formats: list[str], what: str) -> None:
    if set(formats) == {"fp32"}:
        raise ValueError(f"--formats fp32 leaves nothing to {what}: fp32 is the reference "
                         "every other format is compared with, always included; add at least "
                         "one of bf16, fp16, fp8.")


def _cmd_profile(args) -> int:
    from autoprec.profiling import profile

    _more_than_fp32(args.formats, "profile")
    if args.output:
        task = task_file(args.task)
        distinct_files([(args.output, f"-o {args.output}", True),
                        (task, f"the task file {task}", False)])
        _writable_output(args.output)
    task = _load_task(args.task)
    prof = profile(task, formats=args.formats, target=args.target, n_batches=args.batches,
                   sensitivity=args.sensitivity, only_winnable=args.only_winnable,
                   reference_gradients=args.reference_gradients)
    print(profile_view.table(prof))
    print(f"\nprofiled {len(prof.layers)} layers in {prof.elapsed:.1f} s "
          f"(capture: {prof.capture_method})")
    if args.output:
        prof.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _writable_output(path: str, *side: str) -> None:
    """Refuse an output (and the ``side`` files written beside it) that could not be written,
    before any work (and before the study file beside it is created)."""
    from autoprec._util import refuse_non_file, unwritable_folder

    if os.path.isdir(path):
        raise IsADirectoryError(f"-o {shown(path)} is a directory; give the output's file path, "
                                f"e.g. {shown(os.path.join(path, 'policy.yaml'))}.")
    for other in side:
        if os.path.isdir(other):
            raise IsADirectoryError(f"{shown(other)}, which is written beside -o {shown(path)}, "
                                    "is a directory; move it away or choose another -o.")
    refuse_non_file(path, f"-o {shown(path)}")
    for other in side:
        refuse_non_file(other, f"{shown(other)}, which is written beside -o {shown(path)},")

    problem = unwritable_folder(path)
    if problem is not None and problem[1] == "file":
        raise NotADirectoryError(f"Cannot write -o {shown(path)}: {shown(problem[0])} is a file, "
                                 "not a folder. Choose another -o.")
    if problem is not None:
        raise PermissionError(f"Cannot write {shown(path)}: {shown(problem[0])} is not "
                              "writable. Choose another -o.")


def _check_tune_files(args) -> None:
    """Every file a tune reads or writes, checked before any work: none is two of them, each
    can be written, and the storage's file (SQLite, journal) can be opened for writing."""
    from autoprec.tuning.config import TunePaths
    from autoprec.tuning.storage import check_storage, storage_file

    out = args.output
    paths = TunePaths.from_output(out)
    side = paths.beside()
    study = storage_file(args.storage, paths.study_db)
    task = task_file(args.task)
    distinct_files([(out, f"-o {out}", True),
                    *((path, f"{path} ({what} written beside -o {out})", True)
                      for path, what in side.items()),
                    (study, f"the study {study} (the default storage, beside -o {out})"
                     if args.storage is None else f"the file {study} of --storage", True),
                    (task, f"the task file {task}", False)])
    _writable_output(out, *side)
    check_storage(args.storage, paths.study_db)


def _cmd_tune(args) -> int:
    from autoprec.policy import Budget
    from autoprec.tuning import SearchConfig, StudyConfig, TuneConfig, tune, validate_front
    from autoprec.tuning.config import TunePaths

    _more_than_fp32(args.formats, "choose")
    _check_tune_files(args)
    search = SearchConfig(formats=tuple(args.formats),
                          budget=Budget(args.max_loss_increase, args.max_grad_error,
                                        args.max_grad_bias),
                          budget_at=args.budget_at,
                          max_memory=args.max_memory, n_trials=args.n_trials,
                          timeout=args.timeout, target=args.target, seed=args.seed,
                          grouping=args.groups, sensitivity=args.sensitivity,
                          couple=tuple(tuple(names) for names in args.couple),
                          per_gemm=args.per_gemm)
    study = StudyConfig(storage=args.storage, study_name=args.study, output=args.output)
    task = _load_task(args.task)
    result = tune(task, TuneConfig(search=search, study=study))
    print(result.summary())
    if args.final_phase is not None:
        result.policy = _final_phase(result.policy, args.final_phase)
    if args.validate_steps:
        result = validate_front(result, task, steps=args.validate_steps)
        if result.validation is None or not result.validation.passed:
            print("the certificate of no policy on the Pareto front passed; writing all-fp32",
                  file=sys.stderr)
        if args.final_phase is not None and not result.policy.phases:
            result.policy = _final_phase(result.policy, args.final_phase)
    written = result.save(args.output)
    if result.profile is not None:
        profile = TunePaths.from_output(args.output).profile
        result.profile.save(profile)
        written.append(profile)
    print("wrote " + ", ".join(map(shown, written)))
    print(f"study: {shown(result.study_name)} in {shown(result.storage, 300)}")
    return 0


def _final_phase(policy, spec: tuple[float, str]):
    from autoprec.formats import Format
    from autoprec.phases import kept_for_range

    fraction, fmt = spec
    target = Format.parse(fmt)
    kept = kept_for_range(target, policy.formats_used())
    if kept:
        names = ", ".join(sorted(f.label for f in kept))
        print(f"note: --final-phase {fraction:g}:{fmt} leaves the {names} layers as they are: "
              f"{fmt} reaches only {target.max_value:g}, less far than {names}, so "
              "moving them would trade overflow for precision", file=sys.stderr)
    phased = policy.with_final_phase(fraction, fmt)
    if phased is policy:
        print(f"--final-phase {fraction:g}:{fmt}: no {'other ' if kept else ''}layer computes "
              f"below {fmt}, so no final phase is written", file=sys.stderr)
    else:
        print(f"final phase: {shown(phased.phases[-1].describe())}, "
              f"{', '.join(f'{k} -> {v}' for k, v in phased.phases[-1].formats.items())}",
              file=sys.stderr)
    return phased


def _final_phase_spec(text: str) -> tuple[float, str]:
    from autoprec.phases import FINAL_FORMATS

    head, _, fmt = text.partition(":")
    fmt = fmt.strip().lower() or "bf16"
    try:
        fraction = float(head)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction < 1 or fmt not in FINAL_FORMATS:
        raise argparse.ArgumentTypeError(
            f"expected FRACTION[:FORMAT] with 0 < FRACTION < 1 and FORMAT one of "
            f"{', '.join(FINAL_FORMATS)} (e.g. 0.9 or 0.9:fp32), got {text!r}")
    return fraction, fmt


def _cmd_validate(args) -> int:
    from autoprec.certification import REFERENCES, certify
    from autoprec.policy import load_policy

    if args.output:
        task_path = task_file(args.task)
        distinct_files([(args.output, f"-o {args.output}", True),
                        (args.policy, f"the policy {args.policy}", False),
                        (args.reference if args.reference not in REFERENCES else None,
                         f"--reference {args.reference}", False),
                        (task_path, f"the task file {task_path}", False)])
        _writable_output(args.output)
    policy = load_policy(args.policy)
    task = _load_task(args.task)
    result = certify(task, policy, reference=args.reference, steps=args.steps,
                     horizon=args.horizon, branches=args.branches,
                     tolerance=args.tolerance, strict=not args.no_strict)
    print(result.report())
    if args.output:
        policy.with_certificate(result.certificate).save(args.output)
        print(f"wrote {shown(args.output)} (the policy with its certificate)")
    return _VERDICT_EXIT[result.verdict]


# `validate`'s exit status per verdict (2 is a usage or input error, as everywhere)
_VERDICT_EXIT = {"pass": 0, "fail": 1, "undecided": 3}


def _cmd_show(args) -> int:
    from autoprec.policy import load_policy
    from autoprec.policy_text import show_lines
    from autoprec.profiling import Profile

    # everything is read (and checked) before anything is printed
    policy = load_policy(args.policy)
    if args.profile is not None and not os.path.isfile(args.profile):
        raise FileNotFoundError(f"--profile {args.profile} does not exist (or is not a file); "
                                "give the profile JSON that `tune` or `profile -o` wrote, or "
                                "leave --profile out to use the one beside the policy.")
    prof_path = args.profile or _profile_path(args.policy)
    prof = Profile.load(prof_path) if os.path.exists(prof_path) else None
    print("\n".join(show_lines(policy, args.policy, prof, prof_path)))
    return 0


def _cmd_diff(args) -> int:
    from autoprec.policy import load_policy
    from autoprec.policy_text import diff_lines
    from autoprec.profiling import Profile

    a, b = load_policy(args.a), load_policy(args.b)
    prof_path = next((p for p in (_profile_path(args.a), _profile_path(args.b))
                      if os.path.exists(p)), None)
    prof = Profile.load(prof_path) if prof_path is not None else None
    lines, differ = diff_lines(a, b, prof)
    print("\n".join(lines))
    return 1 if differ else 0


def _cmd_export(args) -> int:
    from autoprec._util import escape_line
    from autoprec.exporting import ExportError, export, load_name_map, structure_of
    from autoprec.policy import load_policy

    if args.output:
        model = task_file(args.model) if args.model else None
        distinct_files([(args.output, f"-o {args.output}", True),
                        (args.policy, f"the policy {args.policy}", False),
                        (args.name_map, f"--name-map {args.name_map}", False),
                        (model, f"the task file {model} of --model", False)])
        _writable_output(args.output)
    policy = load_policy(args.policy)
    names = load_name_map(args.name_map) if args.name_map else None
    if args.model is None:
        raise ExportError(f"autoprec export --to {args.to} names the model's modules: give "
                          "--model TASK_SPEC (the task the policy was tuned on; its model is "
                          "built on the meta device, without memory).")
    model = structure_of(_load_task(args.model))
    result = export(policy, args.to, model=model, strict=not args.no_strict, names=names,
                    phase=args.phase)
    for note in result.notes:
        # notes quote module names from the model: one escaped line each on the terminal too
        print(f"note: {escape_line(note)}", file=sys.stderr)
    if args.output:
        result.save(args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    return 0


def _recheck_parser(sub) -> None:
    """``autoprec recheck``: a policy's layers re-measured on a checkpoint's weights."""
    p = sub.add_parser(
        "recheck", help="re-measure a policy's layers on a checkpoint's weights: what to "
                        "demote, what might be promoted (exit 0 nothing to demote, 1 some, "
                        "2 error)")
    p.add_argument("task", help="path/file.py:function or package.module:function: the model "
                                "the checkpoint is of, and the batches to measure on")
    p.add_argument("--policy", required=True, help="the policy YAML to re-check")
    p.add_argument("--checkpoint", required=True,
                   help="the weights: .safetensors, a torch .pt/.bin state dict (or a training "
                        "checkpoint with it under 'model'), or an HF checkpoint folder")
    p.add_argument("-o", "--out", required=True, help="write the report (YAML) here")
    p.add_argument("--amended", default=None, metavar="POLICY_OUT",
                   help="also write the policy with the demotions written in")
    p.add_argument("--promote", action="store_true",
                   help="write the layers that may be promoted into --amended too")
    p.add_argument("--batches", type=_positive_int, default=2,
                   help="the task's calibration batches to measure on (default 2)")
    p.add_argument("--max-loss-increase", type=_nonneg_float, default=None,
                   help="the budget's relative loss change (default: the policy's tuned one)")
    p.add_argument("--max-grad-error", type=_nonneg_float, default=None,
                   help="the budget's gradient error (default: the policy's tuned one)")
    p.set_defaults(fn=_cmd_recheck)


def _check_recheck_files(args) -> None:
    """No output of ``recheck`` is an input (or the other output), and each can be written:
    before any work, each refusal one line."""
    from autoprec._util import refuse_non_file, same_file, unwritable_folder

    if args.promote and not args.amended:
        raise ValueError("--promote writes the promotions into the amended policy; give "
                         "--amended PATH too.")
    ckpt = args.checkpoint
    inputs = [(args.policy, f"the policy {shown(args.policy)}"),
              (task_file(args.task), "the task file"),
              *((os.path.join(ckpt, n), f"a file of the checkpoint {shown(ckpt)}")
                for n in (sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else [])),
              (ckpt, f"the checkpoint {shown(ckpt)}")]
    existing = [(path, role, False) for path, role in inputs if path and os.path.exists(path)]
    outputs = [(o, f"{flag} {shown(o)}") for flag, o in (("-o", args.out),
                                                         ("--amended", args.amended)) if o]
    if len(outputs) == 2 and same_file(outputs[0][0], outputs[1][0]):
        raise ValueError(f"-o and --amended are both {shown(args.out)}: the report and the "
                         "policy need two files. Choose another path.")
    for out, what in outputs:
        distinct_files([(out, what, True), *existing])
        refuse_non_file(out, what)
        problem = unwritable_folder(out)
        if os.path.isdir(out) or problem is not None:
            why = "is a directory" if os.path.isdir(out) else \
                f"cannot be written ({shown(problem[0])} is " \
                f"{'a file' if problem[1] == 'file' else 'not writable'})"
            raise ValueError(f"{what} {why}. Choose another path.")


def _recheck_budget(args, policy):
    """The policy's tuned budget (else the default), with the command's limits over it."""
    from autoprec.policy import Budget

    tuned = policy.provenance.budget or Budget()
    loss = tuned.max_loss_increase if args.max_loss_increase is None else args.max_loss_increase
    grad = tuned.max_grad_error if args.max_grad_error is None else args.max_grad_error
    return Budget(loss, grad)


def _cmd_recheck(args) -> int:
    """``autoprec recheck``: 0 when nothing is to be demoted, 1 when something is."""
    import yaml

    from autoprec._util import ProgressBar, atomic_write_all, log
    from autoprec.checkpoint import load_checkpoint
    from autoprec.policy import load_policy
    from autoprec.recheck import recheck_in_place

    _check_recheck_files(args)
    policy = load_policy(args.policy)
    task = _load_task(args.task)
    model = task.build_model()
    log(f"recheck: loading {shown(args.checkpoint)} into {shown(type(model).__name__)} "
        f"({shown(task.name)})")
    load_checkpoint(model, args.checkpoint)
    policy.check_model(model)
    batches = list(task.batches[:args.batches])
    if len(batches) < args.batches:
        log(f"recheck: the task has {len(batches)} calibration batch(es); measuring on those")
    result = recheck_in_place(model, policy, batches, budget=_recheck_budget(args, policy),
                              loss_fn=task.loss_fn, progress=ProgressBar("recheck"))
    result = dataclasses.replace(result, source=os.fspath(args.checkpoint))
    print(result.format())
    outputs = [(args.out, yaml.safe_dump(result.to_dict(), sort_keys=False, width=100))]
    if args.amended:
        outputs.append((args.amended, result.amended_policy(promote=args.promote).to_yaml()))
    # both or neither: a report beside no amended policy would say a fix was written
    written = atomic_write_all(outputs)
    print("wrote " + ", ".join(map(shown, written)))
    return 1 if result.demote else 0


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
_nonneg_int = _number(int, "an integer", lambda v: v >= 0, "an integer >= 0")
_nonneg_float = _number(float, "a number", lambda v: 0 <= v < float("inf"),
                        "a finite number >= 0")
_positive_float = _number(float, "a number", lambda v: 0 < v < float("inf"),
                          "a finite number greater than 0")


def _study_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is an empty study name; give a name with "
                                         "at least one character other than spaces, or leave "
                                         "--study out to derive one from the task")
    return text


def _size(text: str) -> int:
    """An argparse type: bytes from 2GiB, 512MB or a plain number of bytes."""
    from autoprec.memory import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tune_parser(sub, common: dict) -> None:
    from autoprec.policy import DEFAULT_BIAS_BUDGET, Budget
    from autoprec.tuning.config import default

    budget = Budget()
    p = sub.add_parser("tune", help="search a per-layer policy and write it as YAML")
    p.add_argument("task")
    p.add_argument("--sensitivity", **common["sensitivity"])
    p.add_argument("-o", "--output", required=True, help="policy path, e.g. policies/NAME.yaml")
    p.add_argument("--formats", **common["formats"])
    p.add_argument("--target", **common["target"])
    p.add_argument("--max-loss-increase", type=_nonneg_float, default=budget.max_loss_increase,
                   help="relative loss change allowed vs FP32 (default "
                        f"{budget.max_loss_increase:g} = {budget.max_loss_increase:.0%}".replace("%", "%%") + ")")
    p.add_argument("--max-grad-error", type=_nonneg_float, default=budget.max_grad_error,
                   help="relative gradient error allowed vs FP32 (default "
                        f"{budget.max_grad_error:g})")
    p.add_argument("--max-grad-bias", type=_nonneg_float, default=None,
                   help="gradient bias allowed vs FP32 (the error of the gradients summed over "
                        "the held-out batches; default: no limit, with --budget-at "
                        f"{DEFAULT_BIAS_BUDGET:g})")
    p.add_argument("--budget-at", type=_positive_int, default=None, metavar="STEPS",
                   help="profile and judge trials on the model trained STEPS steps into a "
                        "2*STEPS-step bf16 reference run, where the bias budget was measured "
                        "against certificates; the default budget becomes the gradient bias "
                        f"<= {DEFAULT_BIAS_BUDGET:g} (default: measure the untrained model)")
    p.add_argument("--n-trials", type=_positive_int, default=default("n_trials"),
                   help="distinct policies to measure, warm starts included (default "
                        f"{default('n_trials')})")
    p.add_argument("--timeout", type=_positive_float, default=default("timeout"),
                   help="seconds for this worker")
    p.add_argument("--storage", default=default("storage"),
                   help="Optuna storage URL (sqlite:///, postgresql://, journal:PATH); "
                        "default: SQLite beside the output, so a rerun resumes")
    p.add_argument("--study", type=_study_name, default=default("study_name"),
                   help="study name (share it between workers)")
    p.add_argument("--seed", type=int, default=default("seed"))
    p.add_argument("--groups", choices=["auto", "layer", "role"], default=str(default("grouping")),
                   help="one choice per layer, per role (transformer.h.*.mlp.c_fc) or auto")
    p.add_argument("--couple", type=_names, action="append", default=[], metavar="A,B,...",
                   help="sibling layers that share one choice because the model fuses them, "
                        "e.g. --couple q_proj,k_proj,v_proj (repeatable)")
    p.add_argument("--max-memory", type=_size, default=default("max_memory"), metavar="SIZE",
                   help="peak training-step memory the policy may need, as predicted for the "
                        "task's calibration batch: bytes or 2GiB, 512MB (default: no limit)")
    p.add_argument("--final-phase", type=_final_phase_spec, default=None,
                   metavar="FRACTION[:FORMAT]",
                   help="also write a last phase of the run from FRACTION of its steps in which "
                        "every layer below FORMAT (default bf16: the fp8 layers) computes in "
                        "FORMAT, e.g. 0.9 for the learning-rate decay; the training "
                        "integrations switch at that step")
    p.add_argument("--per-gemm", action="store_true",
                   help="also offer per-GEMM mixes of the scaled formats (forward in one, the "
                        "backward GEMMs in a more precise one or bf16) that run natively on "
                        "--target, priced per GEMM")
    p.add_argument("--validate-steps", type=_nonneg_int, default=0,
                   help="train this many steps to validate the winner; fall back along the "
                        "Pareto front if it fails")
    p.set_defaults(fn=_cmd_tune)


def _format_arg(text: str) -> str:
    """A --formats value: a group word (``fp8``, ``scaled``) or a format's spelling
    (argparse's one-line error else)."""
    from autoprec.formats import Format, format_group

    if format_group(text) is None:
        try:
            Format.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _common_options() -> dict[str, dict]:
    """The options several commands share: --formats, --target, --sensitivity."""
    from autoprec.devices import DEVICES
    from autoprec.formats import Format
    from autoprec.measure.sensitivity import SENSITIVITY_MODES
    from autoprec.tuning.config import default

    formats = dict(nargs="+", default=["fp32", "bf16", "fp16", "fp8"], type=_format_arg,
                   metavar="FORMAT",
                   help="formats to consider (default: fp32 bf16 fp16 fp8; fp8 means every FP8 "
                        "recipe, fp8:<recipe> one of them, scaled every scaled format; the others: "
                        f"{', '.join(f.value for f in Format if f.recipe is None)}; "
                        "fwd/dgrad/wgrad one GEMM's format each, e.g. nvfp4/mxfp8/mxfp8)")
    target = dict(default=None, choices=list(DEVICES),
                  help="price speed with the cost model of this device instead of measuring "
                       f"here: {', '.join(DEVICES)}")
    sensitivity = dict(choices=list(SENSITIVITY_MODES), default=default("sensitivity"),
                       help="how each layer x format's sensitivity is obtained: auto (default: "
                            "first-order estimates from one reference pass, those near the "
                            "budget or doubtful measured exactly), fast (estimates only), exact "
                            "(all measured)")
    return {"formats": formats, "target": target, "sensitivity": sensitivity}


def _parser() -> argparse.ArgumentParser:
    from autoprec.measure.deviation import REFERENCE_GRADIENTS

    ap = argparse.ArgumentParser(prog="autoprec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = _common_options()
    p = sub.add_parser("profile", help="each layer's error and speed in each format")
    p.add_argument("task", help="path/file.py:function or package.module:function")
    p.add_argument("-o", "--output", help="write the profile as JSON")
    p.add_argument("--formats", **common["formats"])
    p.add_argument("--target", **common["target"])
    p.add_argument("--batches", type=_positive_int, default=2,
                   help="calibration batches (default 2)")
    p.add_argument("--sensitivity", **common["sensitivity"])
    p.add_argument("--reference-gradients", choices=list(REFERENCE_GRADIENTS), default="auto",
                   help="how exact comparisons get the FP32 reference's gradients: kept, "
                        "recomputed per comparison, spilled to a temporary file (host memory "
                        "beside a GPU), or auto (default: kept unless they would take over a "
                        "quarter of the free memory); the same numbers every way")
    p.add_argument("--only-winnable", action="store_true",
                   help="measure the numerics only of the formats that can win on the device "
                        "(as the tune does); by default every requested format is measured")
    p.set_defaults(fn=_cmd_profile)
    _tune_parser(sub, common)
    _policy_parsers(sub)
    _recheck_parser(sub)
    return ap


def _policy_parsers(sub) -> None:
    """The commands that read a policy: validate, show, diff, export."""
    from autoprec.certification import DEFAULT_BRANCHES, DEFAULT_STEPS, DEFAULT_TOLERANCE

    p = sub.add_parser(
        "validate", help="certify a policy: paired training branches against a reference "
                         "(exit 0 pass, 1 fail, 3 undecided, 2 error)")
    p.add_argument("policy")
    p.add_argument("--task", required=True)
    p.add_argument("--reference", default="bf16", metavar="bf16|fp32|POLICY",
                   help="what the policy must train like (default bf16: every layer in bf16)")
    p.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS,
                   help=f"steps of the reference run the branches start from (default "
                        f"{DEFAULT_STEPS})")
    p.add_argument("--horizon", type=_positive_int, default=None,
                   help="steps each branch trains (default: half of --steps)")
    p.add_argument("--branches", type=_positive_int, default=DEFAULT_BRANCHES,
                   help=f"branch points over the run (default {DEFAULT_BRANCHES}; it stops "
                        "early once the interval decides)")
    p.add_argument("--tolerance", type=_nonneg_float, default=DEFAULT_TOLERANCE,
                   help=f"largest relative held-out loss gap that passes (default "
                        f"{DEFAULT_TOLERANCE:g})")
    p.add_argument("-o", "--output", default=None, metavar="POLICY_OUT",
                   help="write the policy with its certificate here (never over the input)")
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
    p.add_argument("--phase", type=_nonneg_int, default=None, metavar="N",
                   help="export phase N of a policy with phases (0: from step 0); torchao and "
                        "megatron take one phase, fqn lists them all")
    p.add_argument("--name-map", default=None, metavar="FILE",
                   help="megatron: YAML of HF-name regex -> Megatron module path, tried before "
                        "the built-in Llama and GPT-2 names")
    p.add_argument("--no-strict", action="store_true",
                   help="export what the target cannot express exactly anyway, with notes")
    p.set_defaults(fn=_cmd_export)


def _one_line(e: BaseException) -> str:
    """An error as one terminal line: its whitespace runs as single spaces, the rest escaped
    and bounded (a message quoting input is already bounded where it quotes it; this bounds
    whatever a library said)."""
    return shown(" ".join(str(e).split()), 2000)


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)  # imports torch: a Ctrl-C may come here already
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    ours = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if ours else None
    try:
        return _dispatch(args)
    finally:
        if ours and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _dispatch(args) -> int:
    from autoprec.policy import PolicyError
    from autoprec.task import TaskError

    resume = "completed trials are kept in the study; rerun the same command to resume"
    try:
        return args.fn(args)
    except _Terminated:
        tail = (f": the running trial was abandoned (a rerun measures it again); {resume}"
                if args.cmd == "tune" else "")
        print(f"terminated (SIGTERM){tail}", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"interrupted{': ' + resume if args.cmd == 'tune' else ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _closed_stdout()
    except (PolicyError, TaskError, FileNotFoundError, PermissionError, IsADirectoryError,
            NotADirectoryError) as e:
        print(f"autoprec: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        # the machine's doing (a full or read-only disk, a file in the way): the path and why
        where = f" {e.filename}" if e.filename else ""
        print(f"autoprec: error: cannot write or read{where}: {e.strerror or _one_line(e)}.",
              file=sys.stderr)
        return 2
    except ValueError as e:
        # errors of input (our own ValueErrors, a storage that will not open); a ValueError
        # subclass from deep inside a library is a bug and keeps its traceback
        if type(e) is not ValueError and type(e).__name__ != "StorageError":
            raise
        print(f"autoprec: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if type(e).__name__ != "StorageInternalError":  # optuna's: a write the storage refused
            raise
        # the driver's own first line (SQLAlchemy adds the statement and its parameters)
        cause = (str(e.__cause__ or e).strip().splitlines() or [""])[0][:300]
        hint = (" Another process holds a lock on the study's SQLite file: wait for it to finish"
                " (or close it), then rerun to resume." if "locked" in cause else
                " Check that the storage can be written, then rerun to resume.")
        print(f"autoprec: error: the study's storage refused a write ({cause}).{hint}",
              file=sys.stderr)
        return 2


def _closed_stdout() -> int:
    """Whoever read our output stopped (``autoprec show ... | head``): exit as a program killed
    by SIGPIPE would, quietly; what is still buffered goes nowhere (else flushing it at exit
    fails again)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141


def _interrupt_again(hook, unraisable) -> None:
    """``sys.unraisablehook`` of the console script: a Ctrl-C that lands in a destructor or a
    GC callback (a weakref's, while the tune's own handling is not installed: starting up,
    writing the policy) is swallowed by Python with an "Exception ignored" traceback, and the
    command goes on. Delivered to the main thread again instead, without the traceback, from
    another thread a moment later (raised inside the hook, it would be swallowed again)."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        timer = threading.Timer(0.05, _thread.interrupt_main)
        timer.daemon = True
        timer.start()
        return
    hook(unraisable)


def run() -> None:
    """The console script: :func:`main`, then exit at once. Everything is written and flushed
    by then; skipping the interpreter's shutdown means no thread or connection pool left by a
    library can keep the process alive, and a Ctrl-C cannot land in a finalizer."""
    sys.unraisablehook = functools.partial(_interrupt_again, sys.unraisablehook)
    # behind every field's own escaping (`shown`): no escape sequence from a file, a study or
    # a library's message reaches the terminal
    sys.stdout, sys.stderr = EscapingStream(sys.stdout), EscapingStream(sys.stderr)
    code = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = _closed_stdout()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
