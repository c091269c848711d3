"""The exception vocabulary: every error tinydist, its transports and its scheduler raise on
purpose is a `TinydistError`, so `except TinydistError` catches all of them and nothing foreign.

The whole tree, every class under its first base. A class is defined in the module in brackets,
else in its parent's; other bases in parentheses (a builtin base keeps `except LookupError` and
the like working). tests/test_exception_tree.py imports every module and checks this drawing
against the classes they define, both ways, so it cannot go stale; private signals (a leading
underscore, never seen outside their module) are not drawn, but are TinydistErrors too.

    TinydistError                                   [tinydist.base.errors]
    ├── DeviceError                                 something about one device
    │   ├── DeviceNotFound (LookupError)            the name names no device; lists the available ones
    │   ├── DeviceUnavailable                       the back end exists but cannot open here; says why
    │   ├── DeviceFailed                            the device was marked failed; every later use raises it
    │   │   └── DeviceHang (TimeoutError)           a timeline stopped moving past its deadline
    │   ├── DeviceClosed (ClosedResourceError)      the device, one of its queues, or the engine was closed
    │   ├── TenantWorkerFailed                      a tenant's kernel worker on a node died or was killed: .identity, .cause
    │   ├── RemoteCallFailed [tinydist.runtime.remote.errors]    a node answered with an error no narrower class fits: .status, .method, .node
    │   │   ├── AccessDenied (PermissionError)      UNAUTHENTICATED / PERMISSION_DENIED: the node's reason and the policy line to add
    │   │   ├── QuotaExceeded                       RESOURCE_EXHAUSTED: names the quota or limit
    │   │   ├── InvalidRequest (ValueError)         INVALID_ARGUMENT / FAILED_PRECONDITION: names the argument or the state
    │   │   ├── CallTimeout (TimeoutError)          DEADLINE_EXCEEDED
    │   │   └── NotOnNode (LookupError)             NOT_FOUND: no such device, lease, handle or program for this caller
    │   └── CUDAError [tinydist.runtime.cuda.driver]    a driver call failed: .code, .name, .call
    ├── ClosedResourceError                         a device, link or group segment was closed; open a new one
    ├── BufferError_                                misuse of a buffer or view
    │   ├── OutOfBounds (IndexError)                a view or copy outside its base, refused before touching memory
    │   ├── BufferInUse                             freeing a base that still has live views
    │   └── UseAfterFree                            freeing twice, or using a freed buffer
    ├── AllocationError (MemoryError)               an allocation failed; everything it took was given back
    ├── CompileError                                LLVM refused a kernel; carries LLVM's message
    ├── WorkTooLarge (ValueError)                   one kernel's estimated work passes TINYDIST_MAX_KERNEL_WORK
    ├── LaunchError (ValueError)                    a launch variable (TINYDIST_RANK, ...) is missing or malformed
    ├── SettingError (ValueError)                   a TINYDIST_* setting holds a value it does not accept
    ├── BindRefused (ValueError)                    a listen address breaks the bind policy (tinydist.security.bind)
    ├── DriverUnavailable [tinydist.runtime.cuda.driver]    no usable CUDA driver here; says why
    ├── ScheduleCycleError (ValueError) [tinydist.schedule.linear]    the computation has no valid order
    ├── JitError (ValueError) [tinydist.frontend.jit]        a replay's arguments differ from the captured signature
    ├── ReplayUnfit (ValueError) [tinydist.engine.replay]    a forced replay strategy does not fit the capture
    ├── ShardError (ValueError) [tinydist.multi.sharded]    elements would move between shards
    ├── CheckpointError (ValueError) [tinydist.train.serialization]    not a checkpoint td.save wrote; names the file
    ├── UnsupportedModelError (ValueError) [tinydist.onnx.errors]    an op, dtype, opset or attribute not run exactly
    ├── ModelLoadError (ValueError) [tinydist.onnx.errors]    not an ONNX model at all; names the file
    ├── CollectiveError [tinydist.dist.errors]      a process-group collective failed, on every rank
    │   ├── CollectiveMismatch (ValueError)         ranks called different collectives / shapes / dtypes / ops
    │   ├── RankFailed                              a rank died or left mid-job; .rank
    │   ├── CollectiveTimeout (TimeoutError)        TINYDIST_COLLECTIVE_TIMEOUT passed; .ranks waited on
    │   └── NodeFailed [tinydist.scheduler.errors]           a node of the job died; .node_id, .rank
    ├── ClusterError [tinydist.scheduler.errors]             the cluster scheduler refused or could not do something
    │   ├── MembershipError                         a join, heartbeat or wait the coordinator refused
    │   │   └── SchedulerNameMismatch               the scheduler's certificate does not name the address dialled
    │   ├── CoordinatorLost                         unreachable past TINYDIST_SCHEDULER_LOST_AFTER (retried with backoff)
    │   ├── MembershipStoreError                    the coordinator's membership store cannot be used (etcd unreachable, ...)
    │   │   ├── JournalError                        the coordinator's --state-dir is corrupt, locked or unwritable
    │   │   └── LeadershipLost                      this coordinator's etcd leader key is gone or another's: it stands down
    │   └── PlanError                               no collective plan on this topology
    ├── PKIError [tinydist.security.pki]                     a certificate directory misses or holds something invalid
    ├── IdentityError [tinydist.security.identity]    the peer certificate names no one acceptable identity
    ├── PolicyError (ValueError) [tinydist.security.policy]    the policy file is missing or invalid; names the key
    ├── VerificationError (ValueError) [tinydist.nodes.verifier]    a program refused; names the rule
    ├── RpcError [tinydist.nodes.gate]    a node-service handler's refusal: .code, .reason
    ├── DmaFault [tinydist.transports.rdma_bnxt.softbnxt.physmem]    the NIC model touched unmapped memory
    └── TransportError [tinydist.transports.base]            a link broke its protocol or could not be set up
        ├── LinkClosed (ClosedResourceError)        this side closed the link or the group segment
        ├── PeerFailed                              the peer left without closing: .peer, .blamed, .reason, .code
        ├── PeerGone [tinydist.transports.cma]               the peer process died under a cross-memory copy
        ├── WaitTimeout [tinydist.transports.shm_group]      a shared-memory wait passed its deadline: .ranks, .step
        ├── Abandoned [tinydist.transports.shm_group]        a rank gave up on the group's step: .reason, .blamed, .ranks
        ├── Stalled [tinydist.transports.tcp]                a thread moving frames itself met its deadline: .peers
        └── RdmaError [tinydist.transports.rdma_bnxt.errors]    .recovery, .hint (fields: that module's docstring)
            ├── Timeout                             firmware or a completion gave no answer in its budget
            ├── FirmwareError                       firmware answered with a non-zero code
            │   └── ProtocolViolation               firmware or the bus broke the protocol
            ├── CompletionError                     a work request completed with an error status
            │   ├── BadResponse
            │   ├── LocalLengthError
            │   ├── LocalQpOperation
            │   ├── LocalProtectionError
            │   ├── MemoryOperationError
            │   ├── RemoteInvalidRequest
            │   ├── RemoteAccessError
            │   ├── RemoteOperationError
            │   ├── RnrRetryExceeded
            │   ├── RetryExceeded
            │   ├── Flushed                         secondary: the QP had already failed
            │   ├── LinkDown                        retries exhausted while the port was down
            │   ├── CQOverflow                      a completion queue overflowed
            │   ├── QpFatal                         firmware moved the QP to ERR
            │   └── CqeProtocolViolation            a completion of the wrong type, handle or slot
            ├── TeardownError                       close() steps failed: .errors, .quarantined
            └── NicUnavailable                      no usable NIC; the link factory falls back to TCP

One class stays outside on purpose: `tinydist.runtime.faults.InjectedFault` (a RuntimeError) stands
in for a foreign failure (the OS, a driver) at a fault point, so the rollback under test sees what
it would see in production, not one of ours.

A foreign error (OSError, grpc.RpcError, an ssl, protobuf or cryptography error) is turned into
one of these where it enters: `raise TransportError(...) from exc`, so `__cause__` keeps the
original. A remote node's gRPC statuses are mapped in one table, every status once
(`tinydist.runtime.remote.errors.STATUS_ERRORS`: OUT_OF_RANGE is OutOfBounds, UNAVAILABLE DeviceFailed, ...). Messages name the object, show the values and say what to do.
"""

from __future__ import annotations


class TinydistError(Exception):
    """Base of every error tinydist raises on purpose."""


class ClosedResourceError(TinydistError):
    """The resource (a device, a link, a group's shared memory) was closed; open a new one."""


class DeviceError(TinydistError):
    """An error about one device."""


class DeviceNotFound(DeviceError, LookupError):
    """The device name does not name any device."""


class DeviceUnavailable(DeviceError):
    """The back end exists, but the device cannot be opened on this machine."""


class DeviceFailed(DeviceError):
    """The device was marked failed; it refuses all further work until reopened."""


class DeviceHang(DeviceFailed, TimeoutError):
    """A timeline did not move before its deadline; the device is marked failed."""


class DeviceClosed(DeviceError, ClosedResourceError):
    """The device, one of its queues, or the engine holding the devices was closed; open a new one.

    A DeviceError as well, so callers that treat any device error as "this time only, the device
    may be reopened" (engine.lowered) keep doing so."""


class TenantWorkerFailed(DeviceError):
    """A remote node's worker process for one tenant (`tinydist.nodes.tenants`) died or was killed, or one of
    its requests failed (`fatal=False`). Names the tenant and the cause; the node keeps the tenant's
    buffers and starts a fresh worker at its next call."""

    def __init__(self, identity: str, cause: str, fatal: bool = True) -> None:
        self.identity, self.cause, self.fatal = identity, cause, fatal
        if fatal:
            text = (f"the kernel worker of tenant {identity} {cause}; its pending work failed, its buffers are kept "
                    "(contents as the failed work left them), and its next call starts a fresh worker")
        else:
            text = f"the kernel worker of tenant {identity}: {cause}"
        super().__init__(text)


class BufferError_(TinydistError):
    """Misuse of a buffer or view (named with a trailing underscore: Python owns BufferError)."""


class OutOfBounds(BufferError_, IndexError):
    """A view or transfer reaches outside its base buffer."""


class BufferInUse(BufferError_):
    """The buffer cannot be freed while live views of it exist."""


class UseAfterFree(BufferError_):
    """The buffer was already freed."""


class AllocationError(TinydistError, MemoryError):
    """An allocation failed; everything it had taken was given back."""


class CompileError(TinydistError):
    """LLVM rejected a kernel."""


class WorkTooLarge(TinydistError, ValueError):
    """One kernel's estimated work (operations) passes TINYDIST_MAX_KERNEL_WORK: refused when the
    graph is built, before it could run for hours and be mistaken for a hang."""


class SettingError(TinydistError, ValueError):
    """A TINYDIST_* environment variable holds a value its setting does not accept; names both."""


class LaunchError(TinydistError, ValueError):
    """A launch variable (TINYDIST_RANK, TINYDIST_WORLD_SIZE, ... or the Slurm / Kubernetes ones they
    are mapped from) is missing or malformed; the message names it and who sets it."""


class BindRefused(TinydistError, ValueError):
    """A listen address is malformed, or binding it would expose a server the policy keeps private."""
