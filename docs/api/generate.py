"""Generate the API reference (docs/api/*.md) from the docstrings and signatures of the public API.

    python docs/api/generate.py           # rewrite docs/api/*.md
    python docs/api/generate.py --check   # exit 1 naming the pages that differ from the code (tests/test_docs.py)

Public means: `tinydist.__all__` (the `td` namespace) and the `__all__` of each submodule users
import (MODULES below); a module without `__all__` contributes the classes and functions defined in
it. For each name: a class's constructor signature, its docstring, and those of the public methods
and properties it defines itself; a function's signature and docstring; a module that has a page of
its own, a link to it. Only the standard library's `inspect` is used (no documentation tool to
install), and the output holds nothing of the machine it ran on, so the committed pages can be
compared with a fresh rendering.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent

# (import name, how users reach it): the modules with a page, in the index's order
MODULES = [
    ("tinydist", "import tinydist as td"),
    ("tinydist.dist", "td.dist: process collectives, under `tinydist launch`"),
    ("tinydist.train.nn", "td.nn: layers"),
    ("tinydist.train.nn.functional", "td.nn.functional: losses and activations"),
    ("tinydist.train.optim", "td.optim: optimizers"),
    ("tinydist.frontend.autograd", "td.autograd: gradients"),
    ("tinydist.onnx", "td.onnx: ONNX models (onnxruntime-shaped InferenceSession)"),
    ("tinydist.multi", "td.multi: tensors sharded over the devices of one process"),
    ("tinydist.observability", "td.trace and spans"),
    ("tinydist.scheduler", "the cluster scheduler's Python side (ClusterJob)"),
    ("tinydist.testing", "MockClock and helpers for tests"),
]
PAGED = {name for name, _ in MODULES}


def _public(module: ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, v in vars(module).items() if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))
            and getattr(v, "__module__", None) == module.__name__]


def _doc(obj: Any) -> str:
    """The object's own docstring (not one inherited from a base class or a builtin), dedented."""
    doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
    if doc is None or (inspect.isclass(obj) and any(doc is getattr(base, "__doc__", None) for base in obj.__mro__[1:])):
        return ""
    return inspect.cleandoc(doc)


class _Annotation(str):
    """An annotation kept as source text (`from __future__ import annotations`), shown unquoted."""

    def __repr__(self) -> str:
        return str(self)


def _signature(obj: Any, method: bool = False) -> str:
    """`(a: int, b: str = 'x') -> T`, without a method's `self` and without quotes around annotations."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = list(sig.parameters.values())
    if method and params and params[0].name in ("self", "cls"):
        params = params[1:]
    def bare(annotation: Any) -> Any:
        return _Annotation(annotation) if isinstance(annotation, str) else annotation
    sig = sig.replace(parameters=[p.replace(annotation=bare(p.annotation)) for p in params],
                      return_annotation=bare(sig.return_annotation))
    if inspect.isclass(obj):
        sig = sig.replace(return_annotation=inspect.Signature.empty)
    return re.sub(r" at 0x[0-9a-f]+", "", str(sig))      # a default's repr must not name an address


def _members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined on the class itself, in source order."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            out.append((name, value))
    return out


def _block(doc: str) -> list[str]:
    return [doc, ""] if doc else []


def _entry(module: str, name: str, obj: Any) -> list[str]:
    if inspect.ismodule(obj):
        if obj.__name__ in PAGED and obj.__name__ != module:
            return [f"## `{name}`", "", f"Module `{obj.__name__}`: [its page]({obj.__name__}.md).", ""]
        first = _doc(obj).split("\n\n")[0]
        return [f"## `{name}`", "", f"Module `{obj.__name__}`." + (f" {first}" if first else ""), ""]
    if inspect.isclass(obj):
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        kind = "exception" if issubclass(obj, BaseException) else "class"
        init = "" if kind == "exception" else _signature(obj)
        lines = [f"## {kind} `{name}{init}`" + (f" ({', '.join(bases)})" if bases else ""), ""] + _block(_doc(obj))
        for member, value in _members(obj):
            if isinstance(value, property):
                lines += [f"### `{name}.{member}` (property)", ""] + _block(_doc(value))
            else:
                lines += [f"### `{name}.{member}{_signature(value, method=True)}`", ""] + _block(_doc(value))
        return lines
    if callable(obj):
        return [f"## `{name}{_signature(obj)}`", ""] + _block(_doc(obj))
    return [f"## `{name}`", "", f"`{obj!r}`", ""]


def render(module_name: str, reached: str) -> str:
    module = importlib.import_module(module_name)
    lines = [f"# `{module_name}`", "", f"*{reached}.* Generated by `docs/api/generate.py` from the docstrings; "
             "do not edit.", ""] + _block(_doc(module))
    for name in _public(module):
        lines += _entry(module_name, name, getattr(module, name))
    return "\n".join(lines).rstrip() + "\n"


def render_index() -> str:
    lines = ["# API reference", "", "Generated by `docs/api/generate.py` from the docstrings of the public API "
             "(`tinydist.__all__` and the modules below); `tests/test_docs.py` fails when a page differs from the "
             "code. Regenerate with `python docs/api/generate.py`.", ""]
    lines += [f"- [`{name}`]({name}.md): {reached}" for name, reached in MODULES]
    return "\n".join(lines) + "\n"


def pages() -> dict[str, str]:
    """File name under docs/api/ -> its content."""
    out = {"index.md": render_index()}
    for name, reached in MODULES:
        out[f"{name}.md"] = render(name, reached)
    return out


def stale() -> list[str]:
    """Pages missing, differing from a fresh rendering, or left over from a module no longer listed."""
    want = pages()
    have = {p.name for p in HERE.glob("*.md")}
    wrong = [name for name, text in want.items() if not (HERE / name).is_file() or (HERE / name).read_text() != text]
    return sorted(wrong + [name for name in have - set(want)])


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        wrong = stale()
        if wrong:
            print(f"docs/api is stale ({', '.join(wrong)}): run python docs/api/generate.py", file=sys.stderr)
        return 1 if wrong else 0
    for old in HERE.glob("*.md"):
        old.unlink()
    for name, text in pages().items():
        (HERE / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
