"""One registry for every setting read from the environment.

Each setting is declared once, here, with its type, default and meaning; `docs/env_vars.md`
lists them. Code reads `settings.NAME`; tests override with `settings.override(NAME=value)`.
The launch contract (`LAUNCH_VARIABLES`) is listed here too, with the one parser of its integers
(`launch_int`), but read where a process joins its job (tinydist/dist/environment.py): launchers
write it per child, and some of it is consumed once (a socket handed down).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinydist.base.errors import LaunchError, SettingError


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], Any]
    default: Callable[[], Any]
    doc: str


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return value
    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"expected an integer of 0 or more, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a positive number, got {text!r}")
    return value


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tinydist"


class Settings:
    """Settings read lazily from the environment, once each; overridable in a scope."""

    def __init__(self) -> None:
        self._declared: dict[str, Setting] = {}
        self._values: dict[str, Any] = {}

    def declare(self, setting: Setting) -> None:
        if setting.name in self._declared:
            raise ValueError(f"setting {setting.name} is declared twice")
        self._declared[setting.name] = setting

    def declared(self) -> list[Setting]:
        return list(self._declared.values())

    def __getattr__(self, name: str) -> Any:
        declared = self.__dict__.get("_declared", {})
        if name not in declared:
            raise AttributeError(f"no setting named {name}; declared: {', '.join(sorted(declared))}")
        values = self.__dict__["_values"]
        if name not in values:
            setting = declared[name]
            raw = os.environ.get(f"TINYDIST_{name}")
            if raw is None:
                values[name] = setting.default()
            else:
                try:
                    values[name] = setting.parse(raw)
                except ValueError as exc:
                    raise SettingError(f"environment variable TINYDIST_{name}={raw!r} is invalid: {exc}") from None
        return values[name]

    @contextlib.contextmanager
    def override(self, **values: Any) -> Iterator[None]:
        for name in values:
            if name not in self._declared:
                raise AttributeError(f"no setting named {name}")
        saved = {name: self._values.get(name, _UNSET) for name in values}
        self._values.update(values)
        try:
            yield
        finally:
            for name, old in saved.items():
                if old is _UNSET:
                    self._values.pop(name, None)
                else:
                    self._values[name] = old


_UNSET = object()
settings = Settings()

for _setting in (
    Setting("LOG_FORMAT", _choice("console", "json"), lambda: "console",
            "Log rendering: readable console lines, or one JSON object per line."),
    Setting("LOG_LEVEL", _choice("debug", "info", "warning", "error"), lambda: "warning",
            "Lowest log level printed."),
    Setting("CPU_DEVICES", _positive_int, lambda: max(4, os.cpu_count() or 1),
            "How many virtual CPU devices (CPU:0 … CPU:n-1) exist; each has its own worker threads."),
    Setting("CACHE_DIR", Path, _default_cache_dir,
            "Where compiled kernels (object code) are cached on disk."),
    Setting("COMPILE_CACHE", _choice("1", "0"), lambda: "1",
            "Set to 0 to bypass the on-disk compile cache."),
    Setting("COMPILE_CACHE_MAX_MB", _positive_int, lambda: 512,
            "Cap on the on-disk compile cache, in MiB; past it the least recently used entries are deleted."),
    Setting("COMPILE_WORKER_AFTER", _nonnegative_int, lambda: 64,
            "Modules a process optimises itself before it sends the rest to a child process, replaced every 256 "
            "(LLVM keeps ~74 KiB of every module it optimises at O3 for the life of the process: "
            "tinydist.codegen.compile_worker); 0: never use a child."),
    Setting("LOADED_KERNELS", _positive_int, lambda: 1024,
            "Kernels each device keeps loaded for reuse, the least recently used dropped past it. A dropped kernel's "
            "code is unmapped once nothing else holds it (a cached schedule, a captured step), so a process meeting "
            "new shapes without end plateaus instead of running out of memory mappings."),
    Setting("TIMELINE_TIMEOUT", _positive_float, lambda: 30.0,
            "Seconds a timeline may stand still under a waiter, while no kernel of its device publishes "
            "progress, before the device is declared hung (a long kernel that publishes is waited for)."),
    Setting("MAX_KERNEL_WORK", _positive_int, lambda: 1 << 50,
            "Most operations one kernel may be estimated to do (matmul: 2*M*N*K per batch item); a bigger one "
            "is refused when the graph is built (2**50 is about three hours at 100 GFLOP/s)."),
    Setting("REALIZE_RUN_AHEAD", _positive_int, lambda: 4,
            "Realizes on host-code devices that may be queued unfinished; the next waits for the oldest "
            "(bounds the arenas held, so an eager loop reuses freed ones instead of mapping new memory)."),
    Setting("JIT_RUN_AHEAD", _positive_int, lambda: 64,
            "Replays a synchronous td.jit caller may queue ahead of the devices; at that depth the call waits "
            "until they have finished them all (bounds the memory held for queued work)."),
    Setting("JIT_NATIVE_STREAMS", _choice("on", "off"), lambda: "on",
            "How td.jit replays a step over several CPU devices: on, one native call per queue, the queues "
            "waiting for each other in native code; off, one batch per run of kernels, ordered by the runtime's "
            "access logs (as steps on other devices always are)."),
    Setting("CPU_MEMORY_LIMIT", _positive_int, lambda: 1 << 40,
            "Bytes one CPU device may hold allocated at once."),
    Setting("ALLOCATOR_CACHE", int, lambda: 1 << 30,
            "Bytes of freed device memory each allocator keeps for reuse (0 disables the cache)."),
    Setting("ALLOCATOR_CACHE_BLOCKS", _positive_int, lambda: 2048,
            "Freed blocks each allocator keeps for reuse at most; past it (or past TINYDIST_ALLOCATOR_CACHE bytes) "
            "the blocks freed longest ago are given back, so ever-new tensor sizes do not pile up memory mappings."),
    Setting("COLLECTIVE_TIMEOUT", _positive_float, lambda: 60.0,
            "Seconds one process-group collective (tinydist.dist) may take before every rank raises."),
    Setting("ALLREDUCE", _choice("auto", "naive", "ring", "all2all"), lambda: "auto",
            "Allreduce algorithm where a call says algorithm='auto': auto (tinydist.graph.collectives.choose), naive, ring "
            "or all2all, legal on every medium (the devices of one process in tinydist.multi; processes on one host "
            "or across hosts in tinydist.dist). `direct` (tinydist.multi, devices of one peer group) is only a "
            "call's algorithm=, and auto picks it there. The cluster planner's stages follow its cost model."),
    Setting("COORDINATOR_ALLOW_REMOTE", _choice("0", "1"), lambda: "0",
            "Set to 1 to let rank 0's rendezvous (TINYDIST_COORDINATOR) and the ranks' mesh listeners bind a "
            "non-loopback address. They have no authentication, so by default they bind loopback only; allow more "
            "only where the network between the ranks is trusted (the Slurm and Kubernetes recipes in deploy/ do)."),
    Setting("SCHEDULER_LOST_AFTER", _positive_float, lambda: 60.0,
            "Seconds a node of a cluster job keeps running without reaching its scheduler (`tinydist scheduler serve`) "
            "before its job fails with CoordinatorLost. Meanwhile collectives go on (the data plane does not use the "
            "scheduler) and the node retries with exponential backoff, capped at half the dead-after window, then "
            "re-registers under the rank and incarnation it holds once the scheduler is back."),
    Setting("ETCD_CA", Path, lambda: None,
            "The CA certificate (PEM) an https:// etcd endpoint's certificate is checked against, for the scheduler's "
            "membership store (`tinydist scheduler serve --etcd https://...`): the lab's DIR/ca.pem when etcd serves a "
            "certificate from `tinydist certs etcd DIR`. Needed for https:// endpoints; unused for http://."),
    Setting("ETCD_CERT", Path, lambda: None,
            "The client certificate (PEM) the scheduler presents to etcd over https:// (etcd started with "
            "--client-cert-auth): one from `tinydist certs issue DIR --name NAME` (DIR/clients/NAME.pem). Give "
            "TINYDIST_ETCD_KEY with it."),
    Setting("ETCD_KEY", Path, lambda: None,
            "The key (PEM) of TINYDIST_ETCD_CERT (DIR/clients/NAME.key)."),
    Setting("SHM_SLOT_BYTES", _positive_int, lambda: 4 << 20,
            "Bytes each rank moves per round through the group's shared-memory segment (tinydist.dist on one host); "
            "larger messages take several rounds. Every rank of a job must use the same value."),
    Setting("SHM_SINGLE_COPY", _choice("auto", "on", "off"), lambda: "auto",
            "Whether all2all allreduce on one host (tinydist.dist) copies straight between the ranks' memory with "
            "process_vm_readv/writev, where every rank may: auto from 8 MiB on, on at every size, off never (through "
            "the group segment's slots). One rank's off turns it off for the whole job; on and auto agree on 8 MiB."),
    Setting("SHM_FAST", _choice("on", "off"), lambda: "on",
            "Whether small allreduces on one host (tinydist.dist) run as one native call on the group segment "
            "(tinydist.dist.shm_fast: no header exchange, a call digest instead): on, or off for the segment path. "
            "Every rank of a job must use the same value."),
    Setting("TRANSPORT", _choice("auto", "shm", "tcp", "rdma"), lambda: "auto",
            "Links between ranks. auto: shared memory on one host; between hosts BNXT RDMA when both ranks "
            "have a NIC, else TCP. shm / tcp / rdma force one (rdma falls back to TCP, with the reason logged)."),
    Setting("TRACE", Path, lambda: None,
            "Write a Chrome Trace Event Format file of all device work to this path at exit (.rank{N} is added in a multi-process job)."),
    Setting("TRACE_MAX_EVENTS", _positive_int, lambda: 2_000_000,
            "Most events one trace keeps in memory; later ones are dropped and counted."),
    Setting("RDMA_NIC", _choice("auto", "hw", "soft", "off"), lambda: "auto",
            "RDMA links (transports.rdma_bnxt): a real BNXT NIC if usable (auto, hw), the software NIC model (soft), "
            "or none (off); a pair where either side has none falls back to TCP with a logged reason."),
):
    settings.declare(_setting)

# What launchers (`tinydist launch`, the Slurm and Kubernetes mapping in tinydist/dist/environment.py)
# set for each process they start, and what a process reads to join its job or reach the cluster.
LAUNCH_VARIABLES: dict[str, str] = {
    "TINYDIST_RANK": "This process's rank in its job (0 … world size − 1); set by `tinydist launch` or mapped from "
                     "SLURM_PROCID / JOB_COMPLETION_INDEX.",
    "TINYDIST_WORLD_SIZE": "How many ranks the job has.",
    "TINYDIST_LOCAL_RANK": "This process's rank among the job's processes on its host.",
    "TINYDIST_COORDINATOR": "HOST:PORT where rank 0 holds the rendezvous of tinydist.dist (default 127.0.0.1:29400).",
    "TINYDIST_COORDINATOR_FD": "A listening socket rank 0 inherits from `tinydist launch`, which bound the port before "
                               "starting the ranks; removed from the environment once used.",
    "TINYDIST_JOB_ID": "Names the job's shared-memory segments, so `tinydist launch` can sweep what a killed rank left.",
    "TINYDIST_PORT": "Rendezvous port on Slurm and Kubernetes, where the coordinator host comes from the scheduler "
                     "(default 29400; on Slurm 29400 + 2 * (SLURM_JOB_ID mod 300), so jobs sharing a node differ), "
                     "and under torchrun (default MASTER_PORT + 1: torchrun's agent holds MASTER_PORT).",
    "TINYDIST_K8S_SERVICE": "The headless Service that names rank 0's pod on Kubernetes (when TINYDIST_COORDINATOR is unset).",
    "TINYDIST_NODE_ID": "This node's id for the cluster scheduler (else the pod name, `<SLURMD_NODENAME>-<localid>` "
                        "or `node-<rank>`).",
    "TINYDIST_SCHEDULER": "HOST:PORT of the cluster scheduler (`tinydist scheduler serve`) to join.",
    "TINYDIST_SCHEDULER_PORT": "The cluster scheduler's port on Slurm, on the job's first host (default the port after "
                               "the job's rendezvous port, 29401 + 2 * (SLURM_JOB_ID mod 300); 29500 outside Slurm).",
    "TINYDIST_NODE_HOST": "The address (or name, resolved once) a cluster node's rendezvous binds and advertises to the "
                          "job's other nodes (default: SLURMD_NODENAME resolved under Slurm, else 127.0.0.1); a "
                          "non-loopback one needs TINYDIST_COORDINATOR_ALLOW_REMOTE=1.",
    "TINYDIST_CERT": "Client certificate (PEM path) for mutual TLS to a node or the cluster scheduler.",
    "TINYDIST_KEY": "The client certificate's private key (PEM path).",
    "TINYDIST_CA": "The CA certificate (PEM path) that node and scheduler certificates must chain to.",
    "RANK, LOCAL_RANK, WORLD_SIZE": "torchrun's names, set by `tinydist launch` beside TINYDIST_RANK, TINYDIST_LOCAL_RANK "
                                    "and TINYDIST_WORLD_SIZE (which win); read, with MASTER_ADDR, where torchrun "
                                    "started the process.",
    "LOCAL_WORLD_SIZE, GROUP_RANK": "Set by `tinydist launch`, as torchrun does: ranks on this node (--nproc-per-node), "
                                    "and this node's rank (--node-rank).",
    "MASTER_ADDR, MASTER_PORT": "Set by `tinydist launch`, as torchrun does: where node 0 holds the rendezvous "
                                "(TINYDIST_COORDINATOR, split).",
}


def launch_int(name: str, env: Mapping[str, str] | None = None, *, required: bool = True) -> int | None:
    """The non-negative integer in launch variable `name` (TINYDIST_RANK, SLURM_PROCID, ...): the one
    parse of them all, so a bad value reads the same wherever it is noticed. Unset (or empty): a
    LaunchError when `required`, else None."""
    env = os.environ if env is None else env
    raw = env.get(name, "")
    if not raw.strip():
        if not required:
            return None
        raise LaunchError(f"{name} is not set; start the script with `tinydist launch --nproc N script.py` (or srun, "
                          f"or a Kubernetes Indexed Job), or pass rank/world_size to td.dist.init()")
    if not raw.strip().isdigit():
        what = LAUNCH_VARIABLES.get(name, "set by the job's launcher")
        raise LaunchError(f"{name}={raw!r} is not a non-negative integer ({name}: {what})")
    return int(raw)


def env_vars_markdown() -> str:
    """The text of docs/env_vars.md (the README's regeneration command writes it)."""
    lines = ["# Environment variables", "",
             "Every setting tinydist reads from the environment, declared once in `tinydist/base/config.py`",
             "(this file is generated from that registry by `make env-doc`; `tests/test_settings_doc.py`",
             "keeps it in sync).", "",
             "| variable | meaning |", "|---|---|"]
    lines += [f"| `TINYDIST_{s.name}` | {s.doc} |" for s in settings.declared()]
    lines += ["", "## Launch contract", "",
              "Set by `tinydist launch`, or mapped from Slurm and Kubernetes by `tinydist/dist/environment.py`, for",
              "every process of a job; read where a process joins its job or reaches the cluster.", "",
              "| variable | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {doc} |" for name, doc in LAUNCH_VARIABLES.items()]
    return "\n".join(lines) + "\n"
