"""The tree is the layer table (docs/layout.md): every import points down it, and the doc lists
exactly the modules on disk.

Each module belongs to the layer whose folder is the longest prefix of its path. Every import is
read from the AST — top-level ones, the ones inside functions (deferred, but still a dependency)
and those under `if TYPE_CHECKING:` — and one that reaches a higher layer fails the test, unless
it is one of EXCEPTIONS, each with its reason and the one form it may take (`deferred`: inside a
function; `type`: for the type checker only). An exception that no longer occurs fails too, so the
list only ever shrinks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tinydist", "transports", "nodes", "scheduler", "proto")  # the folders walked, by path
# The folders kept at the top of the tree for the layer table; their modules are imported as
# tinydist.<folder>.* through the symlinks tinydist/<folder> -> ../<folder> (docs/layout.md).
LINKED = ("transports", "nodes", "scheduler", "proto")

LAYERS: list[tuple[str, tuple[str, ...]]] = [  # lowest first: a layer imports only the ones above it here
    ("base", ("tinydist/base",)),
    ("graph", ("tinydist/graph",)),
    ("wire", ("proto", "transports/pci_remote/_generated", "scheduler/_generated")),
    ("security", ("tinydist/security",)),
    ("codegen", ("tinydist/codegen",)),
    ("runtime", ("tinydist/runtime",)),
    ("observability", ("tinydist/observability",)),
    ("schedule", ("tinydist/schedule",)),
    ("engine", ("tinydist/engine",)),
    ("frontend", ("tinydist/frontend",)),
    ("multi", ("tinydist/multi",)),
    ("train", ("tinydist/train",)),
    ("onnx", ("tinydist/onnx",)),
    ("transports", ("transports",)),
    ("remote", ("tinydist/runtime/remote",)),
    ("dist", ("tinydist/dist",)),
    ("api", ("tinydist/__init__.py", "tinydist/testing.py")),
    ("nodes", ("nodes",)),
    ("scheduler", ("scheduler",)),
    ("cli", ("tinydist/cli", "tinydist/__main__.py")),
]
RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}

# (importer, imported) -> (form, why). Keep this list short: move code before adding to it.
EXCEPTIONS: dict[tuple[str, str], tuple[str, str]] = {
    ("tinydist.frontend.tensor", "tinydist.multi.sharded"):
        ("deferred", "`Tensor.shard(devices)` is the public spelling of `MultiTensor.shard`; multi is built "
                     "on Tensor, so the method imports it when called"),
    ("tinydist.graph.lazy", "tinydist.runtime.buffer"):
        ("type", "a realized LazyNode keeps the runtime's Buffer in its `buffer` slot; the graph only "
                 "tests it against None, never calls it"),
}


def layer_of(rel: str) -> str | None:
    best: tuple[int, str] | None = None
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if rel == prefix or rel.startswith(prefix + "/"):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), name)
    return None if best is None else best[1]


def python_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for package in PACKAGES for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(rel: str) -> str:
    """The import name of the file at `rel`: a file in a linked folder is under `tinydist.`."""
    parts = list(Path(rel).with_suffix("").parts)
    if parts[0] in LINKED:
        parts.insert(0, "tinydist")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str, root: Path = ROOT) -> str | None:
    """The file (its real path, from the root) that `name` imports: tinydist/scheduler/plan.py is
    reached through the link, so the layer is the one of scheduler/plan.py."""
    base = Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if (root / candidate).is_file():
            return (root / candidate).resolve().relative_to(root.resolve()).as_posix()
    return None


def _form(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    form = "top"
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return "deferred"
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            form = "type"
    return form


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str, str]]:
    """(line, imported module, form) for every import of our own packages in `path`."""
    rel = path.relative_to(root).as_posix()
    me = module_name(rel)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import module` depends on the module; `from module import name` on the module
            targets = [f"{base}.{a.name}" if module_path(f"{base}.{a.name}", root) else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in PACKAGES:
                found.append((node.lineno, target, _form(node, parents)))
    return found


def old_names(root: Path = ROOT) -> list[str]:
    """Imports of a linked folder by its folder name (`from scheduler.plan import ...`), anywhere in the
    tree: it works from a source checkout, whose root is on sys.path, but makes a second copy of the
    module (its errors no longer caught by `except tinydist.scheduler...`) and fails from the wheel."""
    found = []
    for folder in (*PACKAGES, "tests", "bench", "examples"):
        for path in sorted((root / folder).rglob("*.py")):
            for line, target, _ in imports(path, root):
                if target.split(".")[0] in LINKED:
                    found.append(f"{path.relative_to(root)}:{line} imports {target}: import tinydist.{target}")
    return found


def upward_imports(root: Path = ROOT) -> tuple[list[str], set[tuple[str, str]]]:
    """(violations, exceptions used)."""
    violations, used = [], set()
    for path in python_files(root):
        rel = path.relative_to(root).as_posix()
        mine = layer_of(rel)
        if mine is None:
            violations.append(f"{rel} is in no layer: move it into a layer's folder (docs/layout.md, "
                              "'Where do I put X') or give its folder a row in LAYERS")
            continue
        for line, target, form in imports(path, root):
            target_path = module_path(target, root)
            theirs = layer_of(target_path) if target_path else None
            if theirs is None or RANK[theirs] <= RANK[mine]:
                continue
            key = (module_name(rel), target)
            allowed = EXCEPTIONS.get(key)
            if allowed is not None and allowed[0] == form:
                used.add(key)
                continue
            how = {"top": "", "deferred": " (inside a function)", "type": " (under TYPE_CHECKING)"}[form]
            violations.append(f"{rel}:{line} ({mine}, rank {RANK[mine]}) imports {target}{how} "
                              f"({theirs}, rank {RANK[theirs]}): a layer imports only the layers listed before it in docs/layout.md")
    return violations, used


def test_every_import_points_down_the_layer_table() -> None:
    violations, used = upward_imports()
    assert not violations, "upward imports:\n  " + "\n  ".join(violations)
    stale = sorted(set(EXCEPTIONS) - used)
    assert not stale, f"exceptions that no longer occur (delete them from EXCEPTIONS): {stale}"


def test_nothing_imports_a_linked_folder_by_its_folder_name() -> None:
    found = old_names()
    assert not found, "old top-level names (re-run the import rewrite, /work/pkg_rename.py):\n  " + "\n  ".join(found)


def test_each_linked_folder_is_reached_from_the_tinydist_package() -> None:
    """The links are what setuptools, mypy and the import system follow; a copy instead would drift."""
    wrong = [f"tinydist/{name}" for name in LINKED
             if not ((ROOT / "tinydist" / name).is_symlink() and (ROOT / "tinydist" / name).readlink() == Path("..", name))]
    assert not wrong, f"these must be relative symlinks tinydist/NAME -> ../NAME: {wrong}"


def test_every_layer_folder_exists() -> None:
    missing = [f"{name}: {prefix}" for name, prefixes in LAYERS for prefix in prefixes if not (ROOT / prefix).exists()]
    assert not missing, f"LAYERS names paths that are not in the tree: {missing}"


# ---------------------------------------------------------------------------------------------- docs/layout.md
def module_files(root: Path = ROOT) -> set[str]:
    """Every module a reader needs to find: generated code and docstring-only `__init__.py` left out."""
    out = set()
    for path in python_files(root):
        rel = path.relative_to(root).as_posix()
        if "_generated" in path.parts:
            continue
        if path.name == "__init__.py":
            body = ast.parse(path.read_text()).body
            if all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body):
                continue
        out.add(rel)
    return out


def documented_modules(root: Path = ROOT) -> set[str]:
    """The `.py` files named in the first cell of docs/layout.md's table rows: a path with a `/` is
    from the repository root, a bare `name.py` is in the folder of the path before it in that cell."""
    out = set()
    for line in (root / "docs" / "layout.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for token in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "/" in token:
                folder = token if token.endswith("/") else token.rpartition("/")[0] + "/"
                if token.endswith(".py"):
                    out.add(token)
            elif token.endswith(".py"):
                out.add(folder + token)
    return out


def test_layout_doc_lists_the_modules_on_disk() -> None:
    listed, on_disk = documented_modules(), module_files()
    assert not on_disk - listed, f"docs/layout.md does not list: {sorted(on_disk - listed)}"
    assert not listed - on_disk, f"docs/layout.md lists modules that are not on disk: {sorted(listed - on_disk)}"


def test_layout_doc_draws_the_layers_in_rank_order() -> None:
    headings = [m.group(1) for m in re.finditer(r"^## \d+\. (\w+)", (ROOT / "docs" / "layout.md").read_text(), re.M)]
    assert headings == [name for name, _ in LAYERS], f"docs/layout.md's layer headings {headings} != LAYERS"


# ---------------------------------------------------------------------------------------------- the check itself
def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


_SMALL_TREE = {
    "tinydist/__init__.py": "",
    "tinydist/base/__init__.py": "",
    "tinydist/base/errors.py": "class TinydistError(Exception):\n    pass\n",
    "tinydist/graph/__init__.py": "",
    "tinydist/graph/lazy.py": "from tinydist.base.errors import TinydistError\n",  # down: base is below graph
    "tinydist/runtime/__init__.py": "",
    "tinydist/runtime/buffer.py": "import tinydist.graph.lazy\n",
}


def test_a_tree_whose_imports_point_down_passes(tmp_path: Path) -> None:
    assert upward_imports(_tree(tmp_path, _SMALL_TREE)) == ([], set())


def test_an_upward_import_is_reported_with_its_file_and_line(tmp_path: Path) -> None:
    """base may import nothing of ours: the third line of errors.py reaching up into graph fails,
    and so does one inside a function (deferred is still a dependency)."""
    root = _tree(tmp_path, {**_SMALL_TREE, "tinydist/base/errors.py":
                            '"""Errors."""\n\nfrom tinydist.graph import lazy\n\n\ndef later():\n    import tinydist.runtime.buffer\n'})
    violations, used = upward_imports(root)
    assert len(violations) == 2 and not used, violations
    assert violations[0].startswith("tinydist/base/errors.py:3 (base, rank 0) imports tinydist.graph.lazy (graph, rank 1)")
    assert violations[1].startswith("tinydist/base/errors.py:7 (base, rank 0) imports tinydist.runtime.buffer "
                                    f"(inside a function) (runtime, rank {RANK['runtime']})")


def test_an_exception_holds_only_in_the_form_it_names(tmp_path: Path) -> None:
    """graph.lazy may name the runtime's Buffer for the type checker only; imported at run time it is upward."""
    typed = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from tinydist.runtime.buffer import Buffer\n"
    assert upward_imports(_tree(tmp_path / "typed", {**_SMALL_TREE, "tinydist/graph/lazy.py": typed})) == (
        [], {("tinydist.graph.lazy", "tinydist.runtime.buffer")})
    eager = "from tinydist.runtime.buffer import Buffer\n"
    violations, _ = upward_imports(_tree(tmp_path / "eager", {**_SMALL_TREE, "tinydist/graph/lazy.py": eager}))
    assert [v.split(" (graph")[0] for v in violations] == ["tinydist/graph/lazy.py:1"], violations
