"""Launcher for kernels/delta_rule_chunked.cu: the gated delta rule over a step's whole 64-position chunks (the
chunked form, on the tensor cores: delta_rule_prepare for every chunk at once, then delta_rule_chunked's walk
through each sequence's chunks), and the host's count of those chunks.

A sequence's step tokens that fill a whole chunk [64 m, 64 m + 64) of positions from its start take this kernel;
the others take delta_net.gated_delta_rule's recurrent form, part "head" before its first whole chunk and part
"tail" after its last (CudaOps.gated_delta_rule launches the three in that order on the same state). The scheduler
splits a hybrid model's prompts at multiples of 64 positions, so a prompt's whole chunks, and its bits, are the
same however it is split. d_k 16 and 32 (the tiny test models') have no chunked kernel: every token of such a model
takes the recurrent form (`takes`).
"""

from __future__ import annotations

import ctypes

import numpy as np

from infero.backends.cuda import delta_net, driver, runtime
from infero.backends.cuda.tensor import DeviceTensor, Strided, Workspace

SOURCE = "delta_rule_chunked.cu"
CHUNK = 64  # positions a chunk spans (dchunk::CHUNK)
KEY_DIMS = (64, 128)  # d_k the kernel is compiled for
COLUMNS = 32  # columns of S a block takes (drc::COLS)
THREADS = 256  # drc::THREADS

for _d in KEY_DIMS:  # a unit each, compiled side by side
    runtime.declare(SOURCE, [f"delta_rule_prepare<{_d}>", f"delta_rule_chunked<{_d}>"], needs=(runtime.DELTA_NET,),
                    part=f"d_k {_d}")  # fmt: skip

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_functions: dict[str, object] = {}
runtime.on_reload(_functions.clear)


def takes(d_k: int) -> bool:
    """Whether a model of this d_k runs its whole chunks on the chunked kernel (else every token recurrent)."""
    return d_k in KEY_DIMS


def prepare_shared_bytes(d_k: int) -> int:
    """delta_rule_prepare's dynamic shared memory (drc::Prep<DK>): the chunk's [k | v] rows of d_k + 136 floats,
    the 64 x 64 system (rows of 68), four floats a token."""
    return 4 * (CHUNK * (d_k + 136) + CHUNK * (CHUNK + 4) + 4 * CHUNK)


def walk_shared_bytes(d_k: int) -> int:
    """delta_rule_chunked's dynamic shared memory (drc::Walk<DK>): S's d_k rows and u's 64 of COLUMNS, each
    element split into two floats."""
    return 8 * (d_k + CHUNK) * COLUMNS


def record_floats(d_k: int, d_v: int) -> int:
    """One (chunk, value head)'s record (drc::Record<DK>): -W, Q' and Kt^T (64 x d_k each), A and O' (64 x d_v
    each), exp(G_last) and three unused floats."""
    return 192 * d_k + 128 * d_v + 4


def scratch_bytes(tokens: int, v_heads: int, d_k: int, d_v: int) -> int:
    """The records a step of `tokens` tokens takes from the workspace (given back once the launches are queued)."""
    return 4 * (tokens // CHUNK) * v_heads * record_floats(d_k, d_v) if takes(d_k) else 0


def whole_chunks(positions: np.ndarray, query_starts: np.ndarray) -> int:
    """How many whole chunks the step's sequences hold: sequence s's tokens query_starts[s] .. query_starts[s + 1]
    sit at consecutive positions from positions[query_starts[s]] (delta_chunks.cuh's split, on the host)."""
    starts = np.asarray(query_starts, np.int64)
    lengths = np.diff(starts)
    first = np.asarray(positions, np.int64)[starts[:-1][lengths > 0]]
    lengths = lengths[lengths > 0]
    spans = (first + lengths) // CHUNK - -(-first // CHUNK)
    return int(np.maximum(spans, 0).sum())


def delta_rule_chunked(out: DeviceTensor, q: DeviceTensor | Strided, k: DeviceTensor | Strided,
                       v: DeviceTensor | Strided, g: DeviceTensor, beta: DeviceTensor, pairing: str, scale: float,
                       delta_state: DeviceTensor, query_starts: DeviceTensor, positions: DeviceTensor,
                       state_slots: DeviceTensor, layer: int, stream: driver.Stream,
                       workspace: Workspace) -> None:  # fmt: skip
    """out's rows of each sequence's whole chunks (positions int32 [n]: each token's position) by the chunked gated
    delta rule, from and into its S in delta_state (updated in place); the other rows are left as they are.
    Arguments as delta_net.gated_delta_rule's; d_k one of KEY_DIMS. The chunks' records (n / 64 of them a value
    head) are workspace scratch, handed back after the two launches (the stream runs them before any later use)."""
    r = delta_net.rule_shapes(out, q, k, v, g, beta, pairing, delta_state, query_starts, state_slots, layer)
    if not takes(r.d_k):
        raise ValueError(f"the GPU's chunked delta rule is compiled for d_k in {KEY_DIMS}, got {r.d_k}")
    delta_net.check_positions(positions, out.shape[0])
    records = out.shape[0] // CHUNK
    if r.seqs == 0 or records == 0:
        return
    mark = workspace.offset
    scratch = workspace.empty((records * r.v_heads * record_floats(r.d_k, r.d_v),), np.float32)
    args = (scratch.ptr, r.q.ptr, r.k.ptr, r.v.ptr, g.ptr, beta.ptr, query_starts.ptr, positions.ptr,
            state_slots.ptr, scale, r.seqs, r.slots, r.key_heads, r.v_heads, r.d_v, r.q.stride, r.k.stride,
            r.v.stride, int(pairing == "tiled"))  # fmt: skip
    types = (_P,) * 9 + (_F,) + (_I,) * 9
    # Both kernels are bounded to two blocks an SM: all of the SM's shared memory lets two fit.
    shared = prepare_shared_bytes(r.d_k)
    fn = _kernel(f"delta_rule_prepare<{r.d_k}>", shared)
    driver.launch(fn, (r.v_heads, records), (THREADS,), args, types, stream, shared, pdl=True, carveout=True)
    args = (out.ptr, scratch.ptr, delta_state.ptr, query_starts.ptr, positions.ptr, state_slots.ptr, r.slots,
            r.layers, layer, r.v_heads, r.d_v)  # fmt: skip
    types = (_P,) * 6 + (_I,) * 5
    shared = walk_shared_bytes(r.d_k)
    fn = _kernel(f"delta_rule_chunked<{r.d_k}>", shared)
    driver.launch(fn, (r.v_heads * (r.d_v // COLUMNS), r.seqs), (THREADS,), args, types, stream, shared, pdl=True,
                  carveout=True)  # fmt: skip
    workspace.offset = mark


def _kernel(expression: str, shared: int):
    fn = _functions.get(expression)
    if fn is None:
        fn = _functions[expression] = runtime.kernel(SOURCE, expression)
        driver.set_max_dynamic_shared(fn, shared)  # past the 48 KiB a launch gets without asking
    return fn
