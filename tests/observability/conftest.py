import pytest
import structlog

from tinydist.base import logs


@pytest.fixture(autouse=True)
def restore_logging():
    """`cli.main` reconfigures logging onto pytest's captured stream; put the old configuration back
    so later tests do not log into a closed file."""
    saved, configured = structlog.get_config(), logs._configured
    yield
    structlog.configure(**saved)
    logs._configured = configured
