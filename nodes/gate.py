"""The gate every call of the node service passes before its handler runs:

    TLS identity (single URI SAN, clientAuth, valid) → not revoked → enrolled → method listed in the
    policy with a role the caller has → within its concurrent call and stream caps → within its RPC
    rate → elevation token (admin methods)

Every method is served as a request-streaming handler over raw bytes, so all of this runs when the
call's headers arrive, before its request message is read or parsed (docs/remote.md, "Admission"):
a refused caller holds no slot while its message is outstanding, and a malformed message is
INVALID_ARGUMENT from the admitted caller. A refusal ends the call with its gRPC status and reason; every
call, admitted or not, ends in exactly one audit `decision` record and one RPC metric. Handler
errors are mapped here too: an `RpcError` is its status, a device failure UNAVAILABLE, any other
tinydist error FAILED_PRECONDITION, anything else INTERNAL (logged, never leaked).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tinydist.nodes.audit import AuditLog
from tinydist.base.errors import DeviceFailed, TinydistError
from tinydist.base.logs import get_logger
from tinydist.observability import metrics, tracing
from tinydist.security.identity import IdentityError, PeerCache, peer_from_auth_context
from tinydist.security.policy import ELEVATED, RANK, Policy, PolicyStore
from tinydist.transports.pci_remote import wire
from tinydist.transports.pci_remote._generated import device_pb2 as pb

SERVICE = "tinydist.v1.DeviceService"
ELEVATION_METADATA = "tinydist-elevation"
Code = grpc.StatusCode
# How often the requests still unread past their call's deadline are cancelled: one timer for all the
# calls awaiting their message instead of one each (a `call_at` and its `cancel`, ~3 us a call); a
# request that never comes ends at most this much after its deadline.
READ_SWEEP_S = 0.25


def _log():  # not at import: configuring logs then would bind the importer's stderr
    return get_logger(component="remote-server")


class RpcError(TinydistError):
    """A handler's refusal: the call ends with gRPC status `code` and `reason` as its details, followed
    by `hint` (what the caller or the node's admin can do; the audit records `reason` alone), and
    `metadata` as trailing metadata (`wire.ERROR_METADATA` and friends)."""

    def __init__(self, code: grpc.StatusCode, reason: str, hint: str = "",
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.code = code
        self.reason = reason
        self.hint = hint
        self.metadata = metadata
        super().__init__(self.details)

    @property
    def details(self) -> str:
        return f"{self.reason}: {self.hint}" if self.hint else self.reason


@dataclass(slots=True)
class Call:
    identity: str
    fingerprint: str
    role: str
    policy: Policy
    method: str
    deadline: float  # monotonic
    stream: bool = False  # counted against the identity's stream cap as well as its call cap
    held: bool = False    # whether this call holds its identity's slots (released when it ends)


class Gate:
    """Admission, elevation tokens and the audit of every call; `handlers(servicer)` wraps a
    servicer's `rpc_<Method>(request, call)` coroutines as the gated gRPC handlers."""

    def __init__(self, op_timeout_s: float, policy: PolicyStore, audit: AuditLog) -> None:
        self.op_timeout_s = op_timeout_s
        self.policy = policy
        self.audit = audit
        self.handler_calls: Counter[str] = Counter()  # how often each handler body ran (tests prove refusals)
        self._buckets: dict[str, tuple[float, float]] = {}
        self._tokens: dict[str, list[tuple[bytes, float]]] = {}
        self._peers = PeerCache()
        # calls in progress, per identity (plain dicts: a Counter's missing key and `del` run Python code)
        self.calls_by_identity: dict[str, int] = {}
        self.streams_by_identity: dict[str, int] = {}  # of which streaming calls
        self._reading: dict[asyncio.Task[Any], float] = {}  # handlers awaiting their request -> the call's deadline
        self._expired: set[asyncio.Task[Any]] = set()        # of which the sweep cancelled
        self._sweep: asyncio.TimerHandle | None = None

    def recheck(self, call: Call) -> None:
        """Between the messages of a stream: still before the call's deadline, the certificate
        not revoked since, the role still enough (the policy is re-read when its files change);
        a refusal ends the stream, audited as any refusal."""
        if time.monotonic() > call.deadline:
            raise RpcError(Code.DEADLINE_EXCEEDED, "the stream outlived its deadline; split the transfer")
        policy, denied = self.policy.current()
        if call.fingerprint in denied:
            raise _Refused(call, Code.UNAUTHENTICATED, "certificate revoked", _revoked_hint(call.fingerprint))
        role, need = policy.role_of(call.identity), policy.min_role(call.method)
        if role is None or need is None or RANK[role] < RANK[need]:
            raise _Refused(call, Code.PERMISSION_DENIED, f"the policy no longer lets {role or 'a caller not enrolled'} call {call.method}",
                           _enrol_hint(call.identity, need, "lost the role") if need else "")

    async def messages(self, call: Call, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """A client stream's messages, each admitted by `recheck`; a client that sends nothing
        until the call's deadline ends it (a stream holds no slot while idle for ever)."""
        iterator = requests.__aiter__()
        while True:
            self.recheck(call)
            try:
                message = await asyncio.wait_for(iterator.__anext__(), max(call.deadline - time.monotonic(), 0.0))
            except StopAsyncIteration:
                return
            except (asyncio.TimeoutError, TimeoutError):
                raise RpcError(Code.DEADLINE_EXCEEDED, "the stream sent nothing before its deadline") from None
            yield message

    def mint_token(self, call: Call) -> tuple[str, float]:
        """A new elevation token for the caller's certificate and its time to live in seconds
        (the policy's, at most 60 s); the last eight stay valid until they expire."""
        ttl = min(call.policy.token_ttl, 60.0)
        now = time.monotonic()
        token = secrets.token_urlsafe(32)
        live = [(t, e) for t, e in self._tokens.get(call.fingerprint, []) if e > now][-7:]
        live.append((token.encode(), now + ttl))
        self._tokens[call.fingerprint] = live
        return token, ttl

    def admit(self, method: str, context: grpc.aio.ServicerContext, stream: bool = False) -> Call:
        """Identity → revocation → enrolment → role → concurrency caps → rate → elevation, all from
        the call's headers: it runs when the call starts, before its first message is read."""
        policy, denied = self.policy.current()
        try:
            peer = peer_from_auth_context(context.auth_context(), policy.trust_domain, self._peers)
        except IdentityError as exc:
            raise RpcError(Code.UNAUTHENTICATED, str(exc)) from None
        call = Call(peer.identity, peer.fingerprint, "", policy, method, 0.0)
        if peer.fingerprint in denied:
            raise _Refused(call, Code.UNAUTHENTICATED, "certificate revoked", _revoked_hint(peer.fingerprint))
        role = policy.role_of(peer.identity)
        need = policy.min_role(method)
        if role is None:
            raise _Refused(call, Code.PERMISSION_DENIED, "identity not enrolled", _enrol_hint(peer.identity, need, "is not enrolled"))
        call.role = role
        if need is None:
            raise _Refused(call, Code.PERMISSION_DENIED, "method not in policy (deny by default)",
                           f'the node\'s policy lists no role for {method}; its admin adds `{method} = "operator"` '
                           "(or the role it needs) under [methods]")
        if RANK[role] < RANK[need]:
            raise _Refused(call, Code.PERMISSION_DENIED, f"role {role} below required {need}",
                           _enrol_hint(peer.identity, need, f"has role {role}, and {method} needs {need}"))
        quota = policy.quota_of(peer.identity)
        calls = self.calls_by_identity.get(peer.identity, 0)
        if calls >= quota.max_calls:
            raise _Refused(call, Code.RESOURCE_EXHAUSTED,
                           f"concurrent call quota exceeded ({quota.max_calls} calls in progress for this identity)")
        if stream and self.streams_by_identity.get(peer.identity, 0) >= quota.max_streams:
            raise _Refused(call, Code.RESOURCE_EXHAUSTED,
                           f"concurrent stream quota exceeded ({quota.max_streams} streams open for this identity)")
        now = time.monotonic()
        tokens, last = self._buckets.get(peer.identity, (quota.rpc_burst, now))
        tokens = min(quota.rpc_burst, tokens + (now - last) * quota.rpc_per_second)
        if tokens < 1.0:
            self._buckets[peer.identity] = (tokens, now)
            raise _Refused(call, Code.RESOURCE_EXHAUSTED, "rpc rate quota exceeded")
        self._buckets[peer.identity] = (tokens - 1.0, now)
        if method in ELEVATED:
            self._check_token(call, context)
        remaining = context.time_remaining()
        budget = self.op_timeout_s if remaining is None else min(self.op_timeout_s, remaining)
        call.deadline = now + max(budget, 0.0)
        call.stream, call.held = stream, True
        self.calls_by_identity[peer.identity] = calls + 1
        if stream:
            self.streams_by_identity[peer.identity] = self.streams_by_identity.get(peer.identity, 0) + 1
        return call

    def _release(self, call: Call | None) -> None:
        if call is None or not call.held:
            return
        call.held = False
        for counts in (self.calls_by_identity, self.streams_by_identity) if call.stream else (self.calls_by_identity,):
            left = counts[call.identity] - 1
            if left:
                counts[call.identity] = left
            else:
                del counts[call.identity]

    def _check_token(self, call: Call, context: grpc.aio.ServicerContext) -> None:
        presented = None
        for key, value in context.invocation_metadata() or ():
            if key == ELEVATION_METADATA:
                presented = value.encode() if isinstance(value, str) else bytes(value)
        if not presented:
            raise _Refused(call, Code.PERMISSION_DENIED, "elevation token required")
        now = time.monotonic()
        matched_expired = False
        for token, expires in self._tokens.get(call.fingerprint, ()):
            if hmac.compare_digest(token, presented):
                if expires > now:
                    return
                matched_expired = True
        raise _Refused(call, Code.PERMISSION_DENIED,
                       "elevation token expired" if matched_expired else "elevation token invalid for this certificate")

    async def _one_message(self, call: Call, context: grpc.aio.ServicerContext, decode: Callable[[bytes], Any]) -> Any:
        """The single request of a unary method, read only now that the call is admitted and
        parsed here (malformed bytes are INVALID_ARGUMENT, audited like any refusal). Read with
        `context.read()`: the request iterator gRPC also offers is an async generator, a few
        microseconds more on every call."""
        # bounded: an admitted caller's unsent message holds its slot until the call's deadline, when
        # the sweep (`_sweep_reads`) cancels the wait; a dict entry a call instead of a timer a call
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a gated handler runs in a task")
        self._reading[task] = call.deadline
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(READ_SWEEP_S, self._sweep_reads)
        try:
            raw = await context.read()
        except asyncio.CancelledError:
            if task not in self._expired or task.uncancel():
                raise   # cancelled by someone else (the client left): not our deadline
            raise RpcError(Code.DEADLINE_EXCEEDED, "the request message did not arrive before the deadline") from None
        finally:
            del self._reading[task]
            self._expired.discard(task)
        if raw is grpc.aio.EOF:
            raise RpcError(Code.INVALID_ARGUMENT, f"{call.method} takes one request message; none was sent")
        return _decode(decode, raw, call.method)

    def _sweep_reads(self) -> None:
        """Cancel the handlers still awaiting their request past their call's deadline; runs every
        READ_SWEEP_S while any handler awaits one."""
        now = time.monotonic()
        for task, deadline in list(self._reading.items()):
            if deadline <= now and task not in self._expired:
                self._expired.add(task)
                task.cancel()
        self._sweep = asyncio.get_running_loop().call_later(READ_SWEEP_S, self._sweep_reads) if self._reading else None

    async def _decoded(self, call: Call, requests: AsyncIterator[bytes], decode: Callable[[bytes], Any]) -> AsyncIterator[Any]:
        async for raw in self.messages(call, requests):
            yield _decode(decode, raw, call.method)

    def _wrap(self, method: str, impl: Callable[..., Any], decode: Callable[[bytes], Any],
              client_stream: bool, server_stream: bool) -> Callable[..., Any]:
        """The gated handler of `method`. Every method is served as a request-streaming handler
        with raw-bytes messages, so the handler runs when the call's headers arrive: admission
        (identity, revocation, role, concurrency caps, rate) happens before any request byte is
        read or parsed, and a refused caller holds no slot while its message is outstanding."""
        stream = client_stream or server_stream
        kind = metrics.grpc_type(client_stream, server_stream)
        rpc_metrics = metrics.rpc_metrics(SERVICE, method, kind)

        async def unary_reply(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            call, code, reason, started = None, Code.OK, "ok", tracing.clock()
            refusal: RpcError | None = None
            rpc_metrics.start()
            try:
                call = self.admit(method, context, stream)
                request = self._decoded(call, requests, decode) if client_stream else await self._one_message(call, context, decode)
                self.handler_calls[method] += 1
                return await impl(request, call)
            except _Refused as exc:
                call, code, reason, refusal = exc.call, exc.code, exc.reason, exc
            except RpcError as exc:
                code, reason, refusal = exc.code, exc.reason, exc
            except asyncio.CancelledError:
                code, reason = Code.CANCELLED, "cancelled by the client"
                raise
            except Exception as exc:  # noqa: BLE001 - classified below, never leaked
                code, reason = classify(exc)
            finally:
                self._release(call)
                self._decide(call, method, rpc_metrics, code, reason, context, started)
            await _abort(context, code, reason, refusal)

        async def stream_reply(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call, code, reason, started = None, Code.OK, "ok", tracing.clock()
            refusal: RpcError | None = None
            rpc_metrics.start()
            try:
                call = self.admit(method, context, stream)
                request = await self._one_message(call, context, decode)
                self.handler_calls[method] += 1
                async for reply in impl(request, call):
                    yield reply
            except _Refused as exc:
                call, code, reason, refusal = exc.call, exc.code, exc.reason, exc
            except RpcError as exc:
                code, reason, refusal = exc.code, exc.reason, exc
            except (asyncio.CancelledError, GeneratorExit):
                code, reason = Code.CANCELLED, "cancelled by the client"
                raise
            except Exception as exc:  # noqa: BLE001
                code, reason = classify(exc)
            finally:
                self._release(call)
                self._decide(call, method, rpc_metrics, code, reason, context, started)
            if code is not Code.OK:
                await _abort(context, code, reason, refusal)

        return stream_reply if server_stream else unary_reply

    def _decide(self, call: Call | None, method: str, rpc_metrics: metrics.RpcMetrics, code: grpc.StatusCode, reason: str,
                context: Any, started: int) -> None:
        identity = call.identity if call else None
        status = code._name_  # the name, without the enum `name` property (two Python calls)
        self.audit.decision(identity=identity, method=method, status=status, reason=reason,
                            fingerprint=call.fingerprint if call else None, peer=context.peer())
        rpc_metrics.finish(status, (tracing.clock() - started) / 1e9)
        tracing.record(f"rpc {method}", started, process="node", lane="rpc", cat="rpc", method=method,
                       identity=identity, status=status)
        if code in (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED):
            metrics.count_auth_denial(reason)

    def handlers(self, servicer: Any) -> grpc.GenericRpcHandler:
        service = pb.DESCRIPTOR.services_by_name["DeviceService"]
        table: dict[str, grpc.RpcMethodHandler] = {}
        for m in service.methods:
            req = getattr(pb, m.input_type.name)
            rep = getattr(pb, m.output_type.name)
            # a method with no implementation is refused like one with no policy entry
            impl: Callable[..., Any] = getattr(servicer, f"rpc_{m.name}", None) or self._unimplemented
            decode = _BULK_DECODERS.get(m.name, req.FromString)
            encode = None if m.name in _ENCODED_REPLIES else rep.SerializeToString
            handler = self._wrap(m.name, impl, decode, m.client_streaming, m.server_streaming)
            # request-streaming on the server whatever the client sends: the same bytes on the wire,
            # but the handler starts at the headers (see _wrap); messages stay raw bytes until admitted
            make = grpc.stream_stream_rpc_method_handler if m.server_streaming else grpc.stream_unary_rpc_method_handler
            table[m.name] = make(handler, request_deserializer=None, response_serializer=encode)
        return grpc.method_handlers_generic_handler(SERVICE, table)

    async def _unimplemented(self, request: Any, call: Call) -> Any:
        raise RpcError(Code.UNIMPLEMENTED, "method not implemented")

class _Refused(RpcError):
    """A refusal after the caller was identified (the audit record names them)."""

    def __init__(self, call: Call, code: grpc.StatusCode, reason: str, hint: str = "") -> None:
        super().__init__(code, reason, hint)
        self.call = call


def _enrol_hint(identity: str, need: str | None, what: str) -> str:
    """The policy line that admits `identity` (for a method needing role `need`)."""
    role = need or "operator"
    name = identity.rsplit("/", 1)[-1]
    return (f'{identity} {what}; an admin of the node adds `"{identity}" = "{role}"` under [identities] in its '
            f"policy.toml (tinydist certs enrol DIR --name {name} --role {role}); it applies at the next call")


def _revoked_hint(fingerprint: str) -> str:
    return (f"the certificate with sha256 {fingerprint[:16]}… is on the node's deny-list; ask the lab's admin for a "
            "new one (tinydist certs issue)")


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str, refusal: RpcError | None) -> None:
    if refusal is None:
        await context.abort(code, reason)
    await context.abort(code, refusal.details, trailing_metadata=refusal.metadata)


def _decode(decode: Callable[[bytes], Any], raw: bytes, method: str) -> Any:
    try:
        return decode(raw)
    except DecodeError:
        raise RpcError(Code.INVALID_ARGUMENT, f"malformed {method} request: not a valid protobuf message") from None


def classify(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, DeviceFailed):
        return Code.UNAVAILABLE, "device failed"
    if isinstance(exc, TinydistError):
        return Code.FAILED_PRECONDITION, type(exc).__name__
    _log().error("internal error in handler", error=f"{type(exc).__name__}: {exc}")
    return Code.INTERNAL, "internal error"


# Bulk data goes through wire.py: write-stream chunks decode to views of the received message, and
# the read handlers return replies already encoded.
_BULK_DECODERS: dict[str, Callable[[bytes], Any]] = {"WriteStream": wire.decode_write_request}
_ENCODED_REPLIES = frozenset({"Read", "ReadStream"})
