"""One registry of the OOLONG_* environment variables (training_core/env_vars.py), in step with
the code that reads them and with docs/environment.md, which is generated from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from training_core import env_vars

pytestmark = pytest.mark.unit  # no process, network or database (conftest)

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("training_core", "platform", "webapp", "workers", "scripts", "infra", "benchmarks",
           "tests", "Makefile", ".ci")
NAME = re.compile(r"\bOOLONG_[A-Z0-9_]*[A-Z0-9]")


def names_in_the_tree() -> dict[str, str]:
    found: dict[str, str] = {}
    for top in SOURCES:
        base = ROOT / top
        files = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file()]
        for path in files:
            if path.suffix not in {".py", ".sh", ".tftpl", ".tf", ".yaml", ".toml", ""} \
                    or "__pycache__" in path.parts or path == ROOT / "training_core/env_vars.py":
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            for name in NAME.findall(text):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_tree_reads_is_registered():
    found = names_in_the_tree()
    families = {key[:-2] for key in env_vars.VARIABLES if key.endswith("_*")}
    missing = {n: where for n, where in found.items()
               if not env_vars.covers(n) and n not in families}
    assert not missing, f"unregistered in training_core/env_vars.py: {missing}"
    # the scan finds them where they are
    assert {"OOLONG_SERVER_KEY", "OOLONG_RUNS_DIR", "OOLONG_URL"} <= found.keys()


def test_every_registered_variable_is_read_somewhere():
    found = names_in_the_tree()
    unused = [key for key in env_vars.VARIABLES
              if not (any(n.startswith(key[:-2]) for n in found) if key.endswith("*")
                      else key in found)]
    assert not unused, f"registered but read nowhere: {unused}"


def test_the_docs_table_is_generated_from_the_registry():
    assert (ROOT / "docs/environment.md").read_text() == env_vars.markdown(), (
        "run: python -m training_core.env_vars > docs/environment.md")
