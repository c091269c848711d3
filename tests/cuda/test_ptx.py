"""PTX for every kernel kind of the tensor test matrix, assembled with ptxas for sm_80 and sm_90.

Kernel ASTs come from scheduling small td.Tensor graphs (`create_schedule`), exactly what the
executor would hand a CUDA device. No GPU is needed: PTX generation is checked here, and where
`ptxas` is installed each kernel is assembled for both targets (skipped, with the reason, where not).
"""

from __future__ import annotations

import concurrent.futures
import operator
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

import tinydist as td
from tinydist.base.errors import CompileError
from tinydist.codegen import ptx
from tinydist.codegen.kernel import KernelAST
from tinydist.schedule import create_schedule
from tinydist.schedule.items import KernelCall, MatmulCall

pytestmark = pytest.mark.timeout(120)

ARCHES = ("sm_80", "sm_90")
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.bool_]


def sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) < 0.5
    return (rng.integers(1, 9, size=shape)).astype(dtype)


def kernels_of(*tensors: td.Tensor) -> list[object]:
    """The KernelASTs (and matmul dtypes) a schedule of `tensors` contains."""
    schedule, _ = create_schedule([t.node for t in tensors])
    found: list[object] = []
    for call in schedule.linear:
        if isinstance(call, KernelCall):
            found.append(call.ast)
        elif isinstance(call, MatmulCall):
            found.append(("matmul", call.dtype.name))
    return found


BINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow,
    "maximum": lambda a, b: a.maximum(b), "minimum": lambda a, b: a.minimum(b),
    "and": operator.and_, "or": operator.or_, "xor": operator.xor,
    "lt": operator.lt, "le": operator.le, "eq": operator.eq, "ne": operator.ne,
}
UNARY = {
    "neg": operator.neg, "abs": abs, "exp": lambda t: t.exp(), "log": lambda t: t.log(), "sqrt": lambda t: t.sqrt(),
    "sin": lambda t: t.sin(), "cos": lambda t: t.cos(), "tanh": lambda t: t.tanh(), "sigmoid": lambda t: t.sigmoid(),
    "relu": lambda t: t.relu(), "exp2": lambda t: t.exp2(), "log2": lambda t: t.log2(), "floor": lambda t: t.floor(),
    "invert": operator.invert,
}


def _try(fn, *args):
    try:
        return fn(*args)
    except (TypeError, ValueError):  # the op is not defined for this dtype (numpy says so too)
        return None


def matrix() -> dict[str, list[object]]:
    """name -> kernels, one entry per graph of the tensor test matrix's kinds."""
    cases: dict[str, list[object]] = {}
    for da in DTYPES:
        a = td.Tensor(sample(da, (3, 4), 1))
        b = td.Tensor(sample(da, (3, 4), 2))
        name_a = np.dtype(da).name
        for op_name, op in BINARY.items():
            result = _try(op, a, b)
            if result is not None:
                cases[f"{op_name}-{name_a}"] = kernels_of(result)
        for op_name, op in UNARY.items():
            result = _try(op, a)
            if result is not None:
                cases[f"{op_name}-{name_a}"] = kernels_of(result)
        for db in DTYPES:
            if db is not da:  # a cast to its own dtype is no kernel
                cases[f"cast-{name_a}-{np.dtype(db).name}"] = kernels_of(a.cast(db))
        cond = td.Tensor(sample(np.bool_, (3, 4), 3))
        cases[f"where-{name_a}"] = kernels_of(td.where(cond, a, td.Tensor(sample(da, (4,), 4))))
        for red in ("sum", "max", "min", "prod"):
            for axis, label in ((None, "full"), (1, "row"), (0, "column")):
                result = _try(lambda: getattr(a, red)(axis=axis))
                if result is not None:
                    cases[f"{red}-{label}-{name_a}"] = kernels_of(result)
    x = td.Tensor(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    cases["pad"] = kernels_of(x.pad(((1, 1), (0, 2), (3, 0)), value=1.5) * 2)
    cases["shrink-permute"] = kernels_of(x[:, 1:, ::2].permute(2, 0, 1) + 1)
    cases["expand-broadcast"] = kernels_of(x + td.Tensor(np.ones((3, 1), np.float32)))
    cases["padded-reduce"] = kernels_of(x.pad(((0, 0), (1, 1), (2, 2))).sum(axis=2))
    cases["middle-axis-reduce"] = kernels_of(x.max(axis=1))
    cases["reduce-then-elementwise"] = kernels_of((x.exp().sum(axis=2, keepdim=True) + 1).log())
    cases["softmax"] = kernels_of(x.softmax(axis=-1) if hasattr(x, "softmax") else (x - x.max(axis=-1, keepdim=True)).exp())
    big = td.Tensor(np.ones((1000, 300), np.float32))
    cases["row-reduce-large"] = kernels_of(big.sum(axis=1))
    cases["column-reduce-large"] = kernels_of(big.sum(axis=0))
    cases["full-reduce-large"] = kernels_of(big.max())
    for dt in (np.float32, np.float64):
        m = td.Tensor(np.ones((5, 7), dt))
        n = td.Tensor(np.ones((7, 40), dt))  # wider than the micro-tile: the packed matmul kernel
        cases[f"matmul-{np.dtype(dt).name}"] = kernels_of(m @ n)
        cases[f"matmul-batched-{np.dtype(dt).name}"] = kernels_of(td.Tensor(np.ones((2, 5, 7), dt)) @ n)
        cases[f"matmul-narrow-{np.dtype(dt).name}"] = kernels_of(m @ td.Tensor(np.ones((7, 3), dt)))  # fused kernel
    return cases


def lowered(kernel: object) -> ptx.PTXKernel:
    if isinstance(kernel, KernelAST):
        return ptx.lower_kernel(kernel)
    return ptx.matmul_kernel(kernel[1])  # type: ignore[index]


@pytest.fixture(scope="module")
def all_ptx() -> dict[str, dict[str, str]]:
    """name -> {arch: PTX} for every distinct kernel of the matrix."""
    result: dict[str, dict[str, str]] = {}
    seen: set[str] = set()
    for case, kernels in matrix().items():
        # (an op that is the identity for a dtype — floor of an int — schedules no kernel)
        for index, kernel in enumerate(kernels):
            spec = lowered(kernel)
            if spec.ir in seen:
                continue
            seen.add(spec.ir)
            result[f"{case}#{index}:{spec.name}"] = {arch: ptx.compile_ptx(spec.ir, arch) for arch in ARCHES}
    return result


def test_matrix_covers_every_kind(all_ptx):
    kinds = {key.split("#")[0].split("-")[0] for key in all_ptx}
    for expected in ("add", "exp", "sin", "log2", "pow", "cast", "where", "lt", "sum", "max", "prod", "pad", "matmul"):
        assert expected in kinds, expected
    assert len(all_ptx) > 150


def test_ptx_is_a_kernel_for_the_target(all_ptx):
    for key, by_arch in all_ptx.items():
        for arch, text in by_arch.items():
            assert f".target {arch}" in text, key
            assert ".visible .entry" in text, key
            assert ".extern .func" not in text, f"{key}: calls an external function (libm/libdevice):\n{text[:2000]}"


def test_reductions_use_shared_memory_and_barriers(all_ptx):
    for label in ("sum-full-float32", "sum-row-float32", "max-full-int32", "full-reduce-large", "row-reduce-large"):
        texts = [t["sm_80"] for k, t in all_ptx.items() if k.startswith(label + "#")]
        assert texts, label
        assert any(".shared" in t and "bar.sync" in t for t in texts), label
    column = [t["sm_80"] for k, t in all_ptx.items() if k.startswith("column-reduce-large#")]
    assert column and all("bar.sync" not in t for t in column)  # one thread per column, no block sync


def test_matmul_is_tiled_in_shared_memory(all_ptx):
    text = next(t["sm_90"] for k, t in all_ptx.items() if k.endswith(":tinydist_matmul_float32"))
    assert ".shared" in text and "bar.sync" in text
    assert text.count("fma.rn.f32") >= 128  # 8 k-steps × 4×4 outputs per thread, unrolled


def test_launch_geometry():
    big = td.Tensor(np.ones((1000, 300), np.float32))
    row = lowered(kernels_of(big.sum(axis=1))[0])  # (then a reshape copy)
    assert (row.kind, row.threads, row.work) == ("block", ptx.THREADS, 1000)
    assert row.launch_dims((), sm_count=132) == ((1000, 1, 1), (256, 1, 1))
    full = lowered(kernels_of(big.sum())[0])
    assert (full.kind, full.threads, full.work) == ("block", ptx.FULL_REDUCE_THREADS, 1)
    (ew,) = [lowered(k) for k in kernels_of(big * 2)]
    assert ew.kind == "thread" and ew.launch_dims((), sm_count=2) == ((64, 1, 1), (256, 1, 1))  # grid capped
    mm = ptx.matmul_kernel("float32")
    grid, block = mm.launch_dims((0, 0, 0, 0, 3, 130, 64, 7, 0, 0, 0), sm_count=132)
    assert grid == (1, 3, 3) and block == (256, 1, 1)
    assert mm.launch_dims((0, 0, 0, 0, 1, 0, 64, 7, 0, 0, 0), sm_count=1)[0][1] == 0  # nothing to launch


def test_arch_for_capability():
    assert ptx.arch_for((9, 0)) == "sm_90"
    assert ptx.arch_for((8, 9)) == "sm_89"
    assert ptx.arch_for((8, 8)) == "sm_87"   # unknown minor: the highest known target below it
    assert ptx.arch_for((12, 1)) == "sm_120"
    with pytest.raises(CompileError, match="older than"):
        ptx.arch_for((5, 2))


def test_matmul_rejects_integer_dtypes():
    with pytest.raises(CompileError, match="float32 and float64"):
        ptx.matmul_kernel("int32")


def test_bad_ir_is_a_compile_error():
    with pytest.raises(CompileError, match="NVPTX kernel IR"):
        ptx.compile_ptx("define void @k( {", "sm_80")


def _ptxas(text: str, arch: str, directory: str, key: str) -> tuple[str, str, int, str]:
    path = os.path.join(directory, f"{abs(hash((key, arch)))}.ptx")
    with open(path, "w") as f:
        f.write(text)
    done = subprocess.run(["ptxas", f"-arch={arch}", path, "-o", path + ".cubin"], capture_output=True, text=True, timeout=60)
    return key, arch, done.returncode, done.stderr


def test_ptxas_assembles_every_kernel(all_ptx):
    if shutil.which("ptxas") is None:
        print("SKIPPED: ptxas is not installed (CUDA toolkit missing); PTX was generated but not assembled")
        pytest.skip("ptxas is not installed (CUDA toolkit missing): PTX generated but not assembled")
    with tempfile.TemporaryDirectory() as directory, concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        jobs = [pool.submit(_ptxas, text, arch, directory, key) for key, by_arch in all_ptx.items() for arch, text in by_arch.items()]
        failures = [(key, arch, err) for key, arch, rc, err in (j.result() for j in jobs) if rc != 0]
    assert not failures, "\n".join(f"{key} [{arch}]: {err}" for key, arch, err in failures[:10])
