"""Compile the versioned protos (proto/tinydist/v1/*.proto) into the packages that use them.

    python proto/generate.py                            # regenerate every target in place
    python proto/generate.py --only cluster --out DIR   # one target, elsewhere (freshness tests compare)

Targets: device.proto → transports/pci_remote/_generated/, cluster.proto → scheduler/_generated/.

grpcio-tools mirrors the .proto path in its imports (`from tinydist.v1 import device_pb2`), which
would collide with the `tinydist` Python package; the one import line it writes is rewritten to a
relative import so the generated modules live inside the package that uses them.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
TARGETS = {  # name -> (proto sources, package directory the generated modules live in)
    "device": (("tinydist/v1/device.proto",), ROOT / "transports" / "pci_remote" / "_generated"),
    "cluster": (("tinydist/v1/cluster.proto",), ROOT / "scheduler" / "_generated"),
}


def generate(target: str, out: Path | None = None) -> list[Path]:
    """Generate `target`'s modules into `out` (default: their package); returns the files written."""
    sources, default_out = TARGETS[target]
    out = default_out if out is None else out
    from grpc_tools import protoc  # build-time tool: imported only here
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *sources]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed: {' '.join(args)}")
        for source in sources:
            stem = Path(source).with_suffix("")
            package = ".".join(stem.parent.parts)
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                generated = Path(tmp) / f"{stem}{suffix}"
                text = generated.read_text()
                text = re.sub(rf"^from {re.escape(package)} import ", "from . import ", text, flags=re.M)
                destination = out / generated.name  # not `target`: that is the parameter
                destination.write_text(text)
                written.append(destination)
    init = out / "__init__.py"
    init.write_text(f'"""Generated from proto/{", proto/".join(sources)} by proto/generate.py; do not edit."""\n')
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(TARGETS), help="one target (default: all)")
    parser.add_argument("--out", type=Path, help="write here instead of the package (needs --only)")
    args = parser.parse_args(argv)
    if args.out is not None and args.only is None:
        parser.error("--out needs --only: each target has its own package")
    for target in [args.only] if args.only else sorted(TARGETS):
        for path in generate(target, args.out):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
