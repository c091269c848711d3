"""Reverse-mode autograd over the lazy graph.

    w = td.Tensor(np.ones((3, 2), np.float32), requires_grad=True)
    loss = (x @ w).relu().sum()
    loss.backward()          # w.grad: a lazy Tensor; it fuses and schedules like every other graph
    with td.no_grad(): ...   # nodes built here never require grad (optimizer updates, metrics)

How it works: a `LazyNode` requires grad when it is a float value computed, with gradients
enabled, from a node that requires grad (`tinydist.graph.lazy` computes the flag when the node is
built). Leaves are the nodes of tensors marked with `requires_grad=True`; the registry below maps
each leaf node to its Tensor (weakly), and `Tensor.assign` carries leaf-ness over to the new node,
so an optimizer's in-place update keeps a parameter a leaf. `realize()` keeps the `srcs` of nodes
that require grad (and are not leaves), so a forward that was already computed can still be
walked. `backward()` walks the nodes reachable from the root through sources that require grad,
in reverse topological order, applying one gradient rule per primitive op (`tinydist.graph.lazy.Op`).
Every rule is built from Tensor ops under `no_grad()`, so gradients are lazy graph: nothing is
computed until something realizes them (an optimizer's `step()` does, together with the loss).

After a backward (unless `retain_graph=True`) the graph's interior nodes stop requiring grad:
they drop their sources once computed and a second backward through them raises.

Compound ops whose generic gradient graph would be slow (convolution: the adjoint of its window
view is a scatter of overlapping windows) give their own rule with `custom_gradient`: the
forward is built under no_grad, and backward treats the result as one node with the rule's inputs.

Hooks: `register_grad_hook(tensor, fn)` calls `fn(tensor)` once the tensor's `.grad` is final in
a backward (leaves become final in reverse topological order: the last layer's parameters
first); `queue_callback(fn)` during a backward runs `fn()` when the backward ends. Data-parallel
training (tinydist.dist.parallel) buckets gradients with these.

Not supported: gradients of gradients (the gradient graph never requires grad).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import deque
from collections.abc import Callable, Iterator

from tinydist.frontend.tensor import Tensor
from tinydist.graph.lazy import ELEMENTWISE, LazyNode, Op, grad_mode
from tinydist.graph.shape import ShapeTracker, View, prod

__all__ = ["backward", "custom_gradient", "enable_grad", "is_grad_enabled", "no_grad", "queue_callback", "register_grad_hook",
           "set_requires_grad", "detach"]

# leaf node -> its Tensor (weakly: a parameter that is dropped stops being a leaf)
_leaves: weakref.WeakKeyDictionary[LazyNode, weakref.ref[Tensor]] = weakref.WeakKeyDictionary()
# roots of recent backward passes: an optimizer step realizes them with the update (one forward)
pending_roots: deque[LazyNode] = deque(maxlen=16)
# state assigned during a forward (BatchNorm running statistics): realized by the next optimizer step
pending_updates: list[LazyNode] = []
_callbacks: list[list[Callable[[], None]]] = []
_freed: weakref.WeakSet[LazyNode] = weakref.WeakSet()   # roots whose graph a backward freed
_saved: list[dict[int, LazyNode]] = []
# custom-gradient node -> (the inputs its rule differentiates, forward values the rule reads, the rule)
GradientRule = Callable[..., "list[Tensor | None]"]
_custom: weakref.WeakKeyDictionary[LazyNode, tuple[tuple[LazyNode, ...], tuple[LazyNode, ...], GradientRule]] = \
    weakref.WeakKeyDictionary()


class no_grad(contextlib.ContextDecorator):
    """Build graph that never requires grad (a context manager and a decorator)."""

    _enabled = False

    def __enter__(self) -> no_grad:
        self._prev = grad_mode.enabled
        grad_mode.enabled = self._enabled
        return self

    def __exit__(self, *exc: object) -> None:
        grad_mode.enabled = self._prev


class enable_grad(no_grad):
    _enabled = True


def is_grad_enabled() -> bool:
    return grad_mode.enabled


# ---- leaves -------------------------------------------------------------------------------------

def is_leaf(node: LazyNode) -> bool:
    return node in _leaves


def set_requires_grad(tensor: Tensor, value: bool = True) -> None:
    node = tensor.node
    if value:
        if node in _leaves:
            return
        if node.requires_grad:
            raise RuntimeError("requires_grad can only be set on leaf tensors; this one is computed from tensors "
                               "that require grad (use .detach() first)")
        if not node.dtype.is_float:
            raise TypeError(f"only float tensors can require gradients, got {node.dtype.name}")
        node.requires_grad = True
        _leaves[node] = weakref.ref(tensor)
    else:
        if node in _leaves:
            del _leaves[node]
            node.requires_grad = False
        elif node.requires_grad:
            raise RuntimeError("requires_grad can only be cleared on leaf tensors; use .detach()")


def after_assign(tensor: Tensor, old: LazyNode) -> None:
    """`tensor.assign(...)` replaced a leaf's node: the new node is the same leaf."""
    owner = _leaves.get(old)
    if owner is not None and owner() is tensor:
        tensor.node.requires_grad = True
        _leaves[tensor.node] = weakref.ref(tensor)


def detach(tensor: Tensor) -> Tensor:
    node = tensor.node
    if not node.requires_grad:
        return Tensor(node)
    with no_grad():
        return tensor._buffered()


def register_grad_hook(tensor: Tensor, fn: Callable[[Tensor], None]) -> Callable[[], None]:
    """Call `fn(tensor)` each time a backward has finished accumulating `tensor.grad`; returns a remover."""
    if tensor._grad_hooks is None:
        tensor._grad_hooks = []
    tensor._grad_hooks.append(fn)
    return lambda: tensor._grad_hooks.remove(fn) if tensor._grad_hooks and fn in tensor._grad_hooks else None


def custom_gradient(value: Tensor, inputs: list[Tensor], saved: list[Tensor], rule: GradientRule) -> Tensor:
    """`value`, computed under no_grad from `inputs`, as one node whose gradient `rule` gives:
    `rule(g, *saved)` returns one gradient (or None) per input, from the output gradient `g` and
    the forward tensors `saved` it reads. Without gradients to track, `value` itself."""
    node = value.node
    if not grad_mode.enabled or not any(t.requires_grad for t in inputs):
        return value
    if node.requires_grad:
        raise ValueError("custom_gradient: build the forward under no_grad() (it is differentiated by the rule)")
    # a structural node, not an elementwise one: views are pushed through elementwise nodes, which
    # would bypass the rule; the scheduler computes a contiguous node in place of its source
    wrapped = value._buffered()
    wrapped.node.requires_grad = True
    _custom[wrapped.node] = (tuple(t.node for t in inputs), tuple(t.node for t in saved), rule)
    return wrapped


def _sources(node: LazyNode) -> tuple[LazyNode, ...]:
    """What backward walks from `node`: its rule's inputs for a custom-gradient node, else its sources."""
    custom = _custom.get(node)
    return custom[0] if custom is not None else node.srcs


def queue_callback(fn: Callable[[], None]) -> None:
    """Run `fn()` when the backward in progress ends (after every leaf's grad is final)."""
    if not _callbacks:
        raise RuntimeError("queue_callback() is only valid during backward()")
    _callbacks[-1].append(fn)


def saved_nodes() -> list[LazyNode]:
    """Forward nodes the gradient graph of the backward in progress reads (realize them once to share them)."""
    return list(_saved[-1].values()) if _saved else []


# ---- backward -----------------------------------------------------------------------------------

def _topo(root: LazyNode) -> list[LazyNode]:
    order: list[LazyNode] = []
    visited: set[int] = set()
    stack: list[tuple[LazyNode, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        if node in _leaves:
            continue
        if not node.srcs and node.op not in (Op.BUFFER, Op.CONST):
            raise RuntimeError("backward through a graph that was already freed: a backward() frees the graph it "
                               "walked; call backward() once per forward or pass retain_graph=True")
        for src in _sources(node):
            if src.requires_grad and id(src) not in visited:
                stack.append((src, False))
    return order


def backward(tensor: Tensor, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
    root = tensor.node
    if root in _freed:
        raise RuntimeError("backward through a graph that was already freed: a backward() frees the graph it "
                           "walked; call backward() once per forward or pass retain_graph=True")
    if not root.requires_grad:
        raise RuntimeError("backward(): this tensor does not require grad (no input was created with requires_grad=True, "
                           "or it was computed under no_grad())")
    with no_grad():
        if gradient is None:
            if root.numel != 1:
                raise RuntimeError(f"backward() without a gradient needs a scalar output, got shape {root.shape}")
            gradient = Tensor.full(root.shape, 1.0, root.dtype, root.device)
        elif gradient.shape != root.shape:
            raise ValueError(f"backward(): gradient shape {gradient.shape} differs from the output's {root.shape}")
        order = _topo(root)
        grads: dict[int, Tensor] = {id(root): gradient.cast(root.dtype)}
        _callbacks.append([])
        _saved.append({})
        try:
            for node in reversed(order):
                g = grads.pop(id(node), None)
                if g is None:
                    continue
                owner = _leaves.get(node)
                if owner is not None:
                    leaf = owner()
                    if leaf is None:
                        continue
                    leaf.grad = g if leaf.grad is None else leaf.grad + g
                    for hook in list(leaf._grad_hooks or ()):
                        hook(leaf)
                    continue
                for src, contribution in _rule(node, g):
                    if not src.requires_grad or contribution is None:
                        continue
                    if contribution.shape != src.shape:  # pragma: no cover - a rule bug, loudly
                        raise AssertionError(f"gradient rule for {node.op} gave shape {contribution.shape} for {src.shape}")
                    contribution = contribution.cast(src.dtype)
                    previous = grads.get(id(src))
                    grads[id(src)] = contribution if previous is None else previous + contribution
            callbacks = _callbacks[-1]
            for fn in callbacks:
                fn()
        finally:
            _callbacks.pop()
            _saved.pop()
    pending_roots.append(root)
    if not retain_graph:
        _freed.add(root)
        for node in order:
            if node not in _leaves:
                node.requires_grad = False
                _custom.pop(node, None)
                if node.realized:
                    node.srcs = ()


def _t(node: LazyNode) -> Tensor:
    """A forward node read by a gradient rule (recorded: see saved_nodes)."""
    if _saved and not node.realized and node.op is not Op.CONST:
        _saved[-1][id(node)] = node
    return Tensor(node)


def _zero(g: Tensor) -> Tensor:
    return Tensor.full((), 0, g.dtype, g.device)


LN2 = math.log(2.0)


def _rule(node: LazyNode, g: Tensor) -> list[tuple[LazyNode, Tensor | None]]:
    op, srcs = node.op, node.srcs
    custom = _custom.get(node)
    if custom is not None:
        inputs, saved, rule = custom
        return list(zip(inputs, rule(g, *(_t(n) for n in saved))))
    if op in ELEMENTWISE:
        return _elementwise_rule(node, g)
    if op is Op.REDUCE:
        src = srcs[0]
        reduce_op, axes = node.arg
        ge = g.expand(src.shape)
        if reduce_op == "sum":
            return [(src, ge)]
        x, out = _t(src), _t(node).expand(src.shape)
        if reduce_op in ("max", "min"):
            mask = (x == out).cast(g.dtype)
            count = mask.sum(axes, keepdim=True).expand(src.shape)
            return [(src, ge * mask / count)]
        if reduce_op == "prod":
            return [(src, ge * out / x)]
        raise NotImplementedError(f"no gradient for reduce {reduce_op}")
    if op is Op.VIEW:
        return [(srcs[0], view_adjoint(g, node.arg, srcs[0].shape))]
    if op is Op.CONTIGUOUS:
        return [(srcs[0], g)]
    if op is Op.COPY:
        return [(srcs[0], g.to(srcs[0].device))]
    if op is Op.MATMUL:
        return _matmul_rule(node, g)
    if op in (Op.ASSIGN, Op.BUFFER, Op.CONST):
        return []
    raise NotImplementedError(f"no gradient rule for {op}")


def _elementwise_rule(node: LazyNode, g: Tensor) -> list[tuple[LazyNode, Tensor | None]]:
    op, srcs = node.op, node.srcs
    if op is Op.NEG:
        return [(srcs[0], -g)]
    if op is Op.CAST:
        return [(srcs[0], g.cast(srcs[0].dtype))]
    if op is Op.ABS:
        x = _t(srcs[0])
        return [(srcs[0], (x > 0).where(g, (x < 0).where(-g, _zero(g))))]
    if op is Op.SQRT:
        return [(srcs[0], g / (_t(node) * 2))]
    if op is Op.EXP:
        return [(srcs[0], g * _t(node))]
    if op is Op.EXP2:
        return [(srcs[0], g * _t(node) * LN2)]
    if op is Op.LOG:
        return [(srcs[0], g / _t(srcs[0]))]
    if op is Op.LOG2:
        return [(srcs[0], g / (_t(srcs[0]) * LN2))]
    if op is Op.SIN:
        return [(srcs[0], g * _t(srcs[0]).cos())]
    if op is Op.COS:
        return [(srcs[0], -g * _t(srcs[0]).sin())]
    if op in (Op.FLOOR, Op.NOT, Op.IDIV, Op.AND, Op.OR, Op.XOR, Op.SHL, Op.SHR, Op.CMPLT, Op.CMPLE, Op.CMPEQ, Op.CMPNE):
        return []  # piecewise constant or not float: zero gradient
    if op is Op.WHERE:
        cond = _t(srcs[0])
        return [(srcs[1], cond.where(g, _zero(g)) if srcs[1].requires_grad else None),
                (srcs[2], cond.where(_zero(g), g) if srcs[2].requires_grad else None)]
    a_node, b_node = srcs
    need_a, need_b = a_node.requires_grad, b_node.requires_grad
    if op is Op.ADD:
        return [(a_node, g), (b_node, g)]
    if op is Op.SUB:
        return [(a_node, g), (b_node, -g if need_b else None)]
    if op is Op.MUL:
        return [(a_node, g * _t(b_node) if need_a else None), (b_node, g * _t(a_node) if need_b else None)]
    if op is Op.DIV:
        b = _t(b_node)
        return [(a_node, g / b if need_a else None), (b_node, -g * _t(node) / b if need_b else None)]
    if op is Op.MOD:  # a mod b = a - q·b with q piecewise constant
        if not need_b:
            return [(a_node, g)]
        q = (_t(a_node) - _t(node)) / _t(b_node)
        return [(a_node, g), (b_node, -g * q)]
    if op is Op.POW:
        a, b = _t(a_node), _t(b_node)
        ga = g * b * a.pow(b - 1) if need_a else None
        gb = (a > 0).where(g * _t(node) * a.log(), _zero(g)) if need_b else None
        return [(a_node, ga), (b_node, gb)]
    if op in (Op.MAX, Op.MIN):  # ties split the gradient evenly (as torch.maximum)
        a, b = _t(a_node), _t(b_node)
        wins = (a > b) if op is Op.MAX else (a < b)
        share = wins.cast(g.dtype) + (a == b).cast(g.dtype) * 0.5
        return [(a_node, g * share if need_a else None), (b_node, g * (1 - share) if need_b else None)]
    raise NotImplementedError(f"no gradient rule for {op}")


def _matmul_rule(node: LazyNode, g: Tensor) -> list[tuple[LazyNode, Tensor | None]]:
    a_node, b_node = node.srcs                     # a [Ba, M, K], b [Bb, K, N], out [B, M, N]
    if node.arg is not None:
        raise NotImplementedError(f"no gradient through matmul_prepacked (its {node.arg[0].upper()} is packed for "
                                  "inference): use matmul with the unpacked weight to train")
    count, m, n = node.shape
    k = a_node.shape[2]
    a, b = _t(a_node), _t(b_node)
    ga = gb = None
    if a_node.requires_grad:
        if a_node.shape[0] == count:
            ga = g.matmul(b.permute(0, 2, 1)) if b_node.shape[0] == count else \
                g.reshape(count * m, n).matmul(b.reshape(k, n).T).reshape(count, m, k)
        else:  # one left matrix shared by the batch: sum over it
            ga = g.permute(1, 0, 2).reshape(m, count * n).matmul(b.permute(0, 2, 1).reshape(count * n, k)).reshape(1, m, k)
    if b_node.requires_grad:
        if b_node.shape[0] == count:
            gb = _transposed_matmul(a, g) if a_node.shape[0] == count else \
                a.reshape(m, k).T.matmul(g.permute(1, 0, 2).reshape(m, count * n)).reshape(k, count, n).permute(1, 0, 2)
        else:  # one right matrix shared by the batch: rows of all batches stack
            gb = _transposed_matmul(a.reshape(count * m, k), g.reshape(count * m, n)).reshape(1, k, n)
    return [(a_node, ga), (b_node, gb)]


def _transposed_matmul(x: Tensor, y: Tensor) -> Tensor:
    """xᵀ @ y over the last two axes. The packed kernel reads row-major operands, so one side is
    copied transposed: x, or else y and the (small) result as (yᵀ @ x)ᵀ — whichever moves fewer
    elements (a linear layer's weight gradient: the 10-column output gradient, not the activations)."""
    rows, p, q = x.shape[-2], x.shape[-1], y.shape[-1]

    def t(z: Tensor) -> Tensor:
        return z.permute(*range(z.ndim - 2), z.ndim - 1, z.ndim - 2)
    return t(t(y).matmul(x)) if rows * q + p * q < rows * p else t(x).matmul(y)


# ---- the adjoint of a view (movement ops) -------------------------------------------------------

def view_adjoint(g: Tensor, tracker: ShapeTracker, base_shape: tuple[int, ...]) -> Tensor:
    """The gradient w.r.t. the base of a VIEW: every element of `g` added to the base element it reads.

    A ShapeTracker is a stack of views; each maps an index to a flat offset in the level below.
    Per level: the masked-out region (padding) gets nothing (shrink g to the mask); expanded axes
    (stride 0) sum; the rest is placed with pad/reshape/shrink, one term per index of any axis
    whose windows overlap the others (convolution windows), summed."""
    views = tracker.views
    if len(views) == 1:
        simple = _rearranging_adjoint(g, views[0], base_shape)
        if simple is not None:
            return simple
    current = g
    for level in range(len(views) - 1, -1, -1):
        below = views[level - 1].shape if level else base_shape
        current = _view_level_adjoint(current, views[level], prod(below))
        current = current.reshape(below)
    return current


def _rearranging_adjoint(g: Tensor, view: View, base_shape: tuple[int, ...]) -> Tensor | None:
    """The adjoint of a view that only reshapes, permutes and expands its base (every element
    read, none padded or skipped: a matmul's operand reshapes, a bias broadcast, a transpose),
    or None for any other view. The same values as the general path below — the sum over the
    expanded axes, then the inverse permutation — in at most four movement ops: the general
    path places the result one axis at a time, each reshape of an unrealized gradient rebuilding
    its elementwise chain (62 nodes for the digits MLP's loss reshape, 159 for its backward)."""
    shape, strides = view.shape, view.strides
    if view.mask is not None or view.offset or 0 in shape:
        return None
    moving = [d for d in range(len(shape)) if strides[d] != 0]
    extent = 1  # the read axes, innermost first, must tile the base exactly
    for d in sorted(moving, key=lambda d: strides[d]):
        if strides[d] != extent:
            return None
        extent *= shape[d]
    if extent != prod(base_shape):
        return None
    expanded = tuple(d for d in range(len(shape)) if strides[d] == 0 and shape[d] != 1)
    if expanded:
        g = g.sum(expanded, keepdim=True)
    g = g.reshape(tuple(shape[d] for d in moving))
    outer_first = sorted(range(len(moving)), key=lambda i: -strides[moving[i]])
    if outer_first != list(range(len(moving))):
        g = g.permute(tuple(outer_first))
    return g.reshape(base_shape)


def _view_level_adjoint(g: Tensor, view: View, size: int) -> Tensor:
    shape, strides, offset, mask = list(view.shape), list(view.strides), view.offset, view.mask
    zeros = Tensor.full((size,), 0, g.dtype, g.device)
    if size == 0 or prod(shape) == 0:
        return zeros
    if mask is not None:
        if any(lo >= hi for lo, hi in mask):
            return zeros
        g = g.shrink(mask)
        offset += sum(lo * s for (lo, _), s in zip(mask, strides))
        shape = [hi - lo for lo, hi in mask]
    expanded = tuple(d for d in range(len(shape)) if strides[d] == 0 and shape[d] != 1)
    if expanded:
        g = g.sum(expanded, keepdim=True)
    dims = [d for d in range(len(shape)) if strides[d] != 0]
    g = g.reshape(tuple(shape[d] for d in dims))
    shape, strides = [shape[d] for d in dims], [strides[d] for d in dims]
    if any(s < 0 for s in strides):
        raise NotImplementedError("gradient of a view with negative strides")
    # keep axes that tile without overlap (smallest stride first); enumerate the others
    extent, kept, looped = 1, [], []
    for d in sorted(range(len(shape)), key=lambda d: (strides[d], -shape[d])):
        if strides[d] >= extent:
            kept.append(d)
            extent += (shape[d] - 1) * strides[d]
        else:
            looped.append(d)
    result: Tensor | None = None
    for index in _product([shape[d] for d in looped]):
        part, part_offset = g, offset
        if looped:
            bounds = [(0, s) for s in shape]
            for d, i in zip(looped, index):
                bounds[d] = (i, i + 1)
                part_offset += i * strides[d]
            part = g.shrink(bounds).reshape(tuple(shape[d] for d in range(len(shape)) if d not in looped))
        remaining = [d for d in range(len(shape)) if d not in looped]
        outer_first = list(reversed(kept))
        part = part.permute(tuple(remaining.index(d) for d in outer_first)) if len(remaining) > 1 else part
        placed = _place(part, [shape[d] for d in outer_first], [strides[d] for d in outer_first], part_offset, size)
        result = placed if result is None else result + placed
    assert result is not None
    return result


def _product(sizes: list[int]) -> Iterator[tuple[int, ...]]:
    if not sizes:
        yield ()
        return
    import itertools
    yield from itertools.product(*(range(s) for s in sizes))


def _place(t: Tensor, sizes: list[int], strides: list[int], offset: int, size: int) -> Tensor:
    """Scatter `t` (axes outermost first, non-overlapping strides) into a zero 1-D tensor of `size`."""
    length = 1
    t = t.reshape(tuple(sizes) + (1,))
    for n, s in zip(reversed(sizes), reversed(strides)):
        if s > length:
            t = t.pad(((0, 0),) * (t.ndim - 1) + ((0, s - length),))
        t = t.reshape(t.shape[:-2] + (n * s,))
        new_length = (n - 1) * s + length
        if new_length != n * s:
            t = t.shrink(tuple((0, x) for x in t.shape[:-1]) + ((0, new_length),))
        length = new_length
    t = t.reshape(length)
    if offset or size - offset - length:
        t = t.pad(((offset, size - offset - length),))
    return t
