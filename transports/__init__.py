"""Moving bytes between devices that do not share memory: shared memory, TCP, BNXT RDMA, and the
remote device wire protocol (pci_remote). Transports never import the tensor frontend."""
