"""The documentation: the README is a short way in, its commands are the ones CI and the main
job run, and the reference under docs/ builds with MkDocs in strict mode (every link between
pages and every API entry resolves)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

# the main job's own part of its command: what follows the set-up it shares with the tests
MAIN_JOB = ('pip install -e ".[examples,torchao]" && autoprec tune examples/gpt2_bytes.py:task '
            "-o policies/gpt2_bytes.yaml")
TEST_TAIL = 'pip install -e ".[test]" && python -m pytest'


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)\n```$", text, re.S | re.M)


def test_mkdocs_builds_the_site_in_strict_mode(tmp_path):
    # strict: a warning fails the build (a broken link between pages, a missing anchor, a page
    # left out of the nav, an API entry mkdocstrings cannot collect)
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         os.path.join(ROOT, "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        "mkdocs build --strict failed (pip install -e \".[test]\" installs MkDocs and "
        f"mkdocstrings):\n{proc.stdout}\n{proc.stderr}")
    assert os.path.exists(tmp_path / "site" / "api" / "index.html")


def test_readme_is_at_most_200_lines():
    lines = _read(README).count("\n")
    assert lines <= 200, f"README.md has {lines} lines; the reference belongs under docs/"


def test_readme_test_command_is_what_ci_runs():
    ci = [line for line in _read(os.path.join(ROOT, ".ci", "run")).splitlines() if line.strip()]
    blocks = _bash_blocks(_read(README))
    assert len(blocks) >= 2, "the README's first two bash blocks are the main job and the tests"
    assert blocks[1] == ci[-1], f"README:\n{blocks[1]}\n.ci/run:\n{ci[-1]}"


def test_readme_main_job_is_the_test_set_up_then_the_tune():
    main, tests = _bash_blocks(_read(README))[:2]
    assert tests.endswith(TEST_TAIL)
    assert main == tests[: -len(TEST_TAIL)] + MAIN_JOB, main


def test_readme_links_resolve():
    text = _read(README)
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links to the documentation pages"
    missing = [t for t in local if not os.path.exists(os.path.join(ROOT, t))]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_api_page_documents_exactly_the_public_names():
    # docs/api.md is the public API: one `::: autoprec.<name>` entry per name in
    # autoprec.__all__, and no other entry (an internal name documented there looks public)
    import autoprec

    entries = re.findall(r"^::: ([\w.]+)$", _read(os.path.join(ROOT, "docs", "api.md")), re.M)
    assert entries, "docs/api.md has no `::: autoprec.<name>` entries"
    assert len(entries) == len(set(entries)), f"docs/api.md lists a name twice: {entries}"
    documented = {e.removeprefix("autoprec.") for e in entries if e.count(".") == 1}
    others = [e for e in entries if e.count(".") != 1 or not e.startswith("autoprec.")]
    assert not others, f"docs/api.md entries not of the form `::: autoprec.<name>`: {others}"
    missing = sorted(set(autoprec.__all__) - documented)
    assert not missing, f"autoprec.__all__ names without an entry in docs/api.md: {missing}"
    extra = sorted(documented - set(autoprec.__all__))
    assert not extra, f"docs/api.md documents names that are not in autoprec.__all__: {extra}"
