"""td.data against torch.utils.data: the same indices give the same batches (values, shapes,
dtypes, count); shuffling is a seeded permutation per epoch; drop_last as torch's."""

from __future__ import annotations

import numpy as np
import pytest

import tinydist as td

torch = pytest.importorskip("torch")
tdata = torch.utils.data


def arrays(n: int = 23):
    rng = np.random.default_rng(7)
    return rng.normal(size=(n, 3, 2)).astype(np.float32), rng.integers(0, 10, n).astype(np.int64), rng.random(n) > 0.5


def batches_equal(mine, theirs) -> None:
    mine, theirs = list(mine), list(theirs)
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        a = a if isinstance(a, (tuple, list)) else (a,)
        b = b if isinstance(b, (tuple, list)) else (b,)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert isinstance(x, td.Tensor)
            assert x.shape == tuple(y.shape) and x.dtype.name == str(y.dtype).removeprefix("torch.")
            np.testing.assert_array_equal(x.numpy(), y.numpy())


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [1, 4, 5, 23, 30])
def test_tensor_dataset_batches_are_torchs_in_order(batch_size, drop_last):
    x, y, m = arrays()
    mine = td.data.DataLoader(td.data.TensorDataset(x, y, m), batch_size=batch_size, drop_last=drop_last)
    theirs = tdata.DataLoader(tdata.TensorDataset(*map(torch.from_numpy, (x, y, m))), batch_size=batch_size,
                              drop_last=drop_last)
    assert len(mine) == len(theirs)
    batches_equal(mine, theirs)


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_same_sampled_indices_give_torchs_batches(drop_last):
    x, y, _ = arrays()
    order = list(np.random.default_rng(3).permutation(len(x))[:19]) + [0, 0, 5]   # repeats too
    order = [int(i) for i in order]
    mine = td.data.DataLoader(td.data.TensorDataset(td.Tensor(x), y), batch_size=4, sampler=order, drop_last=drop_last)
    theirs = tdata.DataLoader(tdata.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=4,
                              sampler=order, drop_last=drop_last)
    assert len(mine) == len(theirs)
    batches_equal(mine, theirs)


class Pairs(td.data.Dataset):
    """A map-style dataset of (array, int, float, dict) samples, as a user writes one."""

    def __init__(self, n: int) -> None:
        self.x, self.y, _ = arrays(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], int(self.y[i]), float(self.x[i].sum()), {"id": i, "row": self.x[i, 0]}


class TorchPairs(tdata.Dataset):
    def __init__(self, n: int) -> None:
        self.inner = Pairs(n)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        return self.inner[i]


def test_default_collate_of_a_users_dataset_is_torchs():
    mine = list(td.data.DataLoader(Pairs(11), batch_size=3))
    theirs = list(tdata.DataLoader(TorchPairs(11), batch_size=3))
    assert len(mine) == len(theirs) == 4
    for a, b in zip(mine, theirs):
        batches_equal([a[:3]], [b[:3]])
        assert a[3].keys() == b[3].keys()
        batches_equal([(a[3]["id"], a[3]["row"])], [(b[3]["id"], b[3]["row"])])


def test_shuffle_is_a_seeded_permutation_per_epoch():
    x, y, _ = arrays()
    ds = td.data.TensorDataset(x, y)
    loader = td.data.DataLoader(ds, batch_size=5, shuffle=True, generator=np.random.default_rng(42))
    epochs = [np.concatenate([b[1].numpy() for b in loader]) for _ in range(3)]
    rng = np.random.default_rng(42)
    for seen in epochs:
        np.testing.assert_array_equal(seen, y[rng.permutation(len(y))])   # numpy's permutation, epoch after epoch
    assert not np.array_equal(epochs[0], epochs[1])
    # an int seed is a generator of that seed; the rows stay aligned across the tensors
    again = td.data.DataLoader(ds, batch_size=5, shuffle=True, generator=42)
    first = list(again)
    np.testing.assert_array_equal(np.concatenate([b[1].numpy() for b in first]), epochs[0])
    for bx, by in first:
        rows = [int(np.flatnonzero((x == row).all(axis=(1, 2)))[0]) for row in bx.numpy()]
        np.testing.assert_array_equal(y[rows], by.numpy())
    # the same permutation through torch's loader: the same batches
    order = [int(i) for i in np.random.default_rng(42).permutation(len(y))]
    batches_equal(first, tdata.DataLoader(tdata.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=5,
                                          sampler=order))


def test_shuffle_without_a_generator_follows_manual_seed():
    ds = td.data.TensorDataset(np.arange(50))
    td.manual_seed(5)
    a = [b[0].numpy() for b in td.data.DataLoader(ds, batch_size=50, shuffle=True)]
    td.manual_seed(5)
    b = [b[0].numpy() for b in td.data.DataLoader(ds, batch_size=50, shuffle=True)]
    np.testing.assert_array_equal(a[0], b[0])
    assert sorted(a[0]) == list(range(50)) and list(a[0]) != list(range(50))


def test_batches_go_to_the_device_asked_for():
    x, y, _ = arrays(8)
    for dataset in (td.data.TensorDataset(x, y), Pairs(8)):
        batch = next(iter(td.data.DataLoader(dataset, batch_size=4, device="CPU:1")))
        assert all(t.device == "CPU:1" for t in batch[:2])


def test_errors_say_what_was_wrong():
    with pytest.raises(ValueError, match=r"same first dimension, got shapes \[\(3,\), \(4,\)\]"):
        td.data.TensorDataset(np.zeros(3), np.zeros(4))
    ds = td.data.TensorDataset(np.zeros(3))
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        td.data.DataLoader(ds, batch_size=0)
    with pytest.raises(ValueError, match="exclude each other"):
        td.data.DataLoader(ds, shuffle=True, sampler=[0, 1])
    with pytest.raises(TypeError, match="numpy.random.Generator or an int seed"):
        td.data.DataLoader(ds, shuffle=True, generator=torch.Generator())
    with pytest.raises(TypeError, match="cannot batch samples of type object"):
        td.data.default_collate([object(), object()])
