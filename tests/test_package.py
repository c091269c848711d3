"""The wheel a user installs: one import namespace (`tinydist`), so it sits beside any other package.

The repository keeps nodes/, scheduler/, transports/ and proto/ at the top of the tree (the layer
table, docs/layout.md) and reaches them as `tinydist.<folder>` through symlinks. These tests build
the wheel from a copy of the tree (a build writes build/ and *.egg-info, which must not land in the
checkout), check what it holds, and install it into a fresh virtual environment next to a small
package of someone else's that defines top-level `scheduler` and `transports` modules; both must
import. Nothing is downloaded: the wheels are built with --no-build-isolation and installed with
--no-deps --no-index, and the fresh environment sees this interpreter's site-packages (numpy,
grpcio, ...) through a .pth line, after its own (so its `tinydist` is the wheel's).
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINKED = ("nodes", "scheduler", "transports", "proto")
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

pytestmark = pytest.mark.timeout(300)  # two wheel builds, a venv and three interpreters: about 30 s here


def _run(argv: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_INDEX_URL")}
    env |= {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _wheel(source: Path, out: Path) -> Path:
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
         cwd=source)
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tinydist's wheel, built from a copy of the tree with its symlinks kept as links."""
    tmp = tmp_path_factory.mktemp("tinydist-build")
    source = tmp / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("tinydist", *LINKED):
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=ignore)
    return _wheel(source, tmp / "wheel")


@pytest.fixture(scope="module")
def other_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Someone else's project whose top-level names are the folders ours used to install as."""
    source = tmp_path_factory.mktemp("other") / "src"
    for name in ("scheduler", "transports"):
        (source / name).mkdir(parents=True)
        (source / name / "__init__.py").write_text(f"OWNER = 'other-{name}'\n")
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "other-scheduler"\nversion = "1.0"\n\n'
        '[tool.setuptools]\npackages = ["scheduler", "transports"]\n')
    return _wheel(source, source.parent / "wheel")


def test_the_wheel_holds_one_top_level_package_with_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"tinydist", f"tinydist-{PROJECT['version']}.dist-info"}, f"top-level entries of {wheel.name}: {sorted(top)}"
    # every module of the source tree, the linked folders' under tinydist/<folder>/
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tinydist").rglob("*.py") if "__pycache__" not in p.parts}
    for folder in LINKED:
        source |= {f"tinydist/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / folder).rglob("*.py")
                   if "__pycache__" not in p.parts}
    packaged = {name for name in names if name.endswith(".py")}
    assert source == packaged, f"missing: {sorted(source - packaged)}; unexpected: {sorted(packaged - source)}"
    for data in ("tinydist/py.typed", "tinydist/proto/tinydist/v1/device.proto", "tinydist/proto/tinydist/v1/cluster.proto",
                 "tinydist/scheduler/_generated/cluster_pb2.pyi", "tinydist/transports/pci_remote/_generated/device_pb2.pyi"):
        assert data in names, f"{data} is not in {wheel.name}"


def test_the_wheel_metadata_names_runtime_dependencies_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        meta = email.parser.Parser().parsestr(archive.read(f"tinydist-{PROJECT['version']}.dist-info/METADATA").decode())
    requires = meta.get_all("Requires-Dist") or []
    runtime = sorted(r.split(">")[0].split("=")[0].split(";")[0].strip() for r in requires if "extra ==" not in r)
    assert runtime == sorted(d.split(">")[0].split("=")[0].strip() for d in PROJECT["dependencies"])
    assert "grpcio-tools" not in runtime, "protoc is needed to regenerate the modules, not to run them"
    assert any(r.startswith("grpcio-tools") and 'extra == "test"' in r for r in requires), requires
    assert "Typing :: Typed" in (meta.get_all("Classifier") or [])
    assert meta["Requires-Python"] == PROJECT["requires-python"]


def test_a_fresh_venv_imports_the_wheel_beside_another_scheduler_and_transports(
        wheel: Path, other_wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).stdout.strip())
    # the dependencies from this interpreter's site-packages, searched after the venv's own
    (site / "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for built in (other_wheel, wheel):
        _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(built)],
             cwd=tmp_path)
    check = f"""
import importlib.resources, pathlib, sys
import scheduler, transports  # the other project's (pkg_rename: keep)
assert (scheduler.OWNER, transports.OWNER) == ("other-scheduler", "other-transports"), (scheduler, transports)
import tinydist, tinydist.scheduler.plan, tinydist.transports.tcp, tinydist.nodes.gate
from tinydist.scheduler._generated import cluster_pb2
from tinydist.transports.pci_remote._generated import device_pb2
for module in (tinydist, tinydist.scheduler.plan, tinydist.transports.tcp, tinydist.nodes.gate, cluster_pb2):
    assert pathlib.Path(module.__file__).is_relative_to({str(site)!r}), module.__file__
assert tinydist.scheduler.plan.plan_allreduce and tinydist.transports.tcp.TcpLink
assert sys.modules["scheduler"] is scheduler and "tinydist.scheduler" in sys.modules
proto = importlib.resources.files("tinydist.proto") / "tinydist" / "v1" / "cluster.proto"
assert "package tinydist.v1;" in proto.read_text()
print("ok")
"""
    assert _run([str(python), "-c", check], cwd=tmp_path).stdout.strip() == "ok"
    version = _run([str(venv / "bin" / "tinydist"), "--version"], cwd=tmp_path).stdout.strip()
    assert version == f"tinydist {PROJECT['version']}", version


def test_a_source_checkout_names_itself_in_version() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tinydist.cli", "--version"], capture_output=True, text=True,
                          timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"tinydist {PROJECT['version']} (source checkout {ROOT})"
