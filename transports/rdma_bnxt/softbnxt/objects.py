"""softbnxt's firmware objects (CQ, MR, QP and a QP's in-flight WQE) and the RC sequence-number arithmetic."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinydist.transports.rdma_bnxt import hsi

PSN_MASK = 0xffffff
BURST = 256                      # MTU packets per wire frame (1 MiB)


def psn_diff(a: int, b: int) -> int:
    """a - b in 24-bit sequence space, signed within a 2^23 half window (rxe psn_compare)."""
    d = (a - b) & PSN_MASK
    return d - (1 << 24) if d >= 1 << 23 else d


@dataclass
class Cq:
    id: int
    handle: int
    size: int
    pages: list[int]
    prod: int = 0
    cons: int = 0
    error: bool = False
    qps: set[int] = field(default_factory=set)


@dataclass
class Mr:
    key: int
    va: int
    size: int
    access: int
    pages: np.ndarray            # paddr per page
    shift: int
    run_end: np.ndarray | None = None   # for page i: one past the last page physically contiguous with it


@dataclass
class Wqe:
    index: int
    first_psn: int
    npkts: int
    frames: list                 # (header-parts list) ready to resend
    signaled: bool


@dataclass
class Qp:
    id: int
    handle: int
    scq: Cq
    rcq: Cq
    sq_pages: list[int]
    rq_pages: list[int]
    sq_size: int
    rq_size: int
    access: int = 0
    state: int = hsi.QPS_RESET
    sq_prod: int = 0             # doorbell producer (full 32-bit count)
    sq_next: int = 0             # next WQE the requester reads
    sq_done: int = 0             # WQEs completed
    rq_prod: int = 0
    rq_cons: int = 0
    sq_psn: int = 0
    epsn: int = 0
    dest_qpn: int = 0
    dgid: bytes = b"\0" * 16
    dest_mac: bytes = b"\0" * 6
    timeout: int = 14
    retry_cnt: int = 7
    rnr_retry: int = 7
    min_rnr_timer: int = 1
    retries_left: int = 7
    rnr_left: int = 7
    outstanding: collections.deque = field(default_factory=collections.deque)
    timer: Any = None
    nak_sent: bool = False
    resp_ctx: Any = None         # (kind, mr|rq_slot, va/offset, remaining)
    scheduled: bool = False
    stats: collections.Counter = field(default_factory=collections.Counter)

