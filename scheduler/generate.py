"""Compile proto/tinydist/v1/cluster.proto into scheduler/_generated/ with grpcio-tools.

    python -m scheduler.generate            # regenerate in place
    python -m scheduler.generate --out DIR  # write elsewhere (tests/cluster compares the two)

Same recipe as proto/generate.py (the remote agent's device.proto): grpcio-tools mirrors the proto
path in its imports (`from tinydist.v1 import cluster_pb2`), which would collide with the
`tinydist` package, so that import is rewritten to a relative one.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
SOURCES = ("tinydist/v1/cluster.proto",)
DEFAULT_OUT = ROOT / "scheduler" / "_generated"
HEADER = '"""Generated from proto/tinydist/v1/cluster.proto by scheduler/generate.py; do not edit."""\n'


def generate(out: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc  # build-time tool: imported only here

    include = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *SOURCES]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed: {' '.join(args)}")
        for source in SOURCES:
            stem = Path(source).with_suffix("")
            package = ".".join(stem.parent.parts)
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                generated = Path(tmp) / f"{stem}{suffix}"
                text = generated.read_text()
                text = re.sub(rf"^from {re.escape(package)} import ", "from . import ", text, flags=re.M)
                target = out / generated.name
                target.write_text(text)
                written.append(target)
    init = out / "__init__.py"
    init.write_text(HEADER)
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
