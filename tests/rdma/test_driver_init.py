"""Driver bring-up and teardown against the model: order, fault matrix at every init step, zero leaks."""

from __future__ import annotations

import time

import pytest

from tests.rdma.helpers import FAST, assert_clean, run
from tinydist.transports.rdma_bnxt import BnxtDevice, FirmwareError, ProtocolViolation, TeardownError, Timeout
from tinydist.transports.rdma_bnxt.pci import SoftPciDevice
from tinydist.transports.rdma_bnxt.softbnxt import FaultPlan, PhysMem, SoftNic

INIT_ORDER = ["pci_reset", "ver_get", "func_reset", "func_qcaps", "func_drv_rgtr", "func_qcfg"] + \
    ["func_backing_store_qcaps_v2", "func_backing_store_cfg_v2"] * 9 + \
    ["ring_alloc", "stat_ctx_alloc", "initialize_fw", "ring_alloc", "ring_alloc", "ring_alloc", "vnic_alloc", "vnic_cfg",
     "cfa_l2_filter_alloc", "add_gid"]


async def _open(plan: FaultPlan | None = None):
    nic = SoftNic("nic0", plan=plan, mem=PhysMem(shuffle=True, seed=3))
    dev = BnxtDevice(SoftPciDevice(nic), FAST)
    return nic, dev


def test_init_order_and_clean_close() -> None:
    async def body():
        nic, _ = await _open()
        dev = await BnxtDevice.create(SoftPciDevice(nic), FAST)
        assert dev.steps == INIT_ORDER
        assert dev.state == "open" and nic.fw_state == "ROCE_READY"
        assert nic.live_objects()["gids"] == 1
        await dev.close()
        await dev.close()                              # idempotent
        assert_clean(nic, dev)
    run(body())


# every HWRM request of the init sequence, by (name, occurrence)
HWRM_STEPS = [("ver_get", 1), ("func_reset", 1), ("func_qcaps", 1), ("func_drv_rgtr", 1), ("func_qcfg", 1),
              ("func_backing_store_qcaps_v2", 1), ("func_backing_store_qcaps_v2", 9), ("func_backing_store_cfg_v2", 1),
              ("func_backing_store_cfg_v2", 9), ("ring_alloc", 1), ("stat_ctx_alloc", 1), ("ring_alloc", 2),
              ("ring_alloc", 3), ("ring_alloc", 4), ("vnic_alloc", 1), ("vnic_cfg", 1), ("cfa_l2_filter_alloc", 1)]
HWRM_FAULTS = {
    "resp_len_huge": (lambda r: r.resp_len(0xffff), ProtocolViolation, "resp_len_out_of_bounds"),
    "resp_len_page+1": (lambda r: r.resp_len(4097), ProtocolViolation, "resp_len_out_of_bounds"),
    "resp_len_tiny": (lambda r: r.resp_len(3), ProtocolViolation, "resp_len_out_of_bounds"),
    "seq_mismatch": (lambda r: r.seq_id(1), ProtocolViolation, "seq_mismatch"),
    "req_type_mismatch": (lambda r: r.req_type(0x77), ProtocolViolation, "req_type_mismatch"),
    "valid_byte_2": (lambda r: r.valid(2), ProtocolViolation, "bad_valid_byte"),
    "valid_never": (lambda r: r.valid(0), Timeout, "HWRM_VALID"),
    "no_answer": (lambda r: r.never(), Timeout, "HWRM"),
    "error_invalid_params": (lambda r: r.error(2), FirmwareError, "INVALID_PARAMS"),
    "error_busy_forever": (lambda r: r.error(0x10), FirmwareError, "BUSY"),
}


@pytest.mark.parametrize("fault", sorted(HWRM_FAULTS))
@pytest.mark.parametrize(("step", "nth"), HWRM_STEPS, ids=[f"{s}#{n}" for s, n in HWRM_STEPS])
def test_hwrm_fault_at_every_init_step(step: str, nth: int, fault: str) -> None:
    arm, cls, detail = HWRM_FAULTS[fault]
    plan = FaultPlan(seed=1)
    arm(plan.hwrm(step, nth=nth, times=10 if fault == "error_busy_forever" else 1))

    async def body():
        nic = SoftNic("nic0", plan=plan, mem=PhysMem(shuffle=True, seed=3))
        t0 = time.monotonic()
        dev_holder = {}

        class Capture(BnxtDevice):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                dev_holder["dev"] = self
        with pytest.raises(cls) as info:
            await Capture.create(SoftPciDevice(nic), FAST)
        elapsed = time.monotonic() - t0
        assert elapsed < 2.0, elapsed                          # bounded: a few request budgets at most
        err = info.value
        assert type(err) is cls
        assert detail in (getattr(err, "what", "") + getattr(err, "phase", "") + getattr(err, "code_name", ""))
        assert err.hint and err.recovery is not None
        assert plan.total_fired() >= 1
        assert_clean(nic, dev_holder["dev"], strict=False)
    run(body())


def test_busy_then_ok_is_retried() -> None:
    plan = FaultPlan()
    plan.hwrm("func_qcfg", times=3).error(0x10)

    async def body():
        nic = SoftNic("nic0", plan=plan)
        dev = await BnxtDevice.create(SoftPciDevice(nic), FAST)
        assert dev.hwrm.stats["busy_retries"] == 3
        await dev.close()
        assert_clean(nic, dev)
    run(body())


RCFW_FAULTS = {"status": (lambda r: r.status(1), FirmwareError), "no_answer": (lambda r: r.never(), Timeout),
               "wrong_cookie": (lambda r: r.cookie(0x7abc), Timeout)}


@pytest.mark.parametrize("fault", sorted(RCFW_FAULTS))
@pytest.mark.parametrize("step", ["initialize_fw", "add_gid"])
def test_rcfw_fault_at_init(step: str, fault: str) -> None:
    arm, cls = RCFW_FAULTS[fault]
    plan = FaultPlan()
    arm(plan.rcfw(step))

    async def body():
        nic = SoftNic("nic0", plan=plan, mem=PhysMem(shuffle=True))
        devs = []

        class Capture(BnxtDevice):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                devs.append(self)
        t0 = time.monotonic()
        with pytest.raises(cls) as info:
            await Capture.create(SoftPciDevice(nic), FAST)
        assert time.monotonic() - t0 < 2.0
        if cls is Timeout:
            assert info.value.phase == "RCFW" and devs[0].rcfw.stalled
        if fault == "wrong_cookie":
            assert devs[0].rcfw.violations == 1
        assert_clean(nic, devs[0], strict=False)
    run(body())


def test_rcfw_stall_after_open_closes_by_reset() -> None:
    """A firmware stall later on: commands fail fast, close() skips RCFW destroys, resets, frees everything."""
    plan = FaultPlan()
    plan.rcfw("create_cq", nth=2).never()

    async def body():
        nic = SoftNic("nic0", plan=plan)
        dev = await BnxtDevice.create(SoftPciDevice(nic), FAST)
        await dev.create_cq()
        with pytest.raises(Timeout):
            await dev.create_cq()
        t0 = time.monotonic()
        with pytest.raises(Timeout) as info:
            await dev.create_cq()
        assert info.value.fast_fail and time.monotonic() - t0 < 0.05
        await dev.close()
        assert nic.live_objects() == {} and nic.mem.live_pages == 0 and dev.ledger.live() == {}
    run(body())


def test_reset_failure_at_close_quarantines_pages() -> None:
    """If the function reset at close fails, pages stay pinned (quarantine) instead of being reused under DMA."""
    plan = FaultPlan()
    plan.hwrm("func_reset", nth=2).never()

    async def body():
        nic = SoftNic("nic0", plan=plan)
        dev = await BnxtDevice.create(SoftPciDevice(nic), FAST)
        with pytest.raises(TeardownError) as info:
            await dev.close()
        assert info.value.quarantined == nic.mem.live_pages > 0
        assert sum(len(e.handle) for e in dev.ledger.quarantined) == nic.mem.live_pages
        assert dev.ledger.live() == {}
    run(body())


def test_tinygrad_style_fini_is_flagged_by_the_model() -> None:
    """Negative control: sending only func_drv_unrgtr (tinygrad's fini) leaves objects the model counts as leaked."""
    async def body():
        nic = SoftNic("nic0")
        dev = await BnxtDevice.create(SoftPciDevice(nic), FAST)
        await dev.create_qp(await dev.create_cq(), await dev.create_cq())
        await dev.hwrm.send("func_drv_unrgtr", flags=0)
        assert nic.counters["leaked_at_unrgtr"] >= 3
        assert nic.mem.live_pages > 0
    run(body())
