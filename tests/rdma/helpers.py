"""Shared set-up for the RDMA tests: two modelled NICs joined by a loopback wire, and leak checks."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from tinydist.transports.rdma_bnxt import BnxtDevice, DriverConfig
from tinydist.transports.rdma_bnxt.device import Mr, Qp
from tinydist.transports.rdma_bnxt.pci import SoftPciDevice
from tinydist.transports.rdma_bnxt.softbnxt import FaultPlan, PhysMem, SoftNic

FAST = DriverConfig(hwrm_timeout=0.1, hwrm_reset_timeout=0.1, rcfw_timeout=0.1, qp_timeout=8, retry_cnt=3, rnr_retry=3,
                    drain_timeout=0.1, cq_entries=64, sq_entries=64, rq_entries=64)


def run(coro, timeout: float = 30.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def assert_clean(nic: SoftNic, dev: BnxtDevice, strict: bool = True) -> None:
    """Nothing left: the driver's ledger is empty and the model agrees (no firmware objects, no pages, no faults)."""
    assert dev.ledger.live() == {}, dev.ledger.live()
    assert nic.live_objects() == {}, nic.live_objects()
    assert nic.mem.live_pages == 0, nic.mem.live_pages
    assert nic.faults == [], nic.faults
    assert nic.counters["leaked_at_unrgtr"] == 0, nic.counters
    if strict:   # only a lost answer (the driver never learned the id) may leave an object to the final func_reset
        assert nic.counters["freed_by_reset"] == 0, nic.counters
    created, released = dev.ledger.created, dev.ledger.released
    assert created == released, (created, released)


@dataclasses.dataclass
class Side:
    nic: SoftNic
    dev: BnxtDevice
    qp: Qp
    mr: Mr


async def open_nic(name: str, plan: FaultPlan | None = None, cfg: DriverConfig = FAST, seed: int = 0,
                   **nic_kw) -> tuple[SoftNic, tuple]:
    nic = SoftNic(name, plan=plan, mem=PhysMem(shuffle=True, seed=seed), **nic_kw)
    address = await nic.start()
    return nic, address


async def open_pair(plan_a: FaultPlan | None = None, plan_b: FaultPlan | None = None, cfg: DriverConfig = FAST,
                    mr_bytes: int = 1 << 20, access_b: int | None = None, rq_b: int | None = None,
                    rcq_b: int | None = None, **nic_kw) -> tuple[Side, Side]:
    na, aa = await open_nic("nicA", plan_a, cfg, 1, **nic_kw)
    nb, ab = await open_nic("nicB", plan_b, cfg, 2, **nic_kw)
    da = await BnxtDevice.create(SoftPciDevice(na), cfg)
    db = await BnxtDevice.create(SoftPciDevice(nb), cfg)
    await na.wire.dial(db.gid, ab)
    await nb.wire.dial(da.gid, aa)
    qa = await da.create_qp(await da.create_cq(), await da.create_cq())
    kw = {} if access_b is None else {"access": access_b}
    qb = await db.create_qp(await db.create_cq(), await db.create_cq(rcq_b), rq_entries=rq_b, **kw)
    await qa.connect(qb.qpn, db.gid, db.mac, rq_psn=0x100, sq_psn=0xfffff0)
    await qb.connect(qa.qpn, da.gid, da.mac, rq_psn=0xfffff0, sq_psn=0x100)
    ma, mb = await da.register_mr(mr_bytes), await db.register_mr(mr_bytes)
    return Side(na, da, qa, ma), Side(nb, db, qb, mb)


async def close_pair(a: Side, b: Side) -> None:
    for s in (a, b):
        await s.dev.close()
        await s.nic.stop()


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0
