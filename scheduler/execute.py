"""Run a planned hierarchical allreduce for real between node processes.

    job = ClusterJob.start(coordinator, node_id, ["CPU:0", "CPU:1"], world_size=2)  # join, wait, td.dist.init
    outs = job.all_reduce([t0, t1])          # one td.Tensor per local device in, one reduced per device out
    print(job.plan(nbytes).explain())

Stages (scheduler.plan): (1) inside the process, tinydist.multi.allreduce over its devices (the
plan's in-group algorithm) and the first device's result is the process's contribution; (2) across
processes, tinydist.dist.all_reduce with the plan's across-group algorithm; (3) the result is copied
back to every local device. When several processes share a host (one peer group of several nodes),
their shared-memory stage is folded into stage 2 (tinydist.dist links them over shared memory).

Failures: a node that dies mid-collective makes every survivor raise `NodeFailed` naming the node:
at once when its process dies (its sockets close), or within (miss_limit + 1) heartbeat intervals
when it hangs (the coordinator declares it dead and the node agent fails the dist group). The dist
collective timeout bounds everything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tinydist.scheduler.errors import ClusterError, CoordinatorLost, NodeFailed
from tinydist.scheduler.node import Credentials, NodeAgent
from tinydist.scheduler.plan import Plan, calibrate_call, plan_allreduce
from tinydist.scheduler.topology import Topology
from tinydist.base.logs import get_logger
from tinydist.graph.collectives import AUTO
from tinydist.graph.reduce_ops import MEAN, collective_op


class ClusterJob:
    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent
        self.log = get_logger(component="scheduler", node=agent.node_id)
        self._topology: Topology | None = None
        self._plans: dict[tuple[int, int, str], Plan] = {}

    @classmethod
    def start(cls, coordinator: str, node_id: str, devices: Sequence[str], *, world_size: int, rank: int = -1,
              credentials: Credentials | None = None, host_key: str | None = None, wait_timeout: float = 60.0,
              dist_timeout: float | None = None, probe: bool = True, address: str | None = None,
              min_size: int | None = None, last_call: float = 1.0) -> ClusterJob:
        """Join, wait for `world_size` members, td.dist.init. `address`: the interface this node's
        rendezvous and mesh listen on, the one the other nodes reach (default `environment.node_host()`:
        TINYDIST_NODE_HOST, the Slurm node's address, else loopback; a non-loopback one needs
        TINYDIST_COORDINATOR_ALLOW_REMOTE=1, the bind policy of tinydist.dist).
        `min_size`: elastic, torchrun's `--nnodes MIN:MAX` with MAX = `world_size`: the job is the
        next rendezvous round (NodeAgent.rendezvous), of `min_size` to `world_size` nodes."""
        elastic = min_size is not None
        agent = NodeAgent(coordinator, node_id, devices, rank=rank, world_size=0 if elastic else world_size,
                          host_key=host_key, credentials=credentials, address=address)
        try:
            agent.join()
            if min_size is not None:
                agent.rendezvous(min_size, world_size, last_call, wait_timeout)
            else:
                agent.wait(world_size, wait_timeout)
            agent.init_dist(dist_timeout)
        except BaseException:
            agent.close()
            raise
        job = cls(agent)
        if probe:
            job.measure_links()
        return job

    @property
    def rank(self) -> int:
        return self.agent.table[self.agent.node_id].node.rank

    @property
    def world_size(self) -> int:
        return len(self.agent.table)

    @property
    def devices(self) -> list[str]:
        return self.agent.devices

    def node_ids(self) -> list[str]:
        return [m.node.node_id for m in sorted(self.agent.table.values(), key=lambda m: m.node.rank)]

    def measure_links(self) -> None:
        """Measure every link and what a dist call costs beyond them (all ranks), report the links to
        the coordinator, plan on the measurements."""
        from tinydist.scheduler.probe import measure_links
        measured = measure_links(self.node_ids(), devices=self.devices)
        self.agent.report_links([r for r in measured.links if r.src == self.agent.node_id])
        topo = self.topology()
        for (a, b), model in measured.models.items():
            topo.set_measured(a, b, model)
        topo.copy_back = dict(measured.copy_back)
        topo.call = calibrate_call(topo, self.world_size, *measured.calls)
        self._plans.clear()

    def topology(self) -> Topology:
        """The job's topology: the membership table from wait() (identical on every rank) plus measurements."""
        if self._topology is None:
            from tinydist.scheduler.node import topology_from_status
            st = self.agent.last_status
            if st is None:
                raise ClusterError("no membership table: the job has not waited for its members")
            topo = topology_from_status(st)
            job = set(self.agent.table)
            topo = Topology([n for n in topo.nodes if n.node_id in job], epoch=topo.epoch)
            topo.measured = {}                     # measurements come from measure_links (same on every rank)
            self._topology = topo
        return self._topology

    def plan(self, nbytes: int, inter: str = "auto") -> Plan:
        key = (int(nbytes), self.topology().epoch, inter)
        if key not in self._plans:
            self._plans[key] = plan_allreduce(self.topology(), int(nbytes), executable=True, inter=inter)
        return self._plans[key]

    def _raise_failure(self, exc: BaseException | None = None) -> None:
        from tinydist.dist import RankFailed
        failure = self.agent.failure
        if isinstance(failure, NodeFailed):
            raise NodeFailed(failure.node_id, failure.rank, str(failure)) from exc
        if failure is not None:
            raise failure from exc
        watch = self.agent.watch
        if isinstance(exc, RankFailed) and watch is not None and watch.outage and (
                "declared failed" in str(exc) or watch.near_bound()):
            # a rank declared failed while no coordinator can have declared a death (only node agents
            # declare, and none reaches it), or any loss once this node is itself one backoff step from
            # giving up: the peer gave up on the same coordinator first, and the job fails for that
            raise CoordinatorLost(f"node {self.agent.node_id}: coordinator {self.agent.coordinator} unreachable for "
                                  f"{watch.away():.1f} s, and rank {exc.rank}'s node gave up on it first "
                                  f"(TINYDIST_SCHEDULER_LOST_AFTER={watch.lost_after:g} s passed there): {exc}") from exc
        if isinstance(exc, RankFailed):
            node = self.agent.node_of_rank(exc.rank)
            raise NodeFailed(node, exc.rank, f"node {node!r} (rank {exc.rank}) failed: {exc}") from exc

    def all_reduce(self, tensors: Sequence[Any], op: str = "sum", inter: str = "auto") -> list[Any]:
        """Hierarchical allreduce of one tensor per local device (same shape/dtype everywhere)."""
        from tinydist import dist
        from tinydist.dist import CollectiveError
        from tinydist.multi import allreduce
        from tinydist.frontend.tensor import Tensor
        if len(tensors) != len(self.devices):
            raise ValueError(f"all_reduce needs one tensor per local device ({self.devices}), got {len(tensors)}")
        reduce_op = collective_op(op)            # mean: summed here, divided by the devices below
        self._raise_failure()
        local = [t if isinstance(t, Tensor) else Tensor(np.asarray(t), device=d) for t, d in zip(tensors, self.devices)]
        nbytes = int(np.prod(local[0].shape, dtype=np.int64)) * local[0].dtype.itemsize
        plan = self.plan(nbytes, inter)
        if len(local) > 1:
            mine = allreduce(local, reduce_op, plan.intra_algorithm)[0]
        else:
            mine = local[0]
        contribution = mine.numpy()
        if self.world_size > 1:
            # "none": one peer group spans every process (one host), its shared-memory stage folded in here
            algorithm = AUTO if plan.inter_algorithm == "none" else plan.inter_algorithm
            try:
                total = dist.all_reduce(contribution, reduce_op, algorithm=algorithm).numpy()
            except CollectiveError as exc:
                self._raise_failure(exc)
                raise
        else:
            total = contribution
        if op == MEAN:
            total = total / sum(len(n.devices) for n in self.topology().nodes)
        return [Tensor(np.ascontiguousarray(total), device=d) for d in self.devices]

    def close(self) -> None:
        from tinydist import dist
        try:
            if dist.is_initialized():
                dist.destroy()
        finally:
            self.agent.leave()

    def __enter__(self) -> ClusterJob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
