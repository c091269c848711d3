"""Awaitable polling: check a condition, then sleep on the interrupt with a doubling backoff.

Never busy-blocks the event loop: the first few checks yield with `sleep(0)` (the model and a fast
device answer within a loop turn), later ones wait on the device interrupt for 20 µs doubling to
1 ms, and the loop ends at the deadline (returns None), so every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


async def poll(pci: Any, cond: Callable[[], Any], budget: float, spins: int = 4) -> Any:
    deadline = time.monotonic() + budget
    delay = 20e-6
    while True:
        value = cond()
        if value is not None and value is not False:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if spins > 0:
            spins -= 1
            await asyncio.sleep(0)
            continue
        await pci.wait_irq(min(delay, left))
        delay = min(delay * 2, 1e-3)
