"""Dimension collapsing: the loop nest's shape, before any IR is emitted.

Adjacent axes that every load (and the output) walks as one are merged into one loop, so a
4096×4096 elementwise kernel is one loop of 16M and a contiguous kernel of any rank can become
the one-dimensional vector loop with streaming stores (`tinydist.codegen.lowering`). Two axes
merge only when they are both reduced or both kept, unmasked, and the outer one's stride is the
inner one's stride times its extent for every load (size-1 axes aside).
"""

from __future__ import annotations

from tinydist.codegen.kernel import KernelAST
from tinydist.graph.shape import ShapeTracker, View, prod


def collapse(ast: KernelAST) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, ShapeTracker]]:
    """Merge adjacent axes that every load (and the output) walks as one; returns the new shape,
    reduce axes, and each load node's tracker rewritten for the new shape (keyed by id)."""
    shape = ast.shape
    loads = [n for n in ast.root.walk() if n.op == "load"]
    n = len(shape)

    def joins(group: list[int], axis: int) -> bool:
        """Can `axis` join `group` (the axes just before it) as one loop for every load?"""
        if (axis in ast.reduce_axes) != (group[0] in ast.reduce_axes):
            return False
        for node in loads:  # loads above the reduce see the output shape; the same rule holds there
            top = node.arg[1].views[-1]
            if top.mask is not None and any(top.mask[a] != (0, top.shape[a]) for a in (*group, axis)):
                return False
            # the group's innermost non-unit axis must step exactly over the new axis's extent
            inner = [a for a in group if top.shape[a] != 1]
            if inner and top.shape[axis] != 1 and top.strides[inner[-1]] != top.strides[axis] * top.shape[axis]:
                return False
        return True

    groups: list[list[int]] = []
    for axis in range(n):
        if groups and joins(groups[-1], axis):
            groups[-1].append(axis)
        else:
            groups.append([axis])
    new_shape = tuple(prod([shape[a] for a in g]) for g in groups)
    new_reduce = tuple(i for i, g in enumerate(groups) if g[0] in ast.reduce_axes)
    out_groups_shape = tuple(1 if i in new_reduce else s for i, s in enumerate(new_shape))
    trackers = {}
    for node in loads:
        tracker: ShapeTracker = node.arg[1]
        top = tracker.views[-1]
        target = new_shape if top.shape == shape else out_groups_shape
        strides, mask = [], []
        for g, size in zip(groups, target):
            real = [a for a in g if top.shape[a] != 1]
            strides.append(top.strides[real[-1]] if real else 0)
            # merged groups are unmasked (checked above); a lone axis keeps its own mask
            mask.append(top.mask[g[0]] if top.mask is not None and len(g) == 1 else (0, size))
        trackers[id(node)] = ShapeTracker(tracker.views[:-1] + (View.create(target, tuple(strides), top.offset, None if top.mask is None else tuple(mask)),))
    return new_shape, new_reduce, trackers
