"""The remote back end: a device of this engine whose memory and kernels live on a node
(`remote://HOST:PORT/KIND:N`), spoken to in transports/pci_remote's wire protocol, and the public
client `td.remote`: `connect(target, cert=, key=, ca=)` → `Node`. The registry imports it by name when
the first remote device opens, and `td.remote` on first use, so the rest of the runtime never loads gRPC."""

from tinydist.runtime.remote.client import Node, NodeStatus, connect
from tinydist.runtime.remote.errors import (STATUS_ERRORS, AccessDenied, CallTimeout, InvalidRequest, NotOnNode,
                                            QuotaExceeded, RemoteCallFailed)

__all__ = ["STATUS_ERRORS", "AccessDenied", "CallTimeout", "InvalidRequest", "Node", "NodeStatus", "NotOnNode",
           "QuotaExceeded", "RemoteCallFailed", "connect"]
