// Tensor-core GEMM for prefill and large batches: out[n, rows] = x[n, cols] @ dequant(W)[rows, cols]^T (+ bias).
//
// Layouts. x: float32 [n, cols] row-major; gemm_x_to_f16 first writes it as fp16 [n, kp] into the workspace
// (kp = cols rounded up to 64, the tail zero-filled). W: GGUF blocks of type T, [rows, row_bytes] row-major,
// exactly as the file stores them, or (Q4_K, Q6_K: tiled) in quant.cuh's tiled layout. bias: float32 [rows] or null.
// out: float32 [n, rows] row-major.
//
// Tiling. A block computes BM weight rows x BN tokens: 128 x 128 and 128 x 256 (8 / 16 warps of 64 x 32) for
// large batches, 32 x 64 and 16 x 64 (4 warps of 32 x 16 / 16 x 16) for small ones; the launcher picks by
// shape. Each warp holds MI x NI fp32 accumulator tiles of mma.sync.m16n8k16 (fp16 x fp16 -> fp32), A =
// weights, B = activations, both fed by ldmatrix.x4 from shared memory (144-byte rows: conflict-free). The k
// loop walks 64-wide slices; iteration s (one barrier) does:
//   1. cp.async (16-byte, L2 only) of slice s + AHEAD's activations (BN x 64 fp16) and, when a new raw stage
//      starts at slice s + AHEAD + 1, of that stage's raw weight bytes (BM rows x max(64, block elements) k:
//      one K-quant block, two 32-element blocks or 64 floats per row), into rings of STAGES = AHEAD + 1
//      buffers (2 for the large tiles, 4 for the small one); the fp16 weight tiles are double buffered;
//   2. the MMAs of slice s;
//   3. dequant8 (quant.cuh) of slice s + 1 from its raw stage into the other fp16 weight tile, by all threads,
//      8 elements a thread-step, rounded to fp16 (so the ALU work overlaps the tensor cores in flight).
// Raw rows are copied from the CHUNK-aligned address at or below their first byte (CHUNK = 16, Q6_K 8), so a
// block lands in shared memory at its global address modulo CHUNK >= BlockInfo<T>::ALIGN, and dequant8 sees
// the alignment it would see in global memory. The copy reads up to CHUNK - 1 bytes around a row, inside the
// same aligned chunks (never past an allocation's 256-byte granule). Weight rows past `rows` reload the last
// row, tokens past n are not loaded (stale shared memory reaches only discarded output columns), weight
// groups at k >= cols are set to zero; nothing past n or rows is stored.
// Blocks are rastered in groups of 16 row tiles, so the blocks in flight share weight and activation tiles
// through L2.
//
// Reduction order (batch invariance). Each output element is one fp32 accumulator, started at 0 and updated
// by one MMA per 16-element k step in increasing k (the tensor core sums a step's 16 products in its fixed
// order), then bias is added once in the epilogue. No split-K, no atomics, and an MMA's column n depends on
// activation column n only: a row's result is bitwise the same for every n, every tile shape and every
// position of the token in the batch (tests/cuda/test_gemm.py pins it).
//
// Numerics: both operands are rounded to fp16 (saturating at +-65504), products and sums in fp32; relative
// error vs float64 ~2-3.5e-4 on random data.
//
// Speed on the H200 at two stages for every tile (Q4_K / Q8_0 weights, k = 4096; FLOP rate counts 2 * n * rows * cols):
//   4096 rows:  n = 17: 50 us, n = 256: 92 us, n = 512: 114 us (151 TFLOP/s), n = 2048: 321 us (214 TFLOP/s)
//   14336 rows: n = 64: 92 us, n = 512: 313 us (192 TFLOP/s), n = 2048: 971-1041 us (231-248 TFLOP/s)
// The MMA loop alone runs at ~470 TFLOP/s (128 x 256); dequantization and L2 traffic take the rest. Small
// batches were latency bound: a 32 x 64 block took ~0.75 us per k slice with one slice of loads in flight.

#include "pdl.cuh"
#include "quant.cuh"
#include "tensor_core.cuh"

namespace gemm_detail {

constexpr int BK = 64;        // k per slice
constexpr int LDS = BK + 8;   // fp16 tile row stride in halves: 144 bytes, so ldmatrix rows hit distinct banks
constexpr int GROUP = 16;     // row tiles per raster group

template <int T>
struct RawStage {
  static constexpr int ELEMS = BlockInfo<T>::ELEMS;
  static constexpr int KR = ELEMS > BK ? ELEMS : BK;             // k per raw stage
  static constexpr int SLICES = KR / BK;
  static constexpr int BYTES = KR / ELEMS * BlockInfo<T>::BYTES;  // bytes of one row per stage
  // Q6_K blocks (210 bytes) are only 2-byte aligned: 8-byte copies need less slack (224 bytes a row, not 240).
  static constexpr int CHUNK = T == GGML_Q6_K ? 8 : 16;
  static_assert(CHUNK >= BlockInfo<T>::ALIGN, "shared memory keeps the alignment dequant8 relies on");
  static constexpr int CHUNKS = (BYTES + 2 * CHUNK - 2) / CHUNK;  // covers any start offset modulo CHUNK
  static constexpr int STRIDE = (CHUNKS * CHUNK + 15) / 16 * 16;
  static_assert(KR % BK == 0 && KR % ELEMS == 0, "a raw stage holds whole blocks and whole slices");
};

// A block tile: BM weight rows x BN tokens, split over WARPS_M x WARPS_N warps of MI x NI MMA tiles (16 x 8).
template <int BM_, int BN_>
struct Tile {
  static constexpr int BM = BM_, BN = BN_;
  static constexpr int WARPS_M = BM >= 64 ? 2 : 1;
  static constexpr int WARPS_N = BM >= 64 ? BN / 32 : 4;
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // a warp's rows and tokens
  static constexpr int MI = WM / 16, NI = WN / 8;
  static_assert(WM % 16 == 0 && WN % 16 == 0, "whole ldmatrix x4 tiles per warp");
  static_assert(BM * (BK / 8) % THREADS == 0 && BN * (BK / 8) % THREADS == 0, "even work split");
};

// Buffers of the activation and raw-weight rings: loads run STAGES - 1 slices ahead of their use. The large
// tiles have enough MMA work per slice to hide a load behind one slice (and no shared memory for more); the
// 32 x 64 tile of small batches has little, and was latency bound at two stages (~0.75 us per slice).
template <int BM>
constexpr int stages() {
  return BM >= 64 ? 2 : 4;
}

template <int T, int BM, int BN>
constexpr int shared_bytes() {
  return stages<BM>() * (BM * RawStage<T>::STRIDE + BN * LDS * 2) + 2 * BM * LDS * 2;
}

template <bool V>
struct integral_constant {
  static constexpr bool value = V;
};

}  // namespace gemm_detail

// x float32 [n, cols] -> xh fp16 [n, kp], zeros in columns [cols, kp). One thread per 8 elements.
extern "C" __global__ void gemm_x_to_f16(unsigned short* __restrict__ xh, const float* __restrict__ x, int n, int cols,
                                         int kp) {
  pdl_enter();
  const int groups = kp / 8;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n * groups) return;
  const int t = (int)(i / groups);
  const int c = (int)(i - (long long)t * groups) * 8;
  uint4 o = make_uint4(0, 0, 0, 0);
  if (c < cols) {
    const float4 a = *reinterpret_cast<const float4*>(x + (long long)t * cols + c);
    const float4 b = *reinterpret_cast<const float4*>(x + (long long)t * cols + c + 4);
    o.x = tc::pack_half2_sat(a.x, a.y);
    o.y = tc::pack_half2_sat(a.z, a.w);
    o.z = tc::pack_half2_sat(b.x, b.y);
    o.w = tc::pack_half2_sat(b.z, b.w);
  }
  *reinterpret_cast<uint4*>(xh + (long long)t * kp + c) = o;
}

// grid ceil(rows / BM) * ceil(n / BN) blocks (1-D), block Tile<BM, BN>::THREADS threads, dynamic shared memory
// shared_bytes<T, BM, BN>().
template <int T, int BM, int BN>
__global__ void __launch_bounds__(gemm_detail::Tile<BM, BN>::THREADS)
    gemm(float* __restrict__ out, const uint8_t* __restrict__ weight, const unsigned short* __restrict__ xh,
         const float* __restrict__ bias, int n, int rows, int cols, int kp, int row_bytes, int tiled) {
  using namespace gemm_detail;
  using namespace tc;
  using Raw = RawStage<T>;
  using Tl = Tile<BM, BN>;
  constexpr int THREADS = Tl::THREADS, WARPS_M = Tl::WARPS_M, WM = Tl::WM, WN = Tl::WN, MI = Tl::MI, NI = Tl::NI;

  constexpr int STAGES = stages<BM>(), AHEAD = STAGES - 1;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* raw = smem;                                                      // [STAGES][BM][Raw::STRIDE] bytes
  unsigned short* xs = reinterpret_cast<unsigned short*>(smem + STAGES * BM * Raw::STRIDE);  // [STAGES][BN][LDS]
  unsigned short* ws = xs + STAGES * BN * LDS;                              // [2][BM][LDS] fp16

  pdl_enter();
  {  // A launch with less shared memory than this instantiation lays out would corrupt memory: refuse it.
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < (unsigned)shared_bytes<T, BM, BN>()) __trap();
  }

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp % WARPS_M, warp_n = warp / WARPS_M;
  // Grouped raster: consecutive blocks walk GROUP row tiles, then the next token tile, so the blocks in flight
  // share ~GROUP weight tiles and ~(resident blocks / GROUP) activation tiles through L2.
  int row0, tok0;
  {
    const int row_tiles = (rows + BM - 1) / BM, tok_tiles = (n + BN - 1) / BN;
    const int b = blockIdx.x, group = b / (GROUP * tok_tiles), local = b - group * GROUP * tok_tiles;
    const int first = group * GROUP, size = min(GROUP, row_tiles - first);
    row0 = (first + local % size) * BM;
    tok0 = (local / size) * BN;
  }
  const int raw_stages = (cols + Raw::KR - 1) / Raw::KR;
  const int slices = raw_stages * Raw::SLICES;  // == kp / BK
  const unsigned weight_lo = (unsigned)reinterpret_cast<unsigned long long>(weight);

  auto load_raw = [&](int r, int buf) {
    const int len = min(Raw::KR, cols - r * Raw::KR) / Raw::ELEMS * BlockInfo<T>::BYTES;
    uint8_t* dst = raw + buf * BM * Raw::STRIDE;
    for (int i = tid; i < BM * Raw::CHUNKS; i += THREADS) {  // not unrolled: up to 28 chunks a thread
      const int rr = i / Raw::CHUNKS, c = i - rr * Raw::CHUNKS;
      const int grow = min(row0 + rr, rows - 1);
      long long at = (long long)grow * row_bytes + (long long)r * Raw::BYTES;
      if constexpr (T == GGML_Q4_K || T == GGML_Q6_K)
        if (tiled) at = tiled_offset<T>(grow, r, row_bytes);  // r: the superblock
      const unsigned long long a = reinterpret_cast<unsigned long long>(weight) + at;
      const unsigned long long src = (a & ~(unsigned long long)(Raw::CHUNK - 1)) + c * Raw::CHUNK;
      if (src < a + len) cp_async<Raw::CHUNK>(dst + rr * Raw::STRIDE + c * Raw::CHUNK, reinterpret_cast<const void*>(src));
    }
  };
  auto load_x = [&](int s, int buf) {
    unsigned short* dst = xs + buf * BN * LDS;
#pragma unroll
    for (int it = 0; it < BN * (BK / 8) / THREADS; ++it) {
      const int i = tid + it * THREADS;
      const int t = i >> 3, c = (i & 7) * 8;
      // Tokens past n are not loaded: their smem rows hold stale values, which reach only their own output
      // columns (discarded). Clamping them to token n - 1 instead made every block hammer one L2 line.
      if (tok0 + t < n) cp_async<16>(dst + t * LDS + c, xh + (long long)(tok0 + t) * kp + s * BK + c);
    }
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;

  // Per-lane ldmatrix addresses (shared window, bytes) for k step 0 of a slice.
  // A (weights, 16 x 16 per m tile): lanes 0-15 rows 0-15 at k 0, lanes 16-31 rows 0-15 at k 8.
  const unsigned a_addr = smem_addr(ws + (warp_m * WM + (lane & 15)) * LDS + (lane >> 4) * 8);
  // B (tokens, two n8 tiles of 16 k each per x4): lanes 0-7 tokens 0-7 k 0, 8-15 tokens 0-7 k 8,
  // 16-23 tokens 8-15 k 0, 24-31 tokens 8-15 k 8.
  const int b_row = warp_n * WN + (lane & 7) + ((lane >> 4) << 3);
  const int b_col = ((lane >> 3) & 1) * 8;

  // Slice t of the weights: 128 x 64 fp16 into ws[t & 1], from raw stage t / SLICES. TAIL: the slice reaches
  // past cols (only the last one can), and groups there become zeros. The items of the unrolled loop have no
  // branch between them, so their shared-memory loads overlap.
  auto dequant_slice = [&](int t, auto tail) {
    const int r = t / Raw::SLICES, j = t - r * Raw::SLICES;
    const uint8_t* stage = raw + (r % STAGES) * BM * Raw::STRIDE;
    const unsigned stage_lo = weight_lo + (unsigned)(r * Raw::BYTES);
    unsigned short* dst = ws + (t & 1) * BM * LDS;
#pragma unroll
    for (int it = 0; it < BM * (BK / 8) / THREADS; ++it) {
      const int i = tid + it * THREADS;
      const int rr = i >> 3, grp = i & 7;
      const int grow = min(row0 + rr, rows - 1);
      // (tiled: every superblock starts on 8 bytes)
      const unsigned mis = tiled ? 0u : (stage_lo + (unsigned)grow * (unsigned)row_bytes) & (Raw::CHUNK - 1);
      float v[8];
      dequant8<T>(stage + rr * Raw::STRIDE + mis, j * (BK / 8) + grp, v);
      if constexpr (decltype(tail)::value) {  // stale bytes past the row decode to anything, even NaN
        const bool inside = t * BK + grp * 8 < cols;
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = inside ? v[e] : 0.f;
      }
      uint4 h;
      h.x = pack_half2_sat(v[0], v[1]);
      h.y = pack_half2_sat(v[2], v[3]);
      h.z = pack_half2_sat(v[4], v[5]);
      h.w = pack_half2_sat(v[6], v[7]);
      *reinterpret_cast<uint4*>(dst + rr * LDS + grp * 8) = h;
    }
  };
  auto dequant = [&](int t) {
    if ((t + 1) * BK <= cols) {
      dequant_slice(t, integral_constant<false>());
    } else {
      dequant_slice(t, integral_constant<true>());
    }
  };
  // 4 k16 steps of the warp's WM x WN tile on slice s (ws[s & 1], xs[s % STAGES]).
  auto mma_slice = [&](int s) {
    const unsigned a_base = a_addr + (s & 1) * BM * LDS * 2;
    const unsigned b_base = smem_addr(xs + (s % STAGES) * BN * LDS + b_row * LDS + b_col);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      unsigned a[MI][4], b[NI][2];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(a[mi], a_base + (mi * 16 * LDS + kk * 16) * 2);
#pragma unroll
      for (int p = 0; p < NI / 2; ++p) {
        unsigned t4[4];
        ldmatrix_x4(t4, b_base + (p * 16 * LDS + kk * 16) * 2);
        b[2 * p][0] = t4[0];
        b[2 * p][1] = t4[1];
        b[2 * p + 1][0] = t4[2];
        b[2 * p + 1][1] = t4[3];
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) mma_16816(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
  };

  // Group v of cp.async copies (one per iteration v, and AHEAD prologue groups v = -AHEAD .. -1) holds slice
  // v + AHEAD's activations and, where slice v + AHEAD + 1 starts a raw stage, that stage: both are needed
  // AHEAD iterations later (MMAs of slice v + AHEAD, dequantization of slice v + AHEAD + 1 in iteration
  // v + AHEAD), so AHEAD - 1 younger groups may still be in flight when one is waited for.
  auto issue = [&](int v) {
    const int t = v + AHEAD;
    if (t < slices) load_x(t, t % STAGES);
    if ((t + 1) % Raw::SLICES == 0 && (t + 1) / Raw::SLICES < raw_stages) {
      load_raw((t + 1) / Raw::SLICES, ((t + 1) / Raw::SLICES) % STAGES);
    }
    cp_async_commit();
  };
  // Prologue: raw stage 0, then the groups of v = -AHEAD .. -1; slice 0 dequantized.
  load_raw(0, 0);
  for (int v = -AHEAD; v < 0; ++v) issue(v);
  cp_async_wait<AHEAD - 1>();
  __syncthreads();
  dequant(0);

  // Iteration s: MMAs on slice s while the same warps dequantize slice s + 1, and the copies of the next AHEAD
  // slices are in flight. One barrier per slice.
  for (int s = 0; s < slices; ++s) {
    // Group s - AHEAD has landed (x of slice s, raw for slice s + 1), ws[s & 1] is written, and every warp
    // is done with slice s - 1, whose activation buffer (and, AHEAD raw stages on, raw buffer) is refilled next.
    cp_async_wait<AHEAD - 1>();
    __syncthreads();
    issue(s);
    mma_slice(s);
    if (s + 1 < slices) dequant(s + 1);
  }

  // Epilogue: accumulator (m = weight row, n = token) -> out[token][row] + bias[row]. A warp's stores of one
  // register cover 8 consecutive rows (32 bytes) for each of 4 tokens: whole sectors.
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    const int r_lo = row0 + warp_m * WM + mi * 16 + (lane >> 2), r_hi = r_lo + 8;
    float bias_lo = 0.f, bias_hi = 0.f;
    if (bias != nullptr) {
      if (r_lo < rows) bias_lo = bias[r_lo];
      if (r_hi < rows) bias_hi = bias[r_hi];
    }
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      const int t = tok0 + warp_n * WN + ni * 8 + (lane & 3) * 2;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (t + h >= n) continue;
        float* o = out + (long long)(t + h) * rows;
        if (bias != nullptr) {
          if (r_lo < rows) o[r_lo] = acc[mi][ni][h] + bias_lo;
          if (r_hi < rows) o[r_hi] = acc[mi][ni][2 + h] + bias_hi;
        } else {
          if (r_lo < rows) o[r_lo] = acc[mi][ni][h];
          if (r_hi < rows) o[r_hi] = acc[mi][ni][2 + h];
        }
      }
    }
  }
}
