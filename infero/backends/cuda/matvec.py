"""Launcher for kernels/matvec.cu: out[n, rows] = x[n, cols] @ dequant(W)^T (+ bias) for 1 <= n <= 16 tokens.

Block formats: one small kernel quantizes x to two int8 planes in 32-element groups (into the workspace): x and
the residual of its int8 rounding at 1/256 of the first plane's scale, so x ~ D (256 q0 + q1) to ~1e-5 of the
group's largest value (one plane alone, ~1%, put SmolLM2's logits 1-7% off); then the mat-vec dots both against
the packed weights with __dp4a and combines them in integers. Float weights
(F32/F16/BF16) multiply float32 activations. Each weight byte is read once for all n tokens. The variant (tokens
N, rows per warp RPW, warps per block) is chosen from n and the matrix shape. A block-format row is
kernels/unit_value.cuh's definition: a value per 32-column unit from exact integer dots and the block's scales, the
8 units of each 256-column span by a fixed tree, the spans in fixed point (kernels/fixed_point.cuh: each rounded
once onto 2^-32, added as int64), so no split or order of the spans changes a bit: results are bitwise batch
invariant, and matvec_q, matvec_mma and its fused forms, the experts' kernels and the int8 GEMM (linear_mma) give a
row the same bits. Float weights sum in an order fixed by the width alone.

Q4_K runs matvec_mma, and Q6_K where its rows are a multiple of 2048 wide; every other block format matvec_q. The
mma kernel computes tiles of 16 rows on the tensor cores (two int8 planes as B columns, exact int32 sums) from
weights staged through shared memory by cp.async: on the H200 Q4_K 2-24% faster on the decode shapes of an 8B
model and 4.2 against 3.5 TB/s at steady state, Q6_K 8-33% (its 1024-row v projection excepted) and 3.7 against
2.9 on the 8B's head (scripts/bench_matvec_mma.py, docs/performance.md), measured with float sums.

matvec_many runs up to three block-format matrices that read the same x in one launch, bitwise what separate calls
give: a layer's q/k/v and gate/up take two launches instead of five (on the H200 the 8B's decode step lost
~0.1-0.2 ms with it, the 0.5B's nothing measurable: programmatic launch already hid most launch gaps).

matvec_rope is matvec_many for a decode step's q/k/v (one or two tokens) with rotary_store_kv's work in its
epilogue: q and k rotated, k and v into the KV cache, bitwise what the two launches give (kernels/rope.cuh).

matvec_glu is a decode step's gate + up + SwiGLU in one launch; matvec_norm a decode step's o or down projection with
the residual add and the next RMSNorm in its epilogue, the norm's 1 / rms left to the mat-vecs that read its output
(an Activation with norm_ss): no norm kernel runs between a decode step's mat-vecs (on the H200 the 8B's step took
184 us less, docs/performance.md).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np

from infero.backends.cuda import driver, runtime
from infero.backends.cuda.tensor import DeviceTensor, QuantWeight, Workspace
from infero.checkpoint.tensor_types import GGMLType

SOURCE = "matvec.cu"
MAX_TOKENS = 16
ROPE_MAX_TOKENS = 2  # matvec_q's ROPE epilogue is compiled for N = 1 and 2
TOKEN_BUCKETS = (1, 2, 4, 8, 16)  # template N; a call with n tokens runs the smallest N >= n
FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16
QUANT_TYPES = (2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23)  # Q4_0 .. Q6_K, IQ4_NL, IQ4_XS
QUANTIZE_THREADS = 256
UNIT_ELEMS = {10: 64, 11: 64}  # elements per unit (a lane's work item) where not 32: Q2_K, Q3_K (matvec.cu)


def _variants() -> list[tuple[int, int]]:
    """(N, RPW) pairs compiled: N = 1 with one or two rows per warp, larger N with two."""
    return [(1, 1)] + [(n, 2) for n in TOKEN_BUCKETS]


# (rows per warp, prefetch depth) compiled for N = 1: what plan() can choose (-1: the kernel's default depth).
N1_VARIANTS = ((1, -1), (1, 1), (2, -1), (2, 1), (2, 2), (2, 3), (2, 4))
Q4_K, Q6_K = int(GGMLType.Q4_K), int(GGMLType.Q6_K)
# The types matvec_mma (tensor cores) runs, every other block format matvec_q: bytes a ring stage holds of a row
# (matvec.cu's MmaQ4K::ROW and MmaQ6K::ROW: a pair of superblocks, Q6_K's in the 27 16-byte pieces around it).
MMA_ROW = {Q4_K: 288, Q6_K: 432}
# The widths it takes a multiple of: Q6_K copies a row's pieces from its start, so rows must be 16-byte aligned
# (210-byte superblocks, 8 of them); its other widths take matvec_q.
MMA_COLS = {Q4_K: 256, Q6_K: 2048}
# (warps per block, ring stages) of matvec_mma that mma_plan can choose.
MMA_SHAPES = ((4, 2), (4, 3), (8, 2))
# (type of q and k, type of v) that one matvec_rope launch takes mixed: Q4_K_M stores some layers' v as Q6_K.
MMA_MIXED = ((Q4_K, Q6_K),)
# Ring stages of matvec_mma_glu (gate, up and SwiGLU in one launch): with 2, an 8B's 448 Q4_K blocks of gate + up
# are one wave at 4 blocks an SM; 3 and 4 leave room for 3 (two waves) and measured 0.2 ms slower in its step.
GLU_STAGES = 2

runtime.declare(SOURCE, ["matvec_quantize_x"])
for _t in QUANT_TYPES:
    runtime.declare(
        SOURCE,
        [f"matvec_q<{_t}, 1, {r}, {a}>" for r, a in N1_VARIANTS]
        + [f"matvec_q<{_t}, {n}, {r}, -1>" for n in TOKEN_BUCKETS[1:] for r in (2, 4) if n * r < 64]
        + [f"matvec_q<{_t}, {n}, 2, {a}, true>" for n, a in ((1, 1), (2, -1))],
        needs=(runtime.weight_type(_t),),
    )
for _t in FLOAT_TYPES:
    runtime.declare(SOURCE, [f"matvec_f<{_t}, {n}, {r}>" for n, r in _variants()], needs=(runtime.weight_type(_t),))
# matvec_mma's instantiations of a type in parts, compiled in parallel: in one unit, Q6_K's 15 without an epilogue
# took 21 CPU-seconds, the longest unit of an 8B Q4_K_M model (docs/performance.md, "Cold start").
for _t in MMA_ROW:
    _needs = (runtime.weight_type(_t),)
    for _n in TOKEN_BUCKETS:
        runtime.declare(SOURCE, [f"matvec_mma<{_t}, {_n}, {w}, {s}, false>" for w, s in MMA_SHAPES],
                        needs=_needs, part=f"mma {_n}")  # fmt: skip
    runtime.declare(SOURCE, [f"matvec_mma<{_t}, {n}, {w}, {s}, true>" for n in (1, 2) for w, s in MMA_SHAPES]
                    + [f"matvec_mma_glu<{_t}, {n}, {GLU_STAGES}>" for n in (1, 2)],
                    needs=_needs, part="mma rope glu")  # fmt: skip
    runtime.declare(SOURCE, [f"matvec_mma_norm<{_t}, {n}, {w}, {s}>" for n in (1, 2) for w, s in MMA_SHAPES],
                    needs=_needs, part="mma norm")  # fmt: skip
for _t, _t2 in MMA_MIXED:
    runtime.declare(SOURCE, [f"matvec_mma<{_t}, {n}, 4, {s}, true, {_t2}>" for n in (1, 2) for s in (2, 3)],
                    needs=(runtime.weight_type(_t), runtime.weight_type(_t2)))  # fmt: skip

MAX_SEGMENTS = 3  # matrices per matvec_q launch (matvec.cu's mv::MAX_SEGMENTS)
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong


class Segments(ctypes.Structure):
    """matvec.cu's mv::Segments, passed to matvec_q by value (unused segments: rows 0)."""

    _fields_ = [("weight", _P * MAX_SEGMENTS), ("bias", _P * MAX_SEGMENTS), ("out", _P * MAX_SEGMENTS),
                ("rows", _I * MAX_SEGMENTS), ("tiled", _I * MAX_SEGMENTS)]  # fmt: skip


class Rope(ctypes.Structure):
    """matvec.cu's mv::Rope: the q/k/v epilogue of matvec_q's ROPE instantiations (zeros for the others)."""

    _fields_ = [("positions", _P), ("slots", _P), ("inv_freq", _P), ("k_cache", _P), ("v_cache", _P),
                ("role", _I * MAX_SEGMENTS), ("head_dim", _I), ("neox", _I), ("mscale", ctypes.c_float)]  # fmt: skip


ROPE_ROLES = ("q", "k", "v")  # mv::RopeRole
_Q_ARGS = (None, _P, _P, _I, _I, _L, None)  # None: a ctypes.Structure, passed by value (driver.launch)
_NO_ROPE = Rope()
_F_ARGS = (_P, _P, _P, _P, _I, _I, _I, _L, _I)
_QUANTIZE_ARGS = (_P, _P, _P, _I, _I)
_MMA_ARGS = _Q_ARGS + (_I, ctypes.c_float)  # matvec_mma: matvec_q's, then whether a norm is deferred, and its eps
_GLU_ARGS = (None, _P, _P, _I, _I, _L, _P, _P, _I, ctypes.c_float)
_NORM_ARGS = (None, _P, _P, _I, _I, _L, _P, _P, _P, _P, _P)
# Widest row whose deferred norm a reader takes (matvec.cu's NORM_LOADS groups of 32 per lane).
NORM_MAX_COLS = 8 * 32 * 32
# Static shared memory of matvec_mma's partial sums (matvec.cu's mv::Parts: 16 m-rows' int64 sums and float NaN
# probes), per warp and token.
_MMA_PART_BYTES = 192
_MMA_ZERO_BYTES = 256  # and of the zero bytes its B columns read below 3 tokens (matvec.cu's zero_act)
_launches: dict[tuple, tuple] = {}  # (type, rows of each matrix, n, cols) -> (function, grid, block, shared)
_mma_shared: dict = {}  # matvec_mma function -> the dynamic shared memory it is allowed
_mma_fits: dict[tuple[int, int], bool] = {}  # (type, cols) -> takes_mma
_functions: dict[str, object] = {}
runtime.on_reload(_functions.clear)
runtime.on_reload(_launches.clear)
_num_sms: list[int] = []


def _kernel(expression: str):
    fn = _functions.get(expression)
    if fn is None:
        fn = _functions[expression] = runtime.kernel(SOURCE, expression)
    return fn


def _sms() -> int:
    if not _num_sms:
        _num_sms.append(runtime.context().info.num_sms)
    return _num_sms[0]


# Block formats whose raw unit is large (more registers per prefetched unit): one row per warp on long rows.
_LARGE_UNIT_TYPES = (11, 14)  # Q3_K, Q6_K


def plan(rows: int, n: int, num_sms: int, t: int = -1, units: int = 32) -> tuple[int, int, int, int]:
    """(N, rows per warp, warps per block, prefetch depth) for n tokens on a matrix of `rows` rows of type t whose
    rows have `units` units (matvec.cu's per-lane work items).

    From the sweeps on the H200 (docs/performance.md): at N = 1 a matrix of at most 16 rows per SM wants each
    lane's whole row in flight at once (depth up to 4; scripts/bench_matvec.py); past that, depth 1 (inside the
    decode step, scripts/sweep_decode_plan.py: the 4096- and 6144-row matrices of an 8B model too, which alone
    ran best at depth 2: in the step their first loads overlap the kernel before and the registers a deeper ring
    takes cost resident warps); rows of one unit per lane gain nothing from prefetch and run best one row per
    warp."""
    big_n = next(b for b in TOKEN_BUCKETS if b >= n)
    rpw, ahead = 2, -1
    if big_n == 1 and t not in FLOAT_TYPES:
        per_lane = -(-units // 32)
        if per_lane == 1 and rows < 512 * num_sms:
            rpw, ahead = 1, 1
        elif rows <= 16 * num_sms:
            # Q6_K's ring of 3-4 units over two rows: 6.05 us on 1024x4096 against 3.00 over one row.
            rpw, ahead = 1 if t == int(GGMLType.Q6_K) else 2, min(per_lane - 1, 4)
        else:
            rpw = 1 if t in _LARGE_UNIT_TYPES and per_lane >= 8 and rows < 512 * num_sms else 2
            ahead = 1
    elif big_n == 1:
        rpw = 1 if rows < 16 * num_sms else 2
    elif big_n >= 8 and t not in FLOAT_TYPES:
        # Batches re-read each token's activations per row: four rows per warp halve that traffic, which binds on
        # long or Q6_K rows at N = 8; short Q4_K matrices keep the occupancy of two (sweep, n = 8). At N = 16 four
        # rows measured faster with float sums, but their 64 int64 fixed-point sums a lane spill: two rows.
        few = rows <= 16 * num_sms and t not in _LARGE_UNIT_TYPES
        if big_n == 8 and not few and (t in _LARGE_UNIT_TYPES or rows >= 64 * num_sms):
            rpw = 4
    return big_n, rpw, _warps_per_block(-(-rows // rpw), num_sms), ahead


def _warps_per_block(warps: int, num_sms: int) -> int:
    """The most warps per block (up to 4) that still leave at least two blocks per SM."""
    return 4 if warps >= 4 * num_sms else 2 if warps >= 2 * num_sms else 1


def activation_shapes(n: int, cols: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the activation format of n rows of `cols` (kernels/act_quant.cuh): xq int8 (two planes) and xs
    int32 ({D as float bits, the half's sum} per 16 elements)."""
    return (2, n, cols), (n, cols // 16, 2)


class Activation(NamedTuple):
    """An activation in the mat-vec's format (activation_shapes): q int8, s int32. norm_ss: where matvec_norm wrote
    it, the activation is residual * norm weight and norm_ss float32 [n, cols / 32], right after s in memory (the
    readers stage both in one copy), holds the sum of squares of each 32-element group of the residual: the RMSNorm's
    1 / rms (with eps) is left to the reader, a tensor-core mat-vec of one or two tokens. A plain (q, s) tuple is an
    activation without a deferred norm."""

    q: DeviceTensor
    s: DeviceTensor
    norm_ss: DeviceTensor | None = None
    eps: float = 0.0


def _deferred_norm(quantized) -> tuple[int, float]:
    """The kernels' (deferred, eps) arguments: (1, eps) for an activation whose RMSNorm its reader applies, else 0."""
    if len(quantized) > 2 and quantized[2] is not None:
        return 1, float(quantized[3])
    return 0, 0.0


def check_activation(quantized: tuple[DeviceTensor, DeviceTensor], rows: int, cols: int) -> None:
    """Raise ValueError unless quantized is (xq int8, xs int32) of activation_shapes(rows, cols), cols % 32 == 0:
    the buffers a kernel that writes its output in the activation format is handed (an Activation: with its
    norm_ss float32 [rows, cols / 32] right after xs, if it has one)."""
    xq, xs = quantized[0], quantized[1]
    if cols % 32:
        raise ValueError(f"only rows of a multiple of 32 elements can be quantized, got {cols}")
    q_shape, s_shape = activation_shapes(rows, cols)
    if xq.dtype != np.int8 or xq.shape != q_shape:
        raise ValueError(f"xq must be int8 {list(q_shape)}, got {xq.dtype} {xq.shape}")
    if xs.dtype != np.int32 or xs.shape != s_shape:
        raise ValueError(f"xs must be int32 {list(s_shape)}, got {xs.dtype} {xs.shape}")
    norm_ss = quantized[2] if len(quantized) > 2 else None
    if norm_ss is not None and (norm_ss.dtype != np.float32 or norm_ss.shape != (rows, cols // 32)):
        raise ValueError(f"norm_ss must be float32 {[rows, cols // 32]}, got {norm_ss.dtype} {norm_ss.shape}")
    if norm_ss is not None and norm_ss.ptr != xs.ptr + xs.nbytes:
        raise ValueError("norm_ss must follow xs in memory (the mat-vecs stage them in one copy)")


def _check_deferred_norm(quantized, n: int, cols: int, mma: bool) -> str | None:
    """What keeps a mat-vec launch from applying its activation's deferred norm, or None (also where it has none)."""
    if not _deferred_norm(quantized)[0]:
        return None
    if not mma or n > 16 or cols > NORM_MAX_COLS or cols % 128:
        return (f"an activation with a deferred RMSNorm is read by the tensor-core mat-vecs of 1-16 tokens and "
                f"rows of at most {NORM_MAX_COLS} only, not {n} tokens of {cols} on this weight type")  # fmt: skip
    return None


def quantize(xq: DeviceTensor, xs: DeviceTensor, x: DeviceTensor, stream: driver.Stream) -> None:
    """x float32 [n, cols] (cols % 32 == 0, 16-byte aligned) into the mat-vec's activation format:
    xq int8 and xs int32 of activation_shapes(n, cols) (kernels/act_quant.cuh)."""
    n, cols = x.shape
    if x.dtype != np.float32 or cols % 32 or x.ptr % 16:
        raise ValueError(f"quantize: x must be float32 [n, cols] with cols % 32 == 0, 16-byte aligned; got {x.shape}")
    if (xq.shape, xs.shape) != activation_shapes(n, cols):
        raise ValueError(f"quantize: xq {xq.shape} / xs {xs.shape} do not fit x {x.shape}")
    chunks = n * cols // 8
    driver.launch(_kernel("matvec_quantize_x"), (-(-chunks // QUANTIZE_THREADS),), (QUANTIZE_THREADS,),
                  (xq.ptr, xs.ptr, x.ptr, n, cols), _QUANTIZE_ARGS, stream, pdl=True)  # fmt: skip


def segments(outs: list[DeviceTensor], weights: list[QuantWeight], biases: list[DeviceTensor | None]) -> Segments:
    """The Segments argument of matvec_q for these matrices (at most MAX_SEGMENTS)."""
    seg = Segments()
    for i, (out, weight, bias) in enumerate(zip(outs, weights, biases, strict=True)):
        seg.weight[i], seg.out[i], seg.rows[i], seg.tiled[i] = weight.data.ptr, out.ptr, weight.rows, weight.tiled
        seg.bias[i] = bias.ptr if bias is not None else None
    return seg


def mma_shared(t: int, warps: int, stages: int, n: int, cols: int, t2: int | None = None,
               deferred: bool = False) -> int:  # fmt: skip
    """Dynamic shared memory of matvec_mma: the warps' rings (stages of the larger row where a launch mixes types
    t and t2), and below 3 tokens the staged activation (two int8 planes and their scales; deferred: and a deferred
    norm's sums, Activation)."""
    row = max(MMA_ROW[t], MMA_ROW[t2 if t2 is not None else t])
    return warps * stages * 16 * row + ((5 * n * cols // 2 + (n * cols // 8 if deferred else 0)) if n <= 2 else 0)


def mma_plan(t: int, tiles: int, cols: int, num_sms: int) -> tuple[int, int]:
    """(warps per block, ring stages) of matvec_mma for `tiles` tiles of 16 rows of `cols` columns of type t.
    From the H200 (scripts/bench_matvec_mma.py): long Q4_K rows split over 8 warps (4096x14336: 11.8 us against
    13.6 over 4), Q6_K rows over 4 (4096x14336: 18.0 against 19.5; its 7 KiB stages over 8 warps leave one block
    an SM); a launch of about two Q4_K tiles per SM or fewer keeps three pairs in flight a warp (4096x4096: 4.7 us
    against 5.2), larger ones two (14336x4096: 12.0 us against 14.0); Q6_K three up to one tile per SM (1024x4096:
    3.5 against 3.8; 4096x4096: 6.5 with two against 7.5). The warps split each row's fixed-point sum: no choice here
    changes a bit."""
    if _mma_warps(t, cols) == 8:
        return 8, 2
    return (4, 3) if tiles <= (num_sms if t == Q6_K else 2 * num_sms) else (4, 2)


def _mma_warps(t: int, cols: int) -> int:
    return 8 if t == Q4_K and cols >= 8192 else 4


def _mma_deepest(t: int, cols: int) -> tuple[int, int]:
    """matvec_mma's warps at this type and width and the most ring stages it may take with them: the shape whose
    shared memory every fit check must allow (one decision for every launch of the width)."""
    warps = _mma_warps(t, cols)
    return warps, max(s for w, s in MMA_SHAPES if w == warps)


_tensor_cores = [True]


def use_tensor_cores(on: bool) -> None:
    """Whether a type takes matvec_mma where takes_mma's shapes allow (the default, in both modes), or always
    matvec_q: the tests and benchmarks that compare the two turn it off. A row has the same bits either way: both
    kernels compute unit_value.cuh's definition (docs/kernels.md, batch invariance; tests/cuda/test_matvec.py)."""
    if _tensor_cores[0] != on:
        _tensor_cores[0] = on
        _launches.clear()
        _mma_fits.clear()


def takes_mma(t: int, cols: int) -> bool:
    """Whether matvec_mma runs this type and width: a type of MMA_ROW whose rings, staged activation and partial
    sums fit the GPU's shared memory at every token count (one decision for every batch width; matvec_q, which runs
    the other widths, gives the same bits: e.g. Q4_K rows of more than ~31k columns on the
    H200, 8k and more on sm_89's 99 KiB; Q6_K ~29k and 3k). Q6_K takes it at multiples of 2048 columns only."""
    if not _tensor_cores[0] or t not in MMA_ROW or cols % MMA_COLS[t]:
        return False
    fits = _mma_fits.get((t, cols))  # asked per layer on eager steps (rope_pays): computed once per width
    if fits is None:
        warps, stages = _mma_deepest(t, cols)
        static = _MMA_PART_BYTES * warps
        need = max(mma_shared(t, warps, stages, n, cols) + static * n + _MMA_ZERO_BYTES for n in TOKEN_BUCKETS)
        fits = _mma_fits[(t, cols)] = need <= _shared_optin()
    return fits


def mixes(types: tuple[int, ...], cols: int) -> bool:
    """Whether matvec_rope takes these three matrices (q, k, v) of mixed types in one matvec_mma launch: q and k of
    one type and v of another per MMA_MIXED, both on the tensor cores at this width with the same warps, so every
    row gets the bits its type's own launch gives it."""
    return (len(types) == 3 and types[0] == types[1] and (types[0], types[2]) in MMA_MIXED
            and takes_mma(types[0], cols) and takes_mma(types[2], cols)
            and _mma_warps(types[0], cols) == _mma_warps(types[2], cols) == 4)  # fmt: skip


def glu_fits(gate: QuantWeight, up: QuantWeight, n: int) -> bool:
    """Whether matvec_glu runs these gate and up projections for n tokens: one type on the tensor cores at their
    width, the same shape and layout, whole groups of 32 rows, one or two tokens, and its shared memory fits."""
    t, cols, rows = gate.ggml_type, gate.cols, gate.rows
    same = (up.ggml_type, up.cols, up.rows, up.tiled) == (t, cols, rows, gate.tiled)
    static = 16 * _MMA_PART_BYTES * n + _MMA_ZERO_BYTES
    return (1 <= n <= 2 and same and rows % 32 == 0
            and takes_mma(t, cols) and _glu_shared(t, n, cols) + static <= _shared_optin())  # fmt: skip


def _glu_shared(t: int, n: int, cols: int, deferred: bool = False) -> int:
    return mma_shared(t, 4, GLU_STAGES, n, cols, deferred=deferred)


def matvec_glu(
    out: DeviceTensor,
    gate: QuantWeight,
    up: QuantWeight,
    x: DeviceTensor,
    biases: tuple[DeviceTensor | None, DeviceTensor | None],
    quantized: tuple[DeviceTensor, DeviceTensor],
    out_quantized: tuple[DeviceTensor, DeviceTensor],
    stream: driver.Stream,
) -> None:
    """out [n, rows] = silu(x @ dequant(gate)^T + b_gate) * (x @ dequant(up)^T + b_up) for a decode step of one or
    two tokens (glu_fits), in one launch that also writes out in the activation format to out_quantized (the down
    projection's input). quantized: x in the activation format. A row's sum is split over 4 warps, each taking every
    fourth superblock pair (in fixed point: the bits matvec gives the row), then SwiGLU and the quantization as the
    swiglu kernel's (matvec.cu's matvec_mma_glu)."""
    n, t, cols, rows = x.shape[0], gate.ggml_type, gate.cols, gate.rows
    error = _check_many([out, out], [gate, up], x, list(biases)) or (
        None if glu_fits(gate, up, n) else f"{_type_name(t)} {rows}x{cols} and {n} tokens do not take it (glu_fits)"
    )
    if error:
        raise ValueError(f"matvec_glu: {error}")
    check_activation(quantized, n, cols)
    check_activation(out_quantized, n, rows)
    if error := _check_deferred_norm(quantized, n, cols, True):
        raise ValueError(f"matvec_glu: {error}")
    deferred = _deferred_norm(quantized)
    fn = _kernel(f"matvec_mma_glu<{t}, {n}, {GLU_STAGES}>")
    shared = _glu_shared(t, n, cols, bool(deferred[0]))
    _allow_shared(fn, shared)
    args = (segments([out, out], [gate, up], list(biases)), quantized[0].ptr, quantized[1].ptr, n, cols,
            gate.data.shape[1], out_quantized[0].ptr, out_quantized[1].ptr, *deferred)  # fmt: skip
    driver.launch(fn, (rows // 32,), (128,), args, _GLU_ARGS, stream, shared, pdl=True, carveout=True)


def reads_deferred_norm(weight: QuantWeight, n: int) -> bool:
    """Whether this weight's mat-vec (matvec_mma, and matvec_glu where glu_fits) takes an activation whose RMSNorm
    is deferred to it (Activation.norm_ss), for n tokens: 1-16, rows of at most NORM_MAX_COLS; below 3 tokens its
    shared memory must hold the norm's sums too (they are staged with the activation)."""
    t, cols = weight.ggml_type, weight.cols
    if not (1 <= n <= 16 and cols <= NORM_MAX_COLS and cols % 128 == 0 and takes_mma(t, cols)):
        return False
    if n > 2:
        return True
    warps, stages = _mma_deepest(t, cols)
    optin = _shared_optin()
    mma = mma_shared(t, warps, stages, n, cols, deferred=True) + warps * _MMA_PART_BYTES * n
    glu = _glu_shared(t, n, cols, True) + 16 * _MMA_PART_BYTES * n
    return max(mma, glu) + _MMA_ZERO_BYTES <= optin


def norm_fits(weight: QuantWeight, n: int) -> bool:
    """Whether matvec_norm runs this weight for n tokens: one or two tokens of a type on the tensor cores at its
    width, whole groups of 32 rows and at most NORM_MAX_COLS of them (what its readers take), and its shared memory
    fits."""
    t, rows, cols = weight.ggml_type, weight.rows, weight.cols
    if not (1 <= n <= 2 and rows % 32 == 0 and rows <= NORM_MAX_COLS and takes_mma(t, cols)):
        return False
    warps, _, shared = _norm_launch(t, rows, cols, n)
    return shared + 2 * warps * _MMA_PART_BYTES * n + _MMA_ZERO_BYTES <= _shared_optin()


def _norm_launch(t: int, rows: int, cols: int, n: int) -> tuple[int, int, int]:
    """(warps a tile, ring stages, dynamic shared bytes) of matvec_mma_norm: matvec_mma's plan for the rows, two
    tiles a block."""
    warps, stages = mma_plan(t, rows // 16, cols, _sms())
    return warps, stages, mma_shared(t, 2 * warps, stages, n, cols)


def matvec_norm(
    residual: DeviceTensor,
    weight: QuantWeight,
    x: DeviceTensor,
    quantized: tuple[DeviceTensor, DeviceTensor],
    norm_weight: DeviceTensor,
    out_quantized: Activation,
    stream: driver.Stream,
) -> None:
    """A decode step's linear layer into the residual stream and the RMSNorm after it, for the mat-vecs that read the
    norm (norm_fits): residual [n, rows] += x @ dequant(weight)^T, and out_quantized (an Activation with norm_ss and
    eps) receives residual * norm_weight in the activation format with each group's sum of squares, so that its
    readers (matvec_mma, matvec_mma_glu) apply the norm's 1 / rms (matvec.cu's matvec_mma_norm). quantized: x in the
    activation format. Each row's sum is bitwise what matvec gives it, the residual too."""
    n, t, cols, rows = x.shape[0], weight.ggml_type, weight.cols, weight.rows
    error = _check(residual, weight, x, None) or (
        None if norm_fits(weight, n) else f"{_type_name(t)} {rows}x{cols} and {n} tokens do not take it (norm_fits)"
    )
    if error:
        raise ValueError(f"matvec_norm: {error}")
    if norm_weight.dtype != np.float32 or norm_weight.numel != rows:
        raise ValueError(f"matvec_norm: norm_weight must be float32 [{rows}], got {norm_weight.dtype} "
                         f"{norm_weight.shape}")  # fmt: skip
    check_activation(quantized, n, cols)
    check_activation(out_quantized, n, rows)
    if _deferred_norm(quantized)[0] or not _deferred_norm(out_quantized)[0]:
        raise ValueError("matvec_norm: its input cannot have a deferred norm, and its output needs norm_ss")
    warps, stages, shared = _norm_launch(t, rows, cols, n)
    fn = _kernel(f"matvec_mma_norm<{t}, {n}, {warps}, {stages}>")
    _allow_shared(fn, shared)
    args = (segments([residual], [weight], [None]), quantized[0].ptr, quantized[1].ptr, n, cols,
            weight.data.shape[1], residual.ptr, norm_weight.ptr, *(a.ptr for a in out_quantized[:3]))  # fmt: skip
    driver.launch(fn, (rows // 32,), (64 * warps,), args, _NORM_ARGS, stream, shared, pdl=True, carveout=True)


def _shared_optin() -> int:
    return runtime.context().info.max_shared_per_block_optin


def _launch_q(t: int, rows: tuple[int, ...], n: int, cols: int) -> tuple:
    """(function, grid, block, dynamic shared bytes, whether matvec_mma) of the mat-vec for matrices of these row
    counts: matvec_q planned on the rows their warps cover together (each matrix but the last rounded up to the most
    rows per warp a variant has), or matvec_mma where takes_mma."""
    key = (t, rows, n, cols)  # cols too: the plan depends on the units per row
    launch = _launches.get(key)
    if launch is None:
        if takes_mma(t, cols):
            launch = _launch_mma(t, tuple(-(-r // 16) for r in rows), n, cols, False)
        else:
            covered = sum(-(-r // 4) * 4 for r in rows[:-1]) + rows[-1]
            big_n, rpw, wpb, ahead = plan(covered, n, _sms(), t, cols // UNIT_ELEMS.get(t, 32))
            warps = sum(-(-r // rpw) for r in rows)
            fn = _kernel(f"matvec_q<{t}, {big_n}, {rpw}, {ahead}>")
            launch = (fn, (-(-warps // wpb),), (32 * wpb,), 0, False)
        _launches[key] = launch
    return launch


def _launch_mma(t: int, tiles: tuple[int, ...], n: int, cols: int, rope: bool, t2: int | None = None) -> tuple:
    big_n = next(b for b in TOKEN_BUCKETS if b >= n)
    warps, stages = mma_plan(t, sum(tiles), cols, _sms())
    mixed = "" if t2 is None else f", {t2}"
    fn = _kernel(f"matvec_mma<{t}, {big_n}, {warps}, {stages}, {'true' if rope else 'false'}{mixed}>")
    shared = mma_shared(t, warps, stages, n, cols, t2)
    _allow_shared(fn, shared)
    return fn, (sum(tiles),), (32 * warps,), shared, True


def _allow_shared(fn, shared: int) -> None:
    """Let a matvec_mma kernel take `shared` bytes of dynamic shared memory. Set for any size: without it a launch's
    static and dynamic shared memory together may not pass 48 KiB."""
    if shared > _mma_shared.get(fn, 0):
        driver.set_max_dynamic_shared(fn, shared)
        _mma_shared[fn] = shared


def _launch_rope(types: tuple[int, ...], rows: tuple[int, ...], n: int, cols: int) -> tuple:
    """(function, grid, block, dynamic shared bytes, whether matvec_mma) of the mat-vec with the ROPE epilogue.
    matvec_q: two rows per warp, prefetch depth 1 at one token (what plan gives q/k/v of more than 16 rows per SM;
    smaller ones, which plan would give a deeper ring, were not measured with the epilogue). matvec_mma where
    takes_mma, for mixed types where mixes."""
    key = ("rope", types, rows, n, cols)
    launch = _launches.get(key)
    t = types[0]
    if launch is None:
        if types[-1] != t:
            launch = _launch_mma(t, tuple(-(-r // 16) for r in rows), n, cols, True, types[-1])
        elif takes_mma(t, cols):
            launch = _launch_mma(t, tuple(-(-r // 16) for r in rows), n, cols, True)
        else:
            warps = sum(r // 2 for r in rows)
            wpb = _warps_per_block(warps, _sms())
            fn = _kernel(f"matvec_q<{t}, {1 if n == 1 else 2}, 2, {1 if n == 1 else -1}, true>")
            launch = (fn, (-(-warps // wpb),), (32 * wpb,), 0, False)
        _launches[key] = launch
    return launch


def matvec(
    out: DeviceTensor,
    weight: QuantWeight,
    x: DeviceTensor,
    bias: DeviceTensor | None,
    stream: driver.Stream,
    workspace: Workspace,
    quantized: tuple[DeviceTensor, DeviceTensor] | None = None,
) -> None:
    """out [n, rows] float32 = x [n, cols] float32 @ dequant(weight)^T (+ bias [rows]), 1 <= n <= 16.
    quantized: (xq, xs) already holding x in the activation format (see quantize); else the block formats
    quantize x into the workspace first. Float weights read x itself."""
    if weight.ggml_type not in FLOAT_TYPES:
        _matvec_q("matvec", [out], [weight], x, [bias], stream, workspace, quantized)
        return
    t, rows, cols = weight.ggml_type, weight.rows, weight.cols
    n = x.shape[0]
    error = _check(out, weight, x, bias)
    if error:
        raise ValueError(f"matvec: {error}")
    if n == 0 or rows == 0:
        return
    key = (t, (rows,), n, cols)
    launch = _launches.get(key)
    if launch is None:
        big_n, rpw, wpb, _ = plan(rows, n, _sms(), t)
        launch = _launches[key] = (_kernel(f"matvec_f<{t}, {big_n}, {rpw}>"), (-(-rows // (rpw * wpb)),), (32 * wpb,))
    fn, grid, block = launch
    row_bytes = weight.data.shape[1]
    vec = int(x.ptr % 16 == 0 and weight.data.ptr % 16 == 0 and row_bytes % 16 == 0 and cols % 4 == 0)
    args = (out.ptr, weight.data.ptr, x.ptr, bias.ptr if bias is not None else 0, n, rows, cols, row_bytes, vec)
    driver.launch(fn, grid, block, args, _F_ARGS, stream, pdl=True)


def matvec_many(
    outs: list[DeviceTensor],
    weights: list[QuantWeight],
    x: DeviceTensor,
    biases: list[DeviceTensor | None] | None,
    stream: driver.Stream,
    workspace: Workspace,
    quantized: tuple[DeviceTensor, DeviceTensor] | None = None,
) -> None:
    """outs[i] [n, rows_i] = x [n, cols] @ dequant(weights[i])^T (+ biases[i]) for 1 to MAX_SEGMENTS block-format
    matrices of one type and cols, in one launch; bitwise what matvec gives for each. quantized: as for matvec."""
    biases = [None] * len(weights) if biases is None else list(biases)
    _matvec_q("matvec_many", list(outs), list(weights), x, biases, stream, workspace, quantized)


def matvec_rope(
    outs: list[DeviceTensor],
    weights: list[QuantWeight],
    roles: tuple[str, ...],
    x: DeviceTensor,
    biases: list[DeviceTensor | None] | None,
    positions: DeviceTensor,
    inv_freq: DeviceTensor,
    mscale: float,
    pairing: str,
    head_dim: int,
    k_cache: DeviceTensor,
    v_cache: DeviceTensor,
    slot_mapping: DeviceTensor,
    stream: driver.Stream,
    workspace: Workspace,
    quantized: tuple[DeviceTensor, DeviceTensor] | None = None,
) -> None:
    """matvec_many for 1 to ROPE_MAX_TOKENS tokens over a decode step's q, k and/or v projections (roles: "q",
    "k" or "v" per weight, whole heads of head_dim), with elementwise.rotary_store_kv's work done on the way: q
    and k rotated by position with rope_dim = head_dim (inv_freq [head_dim / 2], mscale, "interleaved" or "neox"
    pairs), k and v written as fp16 into k_cache / v_cache [blocks, block_size, kv_heads, head_dim] at
    slot_mapping (int64 [n]; negative: not written). outs get the rotated q / k and v. Bitwise what matvec_many
    followed by rotary_store_kv gives. The weights share one type, or (mixes) q and k one and v another."""
    biases = [None] * len(weights) if biases is None else list(biases)
    error = _check_many(outs, weights, x, biases, mixed=True) or _check_rope(
        weights, roles, x.shape[0], positions, inv_freq, pairing, head_dim, k_cache, v_cache, slot_mapping
    )
    if error:
        raise ValueError(f"matvec_rope: {error}")
    n = x.shape[0]
    if n == 0:
        return
    rope = Rope(positions.ptr, slot_mapping.ptr, inv_freq.ptr, k_cache.ptr, v_cache.ptr)
    for i, role in enumerate(roles):
        rope.role[i] = ROPE_ROLES.index(role)
    rope.head_dim, rope.neox, rope.mscale = head_dim, int(pairing == "neox"), mscale
    _matvec_q("matvec_rope", list(outs), list(weights), x, biases, stream, workspace, quantized, rope)


def rope_pays(weight: QuantWeight, head_dim: int, pairing: str) -> bool:
    """Whether a decode step's q/k/v of this type and width should take matvec_rope. matvec_q's epilogue needs
    two rows per warp, which plan gives rows of several units per lane; rows of one unit per lane run one row per
    warp, and there the separate rotary kernel measured faster. Decode step on the H200, separate kernel /
    matvec_rope: qwen2.5-0.5b (896-wide Q8_0, one unit per lane) 774 / 792 us, llama-3.1-8b (4096-wide Q4_K,
    then on matvec_q) 2,762 / 2,728. A type and width on matvec_mma (takes_mma) takes it wherever its tiles hold
    whole rotation pairs."""
    if takes_mma(weight.ggml_type, weight.cols):
        return pairing != "neox" or head_dim % 16 == 0
    return -(-(weight.cols // UNIT_ELEMS.get(weight.ggml_type, 32)) // 32) > 1


def _check_rope(weights, roles, n, positions, inv_freq, pairing, head_dim, k_cache, v_cache, slots) -> str | None:
    """What is wrong with matvec_rope's own arguments, or None."""
    if n > ROPE_MAX_TOKENS:
        return f"{n} tokens; it takes at most {ROPE_MAX_TOKENS}"
    if len(roles) != len(weights) or any(r not in ROPE_ROLES for r in roles):
        return f"roles {roles} must name one of {ROPE_ROLES} per weight"
    rows = [w.rows for w in weights]
    if head_dim % 2 or any(r % head_dim for r in rows):
        return f"every matrix must be whole heads of an even head_dim, got {head_dim} and rows {rows}"
    if pairing not in ("interleaved", "neox"):
        return f"pairing must be 'interleaved' or 'neox', got {pairing!r}"
    if pairing == "neox" and head_dim % 16 and takes_mma(weights[0].ggml_type, weights[0].cols):
        name = _type_name(weights[0].ggml_type)
        return f"{name}'s neox pairs need head_dim % 16 == 0 (tiles of 16 rows), got {head_dim}"
    if inv_freq.dtype != np.float32 or inv_freq.numel != head_dim // 2:
        return f"inv_freq must be float32 [{head_dim // 2}] (rotary over whole heads), got {inv_freq.shape}"
    if positions.dtype != np.int32 or positions.numel != n or slots.dtype != np.int64 or slots.numel != n:
        return f"positions must be int32 [{n}] and slot_mapping int64 [{n}]"
    for r, role in zip(rows, roles, strict=True):
        cache = k_cache if role == "k" else v_cache
        fits = cache.dtype == np.float16 and len(cache.shape) == 4 and cache.shape[2] * cache.shape[3] == r
        if role != "q" and not fits:
            return f"the {role} cache must be fp16 [blocks, block_size, heads, head_dim], {r} a slot: {cache.shape}"
    return None


def _matvec_q(name, outs, weights, x, biases, stream, workspace, quantized, rope: Rope | None = None) -> None:
    if rope is None and (error := _check_many(outs, weights, x, biases)):
        raise ValueError(f"{name}: {error}")
    n, rows = x.shape[0], tuple(w.rows for w in weights)
    if n == 0 or sum(rows) == 0:
        return
    t, cols = weights[0].ggml_type, weights[0].cols
    if rope is None:
        fn, grid, block, shared, mma = _launch_q(t, rows, n, cols)
    else:
        fn, grid, block, shared, mma = _launch_rope(tuple(w.ggml_type for w in weights), rows, n, cols)
    if quantized is not None and _deferred_norm(quantized)[0]:
        check_activation(quantized, n, cols)  # with its sums right after the scales, where the kernel stages them
        if error := _check_deferred_norm(quantized, n, cols, mma):
            raise ValueError(f"{name}: {error}")
        if n <= 2:
            shared += n * cols // 8  # the norm's sums, staged with the activation
            _allow_shared(fn, shared)
    mark = workspace.offset
    if quantized is None:
        q_shape, s_shape = activation_shapes(n, cols)
        quantized = (workspace.empty(q_shape, np.int8), workspace.empty(s_shape, np.int32))
        quantize(*quantized, x, stream)
    xq, xs = quantized[0], quantized[1]
    if (xq.shape, xs.shape) != activation_shapes(n, cols):
        raise ValueError(f"{name}: quantized x {xq.shape} / {xs.shape} does not fit x {x.shape}")
    args = (segments(outs, weights, biases), xq.ptr, xs.ptr, n, cols, weights[0].data.shape[1], rope or _NO_ROPE)
    if mma:
        args += _deferred_norm(quantized)
        driver.launch(fn, grid, block, args, _MMA_ARGS, stream, shared, pdl=True, carveout=True)
    else:
        driver.launch(fn, grid, block, args, _Q_ARGS, stream, shared, pdl=True)
    workspace.offset = mark  # the int8 activations are dead once the mat-vec (queued on this stream) has run


def _check_many(
    outs: list[DeviceTensor],
    weights: list[QuantWeight],
    x: DeviceTensor,
    biases: list[DeviceTensor | None],
    mixed: bool = False,
) -> str | None:
    """What is wrong with a grouped call's arguments, or None. mixed: types that mixes() takes are allowed."""
    if not 1 <= len(weights) <= MAX_SEGMENTS:
        return f"{len(weights)} weights; one launch takes 1 to {MAX_SEGMENTS}"
    if len(outs) != len(weights) or len(biases) != len(weights):
        return f"{len(weights)} weights need as many outs and biases, got {len(outs)} and {len(biases)}"
    first = weights[0]
    if first.ggml_type in FLOAT_TYPES:
        return f"float weights ({_type_name(first.ggml_type)}) take matvec, one matrix per launch"
    mixed = mixed and mixes(tuple(w.ggml_type for w in weights), first.cols)
    for i, w in enumerate(weights[1:], 1):
        if mixed and w.cols == first.cols:
            continue
        if (w.ggml_type, w.cols, w.data.shape[1]) != (first.ggml_type, first.cols, first.data.shape[1]):
            return (f"weight {i} ({_type_name(w.ggml_type)}, {w.cols} columns) differs from weight 0 "
                    f"({_type_name(first.ggml_type)}, {first.cols} columns); one launch takes one type and one "
                    "width: run the others separately")  # fmt: skip
    for i, (out, w, bias) in enumerate(zip(outs, weights, biases, strict=True)):
        if (error := _check(out, w, x, bias)) is not None:
            return error if len(weights) == 1 else f"weight {i}: {error}"
    return None


def _check(out: DeviceTensor, weight: QuantWeight, x: DeviceTensor, bias: DeviceTensor | None) -> str | None:
    """What is wrong with these arguments, or None (messages are built only on failure)."""
    t, rows, cols = weight.ggml_type, weight.rows, weight.cols
    tiled_ok = weight.tiled and takes_mma(t, cols)  # matvec_mma's kernels read the tiled layout, matvec_q's not
    if (error := weight.layout_error(FLOAT_TYPES + QUANT_TYPES, tiled_ok)) is not None:
        return error
    if len(x.shape) != 2 or x.shape[1] != cols:
        return f"x {x.shape} must be [n, {cols}]"
    n = x.shape[0]
    if n > MAX_TOKENS:
        return f"{n} tokens; the mat-vec takes at most {MAX_TOKENS} (use the GEMM)"
    if out.shape != (n, rows):
        return f"out {out.shape} must be [{n}, {rows}]"
    if x.dtype != np.float32 or out.dtype != np.float32:
        return f"x and out must be float32, got {x.dtype} and {out.dtype}"
    if bias is not None and (bias.shape != (rows,) or bias.dtype != np.float32):
        return f"bias {bias.dtype} {bias.shape} must be float32 [{rows}]"
    if t not in FLOAT_TYPES and x.ptr % 16:
        return "x must be 16-byte aligned for the block formats"
    return None


def _type_name(t: int) -> str:
    return GGMLType(t).name if t in GGMLType.__members__.values() else f"GGML type {t}"
