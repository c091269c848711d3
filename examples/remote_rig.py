"""Compute on a lab rig's device from another machine, over mutually authenticated gRPC.

On the rig (once; docs/remote.md has the policy format and the roles):

    tinydist certs init ./lab                          # lab CA, server certificate, starter policy
    tinydist certs issue ./lab --name alice            # lab/clients/alice.{pem,key}
    $EDITOR lab/policy.toml                            # [identities] "spiffe://tinydist.lab/user/alice" = "operator"
    tinydist node serve --listen 127.0.0.1:7070 --pki ./lab --devices CPU:0,CPU:1

On the client (which needs lab/ca.pem and alice's certificate and key, never the CA key):

    python examples/remote_rig.py --node 127.0.0.1:7070 --pki ./lab --name alice

The same `td.Tensor` code as on a local device: the tensors live on `remote://HOST:PORT/CPU:0`, the
kernels are compiled here and run on the rig. A two-layer forward pass and its gradient are checked
against numpy; the script exits 1 if they differ.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--node", default="127.0.0.1:7070", help="HOST:PORT of `tinydist node serve`")
    p.add_argument("--device", default="CPU:0", help="the rig's device")
    p.add_argument("--pki", type=Path,
                   help="lab directory: DIR/clients/NAME.pem, .key and DIR/ca.pem (default: TINYDIST_CERT/KEY/CA)")
    p.add_argument("--name", default="alice", help="whose certificate, with --pki")
    p.add_argument("--size", type=int, default=64)
    args = p.parse_args()
    if args.pki is not None:    # the remote device reads the client's credentials from these variables
        os.environ.update(TINYDIST_CERT=str(args.pki / "clients" / f"{args.name}.pem"),
                          TINYDIST_KEY=str(args.pki / "clients" / f"{args.name}.key"),
                          TINYDIST_CA=str(args.pki / "ca.pem"))

    import tinydist as td
    device = f"remote://{args.node}/{args.device}"
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((args.size, 32)).astype(np.float32)
    w1_np = rng.standard_normal((32, 16)).astype(np.float32) / 4
    w2_np = rng.standard_normal((16, 1)).astype(np.float32) / 4

    x = td.Tensor(x_np, device=device)                          # uploaded to the rig
    w1 = td.Tensor(w1_np, device=device, requires_grad=True)
    w2 = td.Tensor(w2_np, device=device, requires_grad=True)
    loss = ((x @ w1).relu() @ w2).square().mean()
    loss.backward()
    print(f"on {x.device}: loss {float(loss.numpy()):.6f}")

    h = np.maximum(x_np.astype(np.float64) @ w1_np, 0)
    y = h @ w2_np
    dy = 2 * y / y.size
    grad_w2 = h.T @ dy
    grad_w1 = x_np.T @ ((dy @ w2_np.T) * (h > 0))
    checks = {"loss": (loss.numpy(), np.mean(y ** 2)), "grad w1": (w1.grad.numpy(), grad_w1),
              "grad w2": (w2.grad.numpy(), grad_w2)}
    ok = True
    for name, (ours, reference) in checks.items():
        same = bool(np.allclose(ours, reference, rtol=1e-4, atol=1e-5))
        ok &= same
        print(f"{name}: max |rig - numpy| = {float(np.max(np.abs(ours - reference))):.2e} {'ok' if same else 'DIFFERS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
