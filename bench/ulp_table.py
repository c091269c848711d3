"""Measured ULP error of tinydist.codegen.transcendental, every function x dtype x input class.

float32 is checked against numpy float64 (exact enough: the reference error is ~2**-29 of a
float32 ulp); float64 against mpmath at 40 digits on a sample. Run:

    python bench/ulp_table.py                      # print the Markdown table
    python bench/ulp_table.py --write docs/transcendentals.md   # also refresh the doc's table
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinydist.codegen import transcendental as T  # noqa: E402
from tinydist.codegen.compiler import HostCompiler  # noqa: E402
from tinydist.runtime.cpu.loader import native_loader  # noqa: E402
from tinydist.testing import transcendental_ir  # noqa: E402

_counter = itertools.count()
_compiler = HostCompiler()


def compile_kernel(name: str, dtype: type) -> Callable[..., np.ndarray]:
    """A native kernel applying transcendental.<name> elementwise; returns f(*arrays) -> array."""
    entry = f"td_{name}_{np.dtype(dtype).name}_{next(_counter)}"
    text, arity = transcendental_ir(name, dtype, entry)
    program = native_loader.load(_compiler.compile(text), entry, ["w"] + ["r"] * arity + ["i64"])

    def run(*arrays: np.ndarray) -> np.ndarray:
        arrays = [np.ascontiguousarray(a, dtype=dtype) for a in arrays]
        result = np.empty_like(arrays[0])
        program.cfunc(result.ctypes.data, *(a.ctypes.data for a in arrays), result.size)
        return result
    return run


def ulp_error(got: np.ndarray, exact: np.ndarray, dtype: type) -> np.ndarray:
    """|got - exact| in units of the ulp of `exact` in `dtype` (subnormal ulp below the normal
    range); infinite when exactly one side is non-finite or they are different specials."""
    info = np.finfo(dtype)
    exact = np.asarray(exact, dtype=np.float64) if dtype == np.float32 else exact
    mag = np.abs(np.asarray(exact, dtype=np.float64))
    with np.errstate(all="ignore"):
        e = np.floor(np.log2(np.maximum(mag, float(info.smallest_normal))))
        ulp = np.exp2(e - info.nmant)
        err = np.abs(got.astype(np.float64) - np.asarray(exact, dtype=np.float64)) / ulp
    both_special = ~np.isfinite(got) | ~np.isfinite(np.asarray(exact, dtype=np.float64))
    same = (np.isnan(got) & np.isnan(np.asarray(exact, np.float64))) | (got.astype(np.float64) == np.asarray(exact, np.float64))
    return np.where(both_special, np.where(same, 0.0, np.inf), err)


# References ------------------------------------------------------------------------------------

_NP = {"exp2": np.exp2, "exp": np.exp, "log2": np.log2, "log": np.log, "sin": np.sin, "cos": np.cos,
       "sqrt": np.sqrt, "tanh": np.tanh, "sigmoid": lambda x: np.where(x >= 0, 1.0 / (1.0 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) / (1.0 + np.exp(-np.abs(x)))), "pow": np.power}


def reference(name: str, *args: np.ndarray) -> np.ndarray:
    """numpy in float64: the float32 reference, and the float64 one for special values (C99)."""
    with np.errstate(all="ignore"):
        return _NP[name](*(a.astype(np.float64) for a in args))


def ulp_error_hp(got: np.ndarray, name: str, args: list[np.ndarray]) -> np.ndarray:
    """float64 error against mpmath, with sub-ulp resolution (the float64 round-trip of the
    reference would otherwise add up to 1/2 ulp)."""
    import mpmath as mp
    mp.mp.dps = 40
    fns = {"exp2": lambda v: mp.power(2, v), "exp": mp.exp, "log2": lambda v: mp.log(v, 2), "log": mp.log,
           "sin": mp.sin, "cos": mp.cos, "sqrt": mp.sqrt, "tanh": mp.tanh,
           "sigmoid": lambda v: 1 / (1 + mp.exp(-v)), "pow": mp.power}
    err = np.empty(got.size)
    tiny = 2.0 ** -1074
    special = reference(name, *args)
    for k, vals in enumerate(zip(*args)):
        g, fe = float(got[k]), float(special[k])
        if not all(math.isfinite(v) for v in vals) or not math.isfinite(fe) or fe == 0.0:
            err[k] = 0.0 if (math.isnan(g) and math.isnan(fe)) or g == fe else math.inf
            continue
        exact = fns[name](*(mp.mpf(float(v)) for v in vals))
        ulp = max(2.0 ** (int(mp.floor(mp.log(abs(exact), 2))) - 52), tiny) if exact != 0 else tiny
        err[k] = float(abs(mp.mpf(g) - exact) / ulp)
    return err


# Input classes ---------------------------------------------------------------------------------

SPECIALS = {"nan": [math.nan], "+-inf": [math.inf, -math.inf], "+-0": [0.0, -0.0]}
DOMAIN = {"exp2": (-150.0, 128.0, 1020.0), "exp": (-103.0, 88.7, 709.7), "log2": None, "log": None,
          "sin": (-1e4, 1e4, 1e4), "cos": (-1e4, 1e4, 1e4), "sqrt": None, "tanh": (-20.0, 20.0, 40.0),
          "sigmoid": (-100.0, 100.0, 740.0)}


def positive_logspace(rng: np.random.Generator, dtype: type, n: int) -> np.ndarray:
    """Uniform in the bit pattern of positive normal floats: every binade equally."""
    if dtype == np.float32:
        return rng.integers(0x00800000, 0x7F800000, n, dtype=np.uint32).view(np.float32)
    return rng.integers(0x0010000000000000, 0x7FF0000000000000, n, dtype=np.uint64).view(np.float64)


def subnormals(rng: np.random.Generator, dtype: type, n: int) -> np.ndarray:
    if dtype == np.float32:
        return rng.integers(1, 0x00800000, n, dtype=np.uint32).view(np.float32)
    return rng.integers(1, 0x0010000000000000, n, dtype=np.uint64).view(np.float64)


def near_pio2_multiples(dtype: type, lo: float, hi: float, count: int) -> np.ndarray:
    """The floats nearest to k*pi/2 for k spread over [lo, hi]: where the reduction cancels most."""
    import mpmath as mp
    mp.mp.dps = 60
    ks = np.unique(np.geomspace(max(1.0, lo / (math.pi / 2)), hi / (math.pi / 2), count).astype(np.int64))
    out = []
    for k in ks:
        v = k * mp.pi / 2
        f = np.array(float(v), dtype=dtype)
        out += [f, np.nextafter(f, dtype(np.inf)), np.nextafter(f, dtype(-np.inf))]
    out = np.array(out, dtype=dtype)
    return out[out <= hi]


def input_classes(name: str, dtype: type, rng: np.random.Generator, n: int) -> dict[str, list[np.ndarray]]:
    f64 = dtype == np.float64
    classes: dict[str, list[np.ndarray]] = {}
    if name == "pow":
        x = np.exp2(rng.uniform(-20, 20, n)).astype(dtype)
        y = rng.uniform(-6, 6, n).astype(dtype)
        classes["x in 2^±20, |y|<=6"] = [x, y]
        x = rng.uniform(0.5, 2, n).astype(dtype)
        ymax = 120.0 if not f64 else 1000.0
        y = (rng.uniform(-1, 1, n) * ymax / np.abs(np.log2(x.astype(np.float64)) + 1e-30)).clip(-1e30, 1e30).astype(dtype)
        classes["large results |y*log2 x|<=%g" % ymax] = [x, y]
        xi = -rng.uniform(0.5, 4, n).astype(dtype)
        yi = rng.integers(-30, 30, n).astype(dtype)
        classes["x<0, integer y"] = [xi, yi]
        sv = np.array([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, np.inf, -np.inf, np.nan, 3.0, -3.0, 2.5], dtype=dtype)
        gx, gy = np.meshgrid(sv, sv)
        classes["special grid (14x14)"] = [gx.ravel(), gy.ravel()]
        return classes
    dom = DOMAIN[name]
    if dom is None:  # positive-domain functions: every binade
        classes["normals (all binades)"] = [positive_logspace(rng, dtype, n)]
        classes["[0.5, 2)"] = [rng.uniform(0.5, 2.0, n).astype(dtype)]
        if name.startswith("log"):
            classes["negative"] = [-positive_logspace(rng, dtype, 64)]
    else:
        lo, hi, hi64 = dom
        if f64 and name in ("exp2", "exp", "sigmoid"):
            lo = -hi64 - (20 if name == "exp2" else 35) if name != "sigmoid" else -hi64
            hi = hi64
        classes[f"uniform [{lo:g}, {hi:g}]"] = [rng.uniform(lo, hi, n).astype(dtype)]
        classes["tiny |x| < 1e-3"] = [(rng.uniform(-1e-3, 1e-3, n)).astype(dtype)]
    if name in ("sin", "cos"):
        for lo, hi in [(1e4, 1e6), (1e6, 2.0 ** 30), (2.0 ** 30, 2.0 ** 48)]:
            classes[f"|x| in [{lo:.3g}, {hi:.3g}]"] = [rng.uniform(lo, hi, n).astype(dtype) * rng.choice([-1, 1], n)]
        limit = T.SIN_COS_ACCURATE_LIMIT
        classes["nearest k*pi/2, |x| <= 2^48"] = [near_pio2_multiples(dtype, 1, limit, 3000 if not f64 else 600)]
    classes["subnormals"] = [subnormals(rng, dtype, 4096 if not f64 else 256)]
    for label, vals in SPECIALS.items():
        classes[label] = [np.array(vals, dtype=dtype)]
    return classes


def exhaustive_binades(name: str) -> dict[str, list[np.ndarray]]:
    """Every float32 in a couple of binades (2**24 values)."""
    ranges = {"exp2": (0.5, 2.0), "exp": (0.5, 2.0), "log2": (0.5, 2.0), "log": (0.5, 2.0),
              "sin": (0.5, 2.0), "cos": (0.5, 2.0), "sqrt": (0.5, 2.0), "tanh": (0.25, 1.0), "sigmoid": (0.5, 2.0)}
    lo, hi = ranges[name]
    start = np.array(lo, np.float32).view(np.uint32)
    stop = np.array(hi, np.float32).view(np.uint32)
    bits = np.arange(start, stop, dtype=np.uint32)
    return {f"exhaustive [{lo:g}, {hi:g})": [bits.view(np.float32)]}


FUNCTIONS = ["exp2", "exp", "log2", "log", "sin", "cos", "sqrt", "pow", "tanh", "sigmoid"]


def measure(n32: int = 1_000_000, n64: int = 5_000, seed: int = 0) -> list[tuple[str, str, str, int, float, float]]:
    rng = np.random.default_rng(seed)
    rows = []
    for name in FUNCTIONS:
        for dtype in (np.float32, np.float64):
            kernel = compile_kernel(name, dtype)
            classes = input_classes(name, dtype, rng, n32 if dtype == np.float32 else n64)
            if dtype == np.float32 and name != "pow":
                classes = {**exhaustive_binades(name), **classes}
            for label, args in classes.items():
                got = kernel(*args)
                if dtype == np.float32:
                    err = ulp_error(got, reference(name, *args), dtype)
                else:
                    err = ulp_error_hp(got, name, args)
                rows.append((name, np.dtype(dtype).name, label, args[0].size, float(err.max()), float(err.mean())))
    return rows


def markdown(rows: list[tuple[str, str, str, int, float, float]]) -> str:
    lines = ["| function | dtype | inputs | n | max ulp | mean ulp |", "|---|---|---|---:|---:|---:|"]
    for name, dt, label, n, mx, mean in rows:
        lines.append(f"| {name} | {dt} | {label} | {n} | {mx:.3g} | {mean:.3g} |")
    return "\n".join(lines)


BEGIN, END = "<!-- ulp-table:begin -->", "<!-- ulp-table:end -->"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="replace the table between the ulp-table markers in this file")
    parser.add_argument("--n32", type=int, default=1_000_000)
    parser.add_argument("--n64", type=int, default=5_000)
    args = parser.parse_args()
    t0 = time.perf_counter()
    table = markdown(measure(args.n32, args.n64))
    print(table)
    print(f"\n({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.write:
        text = args.write.read_text() if args.write.exists() else f"{BEGIN}\n{END}\n"
        block = f"{BEGIN}\n{table}\n{END}"
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        args.write.write_text(text)


if __name__ == "__main__":
    main()
