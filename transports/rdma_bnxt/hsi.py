"""Hand-written little-endian layouts of the BNXT structures the driver and the model use.

Written from field names, offsets and sizes (../shared/design/rdma_bnxt_protocol.md); no header text
is vendored. A `Layout` packs keyword fields into bytes and unpacks a buffer that may be *shorter*
than the layout (the missing tail reads as zero and is reported), never longer than it is given.
"""

from __future__ import annotations

import struct
from typing import Any

PAGE = 4096
MTU = 4096


class Layout:
    def __init__(self, name: str, size: int, fields: dict[str, tuple[int, str]]) -> None:
        self.name, self.size = name, size
        self.fields = {k: (off, struct.Struct("<" + fmt)) for k, (off, fmt) in fields.items()}
        for k, (off, st) in self.fields.items():
            if off + st.size > size:
                raise ValueError(f"{name}.{k} ends at {off + st.size}, past the size {size}")

    def pack(self, base: bytes | None = None, **values: Any) -> bytearray:
        buf = bytearray(self.size) if base is None else bytearray(base.ljust(self.size, b"\0"))
        for k, v in values.items():
            off, st = self.fields[k]
            st.pack_into(buf, off, *(v if isinstance(v, tuple) else (v,)))
        return buf

    def unpack(self, data: bytes | bytearray | memoryview) -> dict[str, Any]:
        """Fields from `data` (zero-extended to the layout's size); `_short` lists fields past its end."""
        raw = bytes(data[:self.size])
        short = [k for k, (off, st) in self.fields.items() if off + st.size > len(raw)]
        raw = raw.ljust(self.size, b"\0")
        out: dict[str, Any] = {}
        for k, (off, st) in self.fields.items():
            vals = st.unpack_from(raw, off)
            out[k] = vals[0] if len(vals) == 1 else vals
        out["_short"] = short
        return out


def _hwrm(name: str, size: int, **fields: tuple[int, str]) -> Layout:
    return Layout(name, size, fields)


# ---- HWRM ---------------------------------------------------------------------------------------
HWRM_MAX_REQ_LEN = 128
HWRM_REQ_OFF, HWRM_TRIGGER_OFF = 0x000, 0x100
REQ_HDR = struct.Struct("<HHHHQ")       # req_type, cmpl_ring, seq_id, target_id, resp_addr
RESP_HDR = struct.Struct("<HHHH")       # error_code, req_type, seq_id, resp_len
HWRM_RESP_VALID_KEY = 1

HWRM = {  # name: (req_type, request layout (fields after the 16-byte header), response layout (valid = last byte))
    "ver_get": (0x00, _hwrm("ver_get_in", 24, hwrm_intf_maj=(16, "B"), hwrm_intf_min=(17, "B")),
                _hwrm("ver_get_out", 176, fw_maj=(18, "H"), fw_min=(20, "H"), max_req_win_len=(116, "H"),
                      max_resp_len=(120, "H"), def_req_timeout=(122, "H"), max_req_timeout=(170, "H"))),
    "func_reset": (0x11, _hwrm("func_reset_in", 24, enables=(16, "I")), _hwrm("func_reset_out", 16)),
    "func_qcaps": (0x15, _hwrm("func_qcaps_in", 24, fid=(16, "H")),
                   _hwrm("func_qcaps_out", 96, fid=(8, "H"), port_id=(10, "H"), mac_address=(16, "6s"))),
    "func_qcfg": (0x16, _hwrm("func_qcfg_in", 24, fid=(16, "H")),
                  _hwrm("func_qcfg_out", 112, fid=(8, "H"), port_id=(10, "H"), legacy_l2_db_size_kb=(84, "H"))),
    "func_drv_rgtr": (0x1d, _hwrm("func_drv_rgtr_in", 32, flags=(16, "I"), enables=(20, "I"), os_type=(24, "H")),
                      _hwrm("func_drv_rgtr_out", 16)),
    "func_drv_unrgtr": (0x1a, _hwrm("func_drv_unrgtr_in", 24, flags=(16, "I")), _hwrm("func_drv_unrgtr_out", 16)),
    "port_phy_qcfg": (0x27, _hwrm("port_phy_qcfg_in", 24, port_id=(16, "H")),
                      _hwrm("port_phy_qcfg_out", 32, link=(8, "B"), link_speed=(10, "H"))),
    "vnic_alloc": (0x40, _hwrm("vnic_alloc_in", 24, flags=(16, "I")), _hwrm("vnic_alloc_out", 16, vnic_id=(8, "I"))),
    "vnic_free": (0x41, _hwrm("vnic_free_in", 24, vnic_id=(16, "I")), _hwrm("vnic_free_out", 16)),
    "vnic_cfg": (0x42, _hwrm("vnic_cfg_in", 40, flags=(16, "I"), enables=(20, "I"), vnic_id=(24, "H"),
                             dflt_rx_ring_id=(26, "H"), dflt_cmpl_ring_id=(28, "H"), mru=(30, "H")),
                 _hwrm("vnic_cfg_out", 16)),
    "ring_alloc": (0x50, _hwrm("ring_alloc_in", 80, enables=(16, "I"), ring_type=(20, "B"), int_mode=(21, "B"),
                               page_tbl_addr=(24, "Q"), page_size=(36, "B"), page_tbl_depth=(37, "B"), length=(40, "I"),
                               logical_id=(44, "H"), cmpl_ring_id=(46, "H"), stat_ctx_id=(48, "I"), rx_buf_size=(52, "H")),
                   _hwrm("ring_alloc_out", 16, ring_id=(8, "H"), logical_ring_id=(10, "H"))),
    "ring_free": (0x51, _hwrm("ring_free_in", 24, ring_type=(16, "B"), ring_id=(18, "H")), _hwrm("ring_free_out", 16)),
    "cfa_l2_filter_alloc": (0x90, _hwrm("cfa_l2_filter_alloc_in", 48, flags=(16, "I"), enables=(20, "I"),
                                        l2_addr=(24, "6s"), l2_addr_mask=(32, "6s"), dst_id=(40, "H")),
                            _hwrm("cfa_l2_filter_alloc_out", 24, l2_filter_id=(8, "Q"))),
    "cfa_l2_filter_free": (0x91, _hwrm("cfa_l2_filter_free_in", 24, l2_filter_id=(16, "Q")), _hwrm("cfa_l2_filter_free_out", 16)),
    "stat_ctx_alloc": (0xb0, _hwrm("stat_ctx_alloc_in", 32, stats_dma_addr=(16, "Q"), update_period_ms=(24, "I"),
                                   stats_dma_length=(28, "H")),
                       _hwrm("stat_ctx_alloc_out", 16, stat_ctx_id=(8, "I"))),
    "stat_ctx_free": (0xb1, _hwrm("stat_ctx_free_in", 24, stat_ctx_id=(16, "I")), _hwrm("stat_ctx_free_out", 16)),
    "func_backing_store_cfg_v2": (0x1a3, _hwrm("bs_cfg_v2_in", 48, type=(16, "H"), instance=(18, "H"), flags=(20, "I"),
                                               page_dir=(24, "Q"), num_entries=(32, "I"), entry_size=(36, "H"),
                                               page_size_pbl_level=(38, "B")),
                                  _hwrm("bs_cfg_v2_out", 16)),
    "func_backing_store_qcaps_v2": (0x1a8, _hwrm("bs_qcaps_v2_in", 24, type=(16, "H")),
                                    _hwrm("bs_qcaps_v2_out", 56, type=(8, "H"), flags=(10, "H"), entry_size=(12, "H"),
                                          instance_bit_map=(16, "I"), ctx_init_value=(20, "B"), ctx_init_offset=(21, "B"),
                                          min_num_entries=(24, "I"), max_num_entries=(28, "I"), split_entry_0=(32, "I"),
                                          split_entry_1=(36, "I"), split_entry_2=(40, "I"), split_entry_3=(44, "I"))),
}
HWRM_BY_TYPE = {v[0]: k for k, v in HWRM.items()}
RING_NQ, RING_L2_CMPL, RING_RX = 5, 0, 2
BS_ALL_DONE = 1
BS_TYPES = ((0, 64), (1, 0), (2, 128), (3, 0), (4, 2), (5, 0), (6, 0), (0xe, 1024), (0xf, 0))  # (type, extra entries)

# ---- RCFW: CMDQ (16-byte slots) and CREQ ---------------------------------------------------------
CMDQ_INIT_OFF, CMDQ_PROD_OFF, RCFW_TRIGGER_OFF = 0x600, 0x60c, 0x700
CMDQ_INIT = struct.Struct("<QHHI")     # cmdq_pbl, size_lvl, creq_ring_id, prod_idx
FIRMWARE_FIRST_FLAG = 1 << 31
CMDQ_ENTRIES = CREQ_ENTRIES = 256
CMDQ_BASE = struct.Struct("<BBHHBxQ")  # opcode, cmd_size (16-B units), flags, cookie, resp_size, resp_addr
CREQ = struct.Struct("<BBHIBBBBHH")    # type, status, cookie, xid, v, event, req_err, res_err, sq_cons, rq_cons
CREQ_QP_EVENT, CREQ_FUNC_EVENT = 0x38, 0x3a
EV_QP_ERROR, EV_CQ_ERROR = 0xc0, 0xc1


def _cmd(name: str, size: int, **fields: tuple[int, str]) -> Layout:
    return Layout(name, size, fields)


RCFW = {  # name: (opcode, layout incl. the 16-byte cmdq_base)
    "create_qp": (0x01, _cmd("create_qp", 80, qp_handle=(16, "Q"), qp_flags=(24, "I"), type=(28, "B"), access=(31, "B"),
                             sq_size=(32, "I"), rq_size=(36, "I"), sq_fwo_sq_sge=(40, "H"), rq_fwo_rq_sge=(42, "H"),
                             scq_cid=(44, "I"), rcq_cid=(48, "I"), pd_id=(52, "I"), sq_pbl=(56, "Q"), rq_pbl=(64, "Q"),
                             sq_pg_size_lvl=(72, "B"), rq_pg_size_lvl=(73, "B"))),
    "destroy_qp": (0x02, _cmd("destroy_qp", 32, qp_cid=(16, "I"))),
    "modify_qp": (0x03, _cmd("modify_qp", 96, modify_mask=(16, "I"), qp_cid=(20, "I"), state=(24, "B"), access=(25, "B"),
                             pkey=(26, "H"), dgid=(32, "16s"), sgid_index=(52, "H"), hop_limit=(54, "B"), dest_mac=(56, "6s"),
                             path_mtu=(62, "B"), timeout=(63, "B"), retry_cnt=(64, "B"), rnr_retry=(65, "B"),
                             min_rnr_timer=(66, "B"), rq_psn=(68, "I"), sq_psn=(72, "I"), max_rd_atomic=(76, "B"),
                             max_dest_rd_atomic=(77, "B"), dest_qp_id=(80, "I"))),
    "create_cq": (0x09, _cmd("create_cq", 48, cq_handle=(16, "Q"), cq_size=(24, "I"), cq_fco_cnq_id=(28, "I"),
                             pg_size_lvl=(32, "B"), pbl=(40, "Q"))),
    "destroy_cq": (0x0a, _cmd("destroy_cq", 32, cq_cid=(16, "I"))),
    "register_mr": (0x0f, _cmd("register_mr", 48, log2_pg_size_lvl=(16, "B"), access=(17, "B"), key=(20, "I"), pbl=(24, "Q"),
                               va=(32, "Q"), mr_size=(40, "Q"))),
    "deregister_mr": (0x10, _cmd("deregister_mr", 32, lkey=(16, "I"))),
    "add_gid": (0x11, _cmd("add_gid", 48, gid=(16, "16s"), src_mac=(32, "6s"), vlan=(38, "H"))),
    "delete_gid": (0x12, _cmd("delete_gid", 32, gid_index=(16, "H"))),
    "initialize_fw": (0x80, _cmd("initialize_fw", 32, stat_ctx_id=(16, "I"), flags=(20, "I"))),
    "deinitialize_fw": (0x81, _cmd("deinitialize_fw", 16)),
    "query_version": (0x8b, _cmd("query_version", 16)),
}
RCFW_BY_OPCODE = {v[0]: k for k, v in RCFW.items()}

# QP states, modify masks, access flags
QPS_RESET, QPS_INIT, QPS_RTR, QPS_RTS, QPS_ERR = 0, 1, 2, 3, 6
M_STATE, M_ACCESS, M_PKEY, M_DGID, M_SGID_INDEX, M_HOP_LIMIT = 0x1, 0x4, 0x8, 0x20, 0x80, 0x100
M_DEST_MAC, M_PATH_MTU, M_TIMEOUT, M_RETRY_CNT, M_RNR_RETRY = 0x400, 0x1000, 0x2000, 0x4000, 0x8000
M_RQ_PSN, M_MAX_RD_ATOMIC, M_MIN_RNR_TIMER, M_SQ_PSN, M_MAX_DEST_RD_ATOMIC, M_DEST_QP_ID = 0x10000, 0x20000, 0x40000, 0x80000, 0x100000, 1 << 26
MASK_INIT = M_STATE | M_ACCESS | M_PKEY                                                                     # 0xd
MASK_RTR = (M_STATE | M_ACCESS | M_PKEY | M_DGID | M_SGID_INDEX | M_HOP_LIMIT | M_DEST_MAC | M_PATH_MTU | M_RQ_PSN
            | M_MIN_RNR_TIMER | M_MAX_DEST_RD_ATOMIC | M_DEST_QP_ID)                                       # 0x41515ad
MASK_RTS = M_STATE | M_ACCESS | M_TIMEOUT | M_RETRY_CNT | M_RNR_RETRY | M_MAX_RD_ATOMIC | M_SQ_PSN          # 0xae005
# the bits each transition must carry (the model enforces these; tinygrad's masks satisfy them)
REQUIRED = {QPS_INIT: M_STATE | M_ACCESS | M_PKEY,
            QPS_RTR: M_STATE | M_DGID | M_DEST_MAC | M_PATH_MTU | M_DEST_QP_ID | M_RQ_PSN | M_MIN_RNR_TIMER | M_MAX_DEST_RD_ATOMIC,
            QPS_RTS: M_STATE | M_TIMEOUT | M_RETRY_CNT | M_RNR_RETRY | M_SQ_PSN | M_MAX_RD_ATOMIC}
ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, ACCESS_REMOTE_READ = 1, 2, 4
PATH_MTU_4096 = 4 << 4

# ---- rings, doorbells, WQEs, CQEs ---------------------------------------------------------------
DB_SQ, DB_RQ, DB_SRQ, DB_CQ, DB_CQ_ARMSE, DB_CQ_ARMALL, DB_NQ, DB_NQ_ARM = 0, 1, 2, 4, 5, 6, 0xa, 0xb
DB_VALID = 1 << 26


def db_value(xid: int, db_type: int, index: int, epoch: int) -> int:
    hi = (xid & 0xfffff) | DB_VALID | (db_type << 28)
    return (hi << 32) | (index & 0xffffff) | ((epoch & 1) << 24)


def db_decode(value: int) -> tuple[int, int, int, int, bool, int]:
    """(xid, type, index, epoch, valid, path) of a 64-bit doorbell."""
    hi, lo = value >> 32, value & 0xffffffff
    return hi & 0xfffff, (hi >> 28) & 0xf, lo & 0xffffff, (lo >> 24) & 1, bool(hi & DB_VALID), (hi >> 24) & 3


SQ_WQE = struct.Struct("<BBBxIIxxxxQIxxxxQII")   # type, flags, wqe_size, imm, length, remote_va, remote_key, sge va/lkey/size
RQ_WQE = struct.Struct("<BBB29xQII")              # type 0x80, flags, wqe_size, sge va/lkey/size
WQE_SEND, WQE_WRITE, WQE_WRITE_IMM, WQE_READ, WQE_RECV = 0x00, 0x04, 0x05, 0x06, 0x80
WQE_SIGNAL = 0x01
WQE_STRIDE, CQE_STRIDE, MSN_STRIDE = 128, 32, 8
CQE_REQ = struct.Struct("<QH")      # qp_handle, sq_cons_idx  (byte 24 type|toggle, byte 25 status)
CQE_RES = struct.Struct("<IIQQ")    # length, imm, qp_handle, mr_handle
CQE_TYPE_REQ, CQE_TYPE_RES_RC, CQE_TYPE_TERM, CQE_TYPE_CUT_OFF = 0, 1, 0xe, 0xf


def msn_entry(slot: int, start_psn: int, next_psn: int) -> int:
    return (slot << 48) | ((next_psn & 0xffffff) << 24) | (start_psn & 0xffffff)


def packets(length: int) -> int:
    return max(1, -(-length // MTU))
