"""Moving bytes between devices that do not share memory: shared memory, TCP, BNXT RDMA, and the
authenticated remote device service. Transports never import the tensor frontend."""
