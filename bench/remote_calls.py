"""Per-call work of the node's Ping, counted: the load-proof companion of bench/remote.py's latency row.

    .venv/bin/python bench/remote_calls.py [--calls 1000] [--repeats 5] [--json PATH] [--top 0]
    PYTHONPATH=/path/to/other/checkout .venv/bin/python bench/remote_calls.py

On this shared 2-vCPU machine bench/remote.py's Ping ratio moves by more than the gate costs between
two runs, so this counts instead. The same two servers as bench/remote.py (the node's service and a
plain grpc.aio server with the same mutual TLS, in one event-loop thread) answer the same Ping, and
on the server's loop thread this counts, per Ping:

- Python and C function calls (sys.setprofile) while the method's handler runs: the gate
  (`nodes/gate.py`'s handler: admission, the request read, the Ping, the audit record, metrics) next
  to the plain server's handler. Deterministic: two runs agree to a tenth of a call;
- the same for the whole thread, the event loop and grpc's Python side included (varies by a few
  calls with how the loop's wake-ups fall);
- the loop thread's CPU time per Ping (`time.thread_time`, medians of alternating repeats): what
  the Python counts miss (grpc's Cython, TLS, the audit's write), less load-proof than the counts.

The tinydist that runs is the one on PYTHONPATH, so one copy of this script counts any revision.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# after PYTHONPATH's entries, so that a checkout named there is the tinydist counted
sys.path.append(str(Path(__file__).resolve().parent.parent))

from tinydist.nodes.server import RemoteServer  # noqa: E402
from tinydist.runtime.remote.client import secure_channel  # noqa: E402
from tinydist.transports.pci_remote._generated import device_pb2 as pb  # noqa: E402
from tinydist.transports.pci_remote._generated import device_pb2_grpc as pb_grpc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from remote import Loop, bench_node_pki, start_plain  # noqa: E402  (imported last: it puts this checkout first on sys.path)

# the handler each server runs for a Ping: bench/remote.py's plain unary, the gate's wrapper
HANDLERS = {"plain": "unary", "node": "unary_reply"}


def _key(code: Any) -> str:
    """`folder/module.py:function`, the same for every checkout."""
    name = re.sub(r"^.*?/(tinydist|nodes|transports|bench)/", r"\1/", code.co_filename)
    name = re.sub(r"^.*/(site-packages|lib/python3\.\d+)/", "lib/", name)
    return f"{name}:{code.co_name}"


def count(loop: Loop, fn: Callable[[], Any], handler: str, calls: int) -> dict[str, collections.Counter[str]]:
    """Calls on the loop thread during `calls` Pings: inside the handler's frame and in all."""
    inside: collections.Counter[str] = collections.Counter()
    everywhere: collections.Counter[str] = collections.Counter()
    depth = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            key = _key(frame.f_code)
            if frame.f_code.co_name == handler:
                depth[0] += 1  # the handler's coroutine starts or resumes
            elif depth[0]:
                inside[key] += 1
            everywhere[key] += 1
        elif event == "return":
            if frame.f_code.co_name == handler:
                depth[0] -= 1  # the handler awaits or ends
        elif event == "c_call":
            key = f"C:{getattr(arg, '__qualname__', arg)}"
            if depth[0]:
                inside[key] += 1
            everywhere[key] += 1

    started = threading.Event()
    loop.loop.call_soon_threadsafe(lambda: (sys.setprofile(profile), started.set()))
    started.wait()
    for _ in range(calls):
        fn()
    stopped = threading.Event()
    loop.loop.call_soon_threadsafe(lambda: (sys.setprofile(None), stopped.set()))
    stopped.wait()
    return {"handler": inside, "thread": everywhere}


def totals(counts: collections.Counter[str], calls: int) -> tuple[float, float]:
    python = sum(v for k, v in counts.items() if not k.startswith("C:"))
    return python / calls, (sum(counts.values()) - python) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="counted Pings per server (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="CPU-time repeats per server (default 5)")
    parser.add_argument("--json", type=Path, help="write the counts by function here")
    parser.add_argument("--top", type=int, default=0, help="print the node handler's N most frequent calls")
    args = parser.parse_args()
    print(f"counting {Path(sys.modules['tinydist'].__file__ or '').parent.parent}")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        creds, server_pki, config, audit = bench_node_pki(root)
        loop = Loop()
        node = loop.run(RemoteServer.start(config, server_pki, root / "policy.toml", audit))
        plain, plain_port = loop.run(start_plain(server_pki, config, []))
        try:
            plain_channel = secure_channel(f"127.0.0.1:{plain_port}", creds)
            node_channel = secure_channel(f"127.0.0.1:{node.port}", creds)
            echo = plain_channel.unary_unary("/bench.Echo/Unary", pb.PingRequest.SerializeToString, pb.PingReply.FromString)
            stub = pb_grpc.DeviceServiceStub(node_channel)
            pings: dict[str, Callable[[], Any]] = {
                "plain": lambda: echo(pb.PingRequest(payload=b"x" * 16), timeout=10),
                "node": lambda: stub.Ping(pb.PingRequest(payload=b"x" * 16), timeout=10),
            }
            for fn in pings.values():
                for _ in range(300):  # warm: connections, caches
                    fn()
            counted = {side: count(loop, fn, HANDLERS[side], args.calls) for side, fn in pings.items()}

            async def thread_time() -> float:
                return time.thread_time()
            cpu: dict[str, list[float]] = {side: [] for side in pings}
            for _ in range(args.repeats):
                for side, fn in pings.items():  # alternating, as bench/remote.py
                    start = loop.run(thread_time())
                    for _ in range(args.calls):
                        fn()
                    cpu[side].append((loop.run(thread_time()) - start) / args.calls)
            plain_channel.close()
            node_channel.close()
        finally:
            loop.run(plain.stop(0))
            loop.run(node.stop(0))
            loop.close()
            audit.close()

    for side in pings:
        hp, hc = totals(counted[side]["handler"], args.calls)
        tp, tc = totals(counted[side]["thread"], args.calls)
        print(f"remote_calls/{side:5s} Ping: {hp:6.1f} Python calls in the handler (C calls {hc:6.1f}); "
              f"server thread {tp:6.1f} Python + {tc:6.1f} C calls; loop-thread CPU {statistics.median(cpu[side]) * 1e6:6.1f} us")
    print(f"remote_calls/added: loop-thread CPU {(statistics.median(cpu['node']) - statistics.median(cpu['plain'])) * 1e6:+.1f} us per Ping "
          f"(medians of {args.repeats} alternating repeats of {args.calls})")
    if args.top:
        for key, n in counted["node"]["handler"].most_common(args.top):
            print(f"    {n / args.calls:7.2f}  {key}")
    if args.json:
        args.json.write_text(json.dumps({side: {part: {k: v / args.calls for k, v in c.most_common()} for part, c in parts.items()}
                                         for side, parts in counted.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
