"""Transcendental functions emitted as straight-line LLVM IR.

Every function takes an ``ir.IRBuilder`` positioned inside a function and a value of type float,
double or a vector of either, and returns a value of the same type. The code calls no external
symbol (no libm): only arithmetic, bit manipulation, ``select`` and intrinsics that LLVM lowers to
single vector instructions (fma, rint, floor, fabs, copysign, sqrt, minnum/maxnum). Used inside a
loop over an array, the loop vectoriser can therefore widen all of it.

No fast-math flags are set: ``nnan``/``ninf`` would license LLVM to delete the very selects that
produce the IEEE special values, and ``reassoc`` would destroy the error-free transformations
(two-sum, Cody–Waite) the accuracy depends on. Contractions are written out as explicit fma.

Algorithms, coefficient provenance and the measured error table: docs/transcendentals.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llvmlite import ir


def _hex(*values: str) -> tuple[float, ...]:
    return tuple(float.fromhex(v) for v in values)


def _pair(high: str, low: str) -> tuple[float, float]:
    """A constant split in two floats (its leading part, then the correction), from C99 hex literals."""
    return float.fromhex(high), float.fromhex(low)


# Polynomial coefficients, lowest degree first. Chebyshev interpolation (near-minimax) of the
# reduced function at 60 digits with mpmath, rounded to the target precision; see the docs.
_COEFFS: dict[tuple[str, int], tuple[float, ...]] = {
    # (2**r - 1) / r on [-1/2, 1/2]
    ("exp2", 32): _hex("0x1.62e43p-1", "0x1.ebfbep-3", "0x1.c6af6cp-5", "0x1.3b2a54p-7", "0x1.5f089p-10",
                       "0x1.44138ap-13"),
    ("exp2", 64): _hex("0x1.62e42fefa39efp-1", "0x1.ebfbdff82c58fp-3", "0x1.c6b08d704a0c0p-5",
                       "0x1.3b2ab6fba4e7bp-7", "0x1.5d87fe78a6732p-10", "0x1.430912f86ac5bp-13",
                       "0x1.ffcbfc5889cb0p-17", "0x1.62c022460176ep-20", "0x1.b5253d41fa178p-24",
                       "0x1.e4cf03bac04a7p-28", "0x1.e8ca8dd465e8bp-32", "0x1.c4b5b04b1e8f9p-36",
                       "0x1.8219217906555p-40"),
    # (e**r - 1) / r on [-ln2/2, ln2/2]
    ("exp", 32): _hex("0x1p+0", "0x1p-1", "0x1.55547cp-3", "0x1.5554e8p-5", "0x1.123e1cp-7", "0x1.6d43bp-10"),
    ("exp", 64): _hex("0x1p+0", "0x1.0000000000005p-1", "0x1.5555555555557p-3", "0x1.5555555552043p-5",
                      "0x1.11111111100bep-7", "0x1.6c16c17f6130bp-10", "0x1.a01a01abf85abp-13",
                      "0x1.a019a60cd99d3p-16", "0x1.71de01fdbf9cap-19", "0x1.28a321f9f0475p-22",
                      "0x1.af4e554377204p-26"),
    # T(z), z = s*s: log((1+s)/(1-s)) = 2s + s*z*T(z) for |s| <= (sqrt2-1)/(sqrt2+1)
    ("log", 32): _hex("0x1.555556p-1", "0x1.9999ecp-2", "0x1.245c0ap-2", "0x1.dddaep-3"),
    ("log", 64): _hex("0x1.5555555555555p-1", "0x1.9999999999a3ap-2", "0x1.2492492476765p-2",
                      "0x1.c71c7201f207cp-3", "0x1.745cf8c4c7bcap-3", "0x1.3b1c42e3df02cp-3",
                      "0x1.0fbd2bafa02d6p-3", "0x1.0c1263e1bac13p-3"),
    # S(z): sin r = r + r*z*S(z);  C(z): cos r = 1 - z/2 + z*z*C(z);  z = r*r, |r| <= pi/4.
    # float32 sin/cos are evaluated in double (see _sin_cos), so only double coefficients exist.
    ("sin", 64): _hex("-0x1.5555555555555p-3", "0x1.1111111111111p-7", "-0x1.a01a01a01a019p-13",
                      "0x1.71de3a556c2bdp-19", "-0x1.ae64567e71537p-26", "0x1.61245fb2b0af7p-33",
                      "-0x1.ae7c50d10c1fdp-41", "0x1.92413fd9b9768p-49"),
    ("cos", 64): _hex("0x1.5555555555555p-5", "-0x1.6c16c16c16c17p-10", "0x1.a01a01a01a019p-16",
                      "-0x1.27e4fb7789d93p-22", "0x1.1eed8eff32b32p-29", "-0x1.9397495269c33p-37",
                      "0x1.ae7ce67d816f8p-45", "-0x1.65d18fe933621p-53"),
    # (tanh x - x) / x**3 as a polynomial in x*x for |x| <= 0.55
    ("tanh", 32): _hex("-0x1.555556p-2", "0x1.111104p-3", "-0x1.ba142ep-5", "0x1.657936p-6", "-0x1.17641p-7",
                       "0x1.4b239ap-9"),
    ("tanh", 64): _hex("-0x1.5555555555555p-2", "0x1.1111111111111p-3", "-0x1.ba1ba1ba1b95bp-5",
                       "0x1.664f4882ba306p-6", "-0x1.226e355c62325p-7", "0x1.d6d3d028aad5bp-9",
                       "-0x1.7da34f4c64329p-10", "0x1.3556886ef1283p-11", "-0x1.f5520c3b9ff15p-13",
                       "0x1.94e894340e4b0p-14", "-0x1.3f58d7db175f6p-15", "0x1.bfb8722b58696p-17",
                       "-0x1.93edec43fd5a2p-19"),
}


@dataclass(frozen=True)
class _Format:
    """Per-precision constants. *_hi parts have enough trailing zero bits that the products
    noted next to them are exact."""

    bits: int
    mant: int                         # explicit mantissa bits
    bias: int
    # Beyond these exp2 / exp certainly overflow / round to zero. The lower bounds are far below
    # the underflow threshold on purpose: there n = 1 - 2*bias, and ldexp's first power of two,
    # 2**(n >> 1) = 2**-bias, has an all-zero bit pattern: +0.0, so the result is 0 * p * 2**(1-bias),
    # exact, with no multiply that underflows. An underflowing multiply costs an x86 core a
    # ~100-cycle microcode assist per lane: with the bound at the threshold (-104 for float32 exp),
    # every lane of a softmax over a causal mask of -3.4e38 (GPT-2's) took one, 5 ns per element
    # instead of 0.4. Arguments between the threshold and the bound still underflow (to 0 or a
    # subnormal: correctly, and slowly).
    exp2_clamp: tuple[float, float]
    exp_clamp: tuple[float, float]
    ln2: tuple[float, float]          # for fma Cody–Waite in exp: hi is just ln2 rounded
    ln2_split: tuple[float, float]    # k*hi exact for every exponent k of a (subnormal) input
    log2e_split: tuple[float, float]  # hi*masked_value exact (see _log2_parts)
    hi_mask: int                      # keeps the top bits of a float so products with *_split[0] are exact
    sub_scale: int                    # subnormal inputs are multiplied by 2**sub_scale to normalise them

    @property
    def one_bits(self) -> int:
        return self.bias << self.mant

    @property
    def sqrt_half_bits(self) -> int:   # bit pattern of sqrt(1/2) rounded down
        return 0x3F3504F3 if self.bits == 32 else 0x3FE6A09E667F3BCC

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)


_F32 = _Format(32, 23, 127, (-253.0, 129.0), (-175.5, 89.5),
               _pair("0x1.62e43p-1", "-0x1.05c61p-29"), _pair("0x1.62e4p-1", "0x1.7f7d1cp-20"),
               _pair("0x1.716p+0", "-0x1.7135a8p-13"), 0xFFFFF000, 24)
_F64 = _Format(64, 52, 1023, (-2045.0, 1025.0), (-1417.5, 710.0),
               _pair("0x1.62e42fefa39efp-1", "0x1.abc9e3b39803fp-56"),
               _pair("0x1.62e42fefa3800p-1", "0x1.ef35793c76730p-45"),
               _pair("0x1.7154765200000p+0", "0x1.705fc2eefa200p-33"), 0xFFFFFFFF00000000, 54)

# pi/2 as three doubles (159 bits) for the Cody–Waite reduction of sin/cos.
_PIO2 = _hex("0x1.921fb54442d18p+0", "0x1.1a62633145c07p-54", "-0x1.f1976b7ed8fbcp-110")
_TWO_OVER_PI = float.fromhex("0x1.45f306dc9c883p-1")
# sin/cos return NaN for finite |x| above this: the reduction needs the quadrant count n below
# 2**52 (where fma(-n, P0, x) is exact) and n*pi/2 well inside the 159 bits of _PIO2. Measured
# correct (<= 0.5 ulp f32, < 1 ulp f64) up to here; at 2**54 errors are already thousands of ulp.
# A Payne–Hanek reduction would be needed beyond; none is implemented.
SIN_COS_ACCURATE_LIMIT = 2.0 ** 48


def _shaped(ty: ir.Type, elt: ir.Type) -> ir.Type:
    return ir.VectorType(elt, ty.count) if isinstance(ty, ir.VectorType) else elt


class _Emitter:
    """A builder plus the float type being computed on: constants, intrinsics and idioms."""

    def __init__(self, b: ir.IRBuilder, ty: ir.Type) -> None:
        elt = ty.element if isinstance(ty, ir.VectorType) else ty
        if isinstance(elt, ir.FloatType):
            self.fmt = _F32
        elif isinstance(elt, ir.DoubleType):
            self.fmt = _F64
        else:
            raise TypeError(f"transcendental functions take float, double or vectors of them, got {ty}")
        self.b, self.ty = b, ty
        self.ity = _shaped(ty, ir.IntType(self.fmt.bits))

    def c(self, value: float) -> ir.Constant:
        return self._splat(self.ty, value)

    def ci(self, value: int) -> ir.Constant:
        return self._splat(self.ity, value)

    @staticmethod
    def _splat(ty: ir.Type, value: float | int) -> ir.Constant:
        if isinstance(ty, ir.VectorType):
            return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)
        return ir.Constant(ty, value)

    def call(self, name: str, *args: ir.Value) -> ir.Value:
        ty = args[0].type
        elt = ty.element if isinstance(ty, ir.VectorType) else ty
        suffix = "f32" if isinstance(elt, ir.FloatType) else "f64"
        if isinstance(ty, ir.VectorType):
            suffix = f"v{ty.count}{suffix}"
        full = f"llvm.{name}.{suffix}"
        module = self.b.module
        fn = module.globals.get(full) or ir.Function(module, ir.FunctionType(ty, [ty] * len(args)), full)
        return self.b.call(fn, args)

    # arithmetic ------------------------------------------------------------------------------
    def add(self, x: ir.Value, y: ir.Value) -> ir.Value:
        return self.b.fadd(x, y)

    def sub(self, x: ir.Value, y: ir.Value) -> ir.Value:
        return self.b.fsub(x, y)

    def mul(self, x: ir.Value, y: ir.Value) -> ir.Value:
        return self.b.fmul(x, y)

    def div(self, x: ir.Value, y: ir.Value) -> ir.Value:
        return self.b.fdiv(x, y)

    def neg(self, x: ir.Value) -> ir.Value:
        return self.b.fneg(x)

    def fma(self, x: ir.Value, y: ir.Value, z: ir.Value) -> ir.Value:
        return self.call("fma", x, y, z)

    def horner(self, x: ir.Value, coeffs: Sequence[float]) -> ir.Value:
        """sum(coeffs[i] * x**i), one fma per coefficient."""
        acc = self.c(coeffs[-1])
        for coeff in reversed(coeffs[:-1]):
            acc = self.fma(acc, x, self.c(coeff))
        return acc

    def two_sum(self, x: ir.Value, y: ir.Value) -> tuple[ir.Value, ir.Value]:
        """(s, e) with s = fl(x + y) and s + e == x + y exactly (Knuth; no ordering needed)."""
        s = self.add(x, y)
        yy = self.sub(s, x)
        e = self.add(self.sub(x, self.sub(s, yy)), self.sub(y, yy))
        return s, e

    # predicates and selection ----------------------------------------------------------------
    def lt(self, x: ir.Value, y: ir.Value) -> ir.Value:
        return self.b.fcmp_ordered("<", x, y)

    def eq(self, x: ir.Value, y: ir.Value) -> ir.Value:
        return self.b.fcmp_ordered("==", x, y)

    def isnan(self, x: ir.Value) -> ir.Value:
        return self.b.fcmp_unordered("uno", x, x)

    def isfinite(self, x: ir.Value) -> ir.Value:
        return self.lt(self.call("fabs", x), self.c(float("inf")))

    def sel(self, cond: ir.Value, x: ir.Value, y: ir.Value) -> ir.Value:
        return self.b.select(cond, x, y)

    # bit manipulation ------------------------------------------------------------------------
    def bits(self, x: ir.Value) -> ir.Value:
        return self.b.bitcast(x, self.ity)

    def from_bits(self, i: ir.Value) -> ir.Value:
        return self.b.bitcast(i, self.ty)

    def pow2i(self, k: ir.Value) -> ir.Value:
        """2**k for an integer vector k within the normal exponent range."""
        return self.from_bits(self.b.shl(self.b.add(k, self.ci(self.fmt.bias)), self.ci(self.fmt.mant)))

    def ldexp(self, p: ir.Value, n: ir.Value) -> ir.Value:
        """p * 2**n for a float-held integer n inside fmt.exp2_clamp. Two factors keep each power
        of two normal; the last multiply rounds once, so subnormal results are correctly rounded
        from p. At the clamp's lower bound n = 1 - 2*bias the first factor is +0.0 (see _Format)."""
        k = self.b.fptosi(n, self.ity)
        k1 = self.b.ashr(k, self.ci(1))
        return self.mul(self.mul(p, self.pow2i(k1)), self.pow2i(self.b.sub(k, k1)))

    def clamp(self, x: ir.Value, lo: float, hi: float) -> ir.Value:
        # minnum/maxnum turn NaN into a bound; callers restore NaN with a final select.
        return self.call("minnum", self.call("maxnum", x, self.c(lo)), self.c(hi))


def _elementwise(fn: Callable[..., ir.Value]) -> Callable[..., ir.Value]:
    """Check operand types agree before emitting."""
    def wrapper(b: ir.IRBuilder, *args: ir.Value) -> ir.Value:
        if any(a.type != args[0].type for a in args):
            raise TypeError(f"{fn.__name__}: operand types differ: {[str(a.type) for a in args]}")
        return fn(b, *args)
    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


def _via_double(b: ir.IRBuilder, core: Callable[..., ir.Value], *args: ir.Value) -> ir.Value:
    """Evaluate a double-precision core for float32 operands and round once at the end."""
    ty = args[0].type
    elt = ty.element if isinstance(ty, ir.VectorType) else ty
    if isinstance(elt, ir.DoubleType):
        return core(_Emitter(b, ty), *args)
    dty = _shaped(ty, ir.DoubleType())
    e = _Emitter(b, dty)
    _Emitter(b, ty)  # type check
    return b.fptrunc(core(e, *(b.fpext(a, dty) for a in args)), ty)


# exp / exp2 ------------------------------------------------------------------------------------

def _exp2_parts(e: _Emitter, hi: ir.Value, lo: ir.Value | None = None) -> ir.Value:
    """2**(hi + lo), |lo| tiny against 1: n = rint(hi), r = hi - n (exact), 2**r by polynomial."""
    t = e.clamp(hi, *e.fmt.exp2_clamp)
    n = e.call("rint", t)
    r = e.sub(t, n)
    if lo is not None:
        # lo is tiny against 1 only while hi is in range: pow's y*log2|x| for y = 1e38 has a
        # tail of ~1e22, which added to r gave 6**1e38 = -inf. Clamped, the result is 0 or inf.
        r = e.add(r, e.sel(e.eq(t, hi), lo, e.c(0.0)))
    p = e.fma(r, e.horner(r, _COEFFS["exp2", e.fmt.bits]), e.c(1.0))
    return e.sel(e.isnan(hi), hi, e.ldexp(p, n))


@_elementwise
def exp2(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """2**x."""
    return _exp2_parts(_Emitter(b, x.type), x)


def _exp(e: _Emitter, x: ir.Value) -> ir.Value:
    t = e.clamp(x, *e.fmt.exp_clamp)
    n = e.call("rint", e.mul(t, e.c(1.4426950408889634)))
    # Cody–Waite with fma: t - n*ln2_hi is exact (|r| < 1/2 and both terms lie on a grid of
    # ulp(ln2)/2), the second step adds the tail of ln2.
    ln2_hi, ln2_lo = e.fmt.ln2
    r = e.fma(n, e.c(-ln2_hi), t)
    r = e.fma(n, e.c(-ln2_lo), r)
    p = e.fma(r, e.horner(r, _COEFFS["exp", e.fmt.bits]), e.c(1.0))
    return e.sel(e.isnan(x), x, e.ldexp(p, n))


@_elementwise
def exp(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """e**x."""
    return _exp(_Emitter(b, x.type), x)


# log / log2 ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _LogReduction:
    k: ir.Value      # exponent, as a float:  x = 2**k * (1 + f)
    f: ir.Value      # in [sqrt(1/2) - 1, sqrt(2) - 1), exact
    s: ir.Value      # f / (2 + f)
    hfsq: ir.Value   # f*f/2 rounded, and its rounding error
    hfsq_err: ir.Value
    sr: ir.Value     # s * (hfsq + R): log(1+f) = f - hfsq + sr


def _log_reduce(e: _Emitter, x: ir.Value) -> _LogReduction:
    """fdlibm's reduction (e_log.c), with subnormals normalised first. Valid for finite x > 0."""
    fmt, b = e.fmt, e.b
    sub = e.lt(x, e.c(fmt.min_normal))
    xs = e.sel(sub, e.mul(x, e.c(2.0 ** fmt.sub_scale)), x)
    # Offsetting the bits by 1 - sqrt(1/2) makes the exponent field roll over at sqrt(2), so the
    # mantissa lands in [sqrt(1/2), sqrt(2)) and |s| <= 0.1716 with no compare.
    ix = b.add(e.bits(xs), e.ci(fmt.one_bits - fmt.sqrt_half_bits))
    k = b.sub(b.lshr(ix, e.ci(fmt.mant)), e.ci(fmt.bias))
    k = b.sub(k, e.sel(sub, e.ci(fmt.sub_scale), e.ci(0)))
    m = e.from_bits(b.add(b.and_(ix, e.ci((1 << fmt.mant) - 1)), e.ci(fmt.sqrt_half_bits)))
    f = e.sub(m, e.c(1.0))
    s = e.div(f, e.add(e.c(2.0), f))
    z = e.mul(s, s)
    big_r = e.mul(z, e.horner(z, _COEFFS["log", fmt.bits]))
    half_f = e.mul(e.c(0.5), f)
    hfsq = e.mul(half_f, f)
    hfsq_err = e.fma(half_f, f, e.neg(hfsq))
    return _LogReduction(b.sitofp(k, e.ty), f, s, hfsq, hfsq_err, e.mul(s, e.add(hfsq, big_r)))


def _log_specials(e: _Emitter, x: ir.Value, value: ir.Value, *, nan_below_zero: bool = True) -> ir.Value:
    value = e.sel(e.eq(x, e.c(float("inf"))), x, value)
    value = e.sel(e.eq(x, e.c(0.0)), e.c(float("-inf")), value)
    bad = e.b.fcmp_unordered("<", x, e.c(0.0)) if nan_below_zero else e.isnan(x)
    return e.sel(bad, e.c(float("nan")), value)


@_elementwise
def log(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Natural logarithm; log(0) = -inf, log(x < 0) = NaN."""
    e = _Emitter(b, x.type)
    red = _log_reduce(e, x)
    ln2_hi, ln2_lo = e.fmt.ln2_split
    # log(1+f) = f - hfsq + sr, summed smallest first; k*ln2_hi is exact.
    tail = e.sub(e.sub(red.hfsq, e.fma(red.k, e.c(ln2_lo), red.sr)), red.f)
    return _log_specials(e, x, e.fma(red.k, e.c(ln2_hi), e.neg(tail)))


def _log2_parts(e: _Emitter, x: ir.Value) -> tuple[ir.Value, ir.Value]:
    """log2(x) as an unevaluated sum hi + lo (|lo| <= ulp(hi)/2) for x >= 0 or NaN; the extra
    bits feed pow. After fdlibm e_log2.c: the leading part of log(1+f) is masked so its product
    with the leading bits of 1/ln2 is exact."""
    red = _log_reduce(e, x)
    head = e.sub(red.f, red.hfsq)
    head = e.from_bits(e.b.and_(e.bits(head), e.ci(e.fmt.hi_mask)))
    tail = e.add(e.sub(e.sub(e.sub(red.f, head), red.hfsq), red.hfsq_err), red.sr)
    inv_hi, inv_lo = e.fmt.log2e_split
    val_hi = e.mul(head, e.c(inv_hi))
    val_lo = e.fma(e.add(tail, head), e.c(inv_lo), e.mul(tail, e.c(inv_hi)))
    w = e.add(red.k, val_hi)  # exact-error sum: |k| >= 1 > |val_hi| or k == 0
    val_lo = e.add(val_lo, e.add(e.sub(red.k, w), val_hi))
    hi = e.add(w, val_lo)
    lo = e.add(e.sub(w, hi), val_lo)
    hi = _log_specials(e, x, hi, nan_below_zero=False)
    return hi, e.sel(e.isfinite(hi), lo, e.c(0.0))


@_elementwise
def log2(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Base-2 logarithm; log2(0) = -inf, log2(x < 0) = NaN."""
    e = _Emitter(b, x.type)
    hi, _ = _log2_parts(e, x)
    return e.sel(e.lt(x, e.c(0.0)), e.c(float("nan")), hi)


# sin / cos -------------------------------------------------------------------------------------

def _sin_cos(e: _Emitter, x: ir.Value, *, cosine: bool) -> ir.Value:
    """Double-precision core. Cody–Waite reduction x = n*pi/2 + (rh + rl) with pi/2 in three
    doubles; the remainder is kept double-double so cancellation near multiples of pi/2 costs
    nothing. Then the sin or cos polynomial by quadrant."""
    b = e.b
    n = e.call("rint", e.mul(x, e.c(_TWO_OVER_PI)))
    r1 = e.fma(n, e.c(-_PIO2[0]), x)           # exact for |n| < 2**52
    p2 = e.mul(n, e.c(_PIO2[1]))
    p2_err = e.fma(n, e.c(_PIO2[1]), e.neg(p2))
    r2, r2_err = e.two_sum(r1, e.neg(p2))
    r_lo = e.fma(n, e.c(-_PIO2[2]), e.sub(r2_err, p2_err))
    rh = e.add(r2, r_lo)
    rl = e.add(e.sub(r2, rh), r_lo)
    z = e.mul(rh, rh)
    # sin(rh + rl) ~ sin(rh) + rl*cos(rh);  cos(rh + rl) ~ cos(rh) - rl*rh
    sin_tail = e.fma(e.mul(rh, z), e.horner(z, _COEFFS["sin", 64]), e.mul(rl, e.fma(z, e.c(-0.5), e.c(1.0))))
    sin_r = e.add(rh, sin_tail)
    hz = e.mul(z, e.c(0.5))
    w = e.sub(e.c(1.0), hz)
    cos_tail = e.fma(e.mul(z, z), e.horner(z, _COEFFS["cos", 64]), e.neg(e.mul(rh, rl)))
    cos_r = e.add(w, e.add(e.sub(e.sub(e.c(1.0), w), hz), cos_tail))  # recovers 1 - hz's rounding
    # Quadrant n mod 4 computed in floating point so that no out-of-range fptosi (poison) can
    # occur for huge or infinite x; NaN lanes get quadrant 0 and stay NaN through r.
    q = e.sub(n, e.mul(e.c(4.0), e.call("floor", e.mul(n, e.c(0.25)))))
    q = b.fptosi(e.sel(e.isnan(q), e.c(0.0), q), e.ity)
    if cosine:
        q = b.add(q, e.ci(1))
    swap = b.icmp_unsigned("!=", b.and_(q, e.ci(1)), e.ci(0))
    negate = b.icmp_unsigned("!=", b.and_(q, e.ci(2)), e.ci(0))
    v = e.sel(swap, cos_r, sin_r)
    v = e.sel(negate, e.neg(v), v)
    if not cosine:
        v = e.sel(e.eq(x, e.c(0.0)), x, v)  # sin(-0) = -0
    too_big = e.b.fcmp_ordered(">", e.call("fabs", x), e.c(SIN_COS_ACCURATE_LIMIT))
    return e.sel(too_big, e.c(float("nan")), v)


@_elementwise
def sin(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """sin x for |x| <= SIN_COS_ACCURATE_LIMIT, NaN above (float32 evaluated in double)."""
    return _via_double(b, lambda e, v: _sin_cos(e, v, cosine=False), x)


@_elementwise
def cos(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """cos x for |x| <= SIN_COS_ACCURATE_LIMIT, NaN above (float32 evaluated in double)."""
    return _via_double(b, lambda e, v: _sin_cos(e, v, cosine=True), x)


# the rest --------------------------------------------------------------------------------------

@_elementwise
def sqrt(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Correctly rounded square root (llvm.sqrt is IEEE sqrt)."""
    return _Emitter(b, x.type).call("sqrt", x)


def _pow(e: _Emitter, x: ir.Value, y: ir.Value) -> ir.Value:
    b = e.b
    hi, lo = _log2_parts(e, e.call("fabs", x))
    # y * (hi + lo) as a double-length product: th exact-rounded, tl collects the rest.
    th = e.mul(y, hi)
    tl = e.fma(y, lo, e.fma(y, hi, e.neg(th)))
    mag = _exp2_parts(e, th, e.sel(e.isfinite(th), tl, e.c(0.0)))
    y_int = e.eq(e.call("rint", y), y)
    half_y = e.mul(y, e.c(0.5))
    y_odd = b.and_(y_int, b.fcmp_unordered("!=", e.call("rint", half_y), half_y))
    sign_set = b.icmp_signed("<", e.bits(x), e.ci(0))
    v = e.sel(b.and_(sign_set, y_odd), e.neg(mag), mag)
    finite_negative = b.and_(e.lt(x, e.c(0.0)), e.isfinite(x))
    v = e.sel(b.and_(finite_negative, b.not_(y_int)), e.c(float("nan")), v)
    one = b.or_(e.eq(y, e.c(0.0)), e.eq(x, e.c(1.0)))
    unit_to_inf = b.and_(e.eq(e.call("fabs", x), e.c(1.0)), e.eq(e.call("fabs", y), e.c(float("inf"))))
    return e.sel(b.or_(one, unit_to_inf), e.c(1.0), v)


@_elementwise
def pow(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:  # noqa: A001 - the math name
    """x**y with C99/IEEE 754 special cases, as exp2(y * log2|x|) with y*log2|x| carried in
    double length; float32 is evaluated in double, which makes it almost correctly rounded."""
    return _via_double(b, _pow, x, y)


@_elementwise
def tanh(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """tanh x: odd polynomial for |x| < 0.55 (where 1 - 2/(e**2x + 1) would cancel), else that."""
    e = _Emitter(b, x.type)
    ax = e.call("fabs", x)
    z = e.mul(x, x)
    small = e.fma(e.mul(x, z), e.horner(z, _COEFFS["tanh", e.fmt.bits]), x)
    big = e.sub(e.c(1.0), e.div(e.c(2.0), e.add(_exp(e, e.add(ax, ax)), e.c(1.0))))
    small = e.sel(e.eq(x, e.c(0.0)), x, small)  # the fma would turn -0 into +0
    return e.sel(e.lt(ax, e.c(0.55)), small, e.call("copysign", big, x))


@_elementwise
def sigmoid(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """1 / (1 + e**-x), from e**-|x| so neither side overflows before its result underflows."""
    e = _Emitter(b, x.type)
    t = _exp(e, e.neg(e.call("fabs", x)))
    d = e.add(e.c(1.0), t)
    return e.sel(b.fcmp_ordered(">=", x, e.c(0.0)), e.div(e.c(1.0), d), e.div(t, d))


__all__ = ["SIN_COS_ACCURATE_LIMIT", "cos", "exp", "exp2", "log", "log2", "pow", "sigmoid", "sin", "sqrt",
           "tanh"]
