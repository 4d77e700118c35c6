"""Launchers for kernels/delta_net.cu: a Gated DeltaNet layer's inputs to the delta rule (conv1d, q/k L2 norm and
gates in one launch), gated delta rule (the recurrent form), gated output norm, sigmoid gate, and the zeroing of
fresh sequences' state.

The state lives in two float32 device tensors laid out as CpuHybridCache's: conv [slots, recurrent layers, conv
channels, kernel - 1] and delta [slots, recurrent layers, value heads, d_k, d_v]. A step's sequences come as device
int32 arrays: query_starts [seqs + 1] (batch.query_starts) and state_slots [seqs]. Inputs that are a column range
of a wider activation (q, k, v of the conv output; the attention's output gate inside q) are passed as `Strided`
views and read in place. Each launcher checks shapes and dtypes (ValueError), allocates nothing and launches one
kernel on `stream`. Nothing reduces across tokens, and the delta rule carries each sequence's state token by token
in one fixed order, so a token's numbers are the same however its prompt was split into steps (docs/kernels.md).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from infero.backends.cuda import driver, runtime
from infero.backends.cuda.tensor import DeviceTensor, Strided

SOURCE = "delta_net.cu"
CONV_TOKENS = 16  # tokens of a sequence a thread of delta_net_inputs' conv1d walks (dn::CONV_TOKENS)
CONV_CHANNELS = 128  # channels a block of delta_net_inputs takes (dn::CONV_CHANNELS): whole heads of q and k
CONV_KERNELS = (4,)  # taps the conv1d is compiled for: every released Gated DeltaNet's
KEY_DIMS = (16, 32, 64, 128)  # d_k the delta rule is compiled for (S's rows in registers); 16: the tiny models'
RULE_PARTS = 4  # threads sharing a column of S (delta_net.cu's dn::RULE_PARTS)
MAX_DV = 128  # the widest value head the delta rule takes (dn::MAX_DV: its shared v tile)
RULE_COLUMNS = 32  # columns of S a block of the delta rule takes (a multiple of 32 dividing d_v)
ROW_WARPS = 8  # the gated norm: a warp a row, 8 rows a block
PAIRINGS = ("tiled", "grouped")  # which key head serves value head h: h % key heads, or h // (value / key heads)
# gated_delta_rule's tokens of a sequence (delta_chunks.cuh's dchunk::Part): all, those before its first whole
# 64-position chunk, those after its last.
PARTS = ("all", "head", "tail")

runtime.declare(
    SOURCE,
    [f"delta_net_inputs<{k}>" for k in CONV_KERNELS]
    + [f"gated_delta_rule<{d}>" for d in KEY_DIMS]
    + ["gated_rms_norm", "sigmoid_gate", "reset_states"],
    needs=(runtime.DELTA_NET,),
)

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float


def _kernel(expression: str):
    return runtime.kernel(SOURCE, expression)  # cached there


def _rows(x: DeviceTensor | Strided, rows: int) -> Strided:
    """x as `rows` rows: a Strided as it is (its row count checked), a contiguous tensor split evenly."""
    if isinstance(x, Strided):
        _require(x.rows == rows, lambda: f"a strided input has {x.rows} rows, the op needs {rows}")
        return x
    cols = x.numel // rows if rows else int(np.prod(x.shape[1:], dtype=np.int64))
    _require(cols * rows == x.numel, lambda: f"a tensor of shape {x.shape} is not {rows} rows")
    return Strided(x, 0, rows, cols, cols)


def _require(cond: bool, message) -> None:
    """Raise ValueError(message()) unless cond; the message is only formatted on failure (launchers run per step)."""
    if not cond:
        raise ValueError(message())


def _f32(name: str, t) -> None:
    _require(t.dtype == np.float32, lambda: f"{name} must be float32, got {t.dtype}")


def _check_sequences(query_starts: DeviceTensor, state_slots: DeviceTensor) -> int:
    """The number of sequences: state_slots int32 [seqs], query_starts int32 [seqs + 1]."""
    seqs = state_slots.numel
    _require(state_slots.dtype == np.int32 and len(state_slots.shape) == 1,
             lambda: f"state_slots must be int32 [seqs], got {state_slots.dtype} {state_slots.shape}")  # fmt: skip
    starts = query_starts
    _require(starts.dtype == np.int32 and starts.shape == (seqs + 1,),
             lambda: f"query_starts must be int32 [{seqs + 1}], got {starts.dtype} {starts.shape}")  # fmt: skip
    return seqs


def _check_conv(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, conv_state: DeviceTensor,
                layer: int) -> tuple[int, int, int]:  # fmt: skip
    """(n, C, taps) of a conv1d of x [n, C] into out, taps weight [C, taps], over conv_state [slots, layers, C,
    taps - 1]."""
    _require(out.ptr != x.ptr, lambda: "out must not be x (a chunk reads the inputs before it)")
    for name, t in (("out", out), ("x", x), ("weight", weight), ("conv_state", conv_state)):
        _f32(name, t)
    _require(len(x.shape) == 2 and out.shape == x.shape, lambda: f"x {x.shape} and out {out.shape} must be [n, C]")
    n, channels = x.shape
    _require(len(weight.shape) == 2 and weight.shape[0] == channels,
             lambda: f"weight {weight.shape} must be [{channels}, kernel]")  # fmt: skip
    taps = weight.shape[1]
    _require(taps in CONV_KERNELS,
             lambda: f"the GPU's conv1d is compiled for kernels of {CONV_KERNELS} taps, got {taps}")  # fmt: skip
    _require(len(conv_state.shape) == 4 and conv_state.shape[2:] == (channels, taps - 1),
             lambda: f"conv_state {conv_state.shape} must be [slots, layers, {channels}, {taps - 1}]")  # fmt: skip
    layers = conv_state.shape[1]
    _require(0 <= layer < layers, lambda: f"layer {layer} is not one of the state's {layers} recurrent layers")
    return n, channels, taps


def _check_gates(g: DeviceTensor, beta_out: DeviceTensor, alpha: DeviceTensor | Strided,
                 beta: DeviceTensor | Strided, dt_bias: DeviceTensor, a: DeviceTensor, group: int | None,
                 group_stride: int) -> tuple[int, int, Strided, Strided]:  # fmt: skip
    """(value heads, group, alpha rows, beta rows) of gates g, beta_out [n, value heads] read from alpha and beta."""
    _require(len(g.shape) == 2 and beta_out.shape == g.shape,
             lambda: f"g {g.shape} and beta_out {beta_out.shape} must be [n, value heads]")  # fmt: skip
    n, heads = g.shape
    group = heads if group is None else group
    _require(group > 0 and heads % group == 0, lambda: f"group {group} must divide the {heads} value heads")
    span = (heads // group - 1) * group_stride + group if heads else 0  # columns a row's last head needs, + 1
    alpha, beta = _rows(alpha, n), _rows(beta, n)
    for name, t in (("g", g), ("beta_out", beta_out), ("alpha", alpha), ("beta", beta), ("dt_bias", dt_bias),
                    ("a", a)):  # fmt: skip
        _f32(name, t)
    narrow = min(alpha.cols, beta.cols)
    _require(narrow >= span, lambda: f"alpha and beta rows of {narrow} columns hold no head {heads - 1} at column "
                                     f"{span - 1}")  # fmt: skip
    _require(dt_bias.numel == heads and a.numel == heads,
             lambda: f"dt_bias ({dt_bias.numel}) and a ({a.numel}) must have one value a head ({heads})")  # fmt: skip
    return heads, group, alpha, beta


def delta_net_inputs(out: DeviceTensor, g: DeviceTensor, beta_out: DeviceTensor, x: DeviceTensor,
                     weight: DeviceTensor, conv_state: DeviceTensor, alpha: DeviceTensor | Strided,
                     beta: DeviceTensor | Strided, dt_bias: DeviceTensor, a: DeviceTensor, d_k: int, normed: int,
                     eps: float, query_starts: DeviceTensor, state_slots: DeviceTensor, layer: int,
                     stream: driver.Stream, group: int | None = None, group_stride: int = 0,
                     max_tokens: int | None = None) -> None:  # fmt: skip
    """What the delta rule reads, in one launch. out [n, C] = SiLU of the depthwise causal conv1d of x [n, C] (taps
    weight [C, K]) over each sequence's earlier inputs, which its slot of conv_state [slots, layers, C, K - 1] holds
    for recurrent layer `layer` and then holds the sequence's last K - 1 inputs (out not x), its first `normed`
    channels (q | k) divided per head of d_k by sqrt(sum of squares + eps). g = a * softplus(alpha + dt_bias) and
    beta_out = sigmoid(beta), [n, value heads]: value head h reads column h of its alpha and beta rows, or with
    `group` column (h // group) * group_stride + h % group (Qwen3-Next's fused projection: alpha = columns(ba,
    group, 2 heads), beta = columns(ba, 0, 2 heads), group_stride 2 group). max_tokens: the most tokens a sequence
    has (default n); its CONV_TOKENS-token chunks run side by side."""
    n, channels, taps = _check_conv(out, x, weight, conv_state, layer)
    _require(len(g.shape) == 2 and g.shape[0] == n, lambda: f"g {g.shape} must be [{n}, value heads]")
    heads, group, alpha, beta = _check_gates(g, beta_out, alpha, beta, dt_bias, a, group, group_stride)
    _require(d_k > 0 and CONV_CHANNELS % d_k == 0,
             lambda: f"d_k must divide {CONV_CHANNELS} (a block's channels: whole heads), got {d_k}")  # fmt: skip
    _require(0 <= normed <= channels and normed % d_k == 0,
             lambda: f"the normed channels ({normed}) must be whole heads of {d_k} within the {channels}")  # fmt: skip
    seqs = _check_sequences(query_starts, state_slots)
    if seqs == 0 or channels == 0:
        return
    slots, layers = conv_state.shape[:2]
    args = (out.ptr, g.ptr, beta_out.ptr, x.ptr, weight.ptr, conv_state.ptr, alpha.ptr, beta.ptr, dt_bias.ptr,
            a.ptr, query_starts.ptr, state_slots.ptr, slots, layers, layer, channels, normed, d_k, eps, heads,
            alpha.stride, beta.stride, group, group_stride)  # fmt: skip
    types = (_P,) * 12 + (_I,) * 6 + (_F,) + (_I,) * 5
    chunks = max(1, -(-(n if max_tokens is None else max_tokens) // CONV_TOKENS))
    driver.launch(_kernel(f"delta_net_inputs<{taps}>"), (-(-channels // CONV_CHANNELS) + 1, seqs, chunks),
                  (CONV_CHANNELS,), args, types, stream, pdl=True)  # fmt: skip


@dataclass(frozen=True)
class RuleShapes:
    """A delta rule launch's inputs as checked: q, k, v as row views and the sizes its kernels take."""

    q: Strided
    k: Strided
    v: Strided
    slots: int
    layers: int
    v_heads: int
    d_k: int
    d_v: int
    key_heads: int
    seqs: int


def rule_shapes(out: DeviceTensor, q: DeviceTensor | Strided, k: DeviceTensor | Strided, v: DeviceTensor | Strided,
                g: DeviceTensor, beta: DeviceTensor, pairing: str, delta_state: DeviceTensor,
                query_starts: DeviceTensor, state_slots: DeviceTensor, layer: int) -> RuleShapes:  # fmt: skip
    """The checks both forms of the delta rule share (gated_delta_rule's arguments; ValueError)."""
    _f32("delta_state", delta_state)
    _require(len(delta_state.shape) == 5,
             lambda: f"delta_state {delta_state.shape} must be [slots, layers, value heads, d_k, d_v]")  # fmt: skip
    slots, layers, v_heads, d_k, d_v = delta_state.shape
    _require(len(out.shape) == 3 and out.shape[1:] == (v_heads, d_v),
             lambda: f"out {out.shape} must be [n, {v_heads}, {d_v}]")  # fmt: skip
    n = out.shape[0]
    q, k, v = _rows(q, n), _rows(k, n), _rows(v, n)
    for name, t in (("out", out), ("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _f32(name, t)
    _require(d_v % 32 == 0 and 0 < d_v <= MAX_DV,
             lambda: f"the GPU's delta rule needs d_v a multiple of 32 up to {MAX_DV}, got {d_v}")  # fmt: skip
    _require(d_k > 0 and q.cols == k.cols and q.cols % d_k == 0,
             lambda: f"q rows of {q.cols} and k rows of {k.cols} must be the same whole heads of {d_k}")  # fmt: skip
    key_heads = q.cols // d_k
    _require(key_heads > 0 and v_heads % key_heads == 0,
             lambda: f"{key_heads} key heads must divide the {v_heads} value heads")  # fmt: skip
    _require(v.cols == v_heads * d_v, lambda: f"v rows of {v.cols} must be {v_heads} heads of {d_v}")
    _require(g.shape == (n, v_heads) and beta.shape == (n, v_heads),
             lambda: f"g {g.shape} and beta {beta.shape} must be [{n}, {v_heads}]")  # fmt: skip
    _require(pairing in PAIRINGS, lambda: f"pairing must be one of {PAIRINGS}, got {pairing!r}")
    _require(0 <= layer < layers, lambda: f"layer {layer} is not one of the state's {layers} recurrent layers")
    seqs = _check_sequences(query_starts, state_slots)
    return RuleShapes(q, k, v, slots, layers, v_heads, d_k, d_v, key_heads, seqs)


def check_positions(positions: DeviceTensor | None, n: int) -> None:
    """positions int32 [n]: each token's position in its sequence (what splits a step's tokens into chunks)."""
    _require(positions is not None and positions.dtype == np.int32 and positions.shape == (n,),
             lambda: f"positions must be int32 [{n}], got "
                     f"{None if positions is None else (positions.dtype, positions.shape)}")  # fmt: skip


def gated_delta_rule(out: DeviceTensor, q: DeviceTensor | Strided, k: DeviceTensor | Strided,
                     v: DeviceTensor | Strided, g: DeviceTensor, beta: DeviceTensor, pairing: str, scale: float,
                     delta_state: DeviceTensor, query_starts: DeviceTensor, state_slots: DeviceTensor, layer: int,
                     stream: driver.Stream, part: str = "all",
                     positions: DeviceTensor | None = None) -> None:  # fmt: skip
    """out [n, value heads, d_v] of the gated delta rule, token by token from each sequence's S in its slot of
    delta_state [slots, layers, value heads, d_k, d_v] (updated in place): q, k [n, key heads x d_k] (q scaled by
    `scale`), v [n, value heads x d_v], g and beta [n, value heads]; value head h reads key head h % key heads
    (pairing "tiled") or h // (value heads / key heads) ("grouped"). part "head" takes only each sequence's tokens
    before its first whole 64-position chunk (all of them where it has none), "tail" those after its last (none
    where it has none), by positions int32 [n] (delta_chunks.cuh); delta_rule_chunked takes the chunks between.
    Every part runs a token with the same arithmetic."""
    r = rule_shapes(out, q, k, v, g, beta, pairing, delta_state, query_starts, state_slots, layer)
    _require(r.d_k in KEY_DIMS, lambda: f"the GPU's delta rule is compiled for d_k in {KEY_DIMS}, got {r.d_k}")
    _require(part in PARTS, lambda: f"part must be one of {PARTS}, got {part!r}")
    if part != "all":
        check_positions(positions, out.shape[0])
    if r.seqs == 0:
        return
    args = (out.ptr, r.q.ptr, r.k.ptr, r.v.ptr, g.ptr, beta.ptr, delta_state.ptr, query_starts.ptr, state_slots.ptr,
            scale, r.slots, r.layers, layer, r.key_heads, r.v_heads, r.d_v, r.q.stride, r.k.stride, r.v.stride,
            int(pairing == "tiled"), positions.ptr if part != "all" else 0, PARTS.index(part))  # fmt: skip
    types = (_P,) * 9 + (_F,) + (_I,) * 10 + (_P, _I)
    fn = _kernel(f"gated_delta_rule<{r.d_k}>")
    driver.launch(fn, (r.v_heads * (r.d_v // RULE_COLUMNS), r.seqs), (RULE_PARTS * RULE_COLUMNS,), args, types,
                  stream, pdl=True)  # fmt: skip


def gated_rms_norm(out: DeviceTensor, x: DeviceTensor, weight: DeviceTensor, gate: DeviceTensor | Strided,
                   eps: float, stream: driver.Stream) -> None:  # fmt: skip
    """out = rms_norm(x) * weight * silu(gate) over each head of x [n, heads, dim] (the delta net's output norm;
    gate [n, heads x dim]; out may be x)."""
    _require(len(x.shape) == 3 and out.shape == x.shape,
             lambda: f"x {x.shape} and out {out.shape} must be [n, heads, dim]")  # fmt: skip
    n, heads, dim = x.shape
    gate = _rows(gate, n)
    for name, t in (("out", out), ("x", x), ("weight", weight), ("gate", gate)):
        _f32(name, t)
    _require(weight.numel == dim, lambda: f"weight has {weight.numel} elements, heads have {dim}")
    _require(gate.cols == heads * dim, lambda: f"gate rows of {gate.cols} must be {heads} heads of {dim}")
    if n * heads * dim == 0:
        return
    args = (out.ptr, x.ptr, weight.ptr, gate.ptr, n, heads, dim, gate.stride, eps)
    types = (_P, _P, _P, _P, _I, _I, _I, _I, _F)
    blocks = -(-n * heads // ROW_WARPS)
    driver.launch(_kernel("gated_rms_norm"), (blocks,), (32 * ROW_WARPS,), args, types, stream, pdl=True)


def sigmoid_gate(out: DeviceTensor, x: DeviceTensor, gate: DeviceTensor | Strided, stream: driver.Stream,
                 addend: DeviceTensor | None = None) -> None:  # fmt: skip
    """out = x * sigmoid(gate) over rows of x's last dim (out may be x), plus addend where given (of x's shape; out
    may be addend); gate has one column per element of a row, or one column for the whole row (the shared expert's
    gate [n, 1])."""
    _require(out.shape == x.shape and len(x.shape) >= 1, lambda: f"out {out.shape} must have x's shape {x.shape}")
    if addend is not None:
        _f32("addend", addend)
        _require(addend.shape == x.shape, lambda: f"addend {addend.shape} must have x's shape {x.shape}")
    cols = x.shape[-1]
    rows = x.numel // cols if cols else 0
    gate = _rows(gate, rows)
    for name, t in (("out", out), ("x", x), ("gate", gate)):
        _f32(name, t)
    _require(gate.cols in (cols, 1), lambda: f"gate rows of {gate.cols} must have x's {cols} columns, or 1")
    if x.numel == 0:
        return
    args = (out.ptr, x.ptr, gate.ptr, addend.ptr if addend is not None else 0, x.numel, cols, gate.stride,
            int(gate.cols == 1 and cols > 1))  # fmt: skip
    types = (_P, _P, _P, _P, _L, _I, _I, _I)
    driver.launch(_kernel("sigmoid_gate"), (-(-x.numel // 256),), (256,), args, types, stream, pdl=True)


def reset_states(conv_state: DeviceTensor, delta_state: DeviceTensor, slots: DeviceTensor,
                 stream: driver.Stream) -> None:  # fmt: skip
    """Zero every layer's conv and delta state of the slots int32 [count] (negative entries are skipped)."""
    _f32("conv_state", conv_state)
    _f32("delta_state", delta_state)
    conv, delta = conv_state.shape, delta_state.shape
    _require(len(conv) == 4 and len(delta) == 5 and conv[:2] == delta[:2],
             lambda: f"conv_state {conv_state.shape} and delta_state {delta_state.shape} must be [slots, layers, ...] "
                     "of the same slots and layers")  # fmt: skip
    _require(slots.dtype == np.int32 and len(slots.shape) == 1,
             lambda: f"slots must be int32 [count], got {slots.dtype} {slots.shape}")  # fmt: skip
    count, num_slots = slots.numel, conv_state.shape[0]
    if count == 0 or num_slots == 0:
        return
    conv_size, delta_size = conv_state.numel // num_slots, delta_state.numel // num_slots
    blocks = min(-(-max(conv_size, delta_size) // 256), 1024)
    args = (conv_state.ptr, delta_state.ptr, slots.ptr, num_slots, conv_size, delta_size)
    types = (_P, _P, _P, _I, _L, _L)
    driver.launch(_kernel("reset_states"), (blocks, count), (256,), args, types, stream, pdl=True)
