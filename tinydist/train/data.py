"""Datasets and batches with torch's names (`td.data`, torch's `torch.utils.data`).

    train = td.data.TensorDataset(images, labels)           # numpy arrays or Tensors, rows aligned
    loader = td.data.DataLoader(train, batch_size=64, shuffle=True, generator=np.random.default_rng(0),
                                drop_last=True)
    for epoch in range(epochs):
        for x, y in loader:                                  # Tensors of 64 rows each
            ...

What torch's map-style loader does, in one process: a sampler yields indices (0..N-1 in order,
or a permutation per epoch with `shuffle=True`, or your own `sampler=`), `batch_size` of them at a
time make a batch (the last one short unless `drop_last=True`), and the samples are collated:
tuples field by field, dicts key by key, arrays and numbers stacked into one Tensor (numbers as
int64 / float64 / bool, as torch's default_collate). The same indices give torch's batches
(tests/train/test_data.py compares them).

Shuffling draws from `generator` (a `numpy.random.Generator`, or an int seed for one), a new
permutation each epoch; without one, each epoch's seed comes from the generator `td.manual_seed`
seeds, so a seeded run repeats. The permutation is numpy's, not torch's: the same seed gives
other orders than torch's `randperm` (pass `sampler=` to use given ones).

A `TensorDataset` batch is one numpy fancy index per tensor and one upload, not N items stacked:
the rows are held as host arrays (Tensors given are read back once).
No worker processes (`num_workers`), pinning or prefetching: each batch is made when asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

import tinydist.frontend.tensor as _tensor_module
from tinydist.frontend.movement import stack
from tinydist.frontend.tensor import Tensor

__all__ = ["DataLoader", "Dataset", "TensorDataset", "default_collate"]


class Dataset:
    """A map-style dataset: `dataset[i]` is sample i, `len(dataset)` how many there are."""

    def __getitem__(self, index: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must define __getitem__")

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must define __len__")


class TensorDataset(Dataset):
    """Rows of tensors (or numpy arrays) of the same length: sample i is `(t[i] for t in tensors)`."""

    def __init__(self, *tensors: Tensor | np.ndarray) -> None:
        if not tensors:
            raise ValueError("TensorDataset needs at least one tensor")
        self.arrays = [t.numpy() if isinstance(t, Tensor) else np.asarray(t) for t in tensors]
        sizes = [a.shape[0] if a.ndim else None for a in self.arrays]
        if None in sizes or len(set(sizes)) != 1:
            shapes = [tuple(a.shape) for a in self.arrays]
            raise ValueError(f"TensorDataset's tensors must have the same first dimension, got shapes {shapes}")
        self._length = int(sizes[0])  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[np.ndarray, ...]:
        return tuple(a[index] for a in self.arrays)

    def __len__(self) -> int:
        return self._length

    def batch(self, indices: np.ndarray, device: str | None = None) -> tuple[Tensor, ...]:
        """The rows at `indices`, one Tensor per tensor (what default_collate of those samples gives)."""
        return tuple(Tensor(np.ascontiguousarray(a[indices]), device) for a in self.arrays)


def default_collate(samples: Sequence[Any], device: str | None = None) -> Any:
    """Samples into a batch as torch's default_collate: tuples and lists field by field, dicts key
    by key, arrays, Tensors and numbers stacked along a new first axis."""
    first = samples[0]
    if isinstance(first, Tensor):
        moved = [s if device is None else s.to(device) for s in samples]
        return stack(moved)
    if isinstance(first, dict):
        return {key: default_collate([s[key] for s in samples], device) for key in first}
    if isinstance(first, (tuple, list)):
        if any(len(s) != len(first) for s in samples):
            raise ValueError(f"default_collate: samples have different lengths {sorted({len(s) for s in samples})}; "
                             "each sample must have the same fields")
        fields = [default_collate([s[i] for s in samples], device) for i in range(len(first))]
        return tuple(fields) if isinstance(first, tuple) else fields
    if isinstance(first, (bool, np.bool_)):
        return Tensor(np.array(samples, dtype=np.bool_), device)
    if isinstance(first, (int, np.integer)):
        return Tensor(np.array(samples, dtype=np.int64 if isinstance(first, int) else None), device)
    if isinstance(first, (float, np.floating)):
        return Tensor(np.array(samples, dtype=np.float64 if isinstance(first, float) else None), device)
    if isinstance(first, np.ndarray):
        return Tensor(np.stack(samples), device)
    raise TypeError(f"default_collate: cannot batch samples of type {type(first).__name__}; give a collate_fn")


class DataLoader:
    """Batches of a dataset, in order, shuffled, or in a sampler's order (see the module's docstring)."""

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = False, sampler: Iterable[int] | None = None,
                 drop_last: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None,
                 generator: np.random.Generator | int | None = None, device: str | None = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"DataLoader batch_size must be a positive int, got {batch_size!r}")
        if shuffle and sampler is not None:
            raise ValueError("DataLoader: shuffle=True and a sampler exclude each other (the sampler gives the order)")
        if generator is not None and not isinstance(generator, (int, np.random.Generator)):
            raise TypeError(f"DataLoader generator must be a numpy.random.Generator or an int seed, got "
                            f"{type(generator).__name__}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.sampler = sampler
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.device = device
        self.generator = np.random.default_rng(generator) if isinstance(generator, int) else generator

    def _indices(self) -> np.ndarray:
        if self.sampler is not None:
            return np.fromiter(self.sampler, dtype=np.int64)
        count = len(self.dataset)
        if not self.shuffle:
            return np.arange(count, dtype=np.int64)
        generator = self.generator
        if generator is None:   # a fresh order per epoch, repeatable under td.manual_seed
            generator = np.random.default_rng(int(_tensor_module._rng.integers(2 ** 63)))
        return generator.permutation(count)

    def __iter__(self) -> Iterator[Any]:
        indices = self._indices()
        full = len(indices) - len(indices) % self.batch_size if self.drop_last else len(indices)
        for start in range(0, full, self.batch_size):
            chunk = indices[start:start + self.batch_size]
            if self.collate_fn is None and isinstance(self.dataset, TensorDataset):
                yield self.dataset.batch(chunk, self.device)
                continue
            samples = [self.dataset[int(i)] for i in chunk]
            yield self.collate_fn(samples) if self.collate_fn is not None else default_collate(samples, self.device)

    def __len__(self) -> int:
        count = len(self.sampler) if self.sampler is not None else len(self.dataset)  # type: ignore[arg-type]
        return count // self.batch_size if self.drop_last else math.ceil(count / self.batch_size)
