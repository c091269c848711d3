"""A node's gRPC answers as the project's own errors, `raise ... from` the original.

Every `grpc.StatusCode` has one entry in `STATUS_ERRORS` (tests/remote/test_errors.py walks the
enum): the class a failed call becomes and what the caller can do about it. Existing classes where
one fits — OUT_OF_RANGE is `OutOfBounds`, UNAVAILABLE `DeviceFailed` (the node went away: the remote
device is marked failed and its next use reconnects), CANCELLED `DeviceClosed` — and the
`RemoteCallFailed` family below for what only a node says (a refusal by its policy, a quota, a
deadline, an object it does not hold). Two answers are told apart by more than their status: a
tenant worker's death carries `tinydist-error: TenantWorkerFailed` in the trailing metadata (with
the tenant and the cause: `TenantWorkerFailed`, whatever the status), and a LoadProgram the node's
verifier or compiler refused is a `CompileError`; an Allocate past a quota is left to the allocator,
which reports it as an `AllocationError`.

The gRPC status, the method and the node stay on `RemoteCallFailed` (`.status`, `.method`, `.node`)
and on every mapped error's `__cause__` (the `grpc.RpcError`).
"""

from __future__ import annotations

from typing import Any

import grpc

from tinydist.base.errors import (CompileError, DeviceClosed, DeviceError, DeviceFailed, DeviceUnavailable, OutOfBounds,
                                  TenantWorkerFailed, TinydistError)
from tinydist.security.diagnose import explain
from tinydist.security.pki import ClientCredentials
from tinydist.transports.pci_remote.wire import CAUSE_METADATA, ERROR_METADATA, FATAL_METADATA, TENANT_METADATA


class RemoteCallFailed(DeviceError):
    """A node answered a call with an error no narrower class of ours describes: `.status` (the gRPC
    status name), `.method`, `.node` (HOST:PORT)."""

    def __init__(self, message: str, status: str = "", method: str = "", node: str = "") -> None:
        super().__init__(message)
        self.status, self.method, self.node = status, method, node


class AccessDenied(RemoteCallFailed, PermissionError):
    """UNAUTHENTICATED or PERMISSION_DENIED: the node's policy refused this certificate or its role; the
    message holds the node's reason and the line an admin adds to its policy (or the certificate to get)."""


class QuotaExceeded(RemoteCallFailed):
    """RESOURCE_EXHAUSTED: one of the identity's quotas (bytes, calls, streams, rate, programs,
    resets) or a node-wide limit; the message names which."""


class InvalidRequest(RemoteCallFailed, ValueError):
    """INVALID_ARGUMENT or FAILED_PRECONDITION: the node refused the request's arguments, or its
    state (a buffer still in use) does not allow it now; the message says which."""


class CallTimeout(RemoteCallFailed, TimeoutError):
    """DEADLINE_EXCEEDED: the call did not finish before its deadline (the client's, or the node's
    `op_timeout_s`)."""


class NotOnNode(RemoteCallFailed, LookupError):
    """NOT_FOUND: the node holds no such device, lease, handle or program for this caller (freed,
    never made, or another tenant's: the node does not say which)."""


# status -> (the class it becomes, what to do); a `RemoteCallFailed` subclass also gets .status/.method/.node
STATUS_ERRORS: dict[grpc.StatusCode, tuple[type[TinydistError], str]] = {
    grpc.StatusCode.OK: (RemoteCallFailed, "the call ended without a reply yet with status OK: a bug, please report it"),
    grpc.StatusCode.CANCELLED: (DeviceClosed, "the call was cancelled (this client closed the device, or the node "
                                              "is stopping); open the device again"),
    grpc.StatusCode.UNKNOWN: (RemoteCallFailed, "the node failed without classifying it; its log says more"),
    grpc.StatusCode.INVALID_ARGUMENT: (InvalidRequest, "the node refused the request; fix the argument it names"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (CallTimeout, "give the call a longer deadline, or split the work"),
    grpc.StatusCode.NOT_FOUND: (NotOnNode, "the object was freed, never made, or belongs to another client"),
    grpc.StatusCode.ALREADY_EXISTS: (RemoteCallFailed, "the node says the object exists already"),
    grpc.StatusCode.PERMISSION_DENIED: (AccessDenied, "the node's policy refuses this; an admin of the node can "
                                                      "change it (tinydist certs enrol)"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (QuotaExceeded, "free what this identity holds, slow down, or ask the node's "
                                                        "admin for a larger quota"),
    grpc.StatusCode.FAILED_PRECONDITION: (InvalidRequest, "the node's state does not allow it now; retry once the "
                                                          "work it names has finished"),
    grpc.StatusCode.ABORTED: (TenantWorkerFailed, "the tenant's next call starts a fresh worker"),
    grpc.StatusCode.OUT_OF_RANGE: (OutOfBounds, "the range lies outside the remote buffer; nothing was touched"),
    grpc.StatusCode.UNIMPLEMENTED: (RemoteCallFailed, "the node runs another tinydist version without this method; "
                                                      "upgrade the node or the client"),
    grpc.StatusCode.INTERNAL: (RemoteCallFailed, "a bug on the node; its log has the traceback"),
    grpc.StatusCode.UNAVAILABLE: (DeviceFailed, "the node is unreachable or its device failed: the remote device is "
                                                "marked failed and its next use reconnects"),
    grpc.StatusCode.DATA_LOSS: (DeviceFailed, "the node lost data; the remote device is marked failed and its next "
                                              "use reconnects"),
    grpc.StatusCode.UNAUTHENTICATED: (AccessDenied, "the node does not accept this certificate; get one from the "
                                                    "node's lab (tinydist certs issue)"),
}


def _metadata(exc: grpc.RpcError) -> dict[str, str]:
    trailing: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    found: dict[str, str] = {}
    for item in trailing or ():
        key, value = item[0], item[1]  # grpc's _Metadatum, or a plain pair
        found[str(key)] = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return found


def from_rpc(exc: grpc.RpcError, method: str, node: str, what: str = "") -> TinydistError:
    """The error of ours a failed call `method` to `node` is; raise it `from exc`. `what` names the
    caller's object in the message (the device, say), else the node."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    code = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or ""
    cls, fix = STATUS_ERRORS[code]
    subject = what or f"node {node}"
    meta = _metadata(exc)
    if meta.get(ERROR_METADATA) == TenantWorkerFailed.__name__ or cls is TenantWorkerFailed:
        identity = meta.get(TENANT_METADATA) or "(unnamed)"
        cause = meta.get(CAUSE_METADATA) or details or code.name
        return TenantWorkerFailed(identity, cause, fatal=meta.get(FATAL_METADATA, "1") == "1")
    if method in ("LoadProgram", "LoadRawProgram") and code is grpc.StatusCode.INVALID_ARGUMENT:
        return CompileError(f"{subject}: the node refused the program: {details}")
    message = f"{subject}: {method} failed: {code.name}: {details or '(no details)'}; {fix}"
    if issubclass(cls, RemoteCallFailed):
        return cls(message, code.name, method, node)
    return cls(message)


def open_error(name: str, node: str, credentials: ClientCredentials, method: str, exc: grpc.RpcError) -> TinydistError:
    """A failed first call to `node` (opening a device, or a client's first call): a connection that did
    not come up is `DeviceUnavailable` with its cause and fix (`tinydist.security.diagnose`), anything
    else as `from_rpc` says (a refusal by the policy is `AccessDenied` with the line to add)."""
    if exc.code() is grpc.StatusCode.UNAVAILABLE or (exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and method == "ListDevices"):
        return DeviceUnavailable(f"{name}: cannot use node {node}: {explain(node, credentials, exc.details() or '')}")
    return from_rpc(exc, method, node, name)
