"""Join the group and leave; prints how init ended (used to check set-up failures)."""

from tinydist import dist

try:
    dist.init()
except Exception as exc:  # noqa: BLE001 - the test reads the message
    print(f"INIT FAILED {type(exc).__name__}: {exc}", flush=True)
    raise SystemExit(3) from None
print("INIT OK", flush=True)
dist.destroy()
