"""Structured logs carry the ids they speak for; settings come from one registry of env variables."""

from __future__ import annotations

import json

import pytest
import structlog

from tinydist.base import logs
from tinydist.base.config import Setting, Settings, settings
from tinydist.runtime.registry import open_device


@pytest.fixture
def restore_logging():
    """Put back the exact logging configuration (including the stream it writes to)."""
    saved, configured = structlog.get_config(), logs._configured
    yield
    structlog.configure(**saved)
    logs._configured = configured


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.anyio
async def test_json_log_lines_carry_ids(capsys, restore_logging) -> None:
    logs.configure("json", "debug")
    dev = open_device("CPU:3")
    async with dev:
        dev.queues["compute"].log.debug("probe", batch=1)
    records = _json_lines(capsys.readouterr().err)
    events = {r["event"]: r for r in records}
    assert events["device opened"]["device"] == "CPU:3"
    assert events["device opened"]["queues"] == ["compute", "copy"]
    assert events["device opened"]["level"] == "debug" and "timestamp" in events["device opened"]
    assert events["device closed"]["device"] == "CPU:3"
    probe = events["probe"]
    assert (probe["device"], probe["queue"], probe["timeline"]) == ("CPU:3", "compute", "CPU:3/compute")


@pytest.mark.anyio
async def test_log_level_filters(capsys, restore_logging) -> None:
    logs.configure("json", "warning")
    async with open_device("CPU:3"):
        pass
    assert _json_lines(capsys.readouterr().err) == []


@pytest.mark.anyio
async def test_console_format_is_not_json(capsys, restore_logging) -> None:
    logs.configure("console", "debug")
    async with open_device("CPU:3"):
        pass
    err = capsys.readouterr().err
    assert "device opened" in err and "CPU:3" in err
    with pytest.raises(json.JSONDecodeError):
        _json_lines(err)


def test_invalid_log_format(restore_logging) -> None:
    with pytest.raises(ValueError, match="log format must be 'console' or 'json', got 'xml'"):
        logs.configure("xml")


def _fresh_settings() -> Settings:
    fresh = Settings()
    for setting in settings.declared():
        fresh.declare(setting)
    return fresh


@pytest.mark.parametrize(("name", "raw"), [("CPU_DEVICES", "abc"), ("CPU_DEVICES", "0"), ("LOG_FORMAT", "xml"),
                                           ("TIMELINE_TIMEOUT", "-1"), ("CPU_MEMORY_LIMIT", "1.5")])
def test_invalid_environment_value_names_the_variable(monkeypatch, name: str, raw: str) -> None:
    monkeypatch.setenv(f"TINYDIST_{name}", raw)
    fresh = _fresh_settings()
    with pytest.raises(ValueError, match=rf"TINYDIST_{name}={raw!r} is invalid"):
        getattr(fresh, name)


def test_environment_values_are_parsed_once(monkeypatch) -> None:
    monkeypatch.setenv("TINYDIST_CPU_DEVICES", "6")
    monkeypatch.setenv("TINYDIST_LOG_FORMAT", " JSON ")
    fresh = _fresh_settings()
    assert fresh.CPU_DEVICES == 6
    assert fresh.LOG_FORMAT == "json"
    monkeypatch.setenv("TINYDIST_CPU_DEVICES", "abc")
    assert fresh.CPU_DEVICES == 6   # read once
    monkeypatch.delenv("TINYDIST_TIMELINE_TIMEOUT", raising=False)
    assert fresh.TIMELINE_TIMEOUT == 30.0


def test_override_is_scoped_and_checked() -> None:
    fresh = _fresh_settings()
    before = fresh.CPU_DEVICES
    with fresh.override(CPU_DEVICES=before + 5):
        assert fresh.CPU_DEVICES == before + 5
    assert fresh.CPU_DEVICES == before
    with pytest.raises(AttributeError, match="no setting named NOPE"):
        with fresh.override(NOPE=1):
            pass
    with pytest.raises(AttributeError, match="no setting named NOPE"):
        _ = fresh.NOPE
    with pytest.raises(ValueError, match="declared twice"):
        fresh.declare(Setting("CPU_DEVICES", int, lambda: 1, "again"))
