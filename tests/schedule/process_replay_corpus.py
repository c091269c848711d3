"""Process replay: a fixed corpus of graphs, and what the scheduler and code generator make of each.

A refactor of the execution layer (realize, the JIT, compilation) must not change what runs: for
every graph below, the schedule (buffers, LINEAR order of calls, memory plan) and the LLVM IR of
every program those calls compile to stay byte for byte what `process_replay/<graph>.txt`
recorded. `test_process_replay.py` compares them; after a deliberate change, regenerate with

    make process-replay-update        # or: python -m tests.schedule.process_replay_update [GRAPH ...]

and review the golden diff like code (tinygrad's "process replay", kept in the repository).

Graphs are built with the public API only (Tensor, functional, nn, optim, multi) from fixed shapes
and fixed-seed data, and scheduled with `create_schedule` exactly as `realize` does, but nothing is
realized, compiled or run: the corpus costs milliseconds per graph. A graph's targets are what its
user would realize; the optimizer steps are scheduled as `td.jit` captures a training step — the
loss plus every assign the step made (`observe_assigns`), which also keeps `step()` from
realizing. Buffer contents never enter a schedule or its IR; only shapes, dtypes, devices and the
scalars in the graph do, so the nn layers' initial weights come from the process-wide generator
as usual (the corpus does not reseed it, which would change what later tests draw).

Each program is recorded as a device's compiler (`tinydist.runtime.compiler`) compiles it: a
KernelCall's or SliceCall's AST through `lower` (its name is the hash of its IR), a MatmulCall's
`matmul_ir` under `codegen.matmul.program_name`.

Nothing recorded depends on node ids, addresses, hash order or what ran before: at f3618e4 every
golden rendered the same alone in a fresh process, after the whole corpus, in shuffled orders,
from a warm schedule cache and under PYTHONHASHSEED 0 and 123. The sharded graphs need two CPU
devices (TINYDIST_CPU_DEVICES, at least 4 by default).

Left out, and why:
  * copies and gathers: whether one streams through the `tinydist_stream_copy` program or is the
    device's own copy is decided at run time from device properties (host visibility, peer
    reads) and the copy's size (at least STREAMING_STORE_BYTES, far beyond this corpus); the
    program's IR does not depend on the graph.
  * compiled object code and everything tied to this process or machine: buffer addresses, node
    ids, the host CPU's name and features (the IR's target triple is a placeholder; the compiler
    sets the host's).
  * back ends with their own code generator (CUDA's PTX); the corpus runs on CPU devices only.
The IR text is printed by llvmlite; `process_replay/llvmlite_version` records the version that
wrote the goldens, so a failure caused by another llvmlite says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import numpy as np

import tinydist as td
from tinydist.codegen.lowering import lower
from tinydist.codegen.matmul import matmul_ir, program_name
from tinydist.frontend.tensor import observe_assigns
from tinydist.graph.lazy import LazyNode
from tinydist.multi import MultiTensor
from tinydist.schedule import Schedule, create_schedule, schedule_cache
from tinydist.schedule.items import BufferSpec, Call, KernelCall, MatmulCall, SliceCall
from tinydist.train.nn import functional as F

GOLDEN_DIR = Path(__file__).parent / "process_replay"
LLVMLITE_VERSION_FILE = GOLDEN_DIR / "llvmlite_version"

Builder = Callable[[], list[LazyNode]]
GRAPHS: dict[str, Builder] = {}


def graph(builder: Builder) -> Builder:
    """Register `builder` under its function name; it returns the nodes to schedule, in order, and
    its docstring's first line heads the golden (a reader of a golden diff sees what the graph is)."""
    if builder.__name__ in GRAPHS:
        raise ValueError(f"graph {builder.__name__!r} is defined twice")
    if not builder.__doc__:
        raise ValueError(f"graph {builder.__name__!r} needs a docstring saying what it covers")
    GRAPHS[builder.__name__] = builder
    return builder


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.txt"


def update_command(*names: str) -> str:
    """The command that regenerates the goldens of `names` (all of them: none given)."""
    return f"python -m tests.schedule.process_replay_update {' '.join(names)}" if names else "make process-replay-update"


def data(seed: int, *shape: int, dtype: type = np.float32) -> td.Tensor:
    """A CPU:0 tensor of fixed-seed normal values (integers: rounded into [-5, 5]; bools: those nonzero)."""
    values = np.random.default_rng(seed).standard_normal(shape)
    if np.dtype(dtype).kind in "ib":
        values = np.round(values * 3).clip(-5, 5)
    return td.Tensor(values.astype(dtype))


def nodes(*results: td.Tensor | MultiTensor) -> list[LazyNode]:
    """The graph nodes of `results`, a sharded tensor contributing each of its shards."""
    out: list[LazyNode] = []
    for result in results:
        if isinstance(result, MultiTensor):
            out.extend(shard.node for shard in result.shards)
        else:
            out.append(result.node)
    return out


# ---- elementwise, broadcasting, dtypes ----------------------------------------------------------

@graph
def elementwise_chain() -> list[LazyNode]:
    """A chain of float32 binary and unary ops: one fused kernel."""
    a, b = data(1, 16, 16), data(2, 16, 16)
    return nodes(((a * b + 1.5) / (b.abs() + 1)).relu() - a.square().sqrt() * 0.25)


@graph
def broadcast() -> list[LazyNode]:
    """Row, column and scalar broadcasts against a matrix."""
    m, row, col = data(3, 8, 12), data(4, 12), data(5, 8, 1)
    return nodes(m * row + col - 2, (row + col).sigmoid())


@graph
def float64_ops() -> list[LazyNode]:
    """float64 arithmetic, floor division, modulo, floor, min/max."""
    a, b = data(6, 6, 10, dtype=np.float64), data(7, 6, 10, dtype=np.float64)
    return nodes((a // (b.abs() + 0.5)) + (a % 3).floor() - a.maximum(b) * b.minimum(0.25))


@graph
def int64_ops() -> list[LazyNode]:
    """int64 arithmetic and bitwise ops, a negative divisor, an int reduction."""
    a, b = data(8, 5, 7, dtype=np.int64), data(9, 5, 7, dtype=np.int64)
    mixed = (a * b - a // 3 + b % -4) ^ (a & 6) | -b
    return nodes(mixed, (~a).abs().sum(1))


@graph
def bool_logic() -> list[LazyNode]:
    """bool tensors: comparisons, and/or/xor/not, any/all."""
    a, b = data(10, 9, 4, dtype=np.bool_), data(11, 9, 4, dtype=np.bool_)
    x = data(12, 9, 4)
    mask = (a & ~b) | (x > 0.5) ^ b
    return nodes(mask, mask.any(0), (x != x).logical_not().all(1))


@graph
def casts() -> list[LazyNode]:
    """Casts between every dtype pair the corpus uses, float rounding toward zero included."""
    f = data(13, 4, 6)
    i = f.cast(td.int64)
    return nodes(i.cast(td.float64) * 0.5, (f > 0).cast(td.float32) + f, i.cast(td.bool_), f.cast(td.float64).cast(td.int32))


@graph
def where_compare() -> list[LazyNode]:
    """where with tensor and scalar branches, clip, every comparison, promotion to float."""
    a, b = data(14, 7, 5), data(15, 7, 5)
    n = data(16, 7, 5, dtype=np.int64)
    picked = td.where(a < b, a, b * 2) + td.where(n >= 0, n, 0.5)
    return nodes(picked.clip(-1, 1), (a <= b) == (n == 1), td.where(a > 0, 1, -1))


@graph
def transcendental_f32() -> list[LazyNode]:
    """exp, log, sin, cos, exp2, log2, pow, tanh on float32 (each a polynomial of its own)."""
    x = data(17, 32)
    p = x.abs() + 0.1
    return nodes(x.exp() + p.log() - x.sin() * x.cos(), x.exp2() + p.log2() + p.pow(1.7) + x.tanh())


@graph
def transcendental_f64() -> list[LazyNode]:
    """The same transcendentals on float64, and an integer power (repeated squaring)."""
    x = data(18, 4, 8, dtype=np.float64)
    p = x.abs() + 0.1
    return nodes(x.exp() * p.log() + x.sin() - x.cos() + p.pow(0.3) + x ** 5)


# ---- reductions -------------------------------------------------------------------------------

@graph
def reduce_sum_axes() -> list[LazyNode]:
    """sum over one axis, two axes, everything, keepdim, and of an int64 tensor."""
    x = data(19, 4, 6, 8)
    n = data(20, 4, 6, 8, dtype=np.int64)
    return nodes(x.sum(0), x.sum((1, 2), keepdim=True), x.sum(), n.sum(-1), (x * 2).sum(1) + 1)


@graph
def reduce_max_mean() -> list[LazyNode]:
    """max, min, mean, var and prod, and a reduce of a reduce (two kernels)."""
    x = data(21, 5, 9, 3)
    return nodes(x.max(1), x.min((0, 2)), x.mean(-1, keepdim=True), x.var(1), (x * 0.5 + 1).prod(2),
                 x.max(2).sum(0))


@graph
def argmax_argmin() -> list[LazyNode]:
    """argmax / argmin: a reduce compared back against its input, then a min over positions."""
    x = data(22, 6, 10)
    return nodes(x.argmax(1), x.argmin(0, keepdim=True), x.argmax())


# ---- matmul -----------------------------------------------------------------------------------

@graph
def matmul_2d() -> list[LazyNode]:
    """A plain float32 matmul with an elementwise epilogue (a kernel after the matmul)."""
    a, b = data(23, 24, 32), data(24, 32, 16)
    return nodes((a @ b).relu())


@graph
def matmul_batched() -> list[LazyNode]:
    """Batched matmul, and a batch multiplying one shared matrix (broadcast batch)."""
    a, b, shared = data(25, 3, 8, 16), data(26, 3, 16, 12), data(27, 16, 12)
    return nodes(a @ b, a @ shared)


@graph
def matmul_transposed() -> list[LazyNode]:
    """Transposed operands: strided views that the matmul reads through or copies first."""
    a, b = data(28, 16, 24), data(29, 20, 16)
    c = data(30, 2, 16, 8)
    return nodes(a.T @ b.T, b @ a, c.transpose(-1, -2) @ c)


@graph
def matmul_float64() -> list[LazyNode]:
    """float64 matmul (its own tiling), a mixed-dtype promotion into it."""
    a, b = data(31, 12, 20, dtype=np.float64), data(32, 20, 10)
    return nodes(a @ b)


@graph
def matmul_small_and_int() -> list[LazyNode]:
    """What is not the packed kernel: a matrix-vector product, an int64 and a bool matmul."""
    a, v = data(33, 16, 32), data(34, 32)
    i, j = data(35, 4, 6, dtype=np.int64), data(36, 6, 3, dtype=np.int64)
    p, q = data(37, 4, 6, dtype=np.bool_), data(38, 6, 3, dtype=np.bool_)
    return nodes(a @ v, i @ j, p @ q)


# ---- compound ops -------------------------------------------------------------------------------

@graph
def softmax() -> list[LazyNode]:
    """softmax and log_softmax over the last axis and over a middle one."""
    x = data(39, 4, 10, 16)
    return nodes(x.softmax(-1), x.log_softmax(1))


@graph
def layernorm() -> list[LazyNode]:
    """nn.LayerNorm (affine) and functional layernorm over two axes."""
    x = data(40, 6, 4, 32)
    norm = td.nn.LayerNorm(32)
    with td.no_grad():
        return nodes(norm(x), x.layernorm((1, 2), eps=1e-3))


@graph
def conv2d() -> list[LazyNode]:
    """conv2d with bias, stride and padding (im2col read strided by the matmul), and a grouped one."""
    x = data(41, 2, 4, 12, 12)
    w, bias = data(42, 8, 4, 3, 3), data(43, 8)
    grouped = data(44, 4, 2, 3, 3)
    return nodes(x.conv2d(w, bias, stride=2, padding=1), x.conv2d(grouped, groups=2).relu())


@graph
def pooling() -> list[LazyNode]:
    """max_pool2d (tiled and strided windows, with padding) and avg_pool2d."""
    x = data(45, 2, 3, 8, 8)
    return nodes(x.max_pool2d(2), x.max_pool2d(3, stride=2, padding=1), x.avg_pool2d(2))


# ---- movement -------------------------------------------------------------------------------------

@graph
def views() -> list[LazyNode]:
    """reshape, permute, transpose, expand, flatten, squeeze/unsqueeze: views fused into loads."""
    x = data(46, 2, 3, 4, 5)
    v = data(47, 5)
    moved = x.permute(3, 1, 0, 2).reshape(5, 3, 8) + v.reshape(5, 1, 1)
    return nodes(moved, x.flatten(1).T * 2, v.unsqueeze(0).expand(4, 5).squeeze() + x.sum((0, 1)))


@graph
def slice_and_pad() -> list[LazyNode]:
    """Slices with steps and ints, shrink, zero and constant padding, a pad of a computed value."""
    x = data(48, 8, 10)
    sliced = x[1:7:2, ::3] + x[2, 1:5]
    return nodes(sliced, x.shrink(((2, 6), (0, 4))).pad(((1, 1), (2, 0))), (x * 2).pad(1, value=-1.0))


@graph
def cat_stack() -> list[LazyNode]:
    """cat of buffers along the first axis (a gather), along the last (a kernel), and stack."""
    a, b, c = data(49, 4, 6), data(50, 2, 6), data(51, 4, 6)
    return nodes(td.cat([a, b, c]), td.cat([a, c * 2], axis=1), td.stack([a, c.exp()], axis=1))


@graph
def contiguous_shared() -> list[LazyNode]:
    """A value read by several kernels: materialized once (contiguous, transcendental, reduce)."""
    x = data(52, 16, 16)
    e = x.exp()
    t = (x + 1).T.contiguous()
    return nodes(e.sum(0) + e.sum(1), t * t.sum(0), (e * t).max(1))


@graph
def zero_size_and_const() -> list[LazyNode]:
    """Factories: constants (full, ones: no input buffer), arange and eye (uploaded), an empty tensor (no call)."""
    empty = td.Tensor(np.zeros((0, 4), np.float32))
    return nodes(td.Tensor.full((3, 4), 2.5) * td.Tensor.ones(4), td.Tensor.arange(12).reshape(3, 4) + 1,
                 td.Tensor.eye(4, dtype=td.float64) * 3, empty + 1)


# ---- assign ---------------------------------------------------------------------------------------

@graph
def assign_in_place() -> list[LazyNode]:
    """Assigns: in place, broadcast and cast; readers of the old value built before are ordered first (WAR)."""
    x, y = data(53, 6, 8), data(54, 6, 8)
    reader = x * 2
    view_reader = x.T[1:]
    x.assign((x + y) * 0.5)
    y.assign(td.Tensor(np.arange(8, dtype=np.int64)))
    return nodes(x, reader, view_reader, y)


@graph
def assign_transpose() -> list[LazyNode]:
    """An assign that reads its own memory transposed: computed aside, then copied over."""
    x = data(55, 8, 8)
    x.assign(x.T + 1)
    return nodes(x)


# ---- gather-like indexing, losses ---------------------------------------------------------------

@graph
def embedding_one_hot() -> list[LazyNode]:
    """nn.Embedding (a one-hot matmul) and cross_entropy's label pick (a one-hot reduce)."""
    embed = td.nn.Embedding(10, 8)
    index = td.Tensor(np.array([[1, 4, 9], [0, 4, 2]], np.int64))
    logits = data(56, 6, 10)
    with td.no_grad():
        return nodes(embed(index), F.cross_entropy(logits, index.reshape(-1)), F.nll_loss(logits.log_softmax(), index.reshape(-1)))


# ---- several devices --------------------------------------------------------------------------------

@graph
def sharded_direct_allreduce() -> list[LazyNode]:
    """A tensor sharded over CPU:0 / CPU:1: per-shard kernels, then a direct allreduce (slice kernels)."""
    x = data(57, 8, 96).shard(["CPU:0", "CPU:1"], axis=0)
    return nodes((x * 2 + 1).sum(axis=0, algorithm="direct"))


@graph
def sharded_naive_and_gather() -> list[LazyNode]:
    """Naive allreduce (peer loads) of a max, a sharded matmul, and a gather onto CPU:0."""
    x = data(58, 6, 16).shard(["CPU:0", "CPU:1"], axis=0)
    w = data(59, 16, 4)
    return nodes(x.max(axis=0, algorithm="naive"), (x @ w).relu().to("CPU:0"))


@graph
def sharded_ring_allreduce() -> list[LazyNode]:
    """Ring allreduce: reduce-scatter and allgather in chunks (copies, slices, a gather of chunks)."""
    x = data(60, 4, 64).shard(["CPU:0", "CPU:1"], axis=0)
    return nodes(x.sum(axis=0, algorithm="ring"))


# ---- training ---------------------------------------------------------------------------------------

def _captured_step(loss: td.Tensor, optimizer: td.optim.Optimizer, with_grads: bool = False) -> list[LazyNode]:
    """backward and `optimizer.step()` as td.jit captures them: nothing is realized, and the targets
    are the loss (with `with_grads`, then every parameter's gradient) and each assign the step made."""
    with observe_assigns() as assigns:
        loss.backward()
        grads = [p.grad for p in optimizer.params if with_grads and p.grad is not None]
        optimizer.step()
    return nodes(loss, *grads) + assigns


@graph
def mlp_sgd_step() -> list[LazyNode]:
    """An nn MLP forward, cross-entropy backward (gradients as targets too), and an SGD momentum step."""
    model = td.nn.Sequential(td.nn.Linear(12, 32), td.nn.ReLU(), td.nn.Linear(32, 5))
    x, labels = data(61, 8, 12), td.Tensor(np.array([0, 1, 2, 3, 4, 0, 1, 2], np.int64))
    optimizer = td.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return _captured_step(F.cross_entropy(model(x), labels), optimizer, with_grads=True)


@graph
def cnn_adam_step() -> list[LazyNode]:
    """A small CNN (conv, relu, max pool, linear) with an MSE loss and an Adam step (L2 weight decay).

    Not AdamW: its decoupled decay assigns each parameter twice, and the second assign realizes
    the first, even inside a td.jit capture (the captured step then replays without the decay)."""
    model = td.nn.Sequential(td.nn.Conv2d(2, 4, 3, padding=1), td.nn.ReLU(), td.nn.MaxPool2d(2), td.nn.Flatten(),
                             td.nn.Linear(4 * 4 * 4, 3))
    x, target = data(62, 2, 2, 8, 8), data(63, 2, 3)
    optimizer = td.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.01)
    return _captured_step(F.mse_loss(model(x), target), optimizer)


# ---- rendering ----------------------------------------------------------------------------------------

def program(call: Call) -> tuple[str, str] | None:
    """(name, LLVM IR) of the program `call` launches; None for copies (see the module docstring)."""
    if isinstance(call, (KernelCall, SliceCall)):
        return lower(call.ast)
    if isinstance(call, MatmulCall):
        name = program_name(call.dtype.name, call.strided)
        return name, matmul_ir(name, call.dtype.name, strided=call.strided)
    return None


def _fields(item: BufferSpec | Call, skip: tuple[str, ...] = ()) -> str:
    """Every field as name=repr: all of a call's arguments, not only what `describe()` says."""
    return " ".join(f"{f.name}={getattr(item, f.name)!r}" for f in fields(item) if f.name not in skip)


def _render_schedule(schedule: Schedule, names: list[str | None]) -> list[str]:
    lines = [f"inputs {schedule.n_inputs}, targets {list(schedule.targets)}, aliases {schedule.aliases}", "buffers"]
    lines += [f"  {number}: {_fields(spec)}" for number, spec in enumerate(schedule.specs)]
    lines.append("calls")
    for index, (description, call, name) in enumerate(zip(schedule.describe(), schedule.linear, names, strict=True)):
        lines.append(f"  {index}: {description}")
        lines.append(f"     {_fields(call, skip=('ast',))}")
        if name is not None:
            lines.append(f"     program {name}")
    plan = schedule.plan
    lines += ["memory", f"  {plan.report()}"]
    lines += [f"  arena {device} {lane}: {size} bytes" for (device, lane), size in plan.arena_bytes.items()]
    lines += [f"  buffer {number}: {plan.arena_of[number]} offset {offset}, live over calls {plan.lifetimes[number]}"
              for number, offset in plan.offsets.items()]
    return lines


def render(name: str) -> str:
    """The golden text of graph `name`: its schedule, then each distinct program's IR once."""
    builder = GRAPHS[name]
    before = schedule_cache.hits + schedule_cache.misses
    targets = builder()
    if schedule_cache.hits + schedule_cache.misses != before:
        raise AssertionError(f"building graph {name!r} realized something (a schedule was made): the corpus only "
                             "builds graphs, or its golden would miss what ran and the test would compile and run kernels")
    schedule, _ = create_schedule(targets)
    texts: dict[str, str] = {}
    users: dict[str, list[int]] = {}
    names: list[str | None] = []
    for index, call in enumerate(schedule.linear):
        found = program(call)
        names.append(found[0] if found else None)
        if found is not None:
            texts.setdefault(found[0], found[1])
            users.setdefault(found[0], []).append(index)
    summary = (builder.__doc__ or "").strip().splitlines()[0]
    lines = [f"# process replay: {name}: {summary}", "", "== schedule",
             *_render_schedule(schedule, names)]
    for kernel, text in texts.items():
        lines += ["", f"== program {kernel} (calls {', '.join(map(str, users[kernel]))})", text.rstrip("\n")]
    return "\n".join(lines) + "\n"
