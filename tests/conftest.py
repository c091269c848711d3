import pytest

from tinydist.base.config import settings


@pytest.fixture(autouse=True, scope="session")
def _isolated_compile_cache(tmp_path_factory: pytest.TempPathFactory):
    """Tests compile into a fresh cache directory, never the user's."""
    with settings.override(CACHE_DIR=tmp_path_factory.mktemp("tinydist-cache")):
        yield
