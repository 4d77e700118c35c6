// linear_mma: a linear layer out[n, rows] = x[n, cols] @ dequant(W)[rows, cols]^T (+ bias) on the int8 tensor
// cores for steps of more than the mat-vec's 16 tokens (prefill chunks, batched decode, mixed steps), types Q4_K,
// Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS. Every output is the linear-layer definition's
// (unit_value.cuh; docs/kernels.md, rule 2): fx::value of the fixed-point sum of the row's span values
// (mma_units.cuh), times a deferred norm's 1 / rms where the activation carries one, then + bias (__fadd_rn):
// bitwise what the mat-vec gives the token alone, whatever n, the token's place or the split of the spans below.
//
// Layouts. W: GGUF rows [rows, row_bytes], or for Q4_K / Q6_K with `tiled` quant.cuh's tiled layout. The activation:
// act_quant.cuh's planes xq [2, n, cols] and scales xs [n, cols / 16] (matvec.quantize, or a fused writer); with
// `deferred` it is residual * norm weight and norm_ss [n, cols / 32] holds each group's sum of squares of the
// residual (matvec.Activation). cols: a multiple of 256 (Q8_0: of 32, the last span's absent units +0).
//
// Blocks: 16 warps (one block an SM at 128 registers a thread), a warp 16 rows x 16 tokens (4 column tiles of 4
// tokens, two planes each), a block 16 WR rows x 32 WT tokens: (8, 1) to 32 tokens, (4, 2) above (linear_mma.py).
// Four warps a scheduler to hide the mma and float latencies (to 7d86218: 8 warps of 32 tokens, 168-255 registers,
// ~33% of issue slots used), at the cost of each A fragment feeding 4 column tiles instead of 8. grid: (row tiles,
// token tiles, splits); split z takes a contiguous range of the row's stages (256 columns: a span), so narrow
// matrices still fill the GPU. A stage's activations, scales and weight pieces (mma_units.cuh's staging) go through
// shared memory, three buffers where the device holds them (linear_mma.buffers; else two): stages s + 1 and s + 2 are
// copied by cp.async (16-byte aligned stages' pieces too; Q6_K's, Q8_0's and IQ4_XS's are loaded into registers
// before stage s's mma work and stored after it: one ahead) while stage s's runs; one barrier a stage. The
// per-(output, unit) work (T from the int32 sums, uv::value_t, a tree add) sets the pace, fx::add once a span. One
// split: outputs written directly; more: each block writes its int64 sums and probes to part [splits, n, rows] and
// linear_mma_finish adds them (in any order: integers).
#include "pdl.cuh"
#include "fixed_point.cuh"
#include "mma_units.cuh"

namespace lm {

constexpr int THREADS = 512, NT = 4;  // threads a block; column tiles a warp (16 tokens)
// Types whose rows may end inside a stage (cols a multiple of 32: qwen2.5-0.5b's 896; linear_mma.PARTIAL_TYPES): Q8_0,
// whose weights take the register path, which reads no block past the row's end.
template <int T> constexpr bool PARTIAL = T == GGML_Q8_0;

// RMSNorm's 1 / rms of token t from its groups' sums of squares, as matvec_mma's stage_activation forms it (lane i
// sums groups i, i + 32, ... in order, then an xor butterfly): every reader of a deferred norm gets the same factor.
__device__ __forceinline__ float inv_rms(const float* __restrict__ norm_ss, int t, int cols, float eps, int lane) {
  const int groups = cols / 32;
  const float* sums = norm_ss + (long long)t * groups;
  float total = 0.f;
  for (int i = lane; i < groups; i += 32) total = __fadd_rn(total, sums[i]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total = __fadd_rn(total, __shfl_xor_sync(0xFFFFFFFFu, total, o));
  return 1.0f / sqrtf(total / (float)cols + eps);
}

}  // namespace lm

template <int T, int WR, int WT>  // a block: 16 WR rows x 32 WT tokens
__global__ void __launch_bounds__(lm::THREADS, 1)
    linear_mma(float* __restrict__ out, long long* __restrict__ part_v, float* __restrict__ part_p,
               const uint8_t* __restrict__ weight, const int8_t* __restrict__ xq, const ActScale* __restrict__ xs,
               const float* __restrict__ norm_ss, float norm_eps, const float* __restrict__ bias, int n, int rows,
               int cols, long long row_bytes, int tiled, int splits, int bufs) {
  using P = mu::Policy<T>;
  constexpr int ROWS = 16 * WR, TOK = 32 * WT, KU = mu::KU, NT = lm::NT;
  static_assert(WR * (TOK / (4 * NT)) * 32 == lm::THREADS, "16 warps: WR rows x TOK / 16 tokens of them");
  // A buffer: activations [KU][TOK][2 planes][32], scales [KU][TOK][2 halves], weight pieces [PIECES][ROWS][16],
  // for PREP types their {A, B} [KU][ROWS] and three more copies of each row's header [3][ROWS][16], so four threads
  // a row form its {A, B} (linear_mma.shared_bytes).
  constexpr int ACT_BYTES = 640 * TOK, W_BYTES = 16 * P::PIECES * ROWS, AB_BYTES = 8 * KU * ROWS;
  constexpr int BUF_BYTES = ACT_BYTES + W_BYTES + (P::PREP ? AB_BYTES + 48 * ROWS : 0);
  constexpr int PC = (P::PIECES * ROWS + lm::THREADS - 1) / lm::THREADS;  // weight pieces a thread copies
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float inv[TOK];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, j = lane & 3;
  const int rl = 16 * (warp % WR) + g, tb = 4 * NT * (warp / WR);
  const int row0 = blockIdx.x * ROWS, tok0 = blockIdx.y * TOK, z = blockIdx.z, live = min(TOK, n - tok0);
  const int units = cols / 32, stages = (units + KU - 1) / KU, st0 = (int)((long long)stages * z / splits),
            st1 = (int)((long long)stages * (z + 1) / splits);
  const int8_t* xq1 = xq + (long long)n * cols;
  const bool active = tb < live;

  auto stage_of = [&](int r, int st) {
    return mu::stage_at<T>(weight, min(row0 + r, rows - 1), st, row_bytes, tiled);
  };
  // Stage st's cp.async copies into buffer b: the activation slices, their scales (a unit's two halves at once) and
  // (ASYNC) the weight pieces. Tokens past the step's end are not copied: the columns of a live tile that read them
  // are never written, nor units past the row's end (Q8_0's last stage may hold fewer than KU). Copy
  // i = tid + THREADS q of each kind keeps the thread's token, plane, half and row whatever q, so a stage's addresses
  // are one base a kind plus constants.
  static_assert(4 * KU * TOK % lm::THREADS == 0 && lm::THREADS % (4 * TOK) == 0 && KU * TOK <= lm::THREADS &&
                    lm::THREADS % ROWS == 0,
                "whole copy rounds of fixed tokens and rows a thread");
  const int ap = (tid >> 2) % TOK, sp = tid % TOK, wr = tid % ROWS, wp = tid / ROWS;
  auto issue = [&](int st, int b) {
    uint8_t* sb = smem + b * BUF_BYTES;
    if (ap < live) {
      const int u = st * KU + (tid >> 2) / TOK;
      const int8_t* src = ((tid >> 1) & 1 ? xq1 : xq) + (long long)(tok0 + ap) * cols + 32 * u + 16 * (tid & 1);
#pragma unroll
      for (int q = 0; q < 4 * KU * TOK / lm::THREADS; ++q)
        if (u + q * (lm::THREADS / (4 * TOK)) < units)
          tc::cp_async<16>(sb + 16 * (tid + q * lm::THREADS), src + 32 * q * (lm::THREADS / (4 * TOK)));
    }
    if (tid < KU * TOK && sp < live && st * KU + tid / TOK < units)
      tc::cp_async<16>(reinterpret_cast<ActScale*>(sb + 512 * TOK) + 2 * tid,
                       xs + (long long)(tok0 + sp) * (cols / 16) + 2 * (st * KU + tid / TOK));
    if constexpr (P::ASYNC) {
      const uint8_t* stage = stage_of(wr, st);
#pragma unroll
      for (int q = 0; q < PC; ++q) {
        const int piece = wp + q * (lm::THREADS / ROWS);
        if (piece < P::PIECES)
          tc::cp_async<16>(sb + ACT_BYTES + 16 * (tid + q * lm::THREADS), P::piece_at(stage, piece));
      }
      if constexpr (P::PREP) {
        if (wp >= 1 && wp < 4)
          tc::cp_async<16>(sb + ACT_BYTES + W_BYTES + AB_BYTES + 16 * ((wp - 1) * ROWS + wr), stage);
      }
    }
  };
  // The register path (!ASYNC): stage st's pieces loaded into held, then stored into buffer b.
  uint4 held[P::ASYNC ? 1 : PC];
  auto load = [&](int st) {
    if constexpr (!P::ASYNC) {
      const uint8_t* stage = stage_of(wr, st);
#pragma unroll
      for (int q = 0; q < PC; ++q) {
        const int piece = wp + q * (lm::THREADS / ROWS);
        if (piece < P::PIECES) held[q] = P::piece(stage, piece, min(KU, units - st * KU));
      }
    }
  };
  auto store = [&](int b) {
    if constexpr (!P::ASYNC) {
      uint4* sa = reinterpret_cast<uint4*>(smem + b * BUF_BYTES + ACT_BYTES);
#pragma unroll
      for (int q = 0; q < PC; ++q)
        if (tid + q * lm::THREADS < P::PIECES * ROWS) sa[tid + q * lm::THREADS] = held[q];
    }
  };

  fx::Sum sum[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) sum[nt][0] = sum[nt][1] = fx::zero();
  if (st0 < st1) load(st0);  // the weights are no earlier kernel's output: loaded before the PDL wait
  pdl_enter();
  // bufs (2 or 3: what the device's shared memory holds) stage buffers, a ring: one cp.async group a stage, bufs - 1
  // ahead of the mma work (a group for every stage number, empty past st1, so "all but the newest bufs - 2" is always
  // stage st's); the register path one ahead.
  if (st0 < st1) {
    issue(st0, 0);
    store(0);
  }
  tc::cp_async_commit();
  if (bufs == 3 && st0 + 1 < st1) issue(st0 + 1, 1);
  tc::cp_async_commit();
  int b = 0;  // stage st's buffer
  for (int st = st0; st < st1; ++st) {
    const bool next = st + 1 < st1;
    if (next) load(st + 1);  // in flight during this stage's mma work
    if (bufs == 3) {
      tc::cp_async_wait<1>();
    } else {
      tc::cp_async_wait<0>();
    }
    mu::scales<T>(reinterpret_cast<ActScale*>(smem + b * BUF_BYTES + 512 * TOK), KU * TOK, tid, lm::THREADS);
    if constexpr (P::PREP) {
      // Row wr's units 2 wp, 2 wp + 1, from the header this thread copied (wp = 0: the row's piece 0).
      uint8_t* sa = smem + b * BUF_BYTES + ACT_BYTES;
      const uint8_t* hd = wp == 0 ? sa + 16 * wr : sa + W_BYTES + AB_BYTES + 16 * ((wp - 1) * ROWS + wr);
      if (wp < 4)
        P::prep_pair(reinterpret_cast<float2*>(sa + W_BYTES), *reinterpret_cast<const uint4*>(hd), ROWS, wr, wp);
    }
    __syncthreads();  // stage st landed and stored for every thread; every warp done with stage st - 1's buffer
    if (st + bufs - 1 < st1) issue(st + bufs - 1, b == 0 ? bufs - 1 : b - 1);  // stage st - 1's buffer
    tc::cp_async_commit();
    const uint8_t* sb = smem + b * BUF_BYTES;
    const float2* dm = reinterpret_cast<const float2*>(sb + 512 * TOK);
    const float2* ab = reinterpret_cast<const float2*>(sb + ACT_BYTES + W_BYTES);
    // The warp's live column tiles: those with a token below the block's live ones.
    if (active)
      mu::span<T, NT, lm::PARTIAL<T>>(sum, sb + ACT_BYTES, ab, sb, dm, ROWS, TOK, rl, tb, min(NT, (live - tb + 3) / 4),
                                      min(KU, units - st * KU), g, j);
    const int after = b + 1 == bufs ? 0 : b + 1;  // stage st + 1's buffer
    if (next) store(after);  // its weights: every warp passed a barrier since its last mma work on that buffer
    b = after;
  }
  if (splits == 1 && norm_ss != nullptr) {
    for (int t = warp; t < live; t += lm::THREADS / 32) {
      const float f = lm::inv_rms(norm_ss, tok0 + t, cols, norm_eps, lane);
      if (lane == 0) inv[t] = f;
    }
    __syncthreads();
  }
  if (!active) return;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int t = tb + 4 * nt + j;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + rl + 8 * h;
      if (t >= live || row >= rows) continue;
      const long long at = (long long)(tok0 + t) * rows + row;
      if (splits > 1) {
        part_v[(long long)z * n * rows + at] = sum[nt][h].v;
        part_p[(long long)z * n * rows + at] = sum[nt][h].probe;
      } else {
        float v = fx::value(sum[nt][h]);
        if (norm_ss != nullptr) v = __fmul_rn(v, inv[t]);
        out[at] = bias != nullptr ? __fadd_rn(v, __ldg(bias + row)) : v;
      }
    }
  }
}

// The splits' sums of token blockIdx.y, rows from THREADS blockIdx.x, added (int64: any order) and finished as
// linear_mma finishes one split's.
__global__ void __launch_bounds__(lm::THREADS) linear_mma_finish(float* __restrict__ out,
                                                                 const long long* __restrict__ part_v,
                                                                 const float* __restrict__ part_p,
                                                                 const float* __restrict__ norm_ss, float norm_eps,
                                                                 const float* __restrict__ bias, int n, int rows,
                                                                 int cols, int splits) {
  __shared__ float inv;
  const int t = blockIdx.y, row = blockIdx.x * lm::THREADS + threadIdx.x;
  pdl_enter();
  if (norm_ss != nullptr) {
    if (threadIdx.x < 32) {
      const float f = lm::inv_rms(norm_ss, t, cols, norm_eps, threadIdx.x);
      if (threadIdx.x == 0) inv = f;
    }
    __syncthreads();
  }
  if (row >= rows) return;
  const long long at = (long long)t * rows + row;
  fx::Sum s = fx::zero();
  for (int z = 0; z < splits; ++z) {
    const long long i = (long long)z * n * rows + at;
    fx::add(s, fx::Sum{part_v[i], part_p[i]});
  }
  float v = fx::value(s);
  if (norm_ss != nullptr) v = __fmul_rn(v, inv);
  out[at] = bias != nullptr ? __fadd_rn(v, __ldg(bias + row)) : v;
}
