"""Where am I in the job? The one reader of the launch variables, the same answer from `tinydist
launch`, torchrun, Slurm (srun) and Kubernetes.

`detect()` (td.dist.job_environment()) answers "am I part of a job?": the launcher's view of this
process, or None outside any. `launch()` is what td.dist.init() reads: its rank, world size,
coordinator and the socket a launcher handed down. It consults `apply()` when TINYDIST_RANK is not
set, so one script runs unchanged. The first row that matches wins (an inner launcher before an outer
one: torchrun started by srun is torchrun's job):

| source | rank | world size | tinydist.dist coordinator |
|---|---|---|---|
| tinydist launch / by hand | TINYDIST_RANK | TINYDIST_WORLD_SIZE | TINYDIST_COORDINATOR |
| torchrun (torch.distributed's env://) | RANK | WORLD_SIZE | MASTER_ADDR : TINYDIST_PORT, else MASTER_PORT + 1 |
| Slurm (an srun step) | SLURM_PROCID | SLURM_NTASKS (SLURM_NPROCS) | first host of SLURM_STEP_NODELIST (else SLURM_NODELIST) : TINYDIST_PORT |
| Kubernetes Indexed Job | JOB_COMPLETION_INDEX | TINYDIST_WORLD_SIZE | TINYDIST_COORDINATOR, else <job>-0.<TINYDIST_K8S_SERVICE>:TINYDIST_PORT |
| Kubernetes StatefulSet | ordinal suffix of HOSTNAME (`train-3`) | TINYDIST_WORLD_SIZE | as above, <statefulset>-0.<service> |

torchrun's agent holds MASTER_PORT itself (its TCPStore: binding it fails with EADDRINUSE, seen with
torch 2.13's `torchrun --standalone`), hence the next port. Slurm counts only inside a step: the
batch script itself also has SLURM_PROCID=0 and SLURM_NTASKS=<the allocation's tasks> but no
SLURM_STEP_ID (seen under Slurm 22.05), and a script run there without srun is one process, not
rank 0 of a group whose other ranks never start.

Ports (`job_ports()`): TINYDIST_PORT (the rendezvous) and TINYDIST_SCHEDULER_PORT (the cluster
scheduler on the first host) when set; else, under Slurm, a pair chosen by the job, 29400 + 2 * (SLURM_JOB_ID
mod 300) and the port after it (29400..29999), so two jobs sharing a node do not collide (two jobs whose
ids are a multiple of 300 apart still would: set the ports); else 29400 and 29500. Where a node's own
servers listen (`node_host()`, the NodeAgent's rendezvous and what it advertises): TINYDIST_NODE_HOST,
else the Slurm node's name (SLURMD_NODENAME) resolved, else loopback. Local rank: SLURM_LOCALID or LOCAL_RANK, else 0 (one pod per rank). The node id
for the cluster scheduler: TINYDIST_NODE_ID, else the pod name, else `<SLURMD_NODENAME>-<localid>`,
else `node-<rank>`. Every integer is parsed by `tinydist.base.config.launch_int`, so a bad TINYDIST_RANK
(or SLURM_PROCID, ...) raises the same LaunchError wherever it is read.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass

from tinydist.base.config import launch_int
from tinydist.base.errors import LaunchError
from tinydist.security.bind import bind_policy

DEFAULT_PORT = 29400
DEFAULT_SCHEDULER_PORT = 29500
DEFAULT_COORDINATOR = f"127.0.0.1:{DEFAULT_PORT}"
SLURM_PORT_PAIRS = 300      # 29400 + 2 * 300 = 30000: the per-job pairs stay in 29400..29999


@dataclass(frozen=True)
class JobEnvironment:
    source: str                 # "tinydist", "torchrun", "slurm", "kubernetes"
    rank: int
    world_size: int
    local_rank: int
    coordinator: str            # host:port of the tinydist.dist rendezvous (rank 0)
    node_id: str
    scheduler: str | None       # host:port of the cluster coordinator, if the job uses one

    def variables(self) -> dict[str, str]:
        return {"TINYDIST_RANK": str(self.rank), "TINYDIST_WORLD_SIZE": str(self.world_size),
                "TINYDIST_LOCAL_RANK": str(self.local_rank), "TINYDIST_COORDINATOR": self.coordinator}


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list: "node[01-03,07],gpu5,rack[1-2]-n[1-2]" → node01 node02 node03 node07 gpu5 ..."""
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        match = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", part)
        if not match:
            if part:
                hosts.append(part)
            continue
        prefix, ranges, rest = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"bad Slurm node list range {item!r} in {text!r}")
            width = len(lo)
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.extend(f"{prefix}{n:0{width}d}{tail}" for tail in (expand_nodelist(rest) if rest else [""]))
    return hosts


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _int(env: MutableMapping[str, str], name: str) -> int:
    value = launch_int(name, env)
    assert value is not None          # required: unset raised
    return value


def _optional_int(env: MutableMapping[str, str], name: str, default: int) -> int:
    value = launch_int(name, env, required=False)
    return default if value is None else value


def job_ports(env: MutableMapping[str, str] | None = None) -> tuple[int, int]:
    """(rendezvous port, scheduler port) of this job: TINYDIST_PORT / TINYDIST_SCHEDULER_PORT where set,
    else under Slurm 29400 + 2 * (SLURM_JOB_ID mod 300) and the next port (a fixed pair would make the
    second job on a shared node fail with EADDRINUSE), else 29400 / 29500."""
    env = os.environ if env is None else env
    job = launch_int("SLURM_JOB_ID", env, required=False)
    rendezvous, scheduler = ((DEFAULT_PORT, DEFAULT_SCHEDULER_PORT) if job is None else
                             (DEFAULT_PORT + 2 * (job % SLURM_PORT_PAIRS), DEFAULT_PORT + 2 * (job % SLURM_PORT_PAIRS) + 1))
    return _optional_int(env, "TINYDIST_PORT", rendezvous), _optional_int(env, "TINYDIST_SCHEDULER_PORT", scheduler)


def node_host(env: MutableMapping[str, str] | None = None) -> str:
    """The IP address this node's own servers (the NodeAgent's rendezvous) bind and advertise to the
    job's other nodes: TINYDIST_NODE_HOST, else SLURMD_NODENAME (this task's node, as the others reach
    it), else 127.0.0.1. A name is resolved once under tinydist.security.bind's policy (never the
    wildcard); binding a non-loopback address still needs TINYDIST_COORDINATOR_ALLOW_REMOTE=1, which
    the Slurm recipe sets."""
    env = os.environ if env is None else env
    for name in ("TINYDIST_NODE_HOST", "SLURMD_NODENAME"):
        host = env.get(name, "").strip()
        if host:
            return bind_policy(host.strip("[]"), 0, resolve=True, what=name,
                               wildcard_hint="set TINYDIST_NODE_HOST to the address the other nodes reach")[0]
    return "127.0.0.1"


def detect(env: MutableMapping[str, str] | None = None) -> JobEnvironment | None:
    """The job environment, or None outside any launcher. Raises ValueError on inconsistent variables."""
    env = os.environ if env is None else env
    port = _optional_int(env, "TINYDIST_PORT", DEFAULT_PORT)
    scheduler = env.get("TINYDIST_SCHEDULER") or None
    if "TINYDIST_RANK" in env:
        rank, world = _int(env, "TINYDIST_RANK"), _int(env, "TINYDIST_WORLD_SIZE")
        return JobEnvironment("tinydist", rank, world, _optional_int(env, "TINYDIST_LOCAL_RANK", 0),
                              env.get("TINYDIST_COORDINATOR", f"127.0.0.1:{port}"),
                              env.get("TINYDIST_NODE_ID", f"node-{rank}"), scheduler)
    if all(name in env for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        rank = _int(env, "RANK")
        after = _int(env, "TINYDIST_PORT") if "TINYDIST_PORT" in env else _int(env, "MASTER_PORT") + 1
        return JobEnvironment("torchrun", rank, _int(env, "WORLD_SIZE"), _optional_int(env, "LOCAL_RANK", 0),
                              env.get("TINYDIST_COORDINATOR", f"{env['MASTER_ADDR']}:{after}"),
                              env.get("TINYDIST_NODE_ID", f"node-{rank}"), scheduler)
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        rank = _int(env, "SLURM_PROCID")
        world = _int(env, "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ValueError("SLURM_PROCID is set but no SLURM_STEP_NODELIST / SLURM_NODELIST names the nodes")
        first = expand_nodelist(nodelist)[0]
        local = _optional_int(env, "SLURM_LOCALID", 0)
        node_id = env.get("TINYDIST_NODE_ID") or f"{env.get('SLURMD_NODENAME', 'slurm')}-{local}"
        rendezvous_port, scheduler_port = job_ports(env)
        return JobEnvironment("slurm", rank, world, local, env.get("TINYDIST_COORDINATOR", f"{first}:{rendezvous_port}"),
                              node_id, scheduler or f"{first}:{scheduler_port}")
    hostname = env.get("HOSTNAME", "")
    ordinal = re.match(r"^(.*)-(\d+)$", hostname)
    if "KUBERNETES_SERVICE_HOST" in env and ("JOB_COMPLETION_INDEX" in env or ordinal):
        rank = _int(env, "JOB_COMPLETION_INDEX") if "JOB_COMPLETION_INDEX" in env else int(ordinal.group(2))  # type: ignore[union-attr]
        if "TINYDIST_WORLD_SIZE" not in env:
            raise ValueError("on Kubernetes set TINYDIST_WORLD_SIZE in the pod template (= completions / replicas)")
        world = _int(env, "TINYDIST_WORLD_SIZE")
        coordinator = env.get("TINYDIST_COORDINATOR")
        if not coordinator:
            service = env.get("TINYDIST_K8S_SERVICE")
            if not service or not ordinal:
                raise ValueError("on Kubernetes set TINYDIST_COORDINATOR, or TINYDIST_K8S_SERVICE (the headless "
                                 "Service) with pods named <name>-<index>")
            coordinator = f"{ordinal.group(1)}-0.{service}:{port}"
        return JobEnvironment("kubernetes", rank, world, 0, coordinator, env.get("TINYDIST_NODE_ID") or hostname, scheduler)
    return None


def apply(env: MutableMapping[str, str] | None = None) -> JobEnvironment | None:
    """Fill in TINYDIST_RANK / WORLD_SIZE / LOCAL_RANK / COORDINATOR from torchrun, Slurm or Kubernetes (never
    overriding what is already set). Returns what was detected."""
    env = os.environ if env is None else env
    found = detect(env)
    if found is not None and found.world_size > 0 and not 0 <= found.rank < found.world_size:
        raise LaunchError(f"{found.source}: rank {found.rank} is outside 0..{found.world_size - 1}")
    if found is not None:
        for name, value in found.variables().items():
            env.setdefault(name, value)
    return found


@dataclass(frozen=True)
class Launch:
    """What a process needs to join its job's process group."""

    rank: int
    world_size: int
    coordinator: str                          # HOST:PORT of rank 0's rendezvous
    coordinator_sock: socket.socket | None    # rank 0's listening socket, bound by the launcher


def launch(rank: int | None = None, world_size: int | None = None, coordinator: str | None = None,
           coordinator_sock: socket.socket | None = None, env: MutableMapping[str, str] | None = None) -> Launch:
    """The arguments of td.dist.init() completed from the launch variables: what is passed wins, the
    rest comes from TINYDIST_* (mapped from torchrun, Slurm or Kubernetes first when TINYDIST_RANK is unset).
    Rank 0 takes the socket `tinydist launch` bound (TINYDIST_COORDINATOR_FD, consumed: removed from
    `env` so this process's own children cannot reuse it) unless a socket or coordinator is passed."""
    env = os.environ if env is None else env
    if rank is None and "TINYDIST_RANK" not in env:
        apply(env)
    rank = _int(env, "TINYDIST_RANK") if rank is None else rank
    world = _int(env, "TINYDIST_WORLD_SIZE") if world_size is None else world_size
    if not 0 <= rank < world:
        raise LaunchError(f"rank {rank} is outside 0..{world - 1} (world size {world})")
    address = coordinator or env.get("TINYDIST_COORDINATOR") or DEFAULT_COORDINATOR
    if rank == 0 and coordinator_sock is None and coordinator is None:
        fd = launch_int("TINYDIST_COORDINATOR_FD", env, required=False)
        if fd is not None:
            coordinator_sock = socket.socket(fileno=fd)
            env.pop("TINYDIST_COORDINATOR_FD")
    return Launch(rank, world, address, coordinator_sock)
