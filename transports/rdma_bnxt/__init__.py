"""RDMA over Broadcom BNXT (Thor2), with a software NIC model (softbnxt) for machines without one.

Layering (as tinygrad's driver): PciDevice (pci.py) -> HWRM mailbox (hwrm.py) -> RCFW CMDQ/CREQ
(rcfw.py) -> rings/doorbells/PBLs and CQ/QP/MR (device.py); `transport.py` makes tinydist links of
it. See docs/rdma.md.
"""

from tinydist.transports.rdma_bnxt.device import BnxtDevice, Cq, DriverConfig, Mr, Qp
from tinydist.transports.rdma_bnxt.errors import (CompletionError, CQOverflow, FirmwareError, Flushed, LinkDown, ProtocolViolation, QpFatal,
                                         RdmaError, Recovery, RemoteAccessError, RetryExceeded, TeardownError, Timeout)

__all__ = ["BnxtDevice", "CQOverflow", "CompletionError", "Cq", "DriverConfig", "FirmwareError", "Flushed", "LinkDown", "Mr",
           "ProtocolViolation", "QpFatal", "Qp", "RdmaError", "Recovery", "RemoteAccessError", "RetryExceeded", "TeardownError",
           "Timeout"]
