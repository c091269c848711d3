"""docs/env_vars.md is generated from tinydist.base.config, and names every TINYDIST_* variable the code reads."""

import re
from pathlib import Path

from tinydist.base.config import LAUNCH_VARIABLES, env_vars_markdown, settings

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "env_vars.md"


def test_the_doc_is_the_generated_one() -> None:
    assert DOC.read_text() == env_vars_markdown(), "regenerate it: make env-doc"


def test_every_variable_the_code_names_is_declared() -> None:
    declared = {f"TINYDIST_{s.name}" for s in settings.declared()} | set(LAUNCH_VARIABLES)
    named: dict[str, str] = {}
    for package in ("tinydist", "scheduler", "nodes", "transports"):
        for path in (ROOT / package).rglob("*.py"):
            for name in re.findall(r"\bTINYDIST_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
                named.setdefault(name, str(path.relative_to(ROOT)))
    undeclared = {name: where for name, where in named.items() if name not in declared}
    assert not undeclared, f"environment variables read but not declared in tinydist/base/config.py: {undeclared}"
