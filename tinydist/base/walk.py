"""Walking graphs of any depth: an iterative post-order, and a driver for recursive steps.

The lazy graph and the kernel IR are as deep as the user's program: a loop of 100,000 elementwise
ops is a chain of 100,000 nodes, a 2,000-layer network a chain of thousands of kernels. A Python
recursion over them overflows the interpreter's stack (the default limit is 1,000 frames), so every
walk over them keeps its own stack instead. Both helpers visit nodes in exactly the order the
recursive walks they replace did, so schedules, kernel numbering and generated code are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, TypeVar

N = TypeVar("N")
T = TypeVar("T")

# A computation that may need the results of others before it finishes: it yields each such
# Step and is sent back that Step's result (`value = yield sub_step`), then returns its own.
Step = Generator["Step[Any]", Any, T]


def postorder(roots: Iterable[N], sources: Callable[[N], Iterable[N]]) -> list[N]:
    """Every node reachable from `roots` once, each after all of its sources.

    The order is that of a recursive depth-first walk, roots in order, `sources(node)` left to
    right, a node listed when its walk returns: `visit(n)` = (visit each of `sources(n)` not yet
    met; then list `n`). Nodes are told apart by identity; the graph must be acyclic."""
    order: list[N] = []
    met: set[int] = set()
    for root in roots:
        if id(root) in met:
            continue
        met.add(id(root))
        stack: list[tuple[N, Iterator[N]]] = [(root, iter(sources(root)))]
        while stack:
            node, pending = stack[-1]
            for src in pending:  # resumes where the last visit of this frame stopped
                if id(src) not in met:
                    met.add(id(src))
                    stack.append((src, iter(sources(src))))
                    break
            else:
                stack.pop()
                order.append(node)
    return order


def drive(step: Step[T]) -> T:
    """Run `step` to completion and return its result, running each Step it yields first.

    This turns a recursive algorithm into an iterative one without changing what it does or in
    which order: write each recursive call `f(x)` as `(yield f(x))`, with `f` a generator, and the
    calls stack up here, on a list, instead of on the interpreter's stack. An exception raised by
    a step is thrown into the step that yielded it, as a recursive call would have raised it."""
    stack: list[Step[Any]] = [step]
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            request = stack[-1].send(value) if error is None else stack[-1].throw(error)
        except StopIteration as done:
            stack.pop()
            value, error = done.value, None
            if not stack:
                return value
            continue
        except BaseException as exc:
            stack.pop()
            if not stack:
                raise
            error = exc
            continue
        stack.append(request)
        value = None
