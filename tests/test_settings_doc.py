"""docs/env_vars.md lists exactly the settings declared in tinydist.config."""

from pathlib import Path

from tinydist.config import settings

DOC = Path(__file__).resolve().parents[1] / "docs" / "env_vars.md"


def test_every_declared_setting_is_documented_and_nothing_else() -> None:
    text = DOC.read_text()
    documented = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `TINYDIST_")}
    declared = {f"TINYDIST_{s.name}" for s in settings.declared()}
    assert documented == declared
    for setting in settings.declared():
        assert setting.doc in text
