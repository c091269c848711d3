"""The `ai.onnx.ml` domain ops the node suite and scikit-learn style exports use: ArrayFeatureExtractor,
Binarizer, TreeEnsemble (5).

TreeEnsemble is evaluated without branching, so it captures like any other graph: every interior
node's test is computed for every row at once (features gathered exactly with `where`, not a
multiply that NaN would poison), and each root-to-leaf path is a column of a constant ±1 matrix
built from the attributes once: a row reaches a leaf when `tests @ path + falses` equals the path's
length (integer counts, exact in float). Aggregation is a matmul of the reached indicators with
the leaf weights (SUM, AVERAGE) or a masked min / max over the paths (MIN, MAX; a target no
reached leaf names is 0, as in onnxruntime). post_transform NONE, SOFTMAX, LOGISTIC. Cost per row:
O(nodes × features) for the gather, O(nodes × paths) for the matmul.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinydist.frontend.tensor import Tensor, where
from tinydist.graph import dtypes
from tinydist.onnx.ops._common import Value, gather_where

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_AVERAGE, _SUM, _MIN, _MAX = range(4)
_NONE, _SOFTMAX, _LOGISTIC = range(3)


def op_array_feature_extractor(ctx: Any, x: Tensor, indices: Value) -> Tensor:
    """x[..., indices] (indices flattened); a 1-D x gives a (1, k) result, as onnxruntime does.
    Run-time indices select with a one-hot mask; an out-of-range one selects zero there."""
    n = x.shape[-1]
    if isinstance(indices, np.ndarray):
        flat = indices.reshape(-1).astype(np.int64)
        if flat.size and not ((flat >= 0) & (flat < n)).all():
            raise ctx.error(f"indices {flat.tolist()} are out of range for the last axis of length {n}")
        mask: Any = ctx.lift(("mask", flat.tobytes()), lambda: flat[:, None] == np.arange(n)[None, :])
        k = flat.size
    else:
        k = indices.numel()
        mask = indices.reshape(k, 1).cast(dtypes.int64) == ctx.lift("arange", lambda: np.arange(n, dtype=np.int64)[None, :])
    out = gather_where(x, mask, x.ndim - 1, 1)
    return out.reshape(1, k) if x.ndim == 1 else out


def op_binarizer(ctx: Any, x: Tensor) -> Tensor:
    """1 where x > threshold, else 0, in x's dtype (NaN gives 0)."""
    return where(x > float(ctx.attr("threshold", 0.0)), 1, 0).cast(x.dtype)


class _Trees:
    """The ensemble's paths, from the attributes: per interior node its feature, test and split;
    per path (root to leaf) its ±1 column, its count of false branches, its leaf's target and weight."""

    def __init__(self, ctx: Any, n_features: int) -> None:
        a = ctx.attr
        self.features = np.asarray(a("nodes_featureids"), np.int64)
        self.modes = np.asarray(a("nodes_modes"), np.int64).reshape(-1)
        self.splits = np.asarray(a("nodes_splits"), np.float64).reshape(-1)
        true_ids, false_ids = a("nodes_truenodeids"), a("nodes_falsenodeids")
        true_leaf, false_leaf = a("nodes_trueleafs"), a("nodes_falseleafs")
        tracks = a("nodes_missing_value_tracks_true", None)
        self.tracks = np.zeros(len(self.features), bool) if tracks is None else np.asarray(tracks, bool)
        targets, weights = np.asarray(a("leaf_targetids"), np.int64), np.asarray(a("leaf_weights"), np.float64).reshape(-1)
        self.n_targets = int(a("n_targets"))
        m = len(self.features)
        if not m or not len(a("tree_roots")):
            raise ctx.error("the ensemble has no nodes or no tree_roots")
        if not all(len(v) == m for v in (self.modes, self.splits, true_ids, false_ids, true_leaf, false_leaf, self.tracks)):
            raise ctx.error("the nodes_* attributes differ in length")
        if m and not ((self.features >= 0) & (self.features < n_features)).all():
            raise ctx.error(f"nodes_featureids {self.features.tolist()} are out of range for {n_features} features")
        if len(targets) != len(weights) or (len(targets) and not ((targets >= 0) & (targets < self.n_targets)).all()):
            raise ctx.error(f"leaf_targetids {targets.tolist()} must match leaf_weights and lie in [0, n_targets={self.n_targets})")
        # set-membership nodes, in node order, each take the next NaN-terminated run of membership_values
        self.members: dict[int, list[float]] = {}
        runs: list[list[float]] = [[]]
        for v in np.asarray(a("membership_values", []), np.float64).reshape(-1):
            if np.isnan(v):
                runs.append([])
            else:
                runs[-1].append(float(v))
        member_nodes = [i for i in range(m) if self.modes[i] == _MEMBER]
        if member_nodes and len(runs) - 1 != len(member_nodes):
            raise ctx.error(f"{len(member_nodes)} BRANCH_MEMBER nodes need as many NaN-terminated runs of membership_values, "
                            f"found {len(runs) - 1}")
        self.members = dict(zip(member_nodes, runs))
        self.paths: list[tuple[list[tuple[int, bool]], int]] = []  # (node, branch taken) steps, leaf
        self.path_tree: list[int] = []
        roots = list(a("tree_roots"))
        for t, root in enumerate(roots):
            if true_leaf[root] and false_leaf[root] and true_ids[root] == false_ids[root]:
                self._add([], int(true_ids[root]), t, len(targets))  # a tree that is one leaf
                continue
            stack: list[tuple[int, list[tuple[int, bool]]]] = [(int(root), [])]
            while stack:
                node, steps = stack.pop()
                if len(steps) > m:
                    raise ctx.error(f"tree {t} has a cycle through node {node}")
                for branch, child, is_leaf in ((True, true_ids[node], true_leaf[node]), (False, false_ids[node], false_leaf[node])):
                    path = steps + [(node, branch)]
                    if is_leaf:
                        self._add(path, int(child), t, len(targets))
                    elif not 0 <= child < m:
                        raise ctx.error(f"node {node}'s {'true' if branch else 'false'} child {child} is out of range")
                    else:
                        stack.append((int(child), path))
        self.n_trees = len(roots)
        self.targets = np.array([targets[leaf] for _, leaf in self.paths], np.int64)
        self.weights = np.array([weights[leaf] for _, leaf in self.paths], np.float64)

    def _add(self, steps: list[tuple[int, bool]], leaf: int, tree: int, n_leaves: int) -> None:
        if not 0 <= leaf < n_leaves:
            raise ValueError(f"leaf index {leaf} is out of range for {n_leaves} leaves")
        self.paths.append((steps, leaf))
        self.path_tree.append(tree)

    def path_matrix(self) -> np.ndarray:
        out = np.zeros((len(self.features), len(self.paths)))
        for p, (steps, _) in enumerate(self.paths):
            for node, branch in steps:
                out[node, p] += 1.0 if branch else -1.0
        return out

    def falses(self) -> np.ndarray:
        return np.array([sum(not b for _, b in steps) for steps, _ in self.paths], np.float64)

    def member_table(self) -> np.ndarray:
        """(nodes, widest set): each BRANCH_MEMBER node's values, padded with NaN (equal to nothing)."""
        table = np.full((len(self.features), max((len(v) for v in self.members.values()), default=0) or 1), np.nan)
        for node, values in self.members.items():
            table[node, :len(values)] = values
        return table

    def lengths(self) -> np.ndarray:
        return np.array([len(steps) for steps, _ in self.paths], np.float64)


def op_tree_ensemble(ctx: Any, x: Tensor) -> Tensor:
    if x.ndim != 2 or not x.dtype.is_float:
        raise ctx.error(f"X must be a 2-D float tensor, got {x.dtype.name}{x.shape}")
    post = int(ctx.attr("post_transform", _NONE))
    aggregate = int(ctx.attr("aggregate_function", _SUM))
    if post not in (_NONE, _SOFTMAX, _LOGISTIC):
        raise ctx.error(f"post_transform {post} is not supported (0 NONE, 1 SOFTMAX, 2 LOGISTIC)")
    if aggregate not in (_AVERAGE, _SUM, _MIN, _MAX):
        raise ctx.error(f"aggregate_function {aggregate} is not one of 0 AVERAGE, 1 SUM, 2 MIN, 3 MAX")
    key = ("trees", x.shape[1])
    trees: _Trees = ctx.memo(key, lambda: _Trees(ctx, x.shape[1]))
    np_dtype = x.dtype.np
    feature_mask = ctx.lift(key + ("features",), lambda: trees.features[:, None] == np.arange(x.shape[1])[None, :])
    xf = gather_where(x, feature_mask, 1, 1)  # (N, nodes): each node's feature
    split = ctx.lift(("splits", np_dtype.str), lambda: trees.splits.astype(np_dtype)[None, :])
    tested = _tests(ctx, trees, xf, split, np_dtype).cast(x.dtype)
    hits = tested.matmul(ctx.lift(key + ("paths",), lambda: trees.path_matrix().astype(np_dtype)))
    hits = hits + ctx.lift(key + ("falses",), lambda: trees.falses().astype(np_dtype)[None, :])
    reached = hits == ctx.lift(key + ("lengths",), lambda: trees.lengths().astype(np_dtype)[None, :])
    leaf_values = ctx.lift(key + ("weights",), lambda: (np.eye(trees.n_targets)[trees.targets] * trees.weights[:, None]).astype(np_dtype))
    if aggregate in (_SUM, _AVERAGE):
        out = reached.cast(x.dtype).matmul(leaf_values)
        if aggregate == _AVERAGE:
            out = out / float(trees.n_trees)
    else:
        on_target = ctx.lift(key + ("targets",), lambda: np.eye(trees.n_targets, dtype=bool)[trees.targets][None])
        # a target no reached leaf names is 0, as onnxruntime gives it (onnx's reference: the dtype's max / min)
        fill = float(np.finfo(np_dtype).max if aggregate == _MIN else np.finfo(np_dtype).min)
        hit = reached.reshape(*reached.shape, 1) & on_target
        chosen = where(hit, leaf_values.reshape(1, *leaf_values.shape), fill)
        out = where(hit.max(1), chosen.min(1) if aggregate == _MIN else chosen.max(1), 0.0)
    if post == _SOFTMAX:
        return out.softmax(-1)
    if post == _LOGISTIC:
        return out.sigmoid()
    return out


def _tests(ctx: Any, trees: _Trees, xf: Tensor, split: Tensor, np_dtype: Any) -> Tensor:
    """(N, nodes) bool: each node's test on each row; NaN goes true where the node says it tracks true."""
    compares = {_LEQ: lambda: xf <= split, _LT: lambda: xf < split, _GTE: lambda: xf >= split, _GT: lambda: xf > split,
                _EQ: lambda: xf == split, _NEQ: lambda: xf != split}
    result: Tensor | None = None
    for mode in sorted(set(trees.modes.tolist())):
        if mode == _MEMBER:
            members = ctx.lift("members", lambda: trees.member_table().astype(np_dtype)[None])
            hit = (xf.reshape(*xf.shape, 1) == members).max(2)
        elif mode in compares:
            hit = compares[mode]()
        else:
            raise ctx.error(f"nodes_modes value {mode} is not a mode (0 LEQ, 1 LT, 2 GTE, 3 GT, 4 EQ, 5 NEQ, 6 MEMBER)")
        only = ctx.lift(("mode", mode), lambda m=mode: (trees.modes == m)[None, :])
        picked = hit & only
        result = picked if result is None else result | picked
    assert result is not None
    if trees.tracks.any():
        result = result | (xf.isnan() & ctx.lift("tracks", lambda: trees.tracks[None, :]))
    return result
