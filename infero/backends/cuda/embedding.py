"""Launcher for kernels/embedding.cu: out[i] = dequant(table)[token_ids[i]] for every GGML type infero runs.

Values are bitwise gguf's dequantized values (the kernel decodes with dequant8 from quant.cuh). A token id
outside the table writes a row of NaN. feed_tokens writes a step's input tokens from the sampling of the step
before it, on the device (asynchronous scheduling).
"""

from __future__ import annotations

import ctypes

import numpy as np

from infero.backends.cuda import driver, runtime
from infero.backends.cuda.tensor import DeviceTensor, QuantWeight

SOURCE = "embedding.cu"
TYPES = (0, 1, 30, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23)
THREADS = 256

runtime.declare(SOURCE, ["feed_tokens"])
for _t in TYPES:
    runtime.declare(SOURCE, [f"embedding<{_t}>"], needs=(runtime.weight_type(_t),))

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
_ARGS = (_P, _P, _P, _I, _I, _I, _L, _I)
_functions: dict[int, object] = {}
runtime.on_reload(_functions.clear)


def embedding(out: DeviceTensor, weight: QuantWeight, token_ids: DeviceTensor, stream: driver.Stream) -> None:
    """out [n, hidden] float32 = rows token_ids (int32 [n]) of weight [vocab, hidden]."""
    error = _check(out, weight, token_ids)
    if error:
        raise ValueError(f"embedding: {error}")
    n, hidden = out.shape
    if n == 0 or hidden == 0:
        return
    t = weight.ggml_type
    fn = _functions.get(t)
    if fn is None:
        fn = _functions[t] = runtime.kernel(SOURCE, f"embedding<{t}>")
    total = n * (-(-hidden // 8))
    vec = int(out.ptr % 16 == 0 and hidden % 4 == 0)
    args = (out.ptr, weight.data.ptr, token_ids.ptr, n, weight.rows, hidden, weight.data.shape[1], vec)
    driver.launch(fn, (-(-total // THREADS),), (THREADS,), args, _ARGS, stream, pdl=True)


def feed_tokens(token_ids: DeviceTensor, sampled: int, rows: DeviceTensor, stream: driver.Stream) -> None:
    """token_ids[i] = sampled[rows[i]] where rows[i] >= 0 (int32 [n] both; sampled: the device address of a step's
    sampled tokens, int32): a step's input tokens from the sampling queued before it, without a host round trip."""
    n = token_ids.shape[0]
    if token_ids.dtype != np.int32 or rows.dtype != np.int32 or rows.shape != (n,):
        raise ValueError(f"feed_tokens: token_ids and rows must be int32 [n], got {token_ids.shape} and {rows.shape}")
    if n:
        driver.launch(runtime.kernel(SOURCE, "feed_tokens"), (-(-n // THREADS),), (THREADS,),
                      (token_ids.ptr, sampled, rows.ptr, n), (_P, _P, _P, _I), stream)  # fmt: skip


def _check(out: DeviceTensor, weight: QuantWeight, token_ids: DeviceTensor) -> str | None:
    """What is wrong with these arguments, or None (messages are built only on failure)."""
    cols = weight.cols
    if (error := weight.layout_error(TYPES)) is not None:
        return error
    if token_ids.dtype != np.int32 or len(token_ids.shape) != 1:
        return f"token_ids must be int32 [n], got {token_ids.dtype} {token_ids.shape}"
    if out.dtype != np.float32 or out.shape != (token_ids.shape[0], cols):
        return f"out {out.dtype} {out.shape} must be float32 [{token_ids.shape[0]}, {cols}]"
    return None
