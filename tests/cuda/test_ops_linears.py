"""CudaOps.linears groups matrices into mat-vec launches: one per block format and width (at most three
matrices each); float weights and more than 16 tokens one linear call per matrix, which takes the int8 GEMM or the
mat-vec in slices; where decode steps fold a norm, every width keeps its deferred form. Runs without a GPU: the
launchers are replaced by recorders."""

from types import SimpleNamespace

import numpy as np
import pytest

from infero.backends.cuda import elementwise, linear_mma, matvec
from infero.backends.cuda import ops as ops_module
from infero.backends.cuda.ops import CudaOps
from infero.checkpoint.tensor_types import GGMLType as T


class _Workspace:
    generation = 0

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)


@pytest.fixture
def recorded(monkeypatch):
    """(ops, calls): calls lists ("many", [weight indices]) and ("linear", index) in launch order."""
    monkeypatch.setattr(matvec, "_shared_optin", lambda: 232448)  # an H200's shared memory per block
    monkeypatch.setattr(matvec, "_mma_fits", {})
    calls = []
    monkeypatch.setattr(matvec, "matvec_many", lambda outs, weights, *rest: calls.append(
        ("many", [w.index for w in weights], [o.shape for o in outs])))  # fmt: skip

    def linear(self, x, weight, bias=None):
        calls.append(("linear", weight.index))
        return np.empty((x.shape[0], weight.rows), np.float32)

    monkeypatch.setattr(CudaOps, "linear", linear)
    ops = CudaOps(SimpleNamespace(workspace=_Workspace(), stream=None, weights_arena=None, batch_invariant=False))
    return ops, calls


def activations(n: int, cols: int = 256):
    return SimpleNamespace(ptr=1 << 20, shape=(n, cols))


def weights(*types, cols=256):
    return [SimpleNamespace(index=i, ggml_type=int(t), rows=32 * (i + 1), cols=cols, tiled=False)
            for i, t in enumerate(types)]  # fmt: skip


@pytest.mark.parametrize(
    "types, launches",
    [
        ((T.Q8_0, T.Q8_0, T.Q8_0), [("many", [0, 1, 2])]),
        ((T.Q4_K, T.Q4_K, T.Q6_K), [("many", [0, 1]), ("many", [2])]),  # Q4_K_M's Q6_K layers of V
        ((T.Q4_K, T.Q6_K, T.Q4_K), [("many", [0, 2]), ("many", [1])]),
        ((T.F16, T.Q8_0, T.Q8_0), [("linear", 0), ("many", [1, 2])]),
        ((T.Q8_0,) * 4, [("many", [0, 1, 2]), ("many", [3])]),
    ],
)
def test_linears_share_one_launch_per_type_and_width(recorded, types, launches):
    ops, calls = recorded
    ws = weights(*types)
    outs = ops.linears(activations(3), ws)
    assert [c[:2] for c in calls] == launches
    assert [o.shape for o in outs] == [(3, w.rows) for w in ws]  # in the order of the weights
    for call in calls:
        if call[0] == "many":
            assert call[2] == [(3, ws[i].rows) for i in call[1]]


def test_linears_of_different_widths_launch_apart(recorded):
    ops, calls = recorded
    ws = weights(T.Q8_0, T.Q8_0)
    ws[1].cols = 512
    ops.linears(activations(1), ws)
    assert [c[:2] for c in calls] == [("many", [0]), ("many", [1])]


def test_linears_beyond_the_matvec_take_one_gemm_each(recorded):
    ops, calls = recorded
    ops.linears(activations(17), weights(T.Q8_0, T.Q8_0))
    assert calls == [("linear", 0), ("linear", 1)]


def test_k_quants_take_the_skinny_gemm_from_a_few_tokens(recorded):
    """Once the skinny GEMM's buffers exist, Q4_K / Q6_K / Q8_0 matrices run one linear each (its kernel) from their
    type's SKINNY_MIN_TOKENS on, while other block formats, and narrower batches, still share mat-vec launches."""
    from infero.backends.cuda.ops import SKINNY_MIN_TOKENS

    ops, calls = recorded
    ops._skinny = {int(T.Q4_K): None, int(T.Q6_K): None, int(T.Q8_0): None}
    ops.linears(activations(SKINNY_MIN_TOKENS[T.Q8_0]), weights(T.Q4_K, T.Q8_0, T.Q6_K))
    ops.linears(activations(8), weights(T.Q5_0, T.Q5_0))
    ops.linears(activations(SKINNY_MIN_TOKENS[T.Q4_K] - 1), weights(T.Q4_K, T.Q4_K))
    ops.linears(activations(SKINNY_MIN_TOKENS[T.Q8_0] - 1), weights(T.Q4_K, T.Q8_0, T.Q8_0))
    assert [c[:2] for c in calls] == [("linear", 0), ("linear", 1), ("linear", 2), ("many", [0, 1]),
                                      ("many", [0, 1]), ("linear", 0), ("many", [1, 2])]  # fmt: skip


def test_batch_invariant_mode_keeps_k_quants_off_the_skinny_gemm_and_takes_linear_mma_from_a_few_tokens(
    recorded, monkeypatch
):
    """In batch-invariant mode no width moves a K-quant to the skinny GEMM, whose bits differ from the mat-vec's:
    below INVARIANT_GEMM_MIN_TOKENS matrices of one type and width share a mat-vec launch; from it each matrix
    linear_mma takes runs one linear (its kernel, the same bits), the others still share mat-vec launches."""
    from infero.backends.cuda.ops import INVARIANT_GEMM_MIN_TOKENS

    ops, calls = recorded
    ops.backend.batch_invariant = True
    ops._skinny = {int(T.Q4_K): None, int(T.Q6_K): None, int(T.Q8_0): None}
    monkeypatch.setattr(linear_mma, "supports", lambda weight, n: weight.ggml_type in (T.Q4_K, T.Q6_K))
    for n in (3, INVARIANT_GEMM_MIN_TOKENS - 1):
        ops.linears(activations(n), weights(T.Q4_K, T.Q8_0, T.Q6_K, T.Q4_K))
    assert [c[:2] for c in calls] == [("many", [0, 3]), ("many", [1]), ("many", [2])] * 2
    calls.clear()
    for n in (INVARIANT_GEMM_MIN_TOKENS, 16):
        ops.linears(activations(n), weights(T.Q4_K, T.Q8_0, T.Q6_K, T.Q4_K))
    assert [c[:2] for c in calls] == [("linear", 0), ("linear", 2), ("linear", 3), ("many", [1])] * 2


@pytest.fixture
def routed(monkeypatch):
    """(ops, calls): CudaOps.linear's launches recorded as ("matvec", rows of the slice), ("linear_mma", n),
    ("router",) and ("gemm", n)."""
    calls = []
    monkeypatch.setattr(matvec, "matvec", lambda out, weight, x, *rest: calls.append(("matvec", x.shape[0])))
    monkeypatch.setattr(linear_mma, "linear_mma", lambda out, weight, *rest: calls.append(("linear_mma", out.shape[0])))
    # linear_mma takes these here (its own supports() grows with its kernel's types)
    monkeypatch.setattr(linear_mma, "supports", lambda w, n: w.ggml_type in (T.Q4_K, T.Q8_0) and w.cols % 256 == 0)
    monkeypatch.setattr(ops_module.moe, "router", lambda out, *rest: calls.append(("router",)))
    monkeypatch.setattr(ops_module.gemm, "gemm", lambda out, *rest: calls.append(("gemm", out.shape[0])))
    ops = CudaOps(SimpleNamespace(workspace=_Workspace(), stream=None, weights_arena=None, batch_invariant=True))
    monkeypatch.setattr(CudaOps, "_quantized", lambda self, x: None)
    return ops, calls


class _Rows(SimpleNamespace):
    def rows(self, a, b):
        return _Rows(ptr=self.ptr, shape=(b - a,) + self.shape[1:])


@pytest.mark.parametrize(
    "qtype, cols, n, launches",
    [
        (T.Q4_K, 256, 40, [("linear_mma", 40)]),
        (T.Q8_0, 4096, 17, [("linear_mma", 17)]),
        (T.Q4_K, 256, 16, [("linear_mma", 16)]),  # from INVARIANT_GEMM_MIN_TOKENS
        (T.Q4_K, 256, 9, [("matvec", 9)]),
        (T.Q5_0, 256, 12, [("matvec", 12)]),
        (T.Q5_0, 256, 40, [("matvec", 16), ("matvec", 16), ("matvec", 8)]),  # not linear_mma's: slices
        (T.Q8_0, 896, 33, [("matvec", 16), ("matvec", 16), ("matvec", 1)]),  # rows of no whole 256-column stage
        (T.F16, 256, 20, [("matvec", 16), ("matvec", 4)]),
    ],
)
def test_a_linear_takes_the_int8_gemm_from_a_few_tokens_or_mat_vec_slices(
    routed, monkeypatch, qtype, cols, n, launches
):
    """In batch-invariant mode, from INVARIANT_GEMM_MIN_TOKENS a quantized linear runs linear_mma, whose rows are the
    mat-vec's bits, where it takes the type and width, else the mat-vec, past 16 tokens in slices of 16 rows (a
    row's bits do not depend on its slice); never the fp16 GEMM."""
    ops, calls = routed
    monkeypatch.setattr(ops_module, "_few_float32_rows", lambda x, w: False)
    x = _Rows(ptr=1 << 20, shape=(n, cols))
    ops.ws.empty = lambda shape, dtype: _Rows(ptr=1 << 21, shape=tuple(shape))
    ops.linear(x, SimpleNamespace(ggml_type=int(qtype), rows=64, cols=cols, tiled=False))
    assert calls == launches


@pytest.mark.parametrize(
    "types, n, rope_dim, cols, launches",
    [
        ((T.Q8_0,) * 3, 1, 32, 2048, [("rope", [0, 1, 2], ("q", "k", "v"))]),
        ((T.Q4_K, T.Q4_K, T.Q6_K), 2, 32, 2048, [("rope", [0, 1, 2], ("q", "k", "v"))]),  # one mixed launch
        # 3072 columns: Q6_K on matvec_q, so v apart
        ((T.Q4_K, T.Q4_K, T.Q6_K), 2, 32, 3072, [("rope", [0, 1], ("q", "k")), ("rope", [2], ("v",))]),
        ((T.Q6_K, T.Q6_K, T.Q4_K), 1, 32, 2048, [("rope", [0, 1], ("q", "k")), ("rope", [2], ("v",))]),
        ((T.Q8_0,) * 3, 3, 32, 2048, [("many", [0, 1, 2]), ("rotary",)]),  # past matvec_rope's two tokens
        ((T.F16,) * 3, 1, 32, 2048, [("linear", 0), ("linear", 1), ("linear", 2), ("rotary",)]),  # float weights
        ((T.Q8_0,) * 3, 1, 16, 2048, [("many", [0, 1, 2]), ("rotary",)]),  # partial rotary
        ((T.Q8_0,) * 3, 1, 32, 896, [("many", [0, 1, 2]), ("rotary",)]),  # one unit per lane: plan's one row a warp
    ],
)
def test_qkv_rotary_store_folds_rotary_into_the_matvec_where_it_pays(recorded, monkeypatch, types, n, rope_dim, cols,
                                                                     launches):  # fmt: skip
    """At one or two tokens on block formats with rows of several units per lane, with rotary over whole heads, q/k/v
    run as matvec_rope launches: one per type, or one for Q4_K q/k with Q6_K v (Q4_K_M's Q6_K layers of V) where
    both take the tensor-core kernel (Q6_K: rows of a multiple of 2048); otherwise as linears then
    rotary_store_kv."""
    ops, calls = recorded
    monkeypatch.setattr(matvec, "matvec_rope", lambda outs, ws, roles, *rest: calls.append(
        ("rope", [w.index for w in ws], roles)))  # fmt: skip
    monkeypatch.setattr(CudaOps, "rotary_store_kv", lambda self, q, *rest: calls.append(("rotary",)) or q)
    monkeypatch.setattr(CudaOps, "_quantizable", lambda self, x: True)
    monkeypatch.setattr(CudaOps, "_quantized", lambda self, x: None)
    monkeypatch.setattr(CudaOps, "_inv_freq", lambda self, rotary: None)
    rotary = SimpleNamespace(rope_dim=rope_dim, mscale=1.0, pairing="neox")
    cache = SimpleNamespace(k=[None], v=[None])
    q = ops.qkv_rotary_store(activations(n, cols), weights(*types, cols=cols), None, 32, None, rotary, cache, 0, None)
    assert [c[:2] if c[0] == "many" else c for c in calls] == launches
    assert q.shape == (n, 1, 32)  # weights() gives q 32 rows: one head


@pytest.mark.parametrize(
    "optin, q4k, q6k",
    [(232448, (4096, 14336, 30976), (2048, 4096, 14336, 28672)), (101376, (768, 4096, 7936), (2048,))],  # H200, sm_89
)
def test_k_quants_take_the_tensor_core_matvec_where_its_shared_memory_fits(monkeypatch, optin, q4k, q6k):
    """matvec_mma's rings, staged activation and partial sums must fit the GPU's shared memory per block at every
    token count (H200: 227 KiB; sm_89: 99 KiB): each type's widest row that fits is the last of its list (Q4_K rows
    of 8192 and more split over 8 warps, with their rings); wider rows, Q6_K rows of other than a multiple of 2048
    columns, and every other type take matvec_q."""
    monkeypatch.setattr(matvec, "_shared_optin", lambda: optin)
    monkeypatch.setattr(matvec, "_mma_fits", {})
    for t, fits, step in ((T.Q4_K, q4k, 256), (T.Q6_K, q6k, 2048)):
        for cols in fits:
            assert matvec.takes_mma(int(t), cols), (t, cols)
        assert not matvec.takes_mma(int(t), max(fits) + step), t
    assert not matvec.takes_mma(int(T.Q6_K), 3072) and not matvec.takes_mma(int(T.Q6_K), 1024)
    assert not matvec.takes_mma(int(T.Q8_0), 4096)


@pytest.mark.parametrize(
    "weight_type, reader_types, n, folded",
    [
        (T.Q4_K, (T.Q4_K, T.Q4_K), 1, True),  # o before the FFN norm, read by gate and up
        (T.Q6_K, (T.Q4_K, T.Q4_K, T.Q6_K), 2, True),  # down before the next attention norm, read by q/k/v
        (T.Q4_K, (T.Q4_K, T.Q4_K), 3, False),  # three tokens: the readers do not stage the activation
        (T.Q8_0, (T.Q4_K, T.Q4_K), 1, False),  # the linear off the tensor cores
        (T.Q4_K, (T.Q4_K, T.Q8_0), 1, False),  # a reader off them
        (T.Q4_K, (T.F16,), 1, False),
        (T.Q4_K, (), 1, False),  # no readers named
    ],
)
def test_linear_add_rms_norm_folds_the_norm_where_the_linear_and_its_readers_take_the_tensor_cores(
    recorded, monkeypatch, weight_type, reader_types, n, folded
):
    """A decode step's linear into the residual stream runs the residual add and the norm in its own launch
    (matvec_norm, the 1 / rms applied by the readers) where it and every weight that reads the normed output take
    the tensor-core mat-vec at one or two tokens; otherwise as linear, then add_rms_norm."""
    ops, calls = recorded
    monkeypatch.setattr(matvec, "_num_sms", [132])
    monkeypatch.setattr(matvec, "matvec_norm", lambda residual, weight, *rest: calls.append(("norm", weight.index)))
    monkeypatch.setattr(CudaOps, "add_rms_norm", lambda self, x, residual, w, eps, readers=(): calls.append(
        ("add_rms_norm",)))  # fmt: skip
    monkeypatch.setattr(CudaOps, "_quantizable", lambda self, x: True)
    monkeypatch.setattr(CudaOps, "_quantized", lambda self, x: None)
    monkeypatch.setattr(CudaOps, "_quantize_into", lambda self, x, keep=None, norm=None: None)
    weight = SimpleNamespace(index=9, ggml_type=int(weight_type), rows=2048, cols=2048)
    readers = [SimpleNamespace(ggml_type=int(t), rows=64, cols=2048) for t in reader_types]
    ops.linear_add_rms_norm(activations(n, 2048), weight, object(), None, 1e-5, readers)
    assert calls == ([("norm", 9)] if folded else [("linear", 9), ("add_rms_norm",)])


@pytest.mark.parametrize(
    "reader_type, n, expected",
    [
        (T.Q4_K, 1, [("norm", 9)]),  # the decode step's fused launch
        (T.Q4_K, 3, [("linear", 9), ("add_rms_norm", "deferred", "buffer")]),  # the same form past its widths
        (T.Q4_K, 40, [("linear", 9), ("add_rms_norm", "deferred", "workspace")]),
        (T.Q8_0, 1, [("linear", 9), ("add_rms_norm",)]),  # a reader off the tensor cores: at no width
        (T.Q8_0, 40, [("linear", 9), ("add_rms_norm",)]),
    ],
)
def test_batch_invariant_mode_defers_a_norm_at_every_width_or_at_none(recorded, monkeypatch, reader_type, n, expected):
    """In batch-invariant mode whether a norm is deferred to its readers depends on the weights alone, never on the
    step's width: the readers must see one rounding of the norm (the deferred form: residual * norm weight, 1 / rms
    applied after the sum) whether the decode step's fused launch or add_rms_norm wrote it."""
    ops, calls = recorded
    ops.backend.batch_invariant = True
    monkeypatch.setattr(matvec, "_num_sms", [132])
    monkeypatch.setattr(linear_mma, "supports", lambda weight, m: weight.ggml_type != int(T.Q8_0))
    monkeypatch.setattr(matvec, "matvec_norm", lambda residual, weight, *rest: calls.append(("norm", weight.index)))
    monkeypatch.setattr(CudaOps, "add_rms_norm", lambda self, x, residual, w, eps, readers=(): calls.append(
        ("add_rms_norm",)))  # fmt: skip
    monkeypatch.setattr(CudaOps, "_quantizable", lambda self, x: x.shape[0] <= 16)
    monkeypatch.setattr(CudaOps, "_quantized", lambda self, x: None)
    monkeypatch.setattr(CudaOps, "_quantize_into", lambda self, x, keep=None, norm=None: ("buffer", norm))
    monkeypatch.setattr(CudaOps, "_workspace_activation", lambda self, x, norm=None: ("workspace", norm))
    monkeypatch.setattr(ops.ws, "empty", lambda shape, dtype: SimpleNamespace(shape=shape), raising=False)
    monkeypatch.setattr(elementwise, "add_rms_norm", lambda out, residual, y, w, eps, stream, act, *skinny:
                        calls.append(("add_rms_norm", "deferred" if act[1] == eps else "plain", act[0])))  # fmt: skip
    weight = SimpleNamespace(index=9, ggml_type=int(T.Q4_K), rows=2048, cols=2048)
    readers = [SimpleNamespace(ggml_type=int(reader_type), rows=64, cols=2048)] * 2
    ops.linear_add_rms_norm(activations(n, 2048), weight, object(), None, 1e-5, readers)
    assert calls == expected


def test_an_output_whose_norm_its_readers_apply_cannot_be_read_as_values():
    """linear_add_rms_norm's folded output exists only quantized, for the readers it was given: a float read (here a
    float weight's mat-vec) raises instead of computing from unwritten memory."""
    ops = CudaOps(SimpleNamespace(workspace=_Workspace(), stream=None, weights_arena=None))
    x = activations(1, 2048)
    ops._act_keys, ops._act_norms = [ops._key(x), None], [1e-5, None]
    f16 = SimpleNamespace(ggml_type=int(T.F16), rows=64, cols=2048)
    with pytest.raises(RuntimeError, match="readers"):
        ops.linear(x, f16)


def test_a_deferred_norms_output_read_as_float_values_is_refused():
    """_require_values: an output whose norm its readers apply (in a decode buffer or, past 16 rows, the workspace)
    has no float values; read as such, a clear error, whether or not other outputs are deferred (its fast path)."""
    from infero.backends.cuda.tensor import DeviceTensor

    class Workspace:
        generation = 5
        offset = 0

        def empty(self, shape, dtype):
            self.offset += 1
            return DeviceTensor(self.offset << 20, tuple(shape), np.dtype(dtype))

    ops = CudaOps(SimpleNamespace(workspace=Workspace(), stream=None, weights_arena=None, batch_invariant=False))
    plain, deferred = (DeviceTensor(p << 30, (3, 256), np.dtype(np.float32)) for p in (1, 2))
    ops._require_values(plain)  # nothing deferred anywhere: the fast path
    ops._act_keys, ops._act_norms = [ops._key(deferred), None], [1e-6, None]
    with pytest.raises(RuntimeError, match="read as float32 values"):
        ops._require_values(deferred)
    ops._require_values(plain)
    ops._act_keys, ops._act_norms = [None, None], [None, None]
    wide = DeviceTensor(3 << 30, (40, 256), np.dtype(np.float32))
    ops._workspace_activation(wide, norm=1e-6)
    with pytest.raises(RuntimeError, match="read as float32 values"):
        ops._require_values(wide)
    ops._require_values(plain)
    ops.backend.workspace.generation += 1  # the next forward: that activation is gone
    ops._require_values(wide)
