"""Nodes: the node daemon (daemon) and the remote device service it hosts — the server's life
cycle (server), the admission gate and the handlers (service), leases and handles (leases), the
audit trail (audit), the verifier of client IR (verifier) and a simulated PCI function (pci_sim).
It speaks transports/pci_remote's wire protocol; who may call is tinydist.security's business."""
