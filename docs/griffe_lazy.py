"""A griffe extension for the API page: the public names griffe's static loader cannot reach.

``autoprec/measure`` is a namespace package (no ``__init__.py``), which griffe does not enter
inside a regular package; ``autoprec.integrations.PolicyCallback`` is a class built on
first access (it subclasses transformers' ``TrainerCallback``). This loads the first from its
folder and inspects the second, and hangs both where ``import autoprec`` finds them. The names
``autoprec`` loads on first use (its ``_LAZY``) become aliases on the package, so that the API
page documents every public name as ``autoprec.<name>``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent


class LazyNames(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name != "autoprec":
            return
        measure = griffe.load("measure", search_paths=[str(ROOT / "autoprec")],
                              docstring_parser=loader.docstring_parser,
                              docstring_options=loader.docstring_options)
        pkg.set_member("measure", measure)
        importlib.import_module("autoprec.integrations").PolicyCallback  # noqa: B018
        inspected = griffe.inspect("autoprec.integrations", import_paths=[str(ROOT)],
                                   docstring_parser=loader.docstring_parser,
                                   docstring_options=loader.docstring_options)
        pkg["integrations"].set_member("PolicyCallback", inspected["PolicyCallback"])
        # the names ``autoprec.__getattr__`` loads on first use: aliases to where each is
        # defined (``autoprec.tuning.tune`` is also a module: the function's own path decides)
        autoprec = importlib.import_module("autoprec")
        for name in autoprec._LAZY:
            value = getattr(autoprec, name)
            pkg.set_member(name, griffe.Alias(name, f"{value.__module__}.{name}",
                                              parent=pkg))
