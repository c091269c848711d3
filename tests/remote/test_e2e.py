"""The remote device is a device of the same engine: tensors compute on a node over mTLS."""

from __future__ import annotations

import gc

import anyio
import grpc
import numpy as np
import pytest

import tinydist as td
from tinydist.base.errors import DeviceError, DeviceUnavailable
from tinydist.runtime.remote.device import RemoteDevice
from tinydist.runtime.remote.errors import AccessDenied


@pytest.fixture
def credentials_env(lab, monkeypatch, tmp_path):
    for part in ("cert", "key", "ca"):
        path = tmp_path / f"bob.{part}"
        path.write_bytes(getattr(lab.creds["bob"], part))
        monkeypatch.setenv(f"TINYDIST_{part.upper()}", str(path))


def test_tensor_on_remote_device_matches_numpy(server, credentials_env) -> None:
    name = f"remote://127.0.0.1:{server.port}/cpu:0"
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    t = td.Tensor(x, device=name)
    assert t.device == f"remote://127.0.0.1:{server.port}/CPU:0"
    result = (t * 2 + 1).sum()
    np.testing.assert_allclose(result.numpy(), (x * 2 + 1).sum(), rtol=1e-5)
    big = np.random.default_rng(1).random((1024, 1536)).astype(np.float32)  # 6 MiB: streamed both ways
    tb = td.Tensor(big, device=name)
    np.testing.assert_array_equal(tb.numpy(), big)
    np.testing.assert_allclose((tb * tb).sum(axis=1).numpy(), (big * big).sum(axis=1), rtol=1e-4)
    assert server.service.handler_calls["LoadProgram"] >= 2 and server.service.handler_calls["Launch"] >= 2
    engine = td.get_engine()
    device = engine.device(name)
    del t, result, tb
    gc.collect()
    engine.synchronize(10)
    engine.run(device.aclose)
    engine._devices.pop(device.name, None)  # the test's server goes away with this module
    assert not server.service.table.leases


def test_remote_device_refuses_object_code_and_needs_credentials(server, lab, monkeypatch) -> None:
    for var in ("TINYDIST_CERT", "TINYDIST_KEY", "TINYDIST_CA"):
        monkeypatch.delenv(var, raising=False)

    async def main() -> None:
        with pytest.raises(DeviceUnavailable, match="TINYDIST_CERT"):
            await td.open_device(f"remote://127.0.0.1:{server.port}/CPU:0").open()
        async with RemoteDevice(f"remote://127.0.0.1:{server.port}/CPU:0", lab.creds["bob"]) as dev:
            with pytest.raises(DeviceError, match="object code"):
                dev.load_program(b"\x7fELF", "k", ["rw"])
            buf = dev.allocator.alloc(4096)
            dev.copyin(buf, np.arange(1024, dtype=np.float32))
            other = dev.allocator.alloc(4096)
            with dev.batch("copy") as batch:
                batch.copy(other, buf)
            out = (await dev.copyout(other, timeout=10)).view(np.float32)
            np.testing.assert_array_equal(out, np.arange(1024, dtype=np.float32))
        with pytest.raises(AccessDenied, match='"spiffe://tinydist.lab/user/mallory" = "viewer"') as refused:
            await RemoteDevice(f"remote://127.0.0.1:{server.port}/CPU:0", lab.creds["mallory"]).open()
        assert isinstance(refused.value.__cause__, grpc.RpcError)   # mapped where it entered, the original kept

    anyio.run(main)


def test_a_capture_on_a_remote_device_replays_in_runs_and_matches_numpy(server, credentials_env) -> None:
    # A remote node runs no client binaries: nothing links into one entry point, so the capture
    # replays its calls by runs, and the frame loop (call_numpy) uploads straight to the node.
    name = f"remote://127.0.0.1:{server.port}/CPU:0"
    g = np.random.default_rng(7)
    w_host = g.standard_normal((8, 4)).astype(np.float32)
    w = td.Tensor(w_host, device=name)

    @td.jit
    def step(x: td.Tensor, bias: td.Tensor) -> td.Tensor:
        return (bias + x @ w).relu()  # `bias` is reached before `x`, against declaration order  # noqa: F821 (ruff#7733, the del below)

    @td.jit
    def frame(x: td.Tensor, bias: td.Tensor) -> td.Tensor:
        return (bias + x @ w).relu()  # noqa: F821 (ruff#7733, the del below)

    for _ in range(5):
        x, bias = g.standard_normal((3, 8)).astype(np.float32), g.standard_normal(4).astype(np.float32)
        expected = np.maximum(bias.astype(np.float64) + x.astype(np.float64) @ w_host, 0)
        out = step(td.Tensor(x, device=name), td.Tensor(bias, device=name))
        assert out.device == name
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(frame.call_numpy(x, bias, device=name), expected, rtol=1e-5, atol=1e-6)
    assert step.captured is not None and step.captured.strategy.name == "runs"
    assert frame.captured is not None and frame.captured.capture.frame is None
    engine = td.get_engine()
    device = engine.device(name)
    del w, out, step, frame
    gc.collect()
    engine.synchronize(10)
    engine.run(device.aclose)
    engine._devices.pop(device.name, None)
