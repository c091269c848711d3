"""The RDMA error taxonomy: every failure of the driver or the NIC ends in one of these classes
(drawn with the rest of the tree in tinydist/base/errors.py). Their fields, each a constructor argument
so that type checkers see it:

    RdmaError           .recovery (what brings the rail back), .hint, .retryable
    Timeout             .phase (HWRM | HWRM_VALID | RCFW | CQ_POLL), .what, .budget_s, .qpn, .note, .fast_fail
    FirmwareError       .channel (HWRM | RCFW), .name, .code, .code_name, .xid
    ProtocolViolation   those, and .what (resp_len_out_of_bounds | seq_mismatch | req_type_mismatch | ...), .detail
    CompletionError     .qpn, .side (REQ | RES), .status, .status_name, .wqe_index; a subclass per status
    CQOverflow          .cq (the CQ of CREQ 0xc1);  QpFatal: .req_reason, .res_reason (CREQ 0xc0)
    TeardownError       .errors (every step failure of close(), raised after all steps were tried), .quarantined

The driver never uses `assert` for a runtime check: each check raises one of these, so the
behaviour is the same under `python -O`.
"""

from __future__ import annotations

import enum

from tinydist.transports.base import TransportError


class Recovery(str, enum.Enum):
    NONE = "none"                  # a bug in our keys/lengths or a caller mistake: fix the caller, retrying will fail again
    RETRY = "retry"                # transient: the same call may succeed (the driver already retried where it is safe)
    RESET_QP = "reset_qp"          # recreate the QP and its CQs, exchange QPN/PSN with the peer, resend
    RESET_DEVICE = "reset_device"  # firmware unresponsive or corrupt: close (reset path) and reopen the device
    RESTAGE = "restage"            # the rail is unusable: move this transfer to another route (TCP / host staging)


HINTS = {
    Recovery.NONE: "not retryable: the request itself is wrong (key, length, state); fix the caller",
    Recovery.RETRY: "transient: retry the operation",
    Recovery.RESET_QP: "recreate the queue pair (new QPN/PSN exchanged with the peer) and resend",
    Recovery.RESET_DEVICE: "close the device (reset path) and reopen it",
    Recovery.RESTAGE: "route the transfer another way (TCP fallback) and mark the rail degraded",
}


class RdmaError(TransportError):
    """A failure of the RDMA driver or NIC; `recovery` says what brings the rail back."""

    recovery: Recovery = Recovery.NONE

    def __init__(self, message: str, *, recovery: Recovery | None = None) -> None:
        if recovery is not None:
            self.recovery = recovery
        super().__init__(f"{message} [recovery: {self.recovery.value}]")

    @property
    def hint(self) -> str:
        return HINTS[self.recovery]

    @property
    def retryable(self) -> bool:
        return self.recovery is not Recovery.NONE


class Timeout(RdmaError):
    """Firmware or a completion did not answer within its budget. `phase` says which wait; `note`
    what was seen; `fast_fail` that the command was refused at once, the firmware having stalled."""

    def __init__(self, phase: str, what: str, budget_s: float, *, qpn: int = -1, note: str = "",
                 fast_fail: bool = False) -> None:
        self.phase, self.what, self.budget_s = phase, what, budget_s
        self.qpn, self.note, self.fast_fail = qpn, note, fast_fail
        rec = Recovery.RESET_DEVICE if phase in ("HWRM", "HWRM_VALID", "RCFW") else Recovery.RESET_QP
        super().__init__(f"timeout in {phase}: {what} gave no answer within {budget_s:.3g} s"
                         + (f" ({note})" if note else ""), recovery=rec)


HWRM_CODES = {0: "SUCCESS", 1: "FAIL", 2: "INVALID_PARAMS", 3: "RESOURCE_ACCESS_DENIED", 4: "RESOURCE_ALLOC_ERROR",
              5: "INVALID_FLAGS", 6: "INVALID_ENABLES", 7: "UNSUPPORTED_TLV", 8: "NO_BUFFER", 9: "UNSUPPORTED_OPTION_ERR",
              0xa: "HOT_RESET_PROGRESS", 0xb: "HOT_RESET_FAIL", 0xc: "NO_FLOW_COUNTER_DURING_ALLOC", 0xd: "KEY_HASH_COLLISION",
              0xe: "KEY_ALREADY_EXISTS", 0xf: "HWRM_ERROR", 0x10: "BUSY", 0x11: "RESOURCE_LOCKED", 0x12: "PF_UNAVAILABLE",
              0x13: "ENTITY_NOT_PRESENT", 0x8000: "TLV_ENCAPSULATED_RESPONSE", 0xfffe: "UNKNOWN_ERR", 0xffff: "CMD_NOT_SUPPORTED"}


class FirmwareError(RdmaError):
    """Firmware answered with a non-zero code (HWRM error_code, or RCFW CREQ status; `xid` the RCFW
    command's transaction id)."""

    def __init__(self, channel: str, name: str, code: int, *, xid: int | None = None) -> None:
        code_name = HWRM_CODES.get(code, f"0x{code:x}") if channel == "HWRM" else f"status 0x{code:x}"
        rec = (Recovery.RETRY if code in (0x10, 0x11) else
               Recovery.RESET_DEVICE if code in (0xa, 0xb, 0xf, 0x12) else Recovery.NONE)
        self.channel, self.name, self.code, self.code_name, self.xid = channel, name, code, code_name, xid
        super().__init__(f"{channel} {name} failed: {code_name}", recovery=rec)


class ProtocolViolation(FirmwareError):
    """Firmware (or the bus) produced something the protocol forbids. Never retried; the device is suspect."""

    def __init__(self, channel: str, name: str, what: str, detail: str = "") -> None:
        self.channel, self.name, self.code, self.code_name, self.xid = channel, name, -1, "PROTOCOL_VIOLATION", None
        self.what, self.detail = what, detail
        RdmaError.__init__(self, f"{channel} {name}: protocol violation {what}{': ' + detail if detail else ''}",
                           recovery=Recovery.RESET_DEVICE)


class CompletionError(RdmaError):
    """A work request completed with an error status (or the QP/CQ/port failed under it)."""

    def __init__(self, message: str, *, qpn: int = -1, side: str = "REQ", status: int = -1, status_name: str = "",
                 wqe_index: int = -1, recovery: Recovery | None = None) -> None:
        self.qpn, self.side, self.status, self.status_name, self.wqe_index = qpn, side, status, status_name, wqe_index
        super().__init__(f"QP {qpn} {side}: {message}", recovery=recovery)


class BadResponse(CompletionError): recovery = Recovery.RESET_QP
class LocalLengthError(CompletionError): recovery = Recovery.NONE
class LocalQpOperation(CompletionError): recovery = Recovery.NONE
class LocalProtectionError(CompletionError): recovery = Recovery.NONE
class MemoryOperationError(CompletionError): recovery = Recovery.NONE
class RemoteInvalidRequest(CompletionError): recovery = Recovery.NONE
class RemoteAccessError(CompletionError): recovery = Recovery.NONE
class RemoteOperationError(CompletionError): recovery = Recovery.RESET_QP
class RnrRetryExceeded(CompletionError): recovery = Recovery.RESET_QP
class RetryExceeded(CompletionError): recovery = Recovery.RESET_QP
class Flushed(CompletionError): recovery = Recovery.RESET_QP     # secondary: the QP already failed
class LinkDown(CompletionError): recovery = Recovery.RESTAGE


class CQOverflow(CompletionError):
    """CREQ CQ_ERROR_NOTIFICATION: completion queue `cq` overflowed, so completions were lost."""

    recovery = Recovery.RESET_QP

    def __init__(self, qpn: int, cq: int) -> None:
        self.cq = cq
        super().__init__(f"CQ {cq} overflowed (CQ_ERROR_NOTIFICATION); completions were lost", qpn=qpn)


class QpFatal(CompletionError):
    """CREQ QP_ERROR_NOTIFICATION: firmware moved the QP to ERR, for the reasons it gives."""

    recovery = Recovery.RESET_QP

    def __init__(self, qpn: int, req_reason: int, res_reason: int) -> None:
        self.req_reason, self.res_reason = req_reason, res_reason
        super().__init__(f"firmware moved the QP to ERR (req reason 0x{req_reason:x}, res reason 0x{res_reason:x})",
                         qpn=qpn)


class CqeProtocolViolation(CompletionError):
    """A CQE that breaks the protocol (wrong type, handle or slot): the device is suspect."""

    recovery = ProtocolViolation.recovery


REQ_STATUS: dict[int, tuple[str, type[CompletionError]]] = {
    1: ("BAD_RESP", BadResponse), 2: ("LOC_LEN", LocalLengthError), 3: ("LOC_QP_OP", LocalQpOperation),
    4: ("PROT", LocalProtectionError), 5: ("MEM_OP", MemoryOperationError), 6: ("REM_INVAL", RemoteInvalidRequest),
    7: ("REM_ACC", RemoteAccessError), 8: ("REM_OP", RemoteOperationError), 9: ("RNR_NAK_XCED", RnrRetryExceeded),
    0xa: ("TRNSP_XCED", RetryExceeded), 0xb: ("WR_FLUSH", Flushed)}
RES_STATUS: dict[int, tuple[str, type[CompletionError]]] = {
    1: ("LOC_ACC", LocalProtectionError), 2: ("LOC_LEN", LocalLengthError), 3: ("LOC_PROT", LocalProtectionError),
    4: ("LOC_QP_OP", LocalQpOperation), 5: ("MEM_OP", MemoryOperationError), 6: ("REM_INVAL", RemoteInvalidRequest),
    7: ("WR_FLUSH", Flushed), 8: ("HW_FLUSH", Flushed)}


def completion_error(side: str, status: int, qpn: int, wqe_index: int = -1) -> CompletionError:
    """The classified error for a CQE status (REQ or RES side); unknown statuses become BadResponse."""
    name, cls = (REQ_STATUS if side == "REQ" else RES_STATUS).get(status, (f"UNKNOWN_0x{status:x}", BadResponse))
    return cls(f"completion status {name} (0x{status:x}) on WQE {wqe_index}", qpn=qpn, side=side, status=status,
               status_name=name, wqe_index=wqe_index)


class TeardownError(RdmaError):
    """close() tried every step; these failed. `errors` lists them; `quarantined` counts pinned pages kept."""

    def __init__(self, errors: list[BaseException], quarantined: int = 0) -> None:
        self.errors, self.quarantined = errors, quarantined
        super().__init__(f"{len(errors)} teardown step(s) failed: " + "; ".join(f"{type(e).__name__}: {e}" for e in errors[:4]),
                         recovery=Recovery.RESET_DEVICE)


class NicUnavailable(RdmaError):
    """No usable NIC here (none present, not bound, or disabled); the factory falls back to TCP."""
    recovery = Recovery.RESTAGE
