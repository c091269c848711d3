import pytest

# helpers.py holds shared leak checks: have pytest rewrite its asserts (so they also run under python -O)
pytest.register_assert_rewrite("tests.rdma.helpers")
