"""One exception tree: every exception class the project defines is a TinydistError and is drawn,
under its real parent, in tinydist/base/errors.py; foreign errors are mapped where they enter, `from`
the original."""

from __future__ import annotations

import importlib
import re
import socket
import tomllib
from pathlib import Path

import anyio
import pytest

import tinydist.base.errors
from tinydist.base.errors import ClosedResourceError, DeviceClosed, DeviceError, TinydistError

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("tinydist", "transports", "scheduler", "nodes")
LINKED = ("transports", "scheduler", "nodes")  # imported as tinydist.<folder> (tinydist/<folder> is a link to it)

# Outside the tree on purpose, each with its reason (the tree's docstring says the same).
ALLOWED = {
    "tinydist.runtime.faults.InjectedFault": "stands in for a foreign failure (the OS, a driver) at a fault point, "
                                             "so the rollback under test sees what production would",
}

_LINE = re.compile(r"(?P<indent>(?:│   |    )*)(?:[├└]── )?(?P<name>\w+)(?: \((?P<bases>[\w, ]+)\))?"
                   r"(?: \[(?P<module>[\w.]+)\])?(?:\s{2,}.*)?")


def project_modules() -> list[str]:
    """Every module under the project's packages, found by file (namespace packages included)."""
    names = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            parts = ("tinydist", *parts) if parts[0] in LINKED else parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def defined_exceptions(modules: list[str]) -> dict[str, type[BaseException]]:
    """`module.Class` -> class, for every exception class a module defines (not ones it imports)."""
    found: dict[str, type[BaseException]] = {}
    for name in modules:
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{name}.{obj.__qualname__}"] = obj
    return found


def drawn_tree(doc: str) -> dict[str, tuple[str | None, tuple[str, ...]]]:
    """`module.Class` -> (its parent's `module.Class`, the names of its other bases) as drawn."""
    lines = doc.split("\n    TinydistError", 1)[1].split("\n\n", 1)[0]
    tree: dict[str, tuple[str | None, tuple[str, ...]]] = {}
    stack: list[tuple[str, str]] = []   # (qualified name, module) of the ancestors of the next line
    for line in ("    TinydistError" + lines).splitlines():
        match = _LINE.fullmatch(line[4:])
        assert match, f"tinydist/base/errors.py: tree line {line!r} does not parse"
        depth = 0 if match["indent"] == "" and not line[4:].startswith(("├", "└")) else len(match["indent"]) // 4 + 1
        del stack[depth:]
        module = match["module"] or (stack[-1][1] if stack else "tinydist.base.errors")
        qualified = f"{module}.{match['name']}"
        assert qualified not in tree, f"{qualified} is drawn twice"
        bases = tuple(b.strip() for b in match["bases"].split(",")) if match["bases"] else ()
        tree[qualified] = (stack[-1][0] if stack else None, bases)
        stack.append((qualified, module))
    return tree


def tree_problems(classes: dict[str, type[BaseException]], tree: dict[str, tuple[str | None, tuple[str, ...]]]) -> list[str]:
    problems = []
    for name, cls in sorted(classes.items()):
        if name in ALLOWED:
            continue
        if not issubclass(cls, TinydistError):
            problems.append(f"{name} is not a TinydistError (bases {[b.__name__ for b in cls.__bases__]}): "
                            "derive it from the tree in tinydist/base/errors.py")
        if cls.__name__.startswith("_"):
            continue   # a private signal: a TinydistError, not drawn
        if name not in tree:
            problems.append(f"{name} is not drawn in tinydist/base/errors.py's tree")
            continue
        parent, others = tree[name]
        first, *rest = cls.__bases__
        real_parent = None if first is Exception else f"{first.__module__}.{first.__qualname__}"
        if parent != real_parent or others != tuple(b.__name__ for b in rest):
            problems.append(f"{name} is drawn under {parent} with {others}, but its bases are "
                            f"{real_parent} and {tuple(b.__name__ for b in rest)}")
    problems += [f"{name} is drawn in tinydist/base/errors.py but no module defines it" for name in tree if name not in classes]
    return problems


def test_every_project_exception_is_a_tinydist_error_drawn_under_its_parent() -> None:
    classes = defined_exceptions(project_modules())
    assert len(classes) > 60, sorted(classes)   # the walk really found the transports and the scheduler
    assert tree_problems(classes, drawn_tree(tinydist.base.errors.__doc__ or "")) == []
    for name in ALLOWED:
        assert name in classes and not issubclass(classes[name], TinydistError), name


def test_the_check_fails_on_a_foreign_rooted_error_and_on_a_stale_drawing() -> None:
    class Stray(ValueError):
        pass

    Stray.__module__ = "tinydist.stray"
    classes = {**defined_exceptions(["tinydist.base.errors"]), "tinydist.stray.Stray": Stray}
    tree = drawn_tree(tinydist.base.errors.__doc__ or "")
    problems = tree_problems(classes, {k: v for k, v in tree.items() if k.startswith("tinydist.base.errors.")})
    assert problems == [("tinydist.stray.Stray is not a TinydistError (bases ['ValueError']): derive it from the tree "
                         "in tinydist/base/errors.py"), "tinydist.stray.Stray is not drawn in tinydist/base/errors.py's tree"]
    moved = {**tree, "tinydist.base.errors.DeviceHang": ("tinydist.base.errors.DeviceError", ("TimeoutError",))}
    assert any("DeviceHang is drawn under" in p for p in tree_problems(defined_exceptions(["tinydist.base.errors"]), moved))


def test_closed_resources_share_one_class_and_keep_their_families() -> None:
    from tinydist.transports.base import LinkClosed, TransportError
    from tinydist.transports.tcp import TcpLink

    async def main() -> None:
        a, b = socket.socketpair()
        link = TcpLink(a, 1)
        await link.close(linger=0)
        with pytest.raises(LinkClosed, match="rank 1 is closed") as info:
            await link.send(b"x")
        assert isinstance(info.value, TransportError) and isinstance(info.value, ClosedResourceError)
        b.close()

    anyio.run(main)
    device = tinydist.open_device("CPU:0")
    anyio.run(device.open)
    anyio.run(device.aclose)
    with pytest.raises(DeviceClosed) as closed:
        anyio.run(device.open)
    assert isinstance(closed.value, DeviceError) and isinstance(closed.value, ClosedResourceError)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_coordinator_is_a_transport_error_caused_by_the_oserror() -> None:
    from tinydist.dist.rendezvous import register
    from tinydist.transports.base import TransportError

    port = _closed_port()
    with pytest.raises(TransportError, match=f"no coordinator at 127.0.0.1:{port}") as info:
        anyio.run(register, ("127.0.0.1", port), 1, 2, 0.05)
    assert isinstance(info.value.__cause__, ConnectionRefusedError)


def test_connecting_a_link_to_a_closed_port_is_a_transport_error_caused_by_the_oserror() -> None:
    from tinydist.dist.rendezvous import connect_mesh, host_key
    from tinydist.transports.base import TransportError

    port = _closed_port()
    listener = socket.create_server(("127.0.0.1", 0))
    me = {"host": host_key(), "addr": list(listener.getsockname())}
    table = {"job": "0123abcd", "peers": {"0": {"host": "elsewhere", "addr": ["127.0.0.1", port]}, "1": me}}
    with pytest.raises(BaseExceptionGroup) as info:   # from the task group that connects the peers
        anyio.run(connect_mesh, 1, 2, table, listener, "tcp", lambda *a: None, 5.0)
    (error,) = info.value.exceptions
    assert isinstance(error, TransportError) and isinstance(error.__cause__, ConnectionRefusedError)
    assert f"cannot connect to rank 0 at 127.0.0.1:{port}" in str(error)
    listener.close()


def test_a_corrupt_onnx_file_is_a_model_load_error_naming_the_file(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    from google.protobuf.message import DecodeError

    import tinydist.onnx as tdo

    path = tmp_path / "broken.onnx"
    path.write_bytes(b"garbage\xff\xff")
    with pytest.raises(tdo.ModelLoadError, match="broken.onnx") as info:
        tdo.load(path)
    assert isinstance(info.value, ValueError) and isinstance(info.value.__cause__, DecodeError)
    with pytest.raises(tdo.ModelLoadError, match="the 9 bytes given"):
        tdo.load(path.read_bytes())


def test_pki_and_policy_files_map_their_parsers_errors(tmp_path: Path) -> None:
    from tinydist.security.pki import ClientCredentials, PKIError, load_ca
    from tinydist.security.policy import PolicyError, parse_policy

    with pytest.raises(PKIError, match="cannot read the client certificate") as info:
        ClientCredentials.load(tmp_path / "none.pem", tmp_path / "none.key", tmp_path / "ca.pem")
    assert isinstance(info.value.__cause__, FileNotFoundError)
    (tmp_path / "ca.pem").write_bytes(b"not a certificate")
    (tmp_path / "ca").mkdir()
    (tmp_path / "ca" / "ca.key").write_bytes(b"not a key")
    with pytest.raises(PKIError, match="do not parse") as info:
        load_ca(tmp_path)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(PolicyError, match="not valid TOML") as policy:
        parse_policy("trust_domain = ", tmp_path)
    assert isinstance(policy.value.__cause__, tomllib.TOMLDecodeError)


def test_a_checkpoint_that_does_not_decode_is_a_checkpoint_error_caused_by_the_decoder(tmp_path: Path) -> None:
    import json
    import struct

    import numpy as np

    import tinydist as td
    from tinydist.train.serialization import CheckpointError

    path = tmp_path / "ckpt.tdz"
    td.save({"w": td.Tensor(np.arange(6, dtype=np.float32))}, path)
    good = path.read_bytes()
    (length,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + length])
    header["w"]["shape"] = [4, 2]   # 8 elements claimed, 6 stored
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(text) == length
    path.write_bytes(good[:8] + text + good[8 + length:])
    with pytest.raises(CheckpointError, match="ckpt.tdz: the header does not describe its tensors") as info:
        td.load(path)
    assert isinstance(info.value, ValueError) and isinstance(info.value.__cause__, ValueError)
    path.write_bytes(good[:8] + b"{" * length + good[8 + length:])
    with pytest.raises(CheckpointError) as info:
        td.load(path)
    assert isinstance(info.value.__cause__, json.JSONDecodeError)


def test_a_coordinator_that_answers_no_json_is_a_transport_error_caused_by_the_decoder() -> None:
    import asyncio
    import json

    from tinydist.dist.rendezvous import register
    from tinydist.transports.base import TransportError

    async def main() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readline()
            writer.write(b"HTTP/1.1 400 Bad Request\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(TransportError, match="not JSON") as info:
            await register(("127.0.0.1", port), 1, 2, 5.0)
        assert isinstance(info.value.__cause__, json.JSONDecodeError)
        server.close()
        await server.wait_closed()

    asyncio.run(main())
