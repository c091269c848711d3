"""The cluster scheduler: membership, peer groups, collective planning, failure handling.

    tinydist scheduler serve --listen 127.0.0.1:29500 --pki ./lab        # the coordinator
    tinydist node join --coordinator 127.0.0.1:29500 --node-id node-0 --world-size 2   # a node, from flags
    job = scheduler.ClusterJob.start("127.0.0.1:29500", "node-0", ["CPU:0", "CPU:1"], world_size=2,
                                     credentials=scheduler.Credentials.load())   # a node, in Python
    outs = job.all_reduce([t0, t1]); print(job.plan(t0.numpy().nbytes).explain())

See docs/cluster.md. Modules: topology (nodes, peer groups, α–β links), plan (hierarchical planner),
membership (join/heartbeat/death, clock injected), coordinator (gRPC service), journal (its
write-ahead state), node (node agent), probe (link measurements), execute (real hierarchical
allreduce), checkpoint, sim (simulated cluster). The Slurm / Kubernetes variables are mapped by
tinydist/dist/environment.py.
"""

from tinydist.scheduler.errors import ClusterError, CoordinatorLost, JournalError, MembershipError, NodeFailed, PlanError

__all__ = ["ClusterError", "ClusterJob", "CoordinatorLost", "Credentials", "JournalError", "MembershipError", "NodeAgent", "NodeFailed",
           "PlanError", "Topology", "explain", "plan_allreduce"]


def __getattr__(name: str):  # lazy: `import tinydist.scheduler` stays cheap
    if name == "ClusterJob":
        from tinydist.scheduler.execute import ClusterJob
        return ClusterJob
    if name in ("Credentials", "NodeAgent"):
        from tinydist.scheduler import node
        return getattr(node, name)
    if name in ("explain", "plan_allreduce"):
        from tinydist.scheduler import plan
        return getattr(plan, name)
    if name == "Topology":
        from tinydist.scheduler.topology import Topology
        return Topology
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
