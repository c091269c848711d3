"""softbnxt: the software BNXT NIC (firmware, rings, RC data path, fault plan) used where no NIC exists."""

from tinydist.transports.rdma_bnxt.softbnxt.faults import FaultPlan
from tinydist.transports.rdma_bnxt.softbnxt.nic import SoftNic
from tinydist.transports.rdma_bnxt.softbnxt.physmem import DmaFault, PhysMem

__all__ = ["DmaFault", "FaultPlan", "PhysMem", "SoftNic"]
