from .helpers import no_shm_leak  # noqa: F401  (fixture)
