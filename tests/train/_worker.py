"""Run by `tinydist launch` from test_training.py: train the shared model over the process group."""

import sys

import numpy as np

import tinydist as td
from tests.train.helpers import data, make_mlp, train

if __name__ == "__main__":
    td.dist.init()
    rank, world = td.dist.rank(), td.dist.world_size()
    model = make_mlp()
    ddp = td.dist.DistributedDataParallel(model)
    opt = td.optim.Adam(ddp.parameters(), lr=1e-2)
    train(ddp, opt, data(), steps=4, rank=rank, world=world)
    if rank == 0:
        np.savez(sys.argv[1], **{k: v.numpy() for k, v in model.state_dict().items()})
    td.dist.barrier()
