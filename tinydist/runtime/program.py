"""A loaded kernel: its entry point as a native callable, and the kinds of its arguments."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ARG_KINDS = {"r": ctypes.c_void_p, "w": ctypes.c_void_p, "rw": ctypes.c_void_p,
             "i64": ctypes.c_int64, "f64": ctypes.c_double, "f32": ctypes.c_float}


def check_signature(entry: str, signature: Sequence[str]) -> tuple[str, ...]:
    bad = [kind for kind in signature if kind not in ARG_KINDS]
    if bad:
        raise ValueError(f"kernel {entry}: unknown argument kind(s) {bad}; known: {', '.join(ARG_KINDS)}")
    return tuple(signature)


# A readable label per program name, for traces: a kernel's symbol is the hash of its IR
# (`k_9c530e27…`, what the code cache and the process-replay goldens key on), so the compiler files
# the label here when it builds the kernel (`DeviceCompiler.kernel`), once per distinct kernel; equal
# IR is equal ops over equal shapes, so one label serves every program of that name. The
# tracer reads it only at export. ~100 bytes per kernel, dropped when the compiler's LRU evicts it.
LABELS: dict[str, str] = {}


@dataclass(frozen=True)
class Program:
    name: str
    signature: tuple[str, ...]
    cfunc: Any  # a ctypes function: calling it releases the GIL for the kernel's duration
    address: int
    progress: int = 0  # address of the kernel's progress word (tinydist.codegen.progress); 0: it publishes none

    def __post_init__(self) -> None:
        # Name the native callable after its kernel, so a trace can label `(cfunc, args)` commands.
        try:
            self.cfunc.__name__ = self.name
        except (AttributeError, TypeError):
            pass

    @property
    def buffer_args(self) -> tuple[tuple[int, bool], ...]:
        """(argument index, writes?) for each buffer argument; cached, it is on the launch path."""
        cached = self.__dict__.get("_buffer_args")
        if cached is None:
            cached = tuple((i, kind != "r") for i, kind in enumerate(self.signature) if kind in ("r", "w", "rw"))
            object.__setattr__(self, "_buffer_args", cached)
        return cached
