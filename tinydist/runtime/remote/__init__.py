"""The remote back end: a device of this engine whose memory and kernels live on a node
(`remote://HOST:PORT/KIND:N`), spoken to in transports/pci_remote's wire protocol. The registry
imports it by name when the first remote device opens, so the rest of the runtime never loads gRPC."""
