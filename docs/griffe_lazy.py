"""A griffe extension for the API page: the public names griffe's static loader cannot reach.

``autoprec/measure`` is a namespace package (no ``__init__.py``), which griffe does not enter
inside a regular package; ``autoprec.integrations.PolicyCallback`` is a class built on
first access (it subclasses transformers' ``TrainerCallback``). This loads the first from its
folder and inspects the second, and hangs both where ``import autoprec`` finds them.
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
