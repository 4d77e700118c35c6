"""A persistent layer kernel against the plain launches it replaces, on llama-3.1-8b's layer at one token (GPU
machine): what "Next for batch 1" in docs/performance.md proposed, built and measured.

    python scripts/bench_layer.py

The chain o projection (+ residual + norm), gate + up + SwiGLU, down projection (+ residual + norm), next q/k/v
(+ rotary + K/V write), for Q4_K_M's two kinds of layer (Q4_K or Q6_K down and v), run as four plain launches
(matvec.matvec_norm, matvec_glu, matvec_rope) and as one launch of matvec_layer (LAYER_SOURCE below: the plain
kernels' blocks as phases between grid barriers), both compiled with every variant the 8B needs and with only the
layer's own; each phase alone, its plain launch against a matvec_layer of that phase only; the layer launch also
without PDL, and without the cooperative attribute. First every output of the layer launch is checked bitwise
against the plain launches'. Each variant timed in a graph (bench_matvec.time_in_graph) over two copies of the
layer's weights in turn (~270 MB: past the L2), median of 7; microseconds per chain.
The kernel lives in this file: a measurement, not part of the engine.
"""

from __future__ import annotations

import ctypes

import numpy as np
from bench_matvec import time_in_graph

from infero.backends.cuda import compiler, driver, matvec, runtime
from infero.backends.cuda.tensor import DeviceTensor, QuantWeight, Workspace, empty, from_host
from infero.checkpoint.synthetic import random_blocks
from infero.checkpoint.tensor_types import GGMLType

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
Q4_K, Q6_K = int(GGMLType.Q4_K), int(GGMLType.Q6_K)
PHASES = ("o", "gate+up", "down", "q/k/v")
COPIES = 2
THREADS = 512  # the layer launch's block
MAX_PHASES = 4  # LAYER_SOURCE's mv::LAYER_MAX_PHASES
# (kind, type, type of segment 2, warps W, ring stages) of a plain launch -> LAYER_SOURCE's LayerVariant
VARIANTS = {("norm", Q4_K, Q4_K, 4, 3): 0, ("norm", Q4_K, Q4_K, 8, 2): 1, ("norm", Q6_K, Q6_K, 4, 2): 2,
            ("glu", Q4_K, Q4_K, 4, matvec.GLU_STAGES): 3, ("glu", Q6_K, Q6_K, 4, matvec.GLU_STAGES): 4,
            ("rope", Q4_K, Q4_K, 4, 2): 5, ("rope", Q4_K, Q6_K, 4, 2): 6}  # fmt: skip
ALL = tuple(range(7))
LAYER_VARIANTS = {Q4_K: (0, 1, 3, 5), Q6_K: (0, 2, 3, 6)}  # each layer kind's own: o, down, gate + up, q/k/v
ALONE = {"o": (256, 0), "gate+up": (512, 3), "down": (512, 1), "q/k/v": (512, 5)}  # of a Q4_K layer: block, variant
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong

LAYER_SOURCE = r"""
// matvec_layer<N, THREADS, V...>: consecutive mat-vec launches of a decode step (one or two tokens) as the phases of
// one persistent launch: a layer's o projection + residual + norm, gate + up + SwiGLU, down + residual + norm, and
// the next layer's q/k/v + rotary + K/V write. One block an SM; each phase's blocks (those of its plain kernel in
// matvec.cu: matvec_mma_norm, matvec_mma_glu, matvec_mma with ROPE, through their Work structs) run by slots of
// THREADS / their size threads; a grid-wide barrier between phases, before which a block issues the next phase's
// first weight copies. Every output is bitwise what the plain launches give (the same blocks, warps and reduction
// order). V...: the LayerVariants compiled in (each one more only costs: bench_layer's table).
//
// Phase block b runs on block b % gridDim.x, slot b / gridDim.x; a slot's rings at slot * its ring bytes, its partial
// sums at part_at, the staged activation (loaded by the whole block, through the L2: other blocks wrote it) at act_at.
// The launch must be cooperative (all blocks resident): the barrier spins.
namespace mv {

constexpr int LAYER_MAX_PHASES = 4;
enum LayerKind { KIND_NORM, KIND_GLU, KIND_ROPE };
// The plain kernels a phase may take (VARIANTS below): (kind, T, T2, W, STAGES).
enum LayerVariant {
  LV_NORM_Q4K_4_3,
  LV_NORM_Q4K_8_2,
  LV_NORM_Q6K_4_2,
  LV_GLU_Q4K,
  LV_GLU_Q6K,
  LV_ROPE_Q4K_4_2,
  LV_ROPE_Q4K_Q6K_4_2,
};
template <int V> struct Variant;
template <int K, int T_, int T2_, int W_, int S_>
struct VariantOf {
  static constexpr int KIND = K, T = T_, T2 = T2_, W = W_, STAGES = S_;
  static constexpr int THREADS = K == KIND_NORM ? 64 * W : K == KIND_GLU ? 128 : 32 * W;  // a slot's
};
template <> struct Variant<LV_NORM_Q4K_4_3> : VariantOf<KIND_NORM, GGML_Q4_K, GGML_Q4_K, 4, 3> {};
template <> struct Variant<LV_NORM_Q4K_8_2> : VariantOf<KIND_NORM, GGML_Q4_K, GGML_Q4_K, 8, 2> {};
template <> struct Variant<LV_NORM_Q6K_4_2> : VariantOf<KIND_NORM, GGML_Q6_K, GGML_Q6_K, 4, 2> {};
template <> struct Variant<LV_GLU_Q4K> : VariantOf<KIND_GLU, GGML_Q4_K, GGML_Q4_K, 4, 2> {};
template <> struct Variant<LV_GLU_Q6K> : VariantOf<KIND_GLU, GGML_Q6_K, GGML_Q6_K, 4, 2> {};
template <> struct Variant<LV_ROPE_Q4K_4_2> : VariantOf<KIND_ROPE, GGML_Q4_K, GGML_Q4_K, 4, 2> {};
template <> struct Variant<LV_ROPE_Q4K_Q6K_4_2> : VariantOf<KIND_ROPE, GGML_Q4_K, GGML_Q6_K, 4, 2> {};

// One phase: the plain kernel's arguments (those of its kind; the rest zero) and where it lives in the block.
struct LayerPhase {
  Segments seg;
  Rope rope;
  const int8_t* xq;
  const ActScale* xs;
  int8_t* yq;
  ActScale* ys;
  float* residual;
  const float* norm_weight;
  float* norm_ss;
  long long row_bytes;
  int variant, blocks, slots, cols, deferred, act_at, part_at;
  float eps;
};

struct Layer {
  LayerPhase phase[LAYER_MAX_PHASES];
  int phases, n;
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every block of the (co-resident) grid arrives, then waits until all have. barrier[0] counts the arrivals and is
// reset by the last one, which then advances the generation barrier[1] that the others wait on: nothing to reset
// between launches (a replayed graph reuses it).
__device__ __forceinline__ void grid_sync(unsigned* barrier) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned generation = ld_acquire(barrier + 1);
    __threadfence();
    if (atomicAdd(barrier, 1u) == gridDim.x - 1) {
      atomicExch(barrier, 0u);
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(barrier + 1) : "memory");
    } else {
      while (ld_acquire(barrier + 1) == generation) {
      }
    }
  }
  __syncthreads();
}

// One step of phase p for this thread's slot: its first weight copies (FIRST), or the rest once the activation is
// staged at sx.
template <int V, int N, bool FIRST>
__device__ __forceinline__ void layer_step(const LayerPhase& p, uint8_t* smem, const int8_t* sx, const float* inv_rms,
                                           int n) {
  using Var = Variant<V>;
  using F = MmaFormat<Var::T>;
  using F2 = MmaFormat<Var::T2>;
  constexpr int GT = Var::THREADS, WARPS = GT / 32, STAGES = Var::STAGES;
  const int slot = threadIdx.x / GT, block = blockIdx.x + gridDim.x * slot;
  if (slot >= p.slots || block >= p.blocks) return;
  const int tid = threadIdx.x % GT, warp = tid >> 5, lane = tid & 31, g = lane >> 2, j = lane & 3;
  const Group gr{tid, 1 + slot, GT};
  float* part = reinterpret_cast<float*>(smem + p.part_at);
  if constexpr (Var::KIND == KIND_NORM) {
    using Work = NormWork<F, N, Var::W, STAGES>;
    uint8_t* rings = smem + slot * WARPS * STAGES * Work::STAGE;
    const Work work(p.seg, p.cols, p.row_bytes, block, warp, lane);
    if constexpr (FIRST) {
      work.first_copies(rings, p.row_bytes, warp, lane);
    } else {
      using Part = float[2][Var::W][2][N][16];
      const float r = Work::residual_in(p.residual, n, p.seg.rows[0], block, tid);
      const MmaAct<1> x = act_view<F, N, 1, N>(sx, p.xq, p.xs, n, p.cols, g, j);
      work.rest(p.seg, x, n, p.cols, p.row_bytes, r, p.residual, p.norm_weight, p.yq, p.ys, p.norm_ss, block, rings,
                reinterpret_cast<Part*>(part)[slot], gr);
    }
  } else if constexpr (Var::KIND == KIND_GLU) {
    using Work = GluWork<F, N, STAGES>;
    uint8_t* rings = smem + slot * WARPS * STAGES * Work::STAGE;
    const Work work(p.seg, p.cols, p.row_bytes, block, warp, lane);
    if constexpr (FIRST) {
      work.first_copies(rings, p.row_bytes, warp, lane);
    } else {
      using Part = float[4][Work::W][2][N][16];
      const MmaAct<1> x = act_view<F, N, 1, N>(sx, p.xq, p.xs, n, p.cols, g, j);
      work.rest(p.seg, x, n, p.cols, p.row_bytes, p.yq, p.ys, p.deferred, inv_rms, block, rings,
                reinterpret_cast<Part*>(part)[slot], gr);
    }
  } else {
    constexpr int STAGE = 16 * (F::ROW > F2::ROW ? F::ROW : F2::ROW);
    using Part = float[Var::W][2][N][16];
    uint8_t* rings = smem + slot * WARPS * STAGES * STAGE;
    const int2 st = segment_tile(p.seg, block);
    auto run = [&](auto format, long long row_bytes) {
      using G = decltype(format);
      using Work = TileWork<G, N, Var::W, STAGES, true, STAGE>;
      const Work work(p.seg, p.rope, p.cols, row_bytes, st.x, st.y, warp, lane);
      if constexpr (FIRST) {
        work.first_copies(rings, row_bytes, warp, lane);
      } else {
        const MmaAct<1> x = act_view<G, N, 1, N>(sx, p.xq, p.xs, n, p.cols, g, j);
        work.rest(p.seg, x, n, p.cols, row_bytes, p.rope, p.deferred, inv_rms, st.x, rings,
                  reinterpret_cast<Part*>(part)[slot], gr);
      }
    };
    if (Var::T2 != Var::T && st.x == 2)  // v of its own type (contiguous GGUF rows)
      run(F2{}, (long long)(p.cols / 256) * F2::SB_BYTES);
    else
      run(F{}, p.row_bytes);
  }
}

// Phase p's step for this thread's slot, among the variants V... compiled into the launch.
template <int N, bool FIRST, int... V>
__device__ __forceinline__ void layer_phase(const LayerPhase& p, uint8_t* smem, const float* inv_rms, int n) {
  const int8_t* sx = reinterpret_cast<const int8_t*>(smem + p.act_at);
  ((p.variant == V ? layer_step<V, N, FIRST>(p, smem, sx, inv_rms, n) : void()), ...);
}

}  // namespace mv

// grid: one block an SM (cooperative), block THREADS, dynamic shared memory: the largest phase's act_at + staged
// activation + its slots' partial sums (matvec.py's LayerQueue lays it out); barrier: two zeroed words this launch's
// stream alone uses. V...: the LayerVariants it takes.
template <int N, int THREADS, int... V>
__global__ void __launch_bounds__(THREADS, 1) matvec_layer(const __grid_constant__ mv::Layer layer,
                                                           unsigned* __restrict__ barrier) {
  static_assert(N == 1 || N == 2, "a decode step of one or two tokens (the activation staged in shared memory)");
  extern __shared__ uint4 dyn[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(dyn);
  __shared__ float inv_rms[N];  // the phase's deferred norm's factor per token (stage_activation)
  mv::layer_phase<N, true, V...>(layer.phase[0], smem, inv_rms, layer.n);
  pdl_enter();
  for (int k = 0; k < layer.phases; ++k) {
    const mv::LayerPhase& p = layer.phase[k];
    mv::stage_activation<N, true>(reinterpret_cast<int8_t*>(smem + p.act_at), p.xq, p.xs, layer.n, p.cols,
                                  p.deferred, p.eps, inv_rms, threadIdx.x, THREADS);
    if (p.deferred) __syncthreads();  // inv_rms is read by every slot (a slot's barrier does not order it)
    mv::layer_phase<N, false, V...>(p, smem, inv_rms, layer.n);
    if (k + 1 < layer.phases) {
      __syncthreads();  // every slot is done with the rings, the staged activation and inv_rms
      mv::layer_phase<N, true, V...>(layer.phase[k + 1], smem, inv_rms, layer.n);
      mv::grid_sync(barrier);
    }
  }
}
"""


class LayerPhase(ctypes.Structure):
    """LAYER_SOURCE's mv::LayerPhase."""

    _fields_ = [("seg", matvec.Segments), ("rope", matvec.Rope), ("xq", _P), ("xs", _P), ("yq", _P), ("ys", _P),
                ("residual", _P), ("norm_weight", _P), ("norm_ss", _P), ("row_bytes", _L), ("variant", _I),
                ("blocks", _I), ("slots", _I), ("cols", _I), ("deferred", _I), ("act_at", _I), ("part_at", _I),
                ("eps", ctypes.c_float)]  # fmt: skip


class Layer(ctypes.Structure):
    _fields_ = [("phase", LayerPhase * MAX_PHASES), ("phases", _I), ("n", _I)]


class LayerKernels:
    """matvec_layer for each (threads, variants) asked, compiled together with matvec.cu's source."""

    def __init__(self, shapes: list[tuple[int, tuple[int, ...]]]):
        self.names = {shape: f"matvec_layer<1, {shape[0]}, {', '.join(map(str, shape[1]))}>" for shape in shapes}
        source = (compiler.KERNEL_DIR / matvec.SOURCE).read_text() + LAYER_SOURCE
        compiled = compiler.compile_source(source, "bench_layer.cu", runtime.context().info.arch,
                                           names=list(self.names.values()))  # fmt: skip
        self.module = driver.Module(compiled.cubin)
        self.functions = {shape: self.module.function(compiled.lowered[name]) for shape, name in self.names.items()}


class Queue:
    """Phases recorded for one matvec_layer launch of one token, then launched by flush()."""

    def __init__(self, kernels: LayerKernels, threads: int, variants: tuple[int, ...], barrier: DeviceTensor):
        self.fn, self.threads, self.variants, self.barrier = (
            kernels.functions[(threads, variants)],
            threads,
            variants,
            barrier,
        )
        self.layer, self.shared, self.pdl, self.cooperative = Layer(), 0, True, True

    def add(self, kind, t, t2, warps, stages, blocks, cols, with_sums, **fields) -> None:
        variant = VARIANTS[(kind, t, t2, warps, stages)]
        assert variant in self.variants, (kind, variant, self.variants)
        threads = 64 * warps if kind == "norm" else 128 if kind == "glu" else 32 * warps  # the plain block
        slots = -(-blocks // matvec._sms())
        assert slots * threads <= self.threads, (kind, slots, threads)
        rings = slots * (threads // 32) * stages * 16 * max(matvec.MMA_ROW[t], matvec.MMA_ROW[t2])
        act = 5 * cols // 2 + (cols // 8 if with_sums else 0)
        part_at = rings + -(-act // 16) * 16
        part_floats = (2 * warps if kind == "norm" else 16 if kind == "glu" else warps) * 2 * 16
        p = self.layer.phase[self.layer.phases]
        ctypes.memset(ctypes.addressof(p), 0, ctypes.sizeof(p))
        fields.update(variant=variant, blocks=blocks, slots=slots, cols=cols, act_at=rings, part_at=part_at)
        for name, value in fields.items():
            setattr(p, name, value)
        self.layer.phases, self.layer.n = self.layer.phases + 1, 1
        self.shared = max(self.shared, part_at + slots * 4 * part_floats)

    def flush(self, stream) -> None:
        matvec._allow_shared(self.fn, self.shared)
        driver.launch(self.fn, (matvec._sms(),), (self.threads,), (self.layer, self.barrier.ptr), (None, _P), stream,
                      self.shared, pdl=self.pdl, cooperative=self.cooperative)  # fmt: skip
        self.layer.phases, self.shared = 0, 0


def weight(qtype: int, rows: int, cols: int, rng) -> QuantWeight:
    return QuantWeight(from_host(random_blocks(qtype, rows, cols, rng, 0.02)), qtype, rows, cols)


def activation(cols: int, deferred: bool) -> matvec.Activation:
    q_shape, s_shape = matvec.activation_shapes(1, cols)
    s_and_sums = empty((int(np.prod(s_shape)) + cols // 32,), np.int32)
    s = DeviceTensor(s_and_sums.ptr, s_shape, np.dtype(np.int32), s_and_sums)
    sums = DeviceTensor(s.ptr + s.nbytes, (1, cols // 32), np.dtype(np.float32), s_and_sums) if deferred else None
    return matvec.Activation(empty(q_shape, np.int8), s, sums, 1e-5 if deferred else 0.0)


class LayerChain:
    """The four launches over each copy of one layer kind's weights, plainly (run) or as phases (record)."""

    def __init__(self, down_type: int, rng, stream):
        self.stream = stream
        qkv_types = (Q4_K, Q4_K, down_type)  # Q4_K_M stores v and down as Q6_K in the same layers
        self.qkv_rows = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
        self.copies = [{
            "o": weight(Q4_K, HIDDEN, HIDDEN, rng), "gate": weight(Q4_K, FFN, HIDDEN, rng),
            "up": weight(Q4_K, FFN, HIDDEN, rng), "down": weight(down_type, HIDDEN, FFN, rng),
            "qkv": [weight(t, r, HIDDEN, rng) for t, r in zip(qkv_types, self.qkv_rows, strict=True)],
        } for _ in range(COPIES)]  # fmt: skip
        self.residual0 = rng.normal(0, 3, size=(1, HIDDEN)).astype(np.float32)
        self.residual = from_host(self.residual0)
        self.norm = from_host(rng.uniform(0.5, 2, size=HIDDEN).astype(np.float32))
        self.x = activation(HIDDEN, False)
        matvec.quantize(self.x.q, self.x.s, from_host(rng.normal(0, 1, size=(1, HIDDEN)).astype(np.float32)), stream)
        self.h1, self.g, self.h2 = activation(HIDDEN, True), activation(FFN, False), activation(HIDDEN, True)
        self.glu_out = empty((1, FFN), np.float32)
        self.outs = [empty((1, r), np.float32) for r in self.qkv_rows]
        self.k_cache, self.v_cache = (empty((4, 16, KV_HEADS, HEAD_DIM), np.float16) for _ in range(2))
        self.positions, self.slots = from_host(np.array([700], np.int32)), from_host(np.array([37], np.int64))
        self.inv_freq = from_host((5e5 ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)).astype(np.float32))
        self.ws = Workspace(1 << 16)
        self.xh, self.xf = empty((1, HIDDEN), np.float32), empty((1, FFN), np.float32)

    def run(self, phases=PHASES) -> None:
        s = self.stream
        for w in self.copies:
            if "o" in phases:
                matvec.matvec_norm(self.residual, w["o"], self.xh, self.x, self.norm, self.h1, s)
            if "gate+up" in phases:
                matvec.matvec_glu(self.glu_out, w["gate"], w["up"], self.xh, (None, None), self.h1, self.g, s)
            if "down" in phases:
                matvec.matvec_norm(self.residual, w["down"], self.xf, self.g, self.norm, self.h2, s)
            if "q/k/v" in phases:
                matvec.matvec_rope(self.outs, w["qkv"], ("q", "k", "v"), self.xh, None, self.positions, self.inv_freq,
                                   1.0, "interleaved", HEAD_DIM, self.k_cache, self.v_cache, self.slots, s, self.ws,
                                   self.h2)  # fmt: skip

    def record(self, queue: Queue, phases=PHASES) -> None:
        """What run() launches, as the phases of one matvec_layer launch a copy (the plain launches' arguments)."""
        for w in self.copies:
            if "o" in phases:
                self._norm(queue, w["o"], self.x, self.h1)
            if "gate+up" in phases:
                gate, up, x = w["gate"], w["up"], self.h1
                queue.add("glu", Q4_K, Q4_K, 4, matvec.GLU_STAGES, FFN // 32, HIDDEN, True,
                          seg=matvec.segments([self.glu_out] * 2, [gate, up], [None, None]), xq=x.q.ptr,
                          xs=x.s.ptr, row_bytes=gate.data.shape[1], yq=self.g.q.ptr, ys=self.g.s.ptr, deferred=1,
                          eps=x.eps)  # fmt: skip
            if "down" in phases:
                self._norm(queue, w["down"], self.g, self.h2)
            if "q/k/v" in phases:
                ws, x = w["qkv"], self.h2
                rope = matvec.Rope(self.positions.ptr, self.slots.ptr, self.inv_freq.ptr, self.k_cache.ptr,
                                   self.v_cache.ptr)  # fmt: skip
                rope.role[0], rope.role[1], rope.role[2] = 0, 1, 2
                rope.head_dim, rope.neox, rope.mscale = HEAD_DIM, 0, 1.0
                tiles = sum(self.qkv_rows) // 16
                warps, stages = matvec.mma_plan(Q4_K, tiles, HIDDEN, matvec._sms())
                queue.add("rope", Q4_K, ws[2].ggml_type, warps, stages, tiles, HIDDEN, True,
                          seg=matvec.segments(self.outs, ws, [None] * 3), rope=rope, xq=x.q.ptr, xs=x.s.ptr,
                          row_bytes=ws[0].data.shape[1], deferred=1, eps=x.eps)  # fmt: skip
            queue.flush(self.stream)

    def _norm(self, queue: Queue, w: QuantWeight, x: matvec.Activation, out: matvec.Activation) -> None:
        warps, stages, _ = matvec._norm_launch(w.ggml_type, w.rows, w.cols, 1)
        queue.add("norm", w.ggml_type, w.ggml_type, warps, stages, w.rows // 32, w.cols, False,
                  seg=matvec.segments([self.residual], [w], [None]), xq=x.q.ptr, xs=x.s.ptr, row_bytes=w.data.shape[1],
                  residual=self.residual.ptr, norm_weight=self.norm.ptr, yq=out.q.ptr, ys=out.s.ptr,
                  norm_ss=out.norm_ss.ptr)  # fmt: skip

    def outputs(self) -> dict[str, np.ndarray]:
        self.stream.synchronize()
        named = {"residual": self.residual, "glu out": self.glu_out, "q": self.outs[0], "k": self.outs[1],
                 "v": self.outs[2], "k cache": self.k_cache, "v cache": self.v_cache}  # fmt: skip
        for name, act in (("o's activation", self.h1), ("SwiGLU's", self.g), ("down's", self.h2)):
            named[f"{name} planes"], named[f"{name} scales"] = act.q, act.s
            if act.norm_ss is not None:
                named[f"{name} sums"] = act.norm_ss
        return {name: t.to_host() for name, t in named.items()}

    def reset(self) -> None:
        self.stream.synchronize()
        driver.copy_host_to_device(self.residual.ptr, self.residual0)


def check_bitwise(chain: LayerChain, queue: Queue) -> None:
    """The layer launch's every output against the plain launches' (from the same residual)."""
    chain.reset()
    chain.run()
    plain = chain.outputs()
    chain.reset()
    chain.record(queue)
    fused = chain.outputs()
    for name, expected in plain.items():
        got = fused[name]
        bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
        differ = np.argwhere(got.view(bits) != expected.view(bits))
        if len(differ):
            raise SystemExit(f"matvec_layer: {name}: {len(differ)} elements differ, first at {differ[0].tolist()}")
    assert np.isfinite(plain["residual"]).all() and np.isfinite(plain["q"]).all()


def main() -> None:
    stream, rng = runtime.stream(), np.random.default_rng(0)
    barrier = from_host(np.zeros(2, np.uint32))
    shapes = [(THREADS, ALL), *((THREADS, v) for v in LAYER_VARIANTS.values()), *ALONE.values()]
    kernels = LayerKernels(list(dict.fromkeys((t, v if isinstance(v, tuple) else (v,)) for t, v in shapes)))
    print(f"{'layer':<6} {'what':<44} {'plain us':>9} {'layer us':>9} {'diff':>8}")
    for name, down_type in (("Q4_K", Q4_K), ("Q6_K", Q6_K)):
        chain = LayerChain(down_type, rng, stream)
        own = LAYER_VARIANTS[down_type]
        for label, variants in (("all 7 variants", ALL), (f"its own {len(own)}", own)):
            queue = Queue(kernels, THREADS, variants, barrier)
            check_bitwise(chain, queue)
            plain = time_in_graph(stream, chain.run, COPIES)
            fused = time_in_graph(stream, lambda q=queue, c=chain: c.record(q), COPIES)
            print(
                f"{name:<6} {' + '.join(PHASES) + ', ' + label:<44} {plain:>9.2f} {fused:>9.2f} {fused - plain:>+8.2f}"
            )
        for label, pdl, cooperative in (
            ("its own, without PDL", False, True),
            ("its own, not cooperative", True, False),
        ):
            queue = Queue(kernels, THREADS, own, barrier)
            queue.pdl, queue.cooperative = pdl, cooperative
            fused = time_in_graph(stream, lambda q=queue, c=chain: c.record(q), COPIES)
            print(f"{name:<6} {label:<44} {'':>9} {fused:>9.2f}")
        if down_type != Q4_K:
            continue
        for phase, (threads, variant) in ALONE.items():
            for label, queue in ((f"{phase} alone, all 7 variants", Queue(kernels, THREADS, ALL, barrier)),
                                 (f"{phase} alone, its variant alone ({threads})",
                                  Queue(kernels, threads, (variant,), barrier))):  # fmt: skip
                chain.record(queue, (phase,))
                plain = time_in_graph(stream, lambda p=phase, c=chain: c.run((p,)), COPIES)
                fused = time_in_graph(stream, lambda q=queue, p=phase, c=chain: c.record(q, (p,)), COPIES)
                print(f"{name:<6} {label:<44} {plain:>9.2f} {fused:>9.2f} {fused - plain:>+8.2f}")


if __name__ == "__main__":
    main()
