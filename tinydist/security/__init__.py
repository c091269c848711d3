"""Security: who may call a server and where it may listen — the lab CA and credentials (pki),
the caller's identity from its certificate (identity), roles, quotas and revocation (policy), and
the bind-address rules every server applies (bind). Shared by the node service, the cluster
coordinator and the remote back end, so it lives in none of them; imports only base."""
