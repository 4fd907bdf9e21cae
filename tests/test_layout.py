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


def _imported(node: ast.AST, modules: dict[str, str]) -> set[str]:
    """The package modules one import statement needs (none for any other node)."""
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        subs = [f"{node.module}.{a.name}" for a in node.names]
        # `from pkg import submodule` needs the submodule; a name defined in pkg's
        # __init__ needs the package itself
        names = subs + ([node.module] if any(s not in modules for s in subs) else [])
    return {n for n in names if n in modules}


def _top_level_imports(path: str, modules: dict[str, str]) -> set[str]:
    """The package modules a module imports when it is imported (not inside functions)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    return set().union(*(_imported(node, modules) for node in tree.body))


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


def _all_imports(path: str, modules: dict[str, str]) -> set[str]:
    """The package modules a module imports anywhere: at the top, inside functions (a
    deferred import is still an arrow), under ``TYPE_CHECKING``."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    return set().union(*(_imported(node, modules) for node in ast.walk(tree)))


def _room(module: str, parent: str) -> str | None:
    """The room of ``parent`` (a package) that ``module`` is in: the child module or
    sub-package of ``parent`` that holds it; None outside ``parent`` or for ``parent`` itself."""
    if not module.startswith(parent + "."):
        return None
    return parent + "." + module[len(parent) + 1:].split(".")[0]


def _room_cycle(modules: dict[str, str], parent: str) -> list[str] | None:
    """A cycle among ``parent``'s rooms (its modules and sub-packages, each taken whole), by
    every import their modules make, or None."""
    graph: dict[str, set[str]] = {}
    for m, path in modules.items():
        a = _room(m, parent)
        if a is None:
            continue
        graph.setdefault(a, set())
        for dep in _all_imports(path, modules):
            b = _room(dep, parent)
            if b is not None and b != a:
                graph[a].add(b)
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_circle_between_rooms_by_any_import():
    # Each package's rooms (its files and its sub-packages, each whole) import one way, counting
    # imports deferred into functions and those under TYPE_CHECKING: an import that runs back
    # up a floor closes a circle at some level, so this finds both.
    modules = _modules()
    packages = sorted({m for m, p in modules.items() if p.endswith("__init__.py")})
    for parent in packages:
        cycle = _room_cycle(modules, parent)
        assert cycle is None, f"rooms of {parent} import in a circle: " + " -> ".join(cycle)


def test_the_room_check_finds_a_deferred_import_back_up(tmp_path):
    sources = {"pkg": "", "pkg.low": "def f():\n    from pkg.high.top import g\n",
               "pkg.high": "", "pkg.high.top": "from pkg.low import f\n"}
    modules = {}
    for name, text in sources.items():
        modules[name] = str(tmp_path / f"{name}.py")
        (tmp_path / f"{name}.py").write_text(text)
    assert _room_cycle(modules, "pkg") == ["pkg.high", "pkg.low", "pkg.high"]
    (tmp_path / "pkg.low.py").write_text("")
    assert _room_cycle(modules, "pkg") is None


# The scalings' names, as a Gemm spells them: outside autoprec/scaling.py nothing compares a
# scaling with one of them (a new scaling would have to be added there); its facts are read
# from the Scaling object instead.
SCALING_NAMES = {"none", "tensor", "row", "mx", "nvfp4"}


def _scaling_comparisons(source: str) -> list[str]:
    """Comparisons in ``source`` of a ``.scaling`` attribute with a scaling's name (or a
    collection of names)."""
    def names(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in SCALING_NAMES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names(e) for e in node.elts)
        return False

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(n, ast.Attribute) and n.attr == "scaling" for n in sides) \
                    and any(names(n) for n in sides):
                found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def _format_comparisons(source: str, names: set[str]) -> list[str]:
    """Comparisons in ``source`` (``is``, ``==``, ``in`` a literal collection) with one of the
    formats ``Format.<name>`` for ``name`` in ``names``."""
    def named(node) -> bool:
        if isinstance(node, ast.Attribute):
            return isinstance(node.value, ast.Name) and node.value.id == "Format" \
                and node.attr in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False

    return [f"{node.lineno}: {ast.unparse(node)[:80]}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Compare) and any(named(n) for n in [node.left, *node.comparators])]


def test_no_identity_check_of_a_scaled_or_fp16_format_outside_the_formats():
    # what a scaled format (FP8 recipes, MXFP8, NVFP4) or fp16 is asked is a field of its
    # numerics (needs_loss_scaling, output_dtype, scaling, torchao_recipe, ...), so that a
    # registered format with the same fields is treated alike
    from autoprec.formats import FORMAT_ORDER

    names = {f.name for f in FORMAT_ORDER if f.is_scaled or f.needs_loss_scaling}
    assert {"FP16", "FP8", "MXFP8", "NVFP4"} <= names
    assert _format_comparisons("a = fmt is Format.FP16\nb = fmt is Format.FP32\n"
                               "c = f in (Format.BF16, Format.MXFP8)\n", names) == [
        "1: fmt is Format.FP16", "3: f in (Format.BF16, Format.MXFP8)"]
    found = {}
    for name, path in _modules().items():
        if name not in ("autoprec.formats", "autoprec.scaling"):
            hits = _format_comparisons(open(path, encoding="utf-8").read(), names)
            if hits:
                found[name] = hits
    assert not found, f"scaled or fp16 formats compared by identity: {found}"


def test_no_comparison_with_a_scaling_name_outside_the_scaling_module():
    assert _scaling_comparisons("ok = g.scaling.one_scale\nbad = g.scaling in ('row', 'mx')\n"
                                "also = fmt.numerics.scaling != 'tensor'\n") == [
        "2: g.scaling in ('row', 'mx')", "3: fmt.numerics.scaling != 'tensor'"]
    found = {}
    for name, path in _modules().items():
        if name != "autoprec.scaling":
            hits = _scaling_comparisons(open(path, encoding="utf-8").read())
            if hits:
                found[name] = hits
    assert not found, f"scaling names compared outside autoprec.scaling: {found}"


def _functions():
    """(module, function node) of every function and method in the package."""
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield name, node


def _code_lines(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines less its docstrings (its own and those of the functions and classes
    it defines): the public API's Args/Returns sections are not code."""
    docs = sum(n.body[0].end_lineno - n.body[0].lineno + 1 for n in ast.walk(f)
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               and ast.get_docstring(n, clean=False) is not None)
    return f.end_lineno - f.lineno + 1 - docs


def test_no_function_over_60_lines():
    long = [f"{m}.{f.name}: {_code_lines(f)} lines" for m, f in _functions()
            if _code_lines(f) > 60]
    assert not long, long


def _parameters(f: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = f.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def test_no_function_over_8_parameters():
    # more than 8 means a config or context object is missing (TuneConfig, a measurement plan)
    wide = [f"{m}.{f.name}: {len(_parameters(f))} parameters" for m, f in _functions()
            if len(_parameters(f)) > 8]
    assert not wide, wide


def _private_definitions(tree: ast.Module) -> set[str]:
    """Single-underscore names a module defines: module-level and class-level functions,
    classes and assignments, and attributes assigned on ``self``/``cls``."""
    names = set()

    def target_names(t):
        if isinstance(t, ast.Name):
            yield t.id
        elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                and t.value.id in ("self", "cls"):
            yield t.attr
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from target_names(e)

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(target_names(t))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "object.__setattr__", "setattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            names.add(node.args[1].value)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_uses(trees: dict[str, ast.Module], packaged: set[str]) -> list[str]:
    """Where a module reads or writes a _private name that only another module defines."""
    defined = {m: _private_definitions(t) for m, t in trees.items()}
    found = []
    for m, tree in trees.items():
        elsewhere = set().union(*(d for other, d in defined.items() if other != m)) - defined[m]
        # os._exit, torch._dynamo, nn.modules.conv._ConvNd: other libraries' names, not ours
        external = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names
                    if not (isinstance(node, ast.ImportFrom) and (node.level or (
                        node.module or "").startswith("autoprec")))
                    and not (isinstance(node, ast.Import) and a.name.startswith("autoprec"))}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                    "autoprec")):
                found += [f"{m}:{node.lineno} imports {a.name} from {node.module}"
                          for a in node.names if a.name.startswith("_")
                          and not a.name.startswith("__") and a.name not in packaged]
            elif isinstance(node, ast.Attribute) and node.attr in elsewhere and not (
                    isinstance(node.value, ast.Name)
                    and node.value.id in ({"self", "cls"} | external)):
                found.append(f"{m}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_private_name_check_finds_reads_writes_and_imports():
    owner = ast.parse("class Guard:\n    def __init__(self):\n        self._suspects = set()\n"
                      "def _blame(x):\n    return x\n")
    part = ast.parse("import os\nfrom autoprec.runtime.guard import _blame\n"
                     "class Watch:\n    def hook(self):\n        self.guard._suspects.add(1)\n"
                     "        self._mine = os._exit\n        return self._mine\n")
    found = _private_uses({"a.guard": owner, "a.watch": part}, set())
    assert found == ["a.watch:2 imports _blame from autoprec.runtime.guard",
                     "a.watch:5 self.guard._suspects"], found


def test_no_module_reads_another_modules_private_names():
    # A part that reads or writes another's _private state is one class split over two files;
    # same-module access (a class and its helpers) is the module's own business. Modules named
    # with an underscore (autoprec._util) are the package's shared internals, importable.
    modules = _modules()
    trees = {m: ast.parse(open(p, encoding="utf-8").read()) for m, p in modules.items()}
    found = _private_uses(trees, {m.rsplit(".", 1)[-1] for m in modules})
    assert not found, "private names used across modules:\n" + "\n".join(found)


# Keywords whose value may be 0.01 without being the loss budget: a measured error that
# happens to be 1% (autoprec.calibration's memory_error) is not a default budget.
NOT_THE_LOSS_BUDGET = {"memory_error"}


def test_the_default_error_budget_is_defined_once():
    # One constant (autoprec.policy.DEFAULT_MAX_LOSS_INCREASE); every default budget reads it
    from autoprec.policy import DEFAULT_MAX_LOSS_INCREASE, Budget

    assert Budget().max_loss_increase == DEFAULT_MAX_LOSS_INCREASE
    literals = []
    for name, path in _modules().items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        allowed = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                   and [ast.unparse(t) for t in n.targets] == ["DEFAULT_MAX_LOSS_INCREASE"]}
        allowed |= {id(n.value) for n in ast.walk(tree)
                    if isinstance(n, ast.keyword) and n.arg in NOT_THE_LOSS_BUDGET}
        literals += [f"{name}:{n.lineno}" for n in ast.walk(tree)
                     if isinstance(n, ast.Constant) and type(n.value) is float
                     and n.value == DEFAULT_MAX_LOSS_INCREASE and id(n) not in allowed]
    assert not literals, (f"the literal {DEFAULT_MAX_LOSS_INCREASE} outside autoprec.policy."
                          f"DEFAULT_MAX_LOSS_INCREASE (use the constant): {literals}")


def test_applying_a_policy_loads_no_tuning_library():
    code = ("import sys, torch, autoprec\n"
            "m = torch.nn.Sequential(torch.nn.Linear(8, 8))\n"
            "autoprec.apply(m, autoprec.Policy(default='bf16'), guard=True)\n"
            "m(torch.randn(2, 8)).sum().backward()\n"
            "autoprec.get_guard(m).step()\n"
            "from autoprec.integrations import training_kit\n"
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
        elif name == "open" and owner == "os" and "devnull" not in ast.unparse(node.args[0]) \
                and not _reads_only(node):
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


def _reads_only(call: ast.Call) -> bool:
    """Whether an ``os.open`` call's flags, written out in the call, open for reading only."""
    flags = ast.unparse(call.args[1]) if len(call.args) > 1 else ""
    return "O_RDONLY" in flags and not any(
        w in flags for w in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"))


def test_every_file_the_package_writes_goes_through_the_one_atomic_write():
    util = os.path.join(PACKAGE, "_util.py")
    offenders = [w for path in _modules().values() if path != util
                 for w in _writes_outside_atomic_write(path)]
    assert not offenders, ("write these through autoprec._util.atomic_write (an exclusive "
                           "temp file renamed over the target):\n" + "\n".join(offenders))


def test_every_exported_function_and_constant_has_a_user_outside_its_module():
    # __all__ is a module's interface, not its inventory: a function or constant listed there
    # is called from another module, a test, a benchmark, an example, the README or docs/. Classes
    # may stand alone (a data type a listed function returns).
    import re

    users = {}
    for folder in ("autoprec", "tests", "benchmarks", "examples", "scripts"):
        for here, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(here, f)
                    users[path] = open(path, encoding="utf-8").read()
    docs = [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
        if f.endswith(".md"))
    readme = "\n".join(open(p, encoding="utf-8").read() for p in docs)
    idle = []
    for name, path in _modules().items():
        tree = ast.parse(users[path])
        exported = next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                         and [ast.unparse(t) for t in n.targets] == ["__all__"]), [])
        classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        for x in exported:
            if x in classes:
                continue
            word = re.compile(rf"\b{re.escape(x)}\b")
            if not word.search(readme) and not any(word.search(text) for p, text in users.items()
                                                   if p != path):
                idle.append(f"{name}.{x}")
    assert not idle, f"listed in __all__ but used nowhere outside their module: {idle}"


def _section(doc: str, header: str) -> list[str] | None:
    """The names a Google-style docstring section (``Args:``, ``Attributes:``) lists, or None
    without one: its entries are its first-indented lines, ``name: ...`` or ``name (type): ...``
    (``*args``, ``**options`` as written)."""
    import re

    lines = doc.expandtabs().splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == header]
    if not starts:
        return None
    top = len(lines[starts[0]]) - len(lines[starts[0]].lstrip())
    body = []
    for line in lines[starts[0] + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= top:
            break
        body.append(line)
    indents = [len(x) - len(x.lstrip()) for x in body if x.strip()]
    first = min(indents, default=0)
    entry = re.compile(r"^\**(\w+)\s*(\([^)]*\))?:")
    return [m.group(1) for x in body if x.strip() and len(x) - len(x.lstrip()) == first
            for m in [entry.match(x.strip())] if m]


def _returns_a_value(fn) -> bool:
    """Whether a function returns something: by its return annotation, else by a ``return``
    of a value in its source."""
    import inspect
    import textwrap

    annotation = inspect.signature(fn).return_annotation
    if annotation is not inspect.Signature.empty:
        return annotation not in (None, "None")
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return any(isinstance(n, ast.Return) and n.value is not None
               and not (isinstance(n.value, ast.Constant) and n.value.value is None)
               for n in ast.walk(tree))


def _public_api_problems(names, namespace) -> list[str]:
    """What ``namespace``'s public ``names`` lack: a name that does not resolve, a class
    without a docstring (or, when its constructor takes arguments and it is no exception, an
    ``Args:``/``Attributes:`` section), a function without a summary, an ``Args:`` entry for each
    parameter, or ``Returns:`` when it returns a value."""
    import inspect

    problems = []
    for name in names:
        try:
            value = getattr(namespace, name)
        except AttributeError:
            problems.append(f"{name}: does not resolve")
            continue
        own = value.__dict__.get("__doc__") if isinstance(value, type) else value.__doc__
        doc = inspect.cleandoc(own or "")
        if not doc.strip():
            problems.append(f"{name}: no docstring")
            continue
        if isinstance(value, type):
            if issubclass(value, BaseException):
                continue
            try:
                takes = bool(inspect.signature(value).parameters)
            except (TypeError, ValueError):
                takes = False
            if takes and _section(doc, "Args:") is None and _section(doc, "Attributes:") is None:
                problems.append(f"{name}: a class built with arguments, without Args:/Attributes:")
            continue
        parameters = list(inspect.signature(value).parameters)
        listed = _section(doc, "Args:")
        if parameters and listed is None:
            problems.append(f"{name}: no Args: section")
        elif parameters:
            unlisted = [p for p in parameters if p not in listed]
            if unlisted:
                problems.append(f"{name}: Args: does not list {unlisted}")
        if _returns_a_value(value) and "\nReturns:\n" not in f"\n{doc}\n":
            problems.append(f"{name}: no Returns: section")
    return problems


def test_the_public_api_check_finds_a_missing_section():
    import types

    def documented(model, *, strict=True):
        """Do it.

        Args:
            model: the model.
            strict (bool): whether to.

        Returns:
            The model.
        """
        return model

    def unlisted(model, **options):
        """Do it.

        Args:
            model: the model.
        """

    def silent(model) -> int:
        """Do it."""
        return 1

    class Plain:
        """A record."""

    class Built:
        """A record."""

        def __init__(self, x):
            self.x = x

    space = types.SimpleNamespace(documented=documented, unlisted=unlisted, silent=silent,
                                  Plain=Plain, Built=Built)
    assert _public_api_problems(["documented", "Plain", "unlisted", "silent", "Built", "gone"],
                                space) == [
        "unlisted: Args: does not list ['options']", "silent: no Args: section",
        "silent: no Returns: section",
        "Built: a class built with arguments, without Args:/Attributes:", "gone: does not resolve"]


def test_the_public_api_is_short_and_documented():
    # issue 39: autoprec exports what users call, grouped by stage, each with Args/Returns
    # docstrings (Google style, as mkdocstrings renders them on docs/api.md); what else the
    # package holds is internal and imported from its module
    import autoprec

    assert len(autoprec.__all__) <= 30, f"{len(autoprec.__all__)} public names: keep it to 30"
    assert len(set(autoprec.__all__)) == len(autoprec.__all__)
    problems = _public_api_problems(autoprec.__all__, autoprec)
    assert not problems, "public names without their docstring sections:\n" + "\n".join(problems)
