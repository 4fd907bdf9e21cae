"""The package's shape: imports run one way, production stays light, functions stay short."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "autoprec")


def _modules() -> dict[str, str]:
    """Module name -> file path of every module in the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _top_level_imports(path: str, modules: dict[str, str]) -> set[str]:
    """The package modules a module imports when it is imported (not inside functions)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = set()
    for node in tree.body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            # `from pkg import submodule` needs the submodule; a name defined in pkg's
            # __init__ needs the package itself
            names = subs + ([node.module] if any(s not in modules for s in subs) else [])
        found.update(n for n in names if n in modules)
    return found


def test_no_import_cycle_inside_the_package():
    modules = _modules()
    graph = {m: _top_level_imports(p, modules) - {m} for m, p in modules.items()}
    # a package imports its own submodules in __init__; a submodule importing its package
    # (its __init__) is the edge that would close a cycle, so it counts
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep] if dep in path else [m, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_no_function_over_80_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long


def test_applying_a_policy_loads_no_tuning_library():
    code = ("import sys, torch, autoprec\n"
            "m = torch.nn.Sequential(torch.nn.Linear(8, 8))\n"
            "autoprec.apply(m, autoprec.Policy(default='bf16'), guard=True)\n"
            "m(torch.randn(2, 8)).sum().backward()\n"
            "autoprec.get_guard(m).step()\n"
            "from autoprec.runtime.integrations import training_kit\n"
            "heavy = sorted({k.split('.')[0] for k in sys.modules} & "
            "{'optuna', 'scipy', 'matplotlib', 'transformers', 'accelerate'})\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"the production path imported {out.stdout.strip()}"


def test_public_functions_are_not_shadowed_by_submodules():
    # importing a submodule binds it as an attribute of its package: a module named like a
    # public function (autoprec/profile.py next to autoprec.profile) would replace the function
    import importlib

    import autoprec

    for name in _modules():
        importlib.import_module(name)
    for name in autoprec.__all__:
        value = getattr(autoprec, name)
        assert not isinstance(value, type(autoprec)), f"autoprec.{name} is a module"


def _writes_outside_atomic_write(path: str) -> list[str]:
    """Calls in ``path`` that write a file by any route but ``_util.atomic_write``: ``open``
    with a mode that writes, ``os.open`` with write flags on anything but os.devnull,
    ``torch.save``, ``Path.write_text``/``write_bytes``, ``json.dump``/``yaml.dump`` to a
    stream, ``savefig`` on a path."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        owner = getattr(fn.value, "id", "") if isinstance(fn, ast.Attribute) else ""
        where = f"{os.path.relpath(path, ROOT)}:{node.lineno} {ast.unparse(node)[:80]}"
        if name == "open" and owner in ("", "io", "builtins"):
            mode = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "mode"), None)
            text = mode.value if isinstance(mode, ast.Constant) else "r"
            if not isinstance(mode, (ast.Constant, type(None))) or set(text) & set("wax+"):
                found.append(where)
        elif name == "open" and owner == "os" and "devnull" not in ast.unparse(node.args[0]):
            found.append(where)
        elif (name, owner) in (("save", "torch"), ("dump", "json")) \
                or name in ("write_text", "write_bytes"):
            found.append(where)
        elif (name, owner) in (("dump", "yaml"), ("safe_dump", "yaml")) and (
                len(node.args) > 1 or any(k.arg == "stream" for k in node.keywords)):
            found.append(where)  # without a stream it returns the text
        elif name == "savefig" and not (node.args and isinstance(node.args[0], ast.Name)
                                        and ast.unparse(node.args[0]) in ("png", "buf")):
            found.append(where)
    return found


def test_every_file_the_package_writes_goes_through_the_one_atomic_write():
    util = os.path.join(PACKAGE, "_util.py")
    offenders = [w for path in _modules().values() if path != util
                 for w in _writes_outside_atomic_write(path)]
    assert not offenders, ("write these through autoprec._util.atomic_write (an exclusive "
                           "temp file renamed over the target):\n" + "\n".join(offenders))
