"""Launcher for kernels/delta_rule_chunked.cu: the gated delta rule over a step's whole 64-position chunks (the
chunked form, on the tensor cores), and the host's count of those chunks.

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
from infero.backends.cuda.tensor import DeviceTensor, Strided

SOURCE = "delta_rule_chunked.cu"
CHUNK = 64  # positions a chunk spans (dchunk::CHUNK)
KEY_DIMS = (64, 128)  # d_k the kernel is compiled for
COLUMNS = 32  # columns of S a block takes (drc::COLS)
THREADS = 256  # drc::THREADS

for _d in KEY_DIMS:  # a unit each (NVRTC: 4.1 and 2.6 s on sm_90a), compiled side by side
    runtime.declare(SOURCE, [f"delta_rule_chunked<{_d}>"], needs=(runtime.DELTA_NET,), part=f"d_k {_d}")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_functions: dict[str, object] = {}
runtime.on_reload(_functions.clear)


def takes(d_k: int) -> bool:
    """Whether a model of this d_k runs its whole chunks on the chunked kernel (else every token recurrent)."""
    return d_k in KEY_DIMS


def shared_bytes(d_k: int) -> int:
    """The kernel's dynamic shared memory (drc::Shared<DK>): the chunk's k rows of d_k + 4, S's column block and
    v / u (rows of COLUMNS + 8), the 64 x 64 system (rows of 68), four floats a token."""
    return 4 * (CHUNK * (d_k + 4) + (d_k + CHUNK) * (COLUMNS + 8) + CHUNK * (CHUNK + 4) + 4 * CHUNK)


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
                       state_slots: DeviceTensor, layer: int, stream: driver.Stream) -> None:  # fmt: skip
    """out's rows of each sequence's whole chunks (positions int32 [n]: each token's position) by the chunked gated
    delta rule, from and into its S in delta_state (updated in place); the other rows are left as they are.
    Arguments as delta_net.gated_delta_rule's; d_k one of KEY_DIMS."""
    r = delta_net.rule_shapes(out, q, k, v, g, beta, pairing, delta_state, query_starts, state_slots, layer)
    if not takes(r.d_k):
        raise ValueError(f"the GPU's chunked delta rule is compiled for d_k in {KEY_DIMS}, got {r.d_k}")
    delta_net.check_positions(positions, out.shape[0])
    if r.seqs == 0:
        return
    args = (out.ptr, r.q.ptr, r.k.ptr, r.v.ptr, g.ptr, beta.ptr, delta_state.ptr, query_starts.ptr, positions.ptr,
            state_slots.ptr, scale, r.slots, r.layers, layer, r.key_heads, r.v_heads, r.d_v, r.q.stride, r.k.stride,
            r.v.stride, int(pairing == "tiled"))  # fmt: skip
    types = (_P,) * 10 + (_F,) + (_I,) * 10
    fn = _kernel(f"delta_rule_chunked<{r.d_k}>", shared_bytes(r.d_k))
    driver.launch(fn, (r.v_heads * (r.d_v // COLUMNS), r.seqs), (THREADS,), args, types, stream,
                  shared_bytes(r.d_k), pdl=True)  # fmt: skip


def _kernel(expression: str, shared: int):
    fn = _functions.get(expression)
    if fn is None:
        fn = _functions[expression] = runtime.kernel(SOURCE, expression)
        driver.set_max_dynamic_shared(fn, shared)  # past the 48 KiB a launch gets without asking
    return fn
