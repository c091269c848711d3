"""A client whose node restarted (issue 23, item 7): its remote device fails once, saying the
buffers are gone, and the next use of the device name reconnects to the new node."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import tinydist as td
from tinydist.base.errors import DeviceFailed


def test_a_node_restart_fails_the_device_once_and_the_next_use_reconnects(make_server, credentials_env) -> None:
    first = make_server()
    name = f"remote://127.0.0.1:{first.port}/CPU:0"
    x = np.arange(1024, dtype=np.float32)
    t = td.Tensor(x, device=name)
    np.testing.assert_array_equal((t + 1).numpy(), x + 1)
    first.stop()
    second = make_server(listen=f"127.0.0.1:{first.port}")  # the node again, same address, new process state
    with pytest.raises(DeviceFailed, match="node restarted: buffers are gone"):
        (t * 2).numpy()  # t's buffer lived on the first node
    fresh = td.Tensor(x, device=name)  # the next use: a new session, a new lease
    np.testing.assert_array_equal((fresh * 3).numpy(), x * 3)
    assert len(second.service.table.leases) == 1
    engine = td.get_engine()
    del t, fresh
    gc.collect()
    engine.synchronize(10)
    device = engine._devices.pop(name)
    engine.run(device.aclose)


def test_a_restarted_node_process_fails_the_device_once_then_serves_it_again(lab, tmp_path, credentials_env) -> None:
    """The same against `tinydist node serve` processes: the first is stopped (SIGTERM) and a second
    serves the same address; then the second stops too, and the node's absence reads as DeviceFailed
    (UNAVAILABLE), not as an allocation failure."""
    import socket

    from tests.remote.test_node import serving_node

    with socket.socket() as probe:   # a free port both processes take in turn
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    policy = tmp_path / "policy.toml"
    policy.write_text(lab.policy_text())
    (tmp_path / "revoked.txt").write_text((lab.root / "revoked.txt").read_text())
    args = ("--policy", str(policy), "--listen", f"127.0.0.1:{port}")
    name = f"remote://127.0.0.1:{port}/CPU:0"
    x = np.arange(4096, dtype=np.float32)
    engine = td.get_engine()
    with serving_node(lab, tmp_path, *args):
        t = td.Tensor(x, device=name)
        np.testing.assert_array_equal((t + 1).numpy(), x + 1)
    with serving_node(lab, tmp_path, *args):
        with pytest.raises(DeviceFailed, match="node restarted: buffers are gone"):
            (t * 2).numpy()   # t's buffer lived on the first process
        fresh = td.Tensor(x, device=name)   # the next use reconnects, to the new process
        np.testing.assert_array_equal((fresh * 3).numpy(), x * 3)
    with pytest.raises(DeviceFailed, match="UNAVAILABLE") as gone:
        (fresh - 1).numpy()
    assert "AllocationError" not in repr(gone.value) and "allocating" not in str(gone.value)
    del t, fresh
    gc.collect()
    engine.synchronize(10)
    engine.run(engine._devices.pop(name).aclose)
