// Mat-vec for decode and small batches: out[n, rows] = x[n, cols] @ dequant(W)[rows, cols]^T (+ bias), n <= 16,
// streaming each weight byte once for all n tokens. matvec_q takes up to three such matrices that read the same x
// (q/k/v, gate/up) in one launch (fewer graph nodes; on the H200 PDL already hid most of the launch gaps, so the
// measured gain was small). Its ROPE instantiations are a decode step's q/k/v projections with rotary_store_kv's
// work as their epilogue (mv::Rope, rope_store): rotation and the K/V cache write without a kernel of their own.
//
// Layouts. W: GGUF blocks of type T, [rows, row_bytes] row-major exactly as the file stores them (tensor base
// 16-byte aligned). x: float32 [n, cols] row-major. bias: float32 [rows] or null. out: float32 [n, rows].
// matvec_q's segments (mv::Segments) share T, cols and row_bytes; each has its own W, bias, out and rows.
//
// Block formats go through integers. The activation arrives in act_quant.cuh's format: per 32-element group
// x ~ D (256 q0 + q1), two int8 planes (x at d0 = amax / 127, and its rounding residual at D = d0 / 256), with
// D and each 16-element half's sum of 256 q0 + q1. matvec_q dots the packed weights against both planes with
// __dp4a (4 weights x 4 activations per instruction) and combines them in integers, 256 dot(q0) + dot(q1), so
// a run's scales and float work come once, not per plane; no float weight is ever formed. Weight offsets
// (Q4_0's -8 ...) and minimums (Q4_1's m, the K-quants' dmin * m) are applied through the half sums, scales
// through one float expression per (unit, token).
// F32 / F16 / BF16 weights take matvec_f: activations stay float32, products in fp32 FMA. Q4_K and Q6_K (rows of
// a multiple of 2048) take matvec_mma (at the end of this file): the same activation format and exact integer dots,
// on the tensor cores with the weights staged through shared memory; 2-33% faster than matvec_q on an 8B model's
// decode shapes. matvec_experts (mixture-of-experts layers) runs matvec_q's units per (token, expert) pair, the
// expert's id read from device memory.
//
// Threads. One warp computes RPW (1, 2 or 4) consecutive rows of one segment for all N tokens; the warps cover
// the segments one after another, each segment's rows rounded up to a whole warp. Blocks hold 1, 2 or 4 warps
// (the launcher picks the most that still gives a grid of at least 2 blocks per SM). Lane l walks the row in units
// l, l + 32, ... (a unit: one 32-element block for the 32-element formats and IQ4_XS; 16 bytes of the quant
// array for the K-quants: 32 elements for Q4_K/Q5_K/Q6_K, 64 for Q2_K/Q3_K; 8 elements for float weights), so
// a warp's loads of one unit cover a contiguous stretch of the row. Per unit a lane loads the unit's bytes of
// each of its RPW rows with the widest loads the block alignment allows (16-byte loads for Q4_K/Q5_K, 8-byte
// for Q5_1/IQ4_XS; for 2- and 4-byte aligned blocks the 16-byte aligned chunks holding the bytes, for Q6_K the
// 8-byte words, shifted into place in registers; aligned weight loads skip L1), then each token's activation
// (16 bytes per plane and 16-element run + its scale) once for all RPW rows. A lane's units are u = lane + 32 i,
// so its slot in a block (u % 8) is fixed: the K-quants' selectors and shifts are computed once per lane. For
// N <= 4 the weight loads are software-pipelined (a ring of raw bytes: at N = 1 the next two units per row are in
// flight while this unit's dot products run, one for Q3_K/Q6_K and for N = 2..4; the loop is unrolled by the
// ring's length so the ring does not cost moves); from N = 8 on the kernel is bound by re-reading each token's
// activations per row (four rows per warp halve that) and loads as it goes. The float kernel does the same with
// 16-byte weight loads. The copies of the 16-byte chunks around a block may read up to 14 bytes outside the
// tensor's bytes, never outside their 16-byte chunk (so never outside a mapped page; compute-sanitizer may still
// report them).
//
// Reduction (batch invariance, issue 29). For each (row, token) of a block format the output is unit_value.cuh's
// definition: per 32-column unit (one activation group) the integers I_0, I_1 (per-plane dots, run scales applied in
// integers) and M, and the block's A and B, give c = uv::value; the 8 units of each 256-column span are summed by
// span()'s fixed tree; the spans in fixed point (fixed_point.cuh: each rounded once onto 2^-32 and added as int64, a
// probe carrying NaN/Inf); then fx::value and the bias. In matvec_q lane k of each 8 holds unit k of a span (the
// K-quants first exchange the 16-element halves their lanes hold with one xor shuffle, exact), so uv::span_of_lanes
// forms the span's value and one lane a span adds it; integer sums do not depend on their order, so a lane's spans and
// the warp's lanes (Spread) combine in any way. Nothing depends on n, N, RPW, the block size or the other segments of
// the launch: a row's result is bitwise the same for every batch width and position in the batch, whether its matrix
// runs alone or grouped, and the int8 GEMM (linear_mma.cu) and matvec_mma (the tensor-core form below, its spans walked
// by one lane each) compute the same. The activation quantization is per token. Float weights (matvec_f) keep float
// sums: a lane's units in increasing order, then a fixed xor butterfly.
//
// Numerics. The integer dots are exact and below 2^24 (unit_value.cuh's bounds), so their floats are exact; T =
// 256 I_0 + I_1 is rounded once, then A T + B M and the factor D; a span's rounding onto 2^-32 (2.3e-10 absolute) is
// below fp32's own for outputs above 4e-3. One int8 plane
// alone (d = amax / 127) leaves rms d / sqrt(12) per element: ~0.54% of a Gaussian row's rms, and 0.6-1.2% on
// real LLM hidden states, whose per-channel outliers set amax for their groups. Through 30 layers that left
// SmolLM2-135M's logits 3-13% (relative L2) off (numpy forward with the linears' inputs so quantized; 1-7%
// measured on the H200). The residual plane divides the error by 256 (|x - d0 q0| <= d0 / 2): ~1e-5 of x
// relative, below the GEMM's own rounding. Against the same math in float64 (x replaced by D (256 q0 + q1)) the
// kernel agrees to ~1e-7.
//
// Speed on the H200 (n = 1, scripts/bench_matvec.py, docs/performance.md): 2.3-2.6 TB/s of weights on the large
// Q4_K matrices, 2.2 on Q6_K 4096x14336, 3.1-3.5 on the vocabulary heads, 1.2-1.7 on matrices of one wave or
// less (latency-bound: few loads in flight per SM), measured with float sums. Q4_K: 167 SASS instructions per 2 rows
// x 32 weights (160 with float sums, before 031e47e).

#include "pdl.cuh"
#include "trace.cuh"
#include "act_quant.cuh"
#include "fixed_point.cuh"
#include "unit_value.cuh"
#include "rope.cuh"
#include "tensor_core.cuh"

namespace mv {

__device__ __forceinline__ float f16_lo(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFFu))); }
__device__ __forceinline__ float f16_hi(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }
__device__ __forceinline__ uint32_t byte_of(uint32_t w, int i) { return (w >> (8 * i)) & 0xFFu; }

// Aligned weight loads that do not allocate in L1: each weight byte is read once, and the L1 is left to the
// activations, which every row of a batched mat-vec re-reads (at N = 8-16 those re-reads, not the weights, bound
// the kernel once they spill to L2).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_stream(const uint2* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t ldg_u16(const uint8_t* p) { return __ldg(reinterpret_cast<const unsigned short*>(p)); }
__device__ __forceinline__ uint32_t ldg_u32(const uint8_t* p) { return __ldg(reinterpret_cast<const unsigned int*>(p)); }

// NW little-endian words starting at byte p (p aligned to ALIGN), in two steps so that loads can be issued long
// before their use: fetch() only loads, get() shifts into place. Exactly aligned ranges load exactly; otherwise
// the 16-byte aligned chunks holding the bytes are loaded (a chunk only when it holds one of them, so nothing
// outside the 16-byte chunks of the requested bytes is read).
template <int NW, int ALIGN>
struct Win {
  static constexpr int MODE = (ALIGN >= 16 && NW % 4 == 0) ? 16 : (ALIGN >= 8 && NW % 2 == 0) ? 8
                              : (ALIGN >= 4 && NW == 1) ? 4 : 0;
  static constexpr int L = (4 * NW + 16 - ALIGN + 15) / 16;  // chunks needed at the worst offset (MODE 0)
  static constexpr int WORDS = MODE ? NW : 4 * L;
  uint32_t w[WORDS];

  __device__ __forceinline__ void fetch(const uint8_t* p) {
    if constexpr (MODE == 16) {
#pragma unroll
      for (int i = 0; i < NW / 4; ++i) {
        const uint4 v = ld_stream(reinterpret_cast<const uint4*>(p) + i);
        w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
      }
    } else if constexpr (MODE == 8) {
#pragma unroll
      for (int i = 0; i < NW / 2; ++i) {
        const uint2 v = ld_stream(reinterpret_cast<const uint2*>(p) + i);
        w[2 * i] = v.x; w[2 * i + 1] = v.y;
      }
    } else if constexpr (MODE == 4) {
      w[0] = ldg_u32(p);
    } else {
      const unsigned long long a = reinterpret_cast<unsigned long long>(p);
      const uint4* base = reinterpret_cast<const uint4*>(a & ~15ull);
      const int o = (int)(a & 15);
#pragma unroll
      for (int c = 0; c < L; ++c) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (c == 0 || 16 * c < o + 4 * NW) v = __ldg(base + c);
        w[4 * c] = v.x; w[4 * c + 1] = v.y; w[4 * c + 2] = v.z; w[4 * c + 3] = v.w;
      }
    }
  }

  __device__ __forceinline__ void get(const uint8_t* p, uint32_t (&out)[NW]) const {
    if constexpr (MODE != 0) {
#pragma unroll
      for (int i = 0; i < NW; ++i) out[i] = w[i];
    } else {
      const int o = (int)(reinterpret_cast<unsigned long long>(p) & 15);
      const int k = o >> 2;  // whole words to drop: 0..3, as two conditional shifts (no dynamic indexing)
      uint32_t v[4 * L];
#pragma unroll
      for (int i = 0; i < 4 * L; ++i) v[i] = w[i];
#pragma unroll
      for (int i = 0; i + 2 < 4 * L; ++i) v[i] = (k & 2) ? v[i + 2] : v[i];
#pragma unroll
      for (int i = 0; i + 1 < 4 * L; ++i) v[i] = (k & 1) ? v[i + 1] : v[i];
      if constexpr (ALIGN >= 4) {
#pragma unroll
        for (int i = 0; i < NW; ++i) out[i] = v[i];
      } else {
        const int sh = (o & 3) * 8;  // 0 or 16
#pragma unroll
        for (int i = 0; i < NW; ++i) out[i] = __funnelshift_r(v[i], v[i + 1], sh);
      }
    }
  }
};

// Q6_K's windows: 16 bytes at a 2-byte aligned p from the three 8-byte words around them, fetch() and get() as
// Win's. Win<4, 2>'s two 16-byte chunks hold 8 words in flight per window and take two selects per word; these
// hold 6 and take one (Q6_K 4096x14336 at one token 25.8 -> 21.7 us, its 128256-row head 175.5 -> 149.4; the 8B's
// decode step -65 us). Unguarded: every window of a Q6_K block is followed by at least 12 more of its bytes
// (scales and d), so the up to 6 bytes read past it stay in the block. The other 2- and 4-byte aligned formats
// measured mixed with 8-byte words (Q4_0 and Q4_1 slower), so they keep Win.
struct Win16At2 {
  uint32_t w[6];

  __device__ __forceinline__ void fetch(const uint8_t* p) {
    const uint2* base = reinterpret_cast<const uint2*>(reinterpret_cast<unsigned long long>(p) & ~7ull);
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const uint2 v = __ldg(base + i);
      w[2 * i] = v.x; w[2 * i + 1] = v.y;
    }
  }

  __device__ __forceinline__ void get(const uint8_t* p, uint32_t (&out)[4]) const {
    const int o = (int)(reinterpret_cast<unsigned long long>(p) & 7);
    uint32_t v[5];
#pragma unroll
    for (int i = 0; i < 5; ++i) v[i] = (o & 4) ? w[i + 1] : w[i];
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __funnelshift_r(v[i], v[i + 1], (o & 2) * 8);
  }
};

template <bool B, class A, class C> struct Pick { using type = A; };
template <class A, class C> struct Pick<false, A, C> { using type = C; };

// Integer dot of 16 weights (4 words) with 16 activations. U: the weight bytes are unsigned (0..255; a 4-bit
// format's high nibbles left in place, 16x their value), else signed.
template <bool U = false>
__device__ __forceinline__ int dot16(const int (&q)[4], const int (&x)[4], int s = 0) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (U) {
      asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(s) : "r"(q[i]), "r"(x[i]));
    } else {
      s = __dp4a(q[i], x[i], s);
    }
  }
  return s;
}

// Bit i of the low 4 bits of n -> bit 4 of byte i (Q5_0/Q5_1's fifth bit).
__device__ __forceinline__ int spread4(uint32_t n) { return (int)((((n & 0xFu) * 0x00204081u) & 0x01010101u) << 4); }

// Low nibbles of 4 qs words -> run 0, high nibbles -> run 1. RAW_HIGH: run 1 keeps the high nibbles in place
// (16x their value, for dot16<true>: one instruction fewer per word where no fifth bit is merged in).
template <bool RAW_HIGH = false>
__device__ __forceinline__ void split_nibbles(const uint32_t (&qs)[4], int (&q0)[4], int (&q1)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    q0[i] = (int)(qs[i] & 0x0F0F0F0Fu);
    q1[i] = RAW_HIGH ? (int)(qs[i] & 0xF0F0F0F0u) : (int)((qs[i] >> 4) & 0x0F0F0F0Fu);
  }
}

// Activations of one unit for one token: R runs of 16 elements; run r lies in group g[r], half h[r]: its two
// planes, the group's D and the half's sum of 256 q0 + q1 (act_quant.cuh).
template <int R>
struct Act {
  int x0[R][4], x1[R][4];
  float d[R];
  int s[R];
};

template <int R>
__device__ __forceinline__ void load_act(Act<R>& a, const int8_t* __restrict__ xq0, const int8_t* __restrict__ xq1,
                                         const ActScale* __restrict__ xs, const int (&g)[R], const int (&h)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int at = 32 * g[r] + 16 * h[r];
    const int4 v0 = __ldg(reinterpret_cast<const int4*>(xq0 + at));
    const int4 v1 = __ldg(reinterpret_cast<const int4*>(xq1 + at));
    a.x0[r][0] = v0.x; a.x0[r][1] = v0.y; a.x0[r][2] = v0.z; a.x0[r][3] = v0.w;
    a.x1[r][0] = v1.x; a.x1[r][1] = v1.y; a.x1[r][2] = v1.z; a.x1[r][3] = v1.w;
    const int2 sc = __ldg(reinterpret_cast<const int2*>(xs) + 2 * g[r] + h[r]);
    a.d[r] = __int_as_float(sc.x);
    a.s[r] = sc.y;
  }
}

// Run r's integer dot with activation plane p (0, 1).
template <bool U = false, int R>
__device__ __forceinline__ int plane_dot(const int (&q)[4], const Act<R>& a, int r, int p) {
  return dot16<U>(q, p == 0 ? a.x0[r] : a.x1[r]);
}

// Sum of plane p over run r (the K-quants whose w carries an offset: dot(q - o, x) = dot(q, x) - o sum(x)).
template <int R>
__device__ __forceinline__ int plane_sum(const Act<R>& a, int r, int p) {
  const int ones[4] = {0x01010101, 0x01010101, 0x01010101, 0x01010101};
  return dot16(ones, p == 0 ? a.x0[r] : a.x1[r]);
}

// A K-quant lane holds one 16-element half of each of its runs' groups; the lane OFF apart holds the other halves.
// Each keeps one run (KEEP: its own half's integer) and receives the partner's half of the same group (exact).
__device__ __forceinline__ int with_partner(int keep, int send, int off) {
  return keep + __shfl_xor_sync(0xFFFFFFFFu, send, off);
}

// ---- per-format units -----------------------------------------------------------------------------------------
// Unit<T>: ELEMS elements per unit, RUNS 16-element runs; runs(u, g, h) names each run's activation group and
// half; fetch(raw, row, u) issues the unit's weight loads; decode(w, raw, row, u) unpacks them. Per token,
// prep(a, k) forms what the rows share (D, M, plane sums) and value(w, a, tk, k) the lane's unit_value.cuh value:
// lane k of each 8 (SPAN_LANES = 4: each 4, two units a lane, their sum) holds 32-column unit k of its span, so
// span_value() forms the span's value. All lanes must call value() (the K-quants exchange halves by shuffles).

template <int T> struct Unit;

// The 32-element formats: a unit is one block; run 0 = elements 0..15, run 1 = 16..31 (same group).
struct Block32 {
  static constexpr int ELEMS = 32, RUNS = 2, SPAN_LANES = 8;
  struct Tok { float d, m; };
  __device__ static Tok prep(const Act<2>& a, int) { return Tok{a.d[0], (float)(a.s[0] + a.s[1])}; }
  __device__ static void runs(int u, int k, int (&g)[2], int (&h)[2]) {
    g[0] = g[1] = u;
    h[0] = 0;
    h[1] = 1;
  }
};

// Q4_0 and IQ4_NL: d @0, qs[16] @2.
template <int T>
struct Unit4NL : Block32 {
  struct Raw { Win<4, 2> qs; uint32_t d; };
  struct W { int q[2][4]; float d; };
  __device__ static void fetch(Raw& raw, const uint8_t* row, int u, int k) {
    const uint8_t* b = row + u * 18;
    raw.qs.fetch(b + 2);
    raw.d = ldg_u16(b);
  }
  __device__ static void decode(W& w, const Raw& raw, const uint8_t* row, int u, int k) {
    uint32_t qs[4];
    raw.qs.get(row + u * 18 + 2, qs);
    if constexpr (T == GGML_Q4_0) {
      split_nibbles<true>(qs, w.q[0], w.q[1]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w.q[0][i] = (int)quant::iq4_lookup4(qs[i] & 0x0F0F0F0Fu);
        w.q[1][i] = (int)quant::iq4_lookup4((qs[i] >> 4) & 0x0F0F0F0Fu);
      }
    }
    w.d = f16_lo(raw.d);
  }
  __device__ static float value(const W& w, const Act<2>& a, const Tok& tk, int) {
    float i[2];
#pragma unroll
    for (int p = 0; p < 2; ++p)
      i[p] = (float)(T == GGML_Q4_0 ? plane_dot(w.q[0], a, 0, p) + (plane_dot<true>(w.q[1], a, 1, p) >> 4)
                                    : plane_dot(w.q[0], a, 0, p) + plane_dot(w.q[1], a, 1, p));
    return T == GGML_Q4_0 ? uv::value(tk.d, w.d, __fmul_rn(-8.f, w.d), i[0], i[1], tk.m)
                          : uv::value(tk.d, w.d, 0.f, i[0], i[1], 0.f);
  }
};
template <> struct Unit<GGML_Q4_0> : Unit4NL<GGML_Q4_0> {};
template <> struct Unit<GGML_IQ4_NL> : Unit4NL<GGML_IQ4_NL> {};

// Q4_1 (20 B: d, m, qs[16]) and Q5_1 (24 B: d, m, qh, qs[16]): value d * q + m.
template <int T>
struct Unit41 : Block32 {
  static constexpr int BYTES = T == GGML_Q4_1 ? 20 : 24, NW = BYTES / 4;
  struct Raw { Win<NW, BYTES == 20 ? 4 : 8> v; };
  struct W { int q[2][4]; float d, m; };
  __device__ static void fetch(Raw& raw, const uint8_t* row, int u, int k) { raw.v.fetch(row + u * BYTES); }
  __device__ static void decode(W& w, const Raw& raw, const uint8_t* row, int u, int k) {
    uint32_t v[NW];
    raw.v.get(row + u * BYTES, v);
    const uint32_t qs[4] = {v[NW - 4], v[NW - 3], v[NW - 2], v[NW - 1]};
    split_nibbles<T == GGML_Q4_1>(qs, w.q[0], w.q[1]);
    if constexpr (T == GGML_Q5_1) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w.q[0][i] |= spread4(v[1] >> (4 * i));
        w.q[1][i] |= spread4(v[1] >> (16 + 4 * i));
      }
    }
    w.d = f16_lo(v[0]);
    w.m = f16_hi(v[0]);
  }
  __device__ static float value(const W& w, const Act<2>& a, const Tok& tk, int) {
    float i[2];
#pragma unroll
    for (int p = 0; p < 2; ++p)
      i[p] = (float)(T == GGML_Q4_1 ? plane_dot(w.q[0], a, 0, p) + (plane_dot<true>(w.q[1], a, 1, p) >> 4)
                                    : plane_dot(w.q[0], a, 0, p) + plane_dot(w.q[1], a, 1, p));
    return uv::value(tk.d, w.d, w.m, i[0], i[1], tk.m);
  }
};
template <> struct Unit<GGML_Q4_1> : Unit41<GGML_Q4_1> {};
template <> struct Unit<GGML_Q5_1> : Unit41<GGML_Q5_1> {};

// Q5_0 (22 B: d, qh, qs[16]) and Q8_0 (34 B: d, qs int8[32]): value d * q (Q5_0: q - 16).
template <int T>
struct Unit50 : Block32 {
  static constexpr int BYTES = T == GGML_Q5_0 ? 22 : 34, NW = (BYTES - 2) / 4;
  struct Raw { Win<NW, 2> v; uint32_t d; };
  struct W { int q[2][4]; float d; };
  __device__ static void fetch(Raw& raw, const uint8_t* row, int u, int k) {
    const uint8_t* b = row + u * BYTES;
    raw.v.fetch(b + 2);
    raw.d = ldg_u16(b);
  }
  __device__ static void decode(W& w, const Raw& raw, const uint8_t* row, int u, int k) {
    uint32_t v[NW];
    raw.v.get(row + u * BYTES + 2, v);
    if constexpr (T == GGML_Q5_0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w.q[0][i] = (int)(v[1 + i] & 0x0F0F0F0Fu) | spread4(v[0] >> (4 * i));
        w.q[1][i] = (int)((v[1 + i] >> 4) & 0x0F0F0F0Fu) | spread4(v[0] >> (16 + 4 * i));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w.q[0][i] = (int)v[i];
        w.q[1][i] = (int)v[4 + i];
      }
    }
    w.d = f16_lo(raw.d);
  }
  __device__ static float value(const W& w, const Act<2>& a, const Tok& tk, int) {
    float i[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) i[p] = (float)(plane_dot(w.q[0], a, 0, p) + plane_dot(w.q[1], a, 1, p));
    return T == GGML_Q5_0 ? uv::value(tk.d, w.d, __fmul_rn(-16.f, w.d), i[0], i[1], tk.m)
                          : uv::value(tk.d, w.d, 0.f, i[0], i[1], 0.f);
  }
};
template <> struct Unit<GGML_Q5_0> : Unit50<GGML_Q5_0> {};
template <> struct Unit<GGML_Q8_0> : Unit50<GGML_Q8_0> {};

// IQ4_XS: a unit is one 32-element sub-block j of a 256-element block (qs[16j..16j+16]).
template <>
struct Unit<GGML_IQ4_XS> : Block32 {
  struct Raw { Win<2, 8> hd; Win<4, 8> qs; };  // d | scales_h, scales_l[4]; qs of sub-block j
  struct W { int q[2][4]; float dsc; };
  __device__ static void fetch(Raw& raw, const uint8_t* row, int u, int k) {
    const uint8_t* b = row + (u >> 3) * 136;
    raw.hd.fetch(b);
    raw.qs.fetch(b + 8 + 16 * k);
  }
  __device__ static void decode(W& w, const Raw& raw, const uint8_t*, int u, int k) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w.q[0][i] = (int)quant::iq4_lookup4(raw.qs.w[i] & 0x0F0F0F0Fu);
      w.q[1][i] = (int)quant::iq4_lookup4((raw.qs.w[i] >> 4) & 0x0F0F0F0Fu);
    }
    const int lo = (int)((raw.hd.w[1] >> (4 * k)) & 0xFu);  // sub-block k: byte k/2, nibble k%2
    const int hi = (int)((raw.hd.w[0] >> (16 + 2 * k)) & 3u);
    w.dsc = __fmul_rn(f16_lo(raw.hd.w[0]), (float)((lo | (hi << 4)) - 32));  // exact: 11 + 6 significant bits
  }
  __device__ static float value(const W& w, const Act<2>& a, const Tok& tk, int) {
    float i[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) i[p] = (float)(plane_dot(w.q[0], a, 0, p) + plane_dot(w.q[1], a, 1, p));
    return uv::value(tk.d, w.dsc, 0.f, i[0], i[1], 0.f);
  }
};

// Q4_K / Q5_K: lane unit u = 16 bytes of qs: block u/8, k = u%8 covers l in [16(k%2), +16) of sub-blocks 2(k/2)
// (low nibbles, run 0) and 2(k/2) + 1 (high nibbles, run 1). Lanes k and k ^ 1 hold the two halves of both: lane k
// keeps run k % 2, so it forms the value of sub-block k (the 32-column unit k of the span).
template <int T>
struct UnitK45 {
  static constexpr int ELEMS = 32, RUNS = 2, SPAN_LANES = 8, BYTES = T == GGML_Q4_K ? 144 : 176,
                       QS = T == GGML_Q4_K ? 16 : 48;
  struct RawQ4 { Win<4, 16> hd, qs; };
  struct RawQ5 { Win<4, 16> hd, qs, qh; };
  using Raw = typename Pick<T == GGML_Q4_K, RawQ4, RawQ5>::type;
  struct W { int q[2][4]; float a, b; };  // unit_value.cuh's A = d sc, B = -dmin m of sub-block k
  struct Tok { float d, m; };
  __device__ static Tok prep(const Act<2>& a, int k) {
    const int b = k & 1;
    return Tok{b ? a.d[1] : a.d[0], (float)with_partner(b ? a.s[1] : a.s[0], b ? a.s[0] : a.s[1], 1)};
  }
  __device__ static void runs(int u, int k, int (&g)[2], int (&h)[2]) {
    g[0] = (u >> 3) * 8 + (k >> 1) * 2;
    g[1] = g[0] + 1;
    h[0] = h[1] = k & 1;
  }
  __device__ static void fetch(Raw& raw, const uint8_t* row, int u, int k) {
    const uint8_t* b = row + (u >> 3) * BYTES;
    raw.hd.fetch(b);
    raw.qs.fetch(b + QS + 16 * k);  // QS + 32 (k / 2) + 16 (k % 2)
    if constexpr (T == GGML_Q5_K) raw.qh.fetch(b + 16 + 16 * (k & 1));
  }
  __device__ static void decode(W& w, const Raw& raw, const uint8_t*, int u, int k) {
    const int c = k >> 1;
    split_nibbles<T == GGML_Q4_K>(raw.qs.w, w.q[0], w.q[1]);
    if constexpr (T == GGML_Q5_K) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w.q[0][i] |= (int)(((raw.qh.w[i] >> (2 * c)) & 0x01010101u) << 4);
        w.q[1][i] |= (int)(((raw.qh.w[i] >> (2 * c + 1)) & 0x01010101u) << 4);
      }
    }
    int sc[2], m[2];
    quant::k4_scales_mins(raw.hd.w, c, sc, m);
    // Exact products: an fp16 times a 6-bit integer.
    w.a = __fmul_rn(f16_lo(raw.hd.w[0]), (float)((k & 1) ? sc[1] : sc[0]));
    w.b = __fmul_rn(-f16_hi(raw.hd.w[0]), (float)((k & 1) ? m[1] : m[0]));
  }
  __device__ static float value(const W& w, const Act<2>& a, const Tok& tk, int k) {
    const int b = k & 1;
    float i[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int d0 = plane_dot(w.q[0], a, 0, p);
      const int d1 = T == GGML_Q4_K ? plane_dot<true>(w.q[1], a, 1, p) >> 4 : plane_dot(w.q[1], a, 1, p);
      i[p] = (float)with_partner(b ? d1 : d0, b ? d0 : d1, 1);
    }
    return uv::value(tk.d, w.a, w.b, i[0], i[1], tk.m);
  }
};
template <> struct Unit<GGML_Q4_K> : UnitK45<GGML_Q4_K> {};
template <> struct Unit<GGML_Q5_K> : UnitK45<GGML_Q5_K> {};

// Q6_K: lane k of each 8 takes chunk j = chunk(k) of a block's ql: block u/8, h = j/4, l0 = 16(j%4): low nibbles
// are elements 128h + l0 + i (run 0), high nibbles 128h + 64 + l0 + i (run 1); their high bits sit in
// qh[32h + 16(j%2) + i]. Run 0 is group 4h + k%2, run 1 group 4h + 2 + k%2, half (k/2)%2: lanes k and k ^ 2 hold
// the two halves of both, and lane k keeps run (k/2)%2, group k (chunk() puts the lanes in the span's column order).
template <>
struct Unit<GGML_Q6_K> {
  static constexpr int ELEMS = 32, RUNS = 2, SPAN_LANES = 8;
  struct Raw { Win16At2 ql, qh; uint32_t sc0, sc1, d; };
  struct W { int q[2][4]; float d; int sc[2]; };
  struct Tok { float d; int sum[2][2]; };  // sum[r][p]: plane p's sum over run r
  __device__ static int chunk(int k) { return (k & 4) | ((k & 1) << 1) | ((k >> 1) & 1); }
  __device__ static Tok prep(const Act<2>& a, int k) {
    Tok tk;
    tk.d = (k & 2) ? a.d[1] : a.d[0];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int p = 0; p < 2; ++p) tk.sum[r][p] = plane_sum(a, r, p);
    return tk;
  }
  __device__ static float value(const W& w, const Act<2>& a, const Tok& tk, int k) {
    // w = q - 32: I_p = sc_r (dot(q, x_p) - 32 sum(x_p)) over each run, |I_p| < 2^24 (unit_value.cuh).
    const int b = (k >> 1) & 1;
    float i[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int d0 = w.sc[0] * (plane_dot(w.q[0], a, 0, p) - 32 * tk.sum[0][p]);
      const int d1 = w.sc[1] * (plane_dot(w.q[1], a, 1, p) - 32 * tk.sum[1][p]);
      i[p] = (float)with_partner(b ? d1 : d0, b ? d0 : d1, 2);
    }
    return uv::value(tk.d, w.d, 0.f, i[0], i[1], 0.f);
  }
  __device__ static void runs(int u, int k, int (&g)[2], int (&h)[2]) {
    k = chunk(k);
    g[0] = (u >> 3) * 8 + (k >> 2) * 4 + ((k & 3) >> 1);
    g[1] = g[0] + 2;
    h[0] = h[1] = k & 1;
  }
  __device__ static const uint8_t* qh_at(const uint8_t* row, int u, int k) {
    return row + (u >> 3) * 210 + 128 + 32 * (k >> 2) + 16 * (k & 1);
  }
  __device__ static void fetch(Raw& raw, const uint8_t* row, int u, int k) {
    k = chunk(k);
    const uint8_t* b = row + (u >> 3) * 210;
    raw.ql.fetch(b + 16 * k);
    raw.qh.fetch(qh_at(row, u, k));
    raw.sc0 = __ldg(b + 192 + 8 * (k >> 2) + (k & 3));
    raw.sc1 = __ldg(b + 196 + 8 * (k >> 2) + (k & 3));
    raw.d = ldg_u16(b + 208);
  }
  __device__ static void decode(W& w, const Raw& raw, const uint8_t* row, int u, int k) {
    k = chunk(k);
    uint32_t ql[4], qh[4];
    raw.ql.get(row + (u >> 3) * 210 + 16 * k, ql);
    raw.qh.get(qh_at(row, u, k), qh);
    // Run 0's high bits are bit pair s0 = 0 or 2 of qh, run 1's pair s0 + 4: moved straight to bits 4..5.
    const int s0 = 2 * ((k & 3) >> 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w.q[0][i] = (int)((ql[i] & 0x0F0F0F0Fu) | ((qh[i] << (4 - s0)) & 0x30303030u));
      w.q[1][i] = (int)(((ql[i] >> 4) & 0x0F0F0F0Fu) | ((qh[i] >> s0) & 0x30303030u));
    }
    w.sc[0] = (int)(int8_t)raw.sc0;
    w.sc[1] = (int)(int8_t)raw.sc1;
    w.d = f16_lo(raw.d);
  }
};

// Q2_K / Q3_K: unit u = 16 bytes of qs: block u/4, c = u%4, h = c/2, half = c%2; bit pair s (0..3) of those bytes
// holds elements 128h + 32s + 16 half + i (run s, activation group 8(u/4) + 4h + s), scale index 8h + 2s + half.
// Lanes c and c ^ 1 hold the two halves of the same four groups: lane c keeps runs 2 half, 2 half + 1, so it forms
// the values of groups 2c and 2c + 1 (units 2c, 2c + 1 of the span) and returns their sum, span()'s first level.
struct UnitK23 {
  static constexpr int ELEMS = 64, RUNS = 4, SPAN_LANES = 4;
  // Run s's own integer with the partner's half of the same group, for the lane's unit j (run 2 half + j).
  __device__ static int unit_int(const int (&v)[4], int j, int half) {
    return with_partner(half ? v[2 + j] : v[j], half ? v[j] : v[2 + j], 1);
  }
  struct Tok { float d[2]; };  // the D of the lane's two groups
  __device__ static Tok prep(const Act<4>& a, int k) {
    const int half = k & 1;
    return Tok{{half ? a.d[2] : a.d[0], half ? a.d[3] : a.d[1]}};
  }
  __device__ static void runs(int u, int k, int (&g)[4], int (&h)[4]) {
    const int c = k & 3;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      g[s] = (u >> 2) * 8 + (c >> 1) * 4 + s;
      h[s] = c & 1;
    }
  }
};

template <>
struct Unit<GGML_Q2_K> : UnitK23 {
  struct Raw { Win<4, 4> qs; uint32_t sc0, sc1, dd; };
  struct W { int qs[4]; float d, dmin; int sc[4], m[4]; };
  __device__ static void fetch(Raw& raw, const uint8_t* row, int u, int k) {
    const uint8_t* b = row + (u >> 2) * 84;
    const int c = k & 3, h = c >> 1;
    raw.qs.fetch(b + 16 + 16 * c);
    raw.sc0 = ldg_u32(b + 8 * h);  // scale bytes 8h .. 8h + 8
    raw.sc1 = ldg_u32(b + 8 * h + 4);
    raw.dd = ldg_u32(b + 80);  // d | dmin
  }
  __device__ static void decode(W& w, const Raw& raw, const uint8_t* row, int u, int k) {
    const int half = k & 1;
    uint32_t qs[4];
    raw.qs.get(row + (u >> 2) * 84 + 16 + 16 * (k & 3), qs);
#pragma unroll
    for (int i = 0; i < 4; ++i) w.qs[i] = (int)qs[i];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t v = byte_of(s < 2 ? raw.sc0 : raw.sc1, half + 2 * (s & 1));
      w.sc[s] = (int)(v & 0xF);
      w.m[s] = (int)(v >> 4);
    }
    w.d = f16_lo(raw.dd);
    w.dmin = f16_hi(raw.dd);
  }
  __device__ static float value(const W& w, const Act<4>& a, const Tok& tk, int k) {
    int v0[4], v1[4], ms[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int q[4] = {(w.qs[0] >> (2 * s)) & 0x03030303, (w.qs[1] >> (2 * s)) & 0x03030303,
                        (w.qs[2] >> (2 * s)) & 0x03030303, (w.qs[3] >> (2 * s)) & 0x03030303};
      v0[s] = w.sc[s] * plane_dot(q, a, s, 0);
      v1[s] = w.sc[s] * plane_dot(q, a, s, 1);
      ms[s] = w.m[s] * a.s[s];
    }
    const int half = k & 1;
    float c[2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
      c[j] = uv::value(tk.d[j], w.d, -w.dmin, (float)unit_int(v0, j, half), (float)unit_int(v1, j, half),
                       (float)unit_int(ms, j, half));
    return __fadd_rn(c[0], c[1]);
  }
};

template <>
struct Unit<GGML_Q3_K> : UnitK23 {
  struct Raw { Win<4, 2> hm, qs; Win<3, 2> sc; uint32_t d; };
  struct W { int q[4][4]; float d; int sc[4]; };
  __device__ static void fetch(Raw& raw, const uint8_t* row, int u, int k) {
    const uint8_t* b = row + (u >> 2) * 110;
    const int c = k & 3;
    raw.hm.fetch(b + 16 * (c & 1));
    raw.qs.fetch(b + 32 + 16 * c);
    raw.sc.fetch(b + 96);
    raw.d = ldg_u16(b + 108);
  }
  __device__ static void decode(W& w, const Raw& raw, const uint8_t* row, int u, int k) {
    const uint8_t* b = row + (u >> 2) * 110;
    const int c = k & 3, h = c >> 1, half = c & 1;
    uint32_t hm[4], qs[4], sc[3];
    raw.hm.get(b + 16 * half, hm);
    raw.qs.get(b + 32 + 16 * c, qs);
    raw.sc.get(b + 96, sc);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w.q[s][i] = (int)(((qs[i] >> (2 * s)) & 0x03030303u) | (((hm[i] >> (4 * h + s)) & 0x01010101u) << 2));
      // scale 8h + 2s + half: low nibble h of byte 2s + half, high bits 2(2h + s/2) of byte 8 + 2(s%2) + half.
      const int lo = (int)((byte_of(sc[s >> 1], 2 * (s & 1) + half) >> (4 * h)) & 0xF);
      const int hi = (int)((byte_of(sc[2], 2 * (s & 1) + half) >> (2 * (2 * h + (s >> 1)))) & 3);
      w.sc[s] = (lo | (hi << 4)) - 32;
    }
    w.d = f16_lo(raw.d);
  }
  __device__ static float value(const W& w, const Act<4>& a, const Tok& tk, int k) {
    // w = q - 4: I_p = (sc - 32)(dot(q, x_p) - 4 sum(x_p)) over each run.
    int v0[4], v1[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      v0[s] = w.sc[s] * (plane_dot(w.q[s], a, s, 0) - 4 * plane_sum(a, s, 0));
      v1[s] = w.sc[s] * (plane_dot(w.q[s], a, s, 1) - 4 * plane_sum(a, s, 1));
    }
    const int half = k & 1;
    float c[2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
      c[j] = uv::value(tk.d[j], w.d, 0.f, (float)unit_int(v0, j, half), (float)unit_int(v1, j, half), 0.f);
    return __fadd_rn(c[0], c[1]);
  }
};

// ---- the reductions --------------------------------------------------------------------------------------------

// A lane's unit value c (0 for a unit past the row's end) into its span's value, added to acc by the span's first
// lane. SPAN_LANES = 4: c already holds span()'s first level (two units), the lanes add the rest of its tree.
template <class U>
__device__ __forceinline__ void add_span(fx::Sum& acc, float c, int lane) {
  if constexpr (U::SPAN_LANES == 8) {
    c = uv::span_of_lanes(c);
  } else {
    c = __fadd_rn(c, __shfl_xor_sync(0xFFFFFFFFu, c, 1));
    c = __fadd_rn(c, __shfl_xor_sync(0xFFFFFFFFu, c, 2));
  }
  if ((lane & (U::SPAN_LANES - 1)) == 0) fx::add(acc, c);
}

// One token's activation a against the lane's units w[RPW] of this step (live: the unit is inside the row; every
// lane calls, for the shuffles).
template <class U, int RPW, int STRIDE>
__device__ __forceinline__ void add_units(fx::Sum* acc, const typename U::W (&w)[RPW], const Act<U::RUNS>& a,
                                          bool live, int k, int lane) {
  const typename U::Tok tk = U::prep(a, k);
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const float c = U::value(w[r], a, tk, k);
    add_span<U>(acc[r * STRIDE], live ? c : 0.f, lane);
  }
}

// Float weights (matvec_f, matvec_experts_f): every lane gets the sums over the warp's lanes, by a fixed xor
// butterfly.
template <int N, int RPW>
__device__ __forceinline__ void warp_sums(float (&acc)[RPW][N]) {
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int t = 0; t < N; ++t)
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        acc[r][t] = __fadd_rn(acc[r][t], __shfl_xor_sync(0xFFFFFFFFu, acc[r][t], off));
}

template <int N, int RPW>
__device__ __forceinline__ void reduce_store(float (&acc)[RPW][N], float* __restrict__ out, const float* __restrict__ bias,
                                             int n, int rows, int row0, int lane) {
  warp_sums<N, RPW>(acc);
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int t = 0; t < N; ++t) {
      const int row = row0 + r;
      if (lane == ((r * N + t) & 31) && t < n && row < rows)
        out[(long long)t * rows + row] = bias != nullptr ? __fadd_rn(acc[r][t], __ldg(bias + row)) : acc[r][t];
    }
}

// Block formats: a lane's fixed-point sums (fixed_point.cuh) of M (row, token) pairs, index m = t RPW + r.
__device__ __forceinline__ fx::Sum shfl_xor(const fx::Sum& s, int off) {
  return fx::Sum{__shfl_xor_sync(0xFFFFFFFFu, s.v, off), __shfl_xor_sync(0xFFFFFFFFu, s.probe, off)};
}

constexpr int log2_of(int v) { return v <= 1 ? 0 : 1 + log2_of(v / 2); }

// The warp's totals of every lane's a[0..M), spread over the lanes: the xor steps of offsets 16, 8, ... first hand
// half of a lane's sums to its partner and add the half it receives (HALVINGS of them, down to K sums a lane, or
// M / 32), the rest add whole. Lane l ends with the totals of indices first(l) + i in a[i], i < KEEP, the lanes that
// differ only in their bits below 32 >> HALVINGS with the same ones. Integer sums, so the totals do not depend on
// the steps; M sums take about M shuffles a word where a butterfly of each took 5 M.
template <int M, int K>
struct Spread {
  static_assert((M & (M - 1)) == 0 && (K & (K - 1)) == 0 && K <= M, "powers of two");
  static constexpr int HALVINGS = log2_of(M / K) < 5 ? log2_of(M / K) : 5, KEEP = M >> HALVINGS;

  template <int COUNT, int OFF>
  __device__ __forceinline__ static void step(fx::Sum (&a)[M], int lane) {
    if constexpr (OFF > 0) {
      if constexpr (COUNT > KEEP) {
        constexpr int H = COUNT / 2;
        const bool up = lane & OFF;
#pragma unroll
        for (int i = 0; i < H; ++i) {  // selected field by field: a select of the array elements went through memory
          const fx::Sum sent{up ? a[i].v : a[i + H].v, up ? a[i].probe : a[i + H].probe};
          a[i] = fx::Sum{up ? a[i + H].v : a[i].v, up ? a[i + H].probe : a[i].probe};
          fx::add(a[i], shfl_xor(sent, OFF));
        }
        step<H, OFF / 2>(a, lane);
      } else {
#pragma unroll
        for (int i = 0; i < COUNT; ++i) fx::add(a[i], shfl_xor(a[i], OFF));
        step<COUNT, OFF / 2>(a, lane);
      }
    }
  }

  __device__ __forceinline__ static void run(fx::Sum (&a)[M], int lane) { step<M, 16>(a, lane); }

  // The index of lane's a[0], and whether it is the one lane of those holding it that stores it.
  __device__ __forceinline__ static int first(int lane) {
    int m = 0;
#pragma unroll
    for (int s = 0; s < HALVINGS; ++s)
      if (lane & (16 >> s)) m += M >> (s + 1);
    return m;
  }
  __device__ __forceinline__ static bool writer(int lane) { return (lane & ((32 >> HALVINGS) - 1)) == 0; }
};

template <int N, int RPW>
__device__ __forceinline__ void reduce_store(fx::Sum (&acc)[N * RPW], float* __restrict__ out,
                                             const float* __restrict__ bias, int n, int rows, int row0, int lane) {
  using S = Spread<N * RPW, 1>;
  S::run(acc, lane);
  const int m0 = S::first(lane);
#pragma unroll
  for (int i = 0; i < S::KEEP; ++i) {
    const int t = (m0 + i) / RPW, row = row0 + (m0 + i) % RPW;
    if (S::writer(lane) && t < n && row < rows) {
      const float v = fx::value(acc[i]);
      out[(long long)t * rows + row] = bias != nullptr ? __fadd_rn(v, __ldg(bias + row)) : v;
    }
  }
}

// The matrices of one matvec_q launch, passed by value (__grid_constant__: read in place from the parameter
// bank): all of type T with the same cols and row_bytes; unused segments have rows 0. pick() selects among
// constant indices; of the forms tried (a variable index, a search loop, no __grid_constant__) this one left the
// fewest added registers and spills in ptxas' allocation of the hot instantiations.
constexpr int MAX_SEGMENTS = 3;
struct Segments {
  const uint8_t* weight[MAX_SEGMENTS];
  const float* bias[MAX_SEGMENTS];
  float* out[MAX_SEGMENTS];
  int rows[MAX_SEGMENTS];
  int tiled[MAX_SEGMENTS];  // in MmaCopy's tiled layout (read by matvec_mma's kernels only; 0 elsewhere)
};

template <class V>
__device__ __forceinline__ V pick(const V (&v)[MAX_SEGMENTS], int s) {
  static_assert(MAX_SEGMENTS == 3, "pick selects among three");
  return s == 0 ? v[0] : s == 1 ? v[1] : v[2];
}

// The epilogue of a decode step's q/k/v projections (matvec_q with ROPE): each segment is q, k or v of whole heads
// (rope_dim = head_dim). q and k rows are rotated by position (rope.cuh, as rotary_store_kv does it), k and v
// also written as fp16 into their cache slots ([slots, rows] row-major; slot < 0: padding, not written); every
// segment's rows also go to its out, rotated. A warp's two rows are a rotation pair: rows 2i, 2i + 1 for
// interleaved pairs; head h's j and j + head_dim / 2 for neox pairs (and for v, which is not rotated, 2i, 2i + 1).
enum RopeRole { ROPE_Q = 0, ROPE_K = 1, ROPE_V = 2 };
struct Rope {
  const int* positions;      // [n]
  const long long* slots;    // [n]
  const float* inv_freq;     // [head_dim / 2]
  __half* k_cache;           // [slots, k rows]
  __half* v_cache;           // [slots, v rows]
  int role[MAX_SEGMENTS];    // RopeRole of each segment
  int head_dim, neox;
  float mscale;
};

// What rope_pair_store reads besides the pair's sums, so that a caller can load it before its stream: in the
// tensor-core q/k/v launch these loads sat in the epilogue, on the path of the launch's last block.
struct RopePairIn {
  float bias0, bias1, inv_freq;
  int pos;
  long long slot;
};

__device__ __forceinline__ RopePairIn rope_pair_in(int t, const float* __restrict__ bias, int r0, int r1, int role,
                                                   const Rope& rope) {
  RopePairIn in{0.f, 0.f, 0.f, 0, -1};
  if (bias != nullptr) {
    in.bias0 = __ldg(bias + r0);
    in.bias1 = __ldg(bias + r1);
  }
  if (role != ROPE_V) {
    in.inv_freq = __ldg(rope.inv_freq + (rope.neox ? r0 % rope.head_dim : (r0 % rope.head_dim) >> 1));
    in.pos = rope.positions[t];
  }
  if (role != ROPE_Q) in.slot = rope.slots[t];
  return in;
}

// Rows r0 and r1 (a rotation pair) of token t, summed: bias, rotation, out and the cache.
__device__ __forceinline__ void rope_pair_store(float a, float b, const RopePairIn& in, int t,
                                                float* __restrict__ out, bool bias, int rows, int r0, int r1,
                                                int role, const Rope& rope) {
  if (bias) {
    a = __fadd_rn(a, in.bias0);
    b = __fadd_rn(b, in.bias1);
  }
  if (role != ROPE_V) {
    float c, s;
    rope::cos_sin(in.pos, in.inv_freq, rope.mscale, c, s);
    rope::rotate(a, b, c, s);
  }
  out[(long long)t * rows + r0] = a;
  out[(long long)t * rows + r1] = b;
  if (role != ROPE_Q && in.slot >= 0) {
    __half* cache = (role == ROPE_K ? rope.k_cache : rope.v_cache) + in.slot * rows;
    cache[r0] = __float2half_rn(a);
    cache[r1] = __float2half_rn(b);
  }
}

// The warp's totals of rows r0 and r1 (as reduce_store: the same bits), then each token's pair stored by the lane
// holding both of its sums.
template <int N>
__device__ __forceinline__ void rope_store(fx::Sum (&acc)[2 * N], float* __restrict__ out,
                                           const float* __restrict__ bias, int n, int rows, int r0, int r1, int lane,
                                           int role, const Rope& rope) {
  using S = Spread<2 * N, 2>;
  S::run(acc, lane);
  const int t = S::first(lane) / 2;
  if (S::writer(lane) && t < n)
    rope_pair_store(fx::value(acc[0]), fx::value(acc[1]), rope_pair_in(t, bias, r0, r1, role, rope), t, out,
                    bias != nullptr, rows, r0, r1, role, rope);
}

}  // namespace mv

// x float32 [n, cols] -> the activation format of act_quant.cuh (two int8 planes; the error is at most
// D / 2 = amax / 65024 per element). One thread per 8 elements, 4 threads per group. cols % 32 == 0; x 16-byte
// aligned.
extern "C" __global__ void matvec_quantize_x(int8_t* __restrict__ xq, ActScale* __restrict__ xs,
                                             const float* __restrict__ x, int n, int cols) {
  pdl_enter();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // 8-element chunk of the n * cols elements
  const bool live = i < n * cols / 8;
  float v[8];
  if (live) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(x) + 2 * i);
    const float4 b = __ldg(reinterpret_cast<const float4*>(x) + 2 * i + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = 0.f;
  }
  const int row = live ? 8 * i / cols : 0;
  aq::quantize_store<8>(v, live, xq, xs, n, cols, row, 8 * i - row * cols);
}

// Block formats. grid: ceil(sum over segments of ceil(rows / RPW) / warps per block), block: 32 * warps per block
// (<= 128). ROPE: the q/k/v epilogue of mv::Rope (rope_store; RPW 2, rows of every segment even); otherwise rope is
// unused (the launcher passes zeros).
template <int T, int N, int RPW, int AHEAD_ = -1, bool ROPE = false>
__global__ void __launch_bounds__(128) matvec_q(const __grid_constant__ mv::Segments seg,
                                                const int8_t* __restrict__ xq, const ActScale* __restrict__ xs,
                                                int n, int cols, long long row_bytes,
                                                const __grid_constant__ mv::Rope rope) {
  using U = mv::Unit<T>;
  // Units prefetched per row: two at N = 1 where the raw bytes are small (register-heavy Q3_K/Q6_K take one and
  // keep more warps resident instead), one up to N = 4, none from N = 8 on (there re-reading the activations binds).
  // AHEAD_ >= 0 overrides this (scripts/bench_matvec.py sweeps it).
  constexpr int AHEAD = AHEAD_ >= 0 ? AHEAD_ : N == 1 ? (T == GGML_Q3_K || T == GGML_Q6_K ? 1 : 2) : N <= 4 ? 1 : 0;
  const int lane = threadIdx.x & 31;
  const int k = lane & 7;  // u % 8 for every unit u this lane visits (u = lane + 32 i): the unit's slot in its block
  // This warp's segment s (segment i's warps follow segment i - 1's) and its first row there.
  const int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int end0 = (seg.rows[0] + RPW - 1) / RPW, end1 = end0 + (seg.rows[1] + RPW - 1) / RPW;
  const int s = (warp >= end0) + (warp >= end1);
  const int rows = mv::pick(seg.rows, s), first = (warp - (s == 0 ? 0 : s == 1 ? end0 : end1)) * RPW;
  if (first >= rows) return;
  // This warp's rows: row0 + r stride. With ROPE and neox pairs, pair i = first / 2 of a rotated segment is rows
  // j and j + head_dim / 2 of head i / (head_dim / 2), j = i % (head_dim / 2).
  const bool neox_pairs = ROPE && rope.neox && mv::pick(rope.role, s) != mv::ROPE_V;
  const int half = rope.head_dim >> 1;
  const int row0 = neox_pairs ? (first >> 1) / half * rope.head_dim + (first >> 1) % half : first;
  const int stride = neox_pairs ? half : 1;
  const uint8_t* weight = mv::pick(seg.weight, s);
  const uint8_t* wrow[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) wrow[r] = weight + (long long)min(row0 + r * stride, rows - 1) * row_bytes;
  const int units = cols / U::ELEMS, halves = cols / 16;
  const int8_t* xq1 = xq + (long long)n * cols;  // plane 1

  fx::Sum acc[N * RPW];  // (row r, token t) at t RPW + r
#pragma unroll
  for (int i = 0; i < N * RPW; ++i) acc[i] = fx::zero();

  // A ring of raw weight bytes: ring[0] is this unit's, ring[a] unit u + 32a (clamped to the last unit: a cached
  // re-read near the row's end), so AHEAD units per row are in flight while this unit's dot products run.
  typename U::Raw ring[AHEAD + 1][RPW];
#pragma unroll
  for (int a = 0; a < AHEAD; ++a)
#pragma unroll
    for (int r = 0; r < RPW; ++r) U::fetch(ring[a][r], wrow[r], min(lane + 32 * a, units - 1), k);
  pdl_enter();  // the weights are immutable: their first loads above overlap the previous kernel's tail
  // Unrolled by the ring's length where the ring is small, so that its shift below is register renaming, not
  // moves (larger rings, Q3_K/Q6_K at depth 2-4, would spill).
  constexpr int UNROLL = N == 1 && sizeof(typename U::Raw) * (AHEAD + 1) * RPW <= 320 ? AHEAD + 1 : 1;
  // Every lane walks the row's steps (the spans' shuffles); a lane past the row's end re-reads its last unit.
#pragma unroll UNROLL
  for (int u0 = 0; u0 < units; u0 += 32) {
    const bool live = u0 + lane < units;
    const int u = min(u0 + lane, units - 1);
#pragma unroll
    for (int r = 0; r < RPW; ++r) U::fetch(ring[AHEAD][r], wrow[r], min(u0 + lane + 32 * AHEAD, units - 1), k);
    typename U::W w[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) U::decode(w[r], ring[0][r], wrow[r], u, k);
#pragma unroll
    for (int a = 0; a < AHEAD; ++a)
#pragma unroll
      for (int r = 0; r < RPW; ++r) ring[a][r] = ring[a + 1][r];
    int g[U::RUNS], h[U::RUNS];
    U::runs(u, k, g, h);
#pragma unroll
    for (int t = 0; t < N; ++t) {
      if (t == 0 || t < n) {  // n >= 1: token 0 unconditional, so no weight load sinks into a branch
        mv::Act<U::RUNS> a;
        mv::load_act(a, xq + t * cols, xq1 + t * cols, xs + t * halves, g, h);
        mv::add_units<U, RPW, 1>(acc + t * RPW, w, a, live, k, lane);
      }
    }
  }
  if constexpr (ROPE) {
    static_assert(RPW == 2, "a rotation pair per warp");
    mv::rope_store<N>(acc, mv::pick(seg.out, s), mv::pick(seg.bias, s), n, rows, row0, row0 + stride, lane,
                      mv::pick(rope.role, s), rope);
  } else {
    mv::reduce_store<N, RPW>(acc, mv::pick(seg.out, s), mv::pick(seg.bias, s), n, rows, row0, lane);
  }
}

// Float weights: lane l walks 8-element units l, l + 32, ...; within a unit the 8 products are accumulated in
// element order with FMA. vec: rows and x rows are 16-byte aligned (then units with all 8 elements inside the row
// load with 16-byte vectors, prefetched like matvec_q's); other units load element by element in the same order,
// so the result does not depend on vec.
namespace mv {
template <int T>
struct FloatUnit {
  static constexpr int CHUNKS = T == GGML_F32 ? 2 : 1;  // 16-byte loads per 8 weights
  struct Raw { uint4 v[CHUNKS]; };
  __device__ static void fetch(Raw& raw, const uint8_t* row, int u) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) raw.v[c] = __ldg(reinterpret_cast<const uint4*>(row) + u * CHUNKS + c);
  }
  __device__ static void decode(const Raw& raw, float (&w)[8]) {
    if constexpr (T == GGML_F32) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        w[4 * c] = __uint_as_float(raw.v[c].x);
        w[4 * c + 1] = __uint_as_float(raw.v[c].y);
        w[4 * c + 2] = __uint_as_float(raw.v[c].z);
        w[4 * c + 3] = __uint_as_float(raw.v[c].w);
      }
    } else {
      const uint32_t p[4] = {raw.v[0].x, raw.v[0].y, raw.v[0].z, raw.v[0].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (T == GGML_F16) {
          w[2 * i] = f16_lo(p[i]);
          w[2 * i + 1] = f16_hi(p[i]);
        } else {
          w[2 * i] = __uint_as_float(p[i] << 16);
          w[2 * i + 1] = __uint_as_float(p[i] & 0xFFFF0000u);
        }
      }
    }
  }
  // Element e of a row, or 0 past its end.
  __device__ static float element(const uint8_t* row, int e, int cols) {
    if (e >= cols) return 0.f;
    if constexpr (T == GGML_F32) {
      return __ldg(reinterpret_cast<const float*>(row) + e);
    } else {
      const unsigned short b = __ldg(reinterpret_cast<const unsigned short*>(row) + e);
      return T == GGML_F16 ? __half2float(__ushort_as_half(b)) : __uint_as_float((uint32_t)b << 16);
    }
  }
};

template <int N, int RPW>
__device__ __forceinline__ void fma_unit(float (&acc)[RPW][N], const float (&w)[RPW][8], const float* __restrict__ x,
                                         int n, int cols, int e0, bool vec) {
#pragma unroll
  for (int t = 0; t < N; ++t) {
    if (t == 0 || t < n) {
      const float* xt = x + (long long)t * cols + e0;
      float v[8];
      if (vec) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(xt));
        const float4 b = __ldg(reinterpret_cast<const float4*>(xt) + 1);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = e0 + i < cols ? __ldg(xt + i) : 0.f;
      }
#pragma unroll
      for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][t] = __fmaf_rn(w[r][i], v[i], acc[r][t]);
    }
  }
}
}  // namespace mv

template <int T, int N, int RPW>
__global__ void __launch_bounds__(128) matvec_f(float* __restrict__ out, const uint8_t* __restrict__ weight,
                                                const float* __restrict__ x, const float* __restrict__ bias, int n,
                                                int rows, int cols, long long row_bytes, int vec) {
  using U = mv::FloatUnit<T>;
  constexpr int AHEAD = N == 1 ? 2 : N <= 4 ? 1 : 0;
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * RPW;
  if (row0 >= rows) return;
  const uint8_t* wrow[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) wrow[r] = weight + (long long)min(row0 + r, rows - 1) * row_bytes;
  const int units = (cols + 7) / 8, vec_units = vec ? cols / 8 : 0;

  float acc[RPW][N];
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int t = 0; t < N; ++t) acc[r][t] = 0.f;

  // Units below vec_units: 16-byte loads through a prefetch ring; the rest (all of them when !vec, else at most
  // the row's last, partial unit) element by element. Both walk a lane's units in increasing order.
  int u = lane;
  if (vec_units == 0) pdl_enter();
  if (vec_units > 0) {
    typename U::Raw ring[AHEAD + 1][RPW];
    if (lane < vec_units) {
#pragma unroll
      for (int a = 0; a < AHEAD; ++a)
#pragma unroll
        for (int r = 0; r < RPW; ++r) U::fetch(ring[a][r], wrow[r], min(lane + 32 * a, vec_units - 1));
    }
    pdl_enter();  // the weights are immutable: their first loads above overlap the previous kernel's tail
    for (; u < vec_units; u += 32) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) U::fetch(ring[AHEAD][r], wrow[r], min(u + 32 * AHEAD, vec_units - 1));
      float w[RPW][8];
#pragma unroll
      for (int r = 0; r < RPW; ++r) U::decode(ring[0][r], w[r]);
#pragma unroll
      for (int a = 0; a < AHEAD; ++a)
#pragma unroll
        for (int r = 0; r < RPW; ++r) ring[a][r] = ring[a + 1][r];
      mv::fma_unit<N, RPW>(acc, w, x, n, cols, 8 * u, true);
    }
  }
  for (; u < units; u += 32) {
    float w[RPW][8];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int i = 0; i < 8; ++i) w[r][i] = U::element(wrow[r], 8 * u + i, cols);
    mv::fma_unit<N, RPW>(acc, w, x, n, cols, 8 * u, false);
  }
  mv::reduce_store<N, RPW>(acc, out, bias, n, rows, row0, lane);
}

// ---- the experts of a mixture-of-experts layer ----------------------------------------------------------------
// matvec_experts (block formats) and matvec_experts_f (float weights): for each (token, rank) pair p of a MoE
// layer, the 1-token mat-vec of the expert the pair was routed to (moe.py). An expert tensor is one matrix of
// experts x rows GGUF rows (never tiled; expert e's matrix from row e x rows); ids int32 [pairs] is moe_route's
// output, read after the PDL wait. Pair p reads activation row p / per_token (gate and up: per_token = k, the
// token's normed hidden state; down: 1, the pair's own SwiGLU output, of act_rows = pairs rows) and writes row p
// of its segment's out [pairs, rows]. Segments as matvec_q's (gate and up share a launch; bias unused).
// grid: (pairs, blocks over the segments' warps), block: 32 x warps (<= 128); each warp RPW rows of one segment
// (moe.PAIR_RPW: an expert's rows are short, so a warp's rows are all of its loads in flight at once).
// A row's lanes walk its units as matvec_q (matvec_f) does with its prefetch ring at N = 1, and reduce_store sums
// them in fixed point (matvec_f: by its butterfly): each pair's output is bitwise what matvec_q<T, 1, ...>
// (matvec_f<T, 1, ...>) gives that token on the chosen expert's matrix alone, whatever the other pairs, their
// experts or their count.
namespace mv {
// The RPW rows row0, row0 + 1, ... of one expert matrix against one token's activation (x0, x1: its planes, xsa:
// its scales), as matvec_q<T, 1, RPW> computes them with its prefetch ring: acc[r] = each row's lane partial, before
// the warp's sum.
template <int T, int RPW>
__device__ __forceinline__ void expert_pair_rows(fx::Sum (&acc)[RPW], const uint8_t* weight, int rows, int row0,
                                                 long long row_bytes, const int8_t* __restrict__ x0,
                                                 const int8_t* __restrict__ x1, const ActScale* __restrict__ xsa,
                                                 int cols, int lane) {
  using U = Unit<T>;
  constexpr int AHEAD = 1;  // what matvec.plan gives a decode step's large matrices (fewer registers than 2)
  const int k = lane & 7;
  const uint8_t* wrow[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) wrow[r] = weight + (long long)min(row0 + r, rows - 1) * row_bytes;
  const int units = cols / U::ELEMS;
#pragma unroll
  for (int r = 0; r < RPW; ++r) acc[r] = fx::zero();
  typename U::Raw ring[AHEAD + 1][RPW];
#pragma unroll
  for (int i = 0; i < AHEAD; ++i)
#pragma unroll
    for (int r = 0; r < RPW; ++r) U::fetch(ring[i][r], wrow[r], min(lane + 32 * i, units - 1), k);
  // Unrolled by the ring's length as matvec_q (Q5_1 so unrolled spilled 12 bytes in ptxas' allocation: not).
  constexpr int UNROLL = T != GGML_Q5_1 && sizeof(typename U::Raw) * (AHEAD + 1) * RPW <= 320 ? AHEAD + 1 : 1;
  // Every lane walks the row's steps (the spans' shuffles); a lane past the row's end re-reads its last unit.
#pragma unroll UNROLL
  for (int u0 = 0; u0 < units; u0 += 32) {
    const bool live = u0 + lane < units;
    const int u = min(u0 + lane, units - 1);
#pragma unroll
    for (int r = 0; r < RPW; ++r) U::fetch(ring[AHEAD][r], wrow[r], min(u0 + lane + 32 * AHEAD, units - 1), k);
    typename U::W w[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) U::decode(w[r], ring[0][r], wrow[r], u, k);
#pragma unroll
    for (int i = 0; i < AHEAD; ++i)
#pragma unroll
      for (int r = 0; r < RPW; ++r) ring[i][r] = ring[i + 1][r];
    int g[U::RUNS], h[U::RUNS];
    U::runs(u, k, g, h);
    Act<U::RUNS> av;
    load_act(av, x0, x1, xsa, g, h);
    add_units<U, RPW, 1>(acc, w, av, live, k, lane);
  }
}
}  // namespace mv

template <int T, int RPW>
__global__ void __launch_bounds__(128) matvec_experts(const __grid_constant__ mv::Segments seg,
                                                      const int* __restrict__ ids, int per_token,
                                                      const int8_t* __restrict__ xq, const ActScale* __restrict__ xs,
                                                      int act_rows, int cols, long long row_bytes) {
  const int lane = threadIdx.x & 31;
  const int pair = blockIdx.x;
  const int warp = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int end0 = (seg.rows[0] + RPW - 1) / RPW, end1 = end0 + (seg.rows[1] + RPW - 1) / RPW;
  const int s = (warp >= end0) + (warp >= end1);
  const int rows = mv::pick(seg.rows, s), row0 = (warp - (s == 0 ? 0 : s == 1 ? end0 : end1)) * RPW;
  pdl_enter();  // the expert ids, and the activation, are earlier kernels' output
  if (row0 >= rows) return;
  const uint8_t* weight = mv::pick(seg.weight, s) + (long long)ids[pair] * rows * row_bytes;
  const int a = pair / per_token;  // the activation row
  fx::Sum acc[RPW];
  mv::expert_pair_rows<T, RPW>(acc, weight, rows, row0, row_bytes, xq + (long long)a * cols,
                          xq + ((long long)act_rows + a) * cols, xs + (long long)a * (cols / 16), cols, lane);
  mv::reduce_store<1, RPW>(acc, mv::pick(seg.out, s) + (long long)pair * rows, nullptr, 1, rows, row0, lane);
}

// matvec_experts_combine: a decode step's down projection and moe_combine in one launch. grid: (tokens,
// ceil(rows / RPW)), block: 32 x k (k <= COMBINE_MAX_K); warp r computes rows row0 .. row0 + RPW - 1 of pair t k + r
// on its expert as matvec_experts does (the pair's y bitwise), then RPW threads add the k ranks' products in rank
// order as moe_combine does: out[t, row] = w0 y0 + w1 y1 + ..., each product rounded, so out is bitwise down +
// moe_combine.
// Activation: the pairs' quantized SwiGLU outputs, row p for pair p (act_rows = pairs).
constexpr int COMBINE_MAX_K = 16;
template <int T, int RPW>
__global__ void __launch_bounds__(32 * COMBINE_MAX_K) matvec_experts_combine(
    float* __restrict__ out, const uint8_t* __restrict__ weight, const int* __restrict__ ids,
    const float* __restrict__ weights, int k, const int8_t* __restrict__ xq, const ActScale* __restrict__ xs,
    int act_rows, int rows, int cols, long long row_bytes) {
  __shared__ float y[COMBINE_MAX_K][RPW];
  const int lane = threadIdx.x & 31, rank = threadIdx.x >> 5;
  const int t = blockIdx.x, row0 = RPW * blockIdx.y, pair = t * k + rank;
  pdl_enter();
  fx::Sum acc[RPW];
  mv::expert_pair_rows<T, RPW>(acc, weight + (long long)ids[pair] * rows * row_bytes, rows, row0, row_bytes,
                          xq + (long long)pair * cols, xq + ((long long)act_rows + pair) * cols,
                          xs + (long long)pair * (cols / 16), cols, lane);
  using S = mv::Spread<RPW, 1>;
  S::run(acc, lane);
#pragma unroll
  for (int i = 0; i < S::KEEP; ++i)
    if (S::writer(lane)) y[rank][S::first(lane) + i] = fx::value(acc[i]);
  __syncthreads();
  if (threadIdx.x < RPW && row0 + threadIdx.x < rows) {
    const float* w = weights + (long long)t * k;
    float sum = __fmul_rn(w[0], y[0][threadIdx.x]);
    for (int r = 1; r < k; ++r) sum = __fadd_rn(sum, __fmul_rn(w[r], y[r][threadIdx.x]));
    out[(long long)t * rows + row0 + threadIdx.x] = sum;
  }
}

// matvec_experts_grouped: the same outputs as matvec_experts, with each expert's rows read once for up to N of
// its pairs instead of once per pair (prefill and batched steps, where tokens share experts). moe_sort (moe.cu)
// lists the pairs by expert in order and cuts each expert's run into groups of at most N: groups[g] = (expert,
// first, count). grid: (an upper bound of the number of groups, blocks over the segments' warps); a block past
// num_groups, or of an expert nobody chose, does nothing. A warp computes RPW rows for the group's pairs as
// matvec_q<T, N> computes them for N tokens: each (row, pair) is the sum of the same unit contributions in fixed
// point as matvec_experts (matvec_q at one token), so every pair's row is bitwise what matvec_experts gives it,
// whatever the group, the pair's place in it or N.
template <int T, int N, int RPW>
__global__ void __launch_bounds__(128) matvec_experts_grouped(const __grid_constant__ mv::Segments seg,
                                                              const int* __restrict__ order,
                                                              const int4* __restrict__ groups,
                                                              const int* __restrict__ num_groups, int per_token,
                                                              const int8_t* __restrict__ xq,
                                                              const ActScale* __restrict__ xs, int act_rows, int cols,
                                                              long long row_bytes) {
  using U = mv::Unit<T>;
  constexpr int AHEAD = 1;  // a row has few units a lane (2 on a 2048-wide expert): their loads in flight together
  const int lane = threadIdx.x & 31;
  const int k = lane & 7;
  const int warp = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int end0 = (seg.rows[0] + RPW - 1) / RPW, end1 = end0 + (seg.rows[1] + RPW - 1) / RPW;
  const int s = (warp >= end0) + (warp >= end1);
  const int rows = mv::pick(seg.rows, s), row0 = (warp - (s == 0 ? 0 : s == 1 ? end0 : end1)) * RPW;
  // The group's activation rows, read from shared memory where used: held in registers (hoisted 64-bit addresses
  // of N tokens) they took Q4_K to 200 registers against matvec_q<12, 8, 2>'s 128.
  __shared__ int arow[N];
  pdl_enter();  // the groups and the activation are earlier kernels' output
  if ((int)blockIdx.x >= *num_groups) return;
  const int4 group = groups[blockIdx.x];
  const int n = group.z;
  const uint8_t* weight = mv::pick(seg.weight, s) + (long long)group.x * rows * row_bytes;
  const uint8_t* wrow[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) wrow[r] = weight + (long long)min(row0 + r, rows - 1) * row_bytes;
  const int units = cols / U::ELEMS, halves = cols / 16;
  const int8_t* xq1 = xq + (long long)act_rows * cols;  // plane 1
  // The first weight loads go out before the group's pair list is read and shared (two dependent loads and a
  // barrier: the block's whole life at decode widths, where a group is one or two pairs).
  typename U::Raw ring[AHEAD + 1][RPW];
  if (row0 < rows) {
#pragma unroll
    for (int i = 0; i < AHEAD; ++i)
#pragma unroll
      for (int r = 0; r < RPW; ++r) U::fetch(ring[i][r], wrow[r], min(lane + 32 * i, units - 1), k);
  }
  if (threadIdx.x < N) arow[threadIdx.x] = order[group.y + min((int)threadIdx.x, n - 1)] / per_token;
  __syncthreads();
  if (row0 >= rows) return;

  fx::Sum acc[N * RPW];  // (row r, pair t of the group) at t RPW + r
#pragma unroll
  for (int i = 0; i < N * RPW; ++i) acc[i] = fx::zero();
  for (int u0 = 0; u0 < units; u0 += 32) {
    const bool live = u0 + lane < units;
    const int u = min(u0 + lane, units - 1);
#pragma unroll
    for (int r = 0; r < RPW; ++r) U::fetch(ring[AHEAD][r], wrow[r], min(u0 + lane + 32 * AHEAD, units - 1), k);
    typename U::W w[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) U::decode(w[r], ring[0][r], wrow[r], u, k);
#pragma unroll
    for (int i = 0; i < AHEAD; ++i)
#pragma unroll
      for (int r = 0; r < RPW; ++r) ring[i][r] = ring[i + 1][r];
    int g[U::RUNS], h[U::RUNS];
    U::runs(u, k, g, h);
#pragma unroll
    for (int t = 0; t < N; ++t) {
      if (t == 0 || t < n) {
        const long long at = (long long)arow[t] * cols;
        mv::Act<U::RUNS> a;
        mv::load_act(a, xq + at, xq1 + at, xs + (long long)arow[t] * halves, g, h);
        mv::add_units<U, RPW, 1>(acc + t * RPW, w, a, live, k, lane);
      }
    }
  }
  using S = mv::Spread<N * RPW, 1>;
  S::run(acc, lane);
  float* out = mv::pick(seg.out, s);
  const int m0 = S::first(lane);
#pragma unroll
  for (int i = 0; i < S::KEEP; ++i) {
    const int t = (m0 + i) / RPW, row = row0 + (m0 + i) % RPW;
    if (S::writer(lane) && t < n && row < rows) out[(long long)order[group.y + t] * rows + row] = fx::value(acc[i]);
  }
}

// Float weights: x float32 [act_rows, cols]; vec as matvec_f's (x rows and weight rows 16-byte aligned).
template <int T>
__global__ void __launch_bounds__(128) matvec_experts_f(const __grid_constant__ mv::Segments seg,
                                                        const int* __restrict__ ids, int per_token,
                                                        const float* __restrict__ x, int cols, long long row_bytes,
                                                        int vec) {
  using U = mv::FloatUnit<T>;
  constexpr int RPW = 2, AHEAD = 2;
  const int lane = threadIdx.x & 31;
  const int pair = blockIdx.x;
  const int warp = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int end0 = (seg.rows[0] + RPW - 1) / RPW, end1 = end0 + (seg.rows[1] + RPW - 1) / RPW;
  const int s = (warp >= end0) + (warp >= end1);
  const int rows = mv::pick(seg.rows, s), row0 = (warp - (s == 0 ? 0 : s == 1 ? end0 : end1)) * RPW;
  pdl_enter();
  if (row0 >= rows) return;
  const uint8_t* weight = mv::pick(seg.weight, s) + (long long)ids[pair] * rows * row_bytes;
  const uint8_t* wrow[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) wrow[r] = weight + (long long)min(row0 + r, rows - 1) * row_bytes;
  const float* xa = x + (long long)(pair / per_token) * cols;
  const int units = (cols + 7) / 8, vec_units = vec ? cols / 8 : 0;

  float acc[RPW][1];
#pragma unroll
  for (int r = 0; r < RPW; ++r) acc[r][0] = 0.f;
  int u = lane;
  if (vec_units > 0) {
    typename U::Raw ring[AHEAD + 1][RPW];
    if (lane < vec_units) {
#pragma unroll
      for (int i = 0; i < AHEAD; ++i)
#pragma unroll
        for (int r = 0; r < RPW; ++r) U::fetch(ring[i][r], wrow[r], min(lane + 32 * i, vec_units - 1));
    }
    for (; u < vec_units; u += 32) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) U::fetch(ring[AHEAD][r], wrow[r], min(u + 32 * AHEAD, vec_units - 1));
      float w[RPW][8];
#pragma unroll
      for (int r = 0; r < RPW; ++r) U::decode(ring[0][r], w[r]);
#pragma unroll
      for (int i = 0; i < AHEAD; ++i)
#pragma unroll
        for (int r = 0; r < RPW; ++r) ring[i][r] = ring[i + 1][r];
      mv::fma_unit<1, RPW>(acc, w, xa, 1, cols, 8 * u, true);
    }
  }
  for (; u < units; u += 32) {
    float w[RPW][8];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int i = 0; i < 8; ++i) w[r][i] = U::element(wrow[r], 8 * u + i, cols);
    mv::fma_unit<1, RPW>(acc, w, xa, 1, cols, 8 * u, false);
  }
  mv::reduce_store<1, RPW>(acc, mv::pick(seg.out, s) + (long long)pair * rows, nullptr, 1, rows, row0, lane);
}

// ---- Q4_K and Q6_K through the tensor cores ---------------------------------------------------------------------
// matvec_mma<T>: every Q4_K mat-vec and the Q6_K ones of rows of a multiple of 2048 (1-16 tokens, grouped, ROPE), by
// mma.sync (u8 weights x s8 activation planes, exact int32 sums). Per 16 rows x 64 Q4_K weights it issues about a third
// of matvec_q's __dp4a loop's SASS, and it loads the weights in whole lines. The weights go through shared memory:
// loaded straight into A fragments (8 bytes a lane, 8 rows an instruction) each L2 request carried one 32-byte sector,
// 2.7x matvec_q's requests, and Q4_K ran at 2.4 TB/s against matvec_q's 3.5 at steady state; staged by cp.async in
// row-contiguous 16-byte pieces the requests carry whole lines and Q4_K streams at 4.1-4.3 TB/s
// (scripts/bench_matvec_mma.py, docs/performance.md).
//
// Blocks. A block computes one tile of 16 rows for all tokens: m-rows 0-7 are rows base0 + i, 8-15 rows base1 + i
// (base1 = base0 + 8, but base0 + head_dim / 2 for neox rotation pairs, so that m-rows i and i + 8 are a pair).
// Its W warps split the rows' superblock pairs into W contiguous ranges; each warp streams its range through its
// own ring of STAGES pairs in shared memory (no block barrier in the loop). For N <= 2 the block first copies the
// activation (both planes of every token, and the scales) into shared memory.
//
// Fragments. Lane (g, j) = (lane / 4, lane % 4) supplies 4 or 8 weights of m-rows g and g + 8 as its k positions
// (the order of k inside a unit does not matter to an exact integer sum) and, as B column g, the same elements of
// plane g % 2 of token g / 2 (below 4 tokens the columns repeat: token (g / 2) mod N). The result's column pair j is
// then (plane 0, plane 1) of token j mod min(N, 4), rows g and g + 8: a unit's I_0 and I_1 (Q4_K: one mma a unit;
// Q6_K: one a run, see MmaQ6K). The format is a policy (MmaQ4K, MmaQ6K: stage rows, copies, fragments and scales).
//
// Numerics: unit_value.cuh's definition, bitwise matvec_q's rows. A lane forms 256 I_0 + I_1 of a unit exactly in
// integers (one conversion: uv::value_t), A, B and M as matvec_q does, and walks whole spans (a superblock's 8
// units in column order, uv::span_step); the lanes holding one token split its rows and superblocks (Own), so each
// span is one lane's, and each span's value is fx::add-ed into the lane's fixed-point sums, which lanes and warps
// then add in any order (Parts). A deferred norm's factor after fx::value, the bias last, as matvec_q.

namespace mv {

// The spans a lane of the fragments walks, TPT tokens to a column tile: lanes j and j ^ PARTNER hold the same token
// (j mod TPT) and split its m-rows g, g + 8 and the pair's two superblocks. One token: lane j takes m-row g + 8 (j / 2)
// of superblock j % 2; two: both m-rows of superblock j / 2; four: both m-rows of both. So every lane scales 8 units
// a pair per token it holds, and selects its superblock's mma results where the token's lanes split them.
template <int TPT>
struct Own {
  static constexpr int RH = TPT == 1 ? 1 : 2, SBS = TPT == 4 ? 2 : 1, PARTNER = TPT == 1 ? 1 : TPT == 2 ? 2 : 0;
  __device__ static int half(int j, int h) { return TPT == 1 ? j >> 1 : h; }  // of its row h < RH
  __device__ static int sb(int j, int q) { return TPT == 4 ? q : TPT == 2 ? j >> 1 : j & 1; }  // of its q < SBS
  // Below 4 tokens, the superblock of the lanes whose results B column g feeds (output column pair g / 2).
  __device__ static int column_sb(int g) { return TPT == 1 ? (g >> 1) & 1 : g >> 2; }
};

// Plane i's dot of this lane's row h < Own::RH in an mma result (rows g: r[0], r[1]; g + 8: r[2], r[3]).
template <int TPT>
__device__ __forceinline__ int own_dot(const int (&r)[4], int j, int h, int i) {
  return TPT == 1 ? (Own<TPT>::half(j, h) ? r[2 + i] : r[i]) : r[2 * h + i];
}

// The W warps' fixed-point sums of N tokens x 16 m-rows, in shared memory: each warp puts its own, then any thread
// adds them (in any order: integer sums).
template <int W, int N>
struct Parts {
  long long v[W][N][16];
  float probe[W][N][16];

  __device__ void put(int w, int t, int mr, const fx::Sum& s) {
    v[w][t][mr] = s.v;
    probe[w][t][mr] = s.probe;
  }
  __device__ float total(int t, int mr) const {
    fx::Sum s = fx::zero();
#pragma unroll
    for (int w = 0; w < W; ++w) fx::add(s, fx::Sum{v[w][t][mr], probe[w][t][mr]});
    return fx::value(s);
  }
};

// A warp's sums into its Parts: a token's lanes joined (xor PARTNER), then one lane each puts them.
template <int TILES, int TPT, int W, int N>
__device__ __forceinline__ void put_sums(Parts<W, N>& part, fx::Sum (&acc)[TILES][Own<TPT>::RH], int warp, int g,
                                         int j) {
  using O = Own<TPT>;
#pragma unroll
  for (int nt = 0; nt < TILES; ++nt)
#pragma unroll
    for (int h = 0; h < O::RH; ++h) {
      if constexpr (O::PARTNER != 0) fx::add(acc[nt][h], shfl_xor(acc[nt][h], O::PARTNER));
      if ((j & O::PARTNER) == 0) part.put(warp, 4 * nt + j % TPT, g + 8 * O::half(j, h), acc[nt][h]);
    }
}

// What a format's pair() reads: this lane's B columns (xb: offsets in xa per column tile) and scales (xt: the
// scaled token's first ActScale in sa per column tile). Below 4 tokens, where the activation is staged, one mma
// takes both superblocks of a pair, k 0-15 the first's and k 16-31 the second's: B column g carries its own
// superblock's (col_sb: Own::column_sb) and reads the other half of k from zero, 256 zero bytes in shared memory,
// so each lane's results are its own superblock's dots and no lane selects among them.
template <int TILES>
struct MmaAct {
  const int8_t* xa;
  const ActScale* sa;
  int xb[TILES], xt[TILES];
  const int8_t* zero;
  int col_sb;

  // Below 4 tokens: the B bytes of k 0-15 (k0) and 16-31 (k1) of pair p's units; second: the pair's second
  // superblock exists.
  __device__ void pair_b(int p, bool second, const int8_t*& k0, const int8_t*& k1) const {
    const int8_t* first = xa + xb[0] + 512 * p;
    k0 = col_sb ? zero : first;
    k1 = col_sb && second ? first + 256 : zero;
  }
};

// d = a b + c: mma.m16n8k32 of u8 weights and s8 activations, accumulating.
__device__ __forceinline__ void mma_16832_u8s8_acc(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Q4_K: a stage row is a superblock pair, 288 bytes (16-byte aligned: rows are 144 nsb bytes). Per 32-byte chunk c of a
// superblock's qs two units: the low nibbles (sub-block 2c, unit 2c) and the high nibbles in place (unit 2c + 1, 16x
// its dots: 256 I_0 + I_1 is their integer >> 4, exact); lane (g, j) supplies qs bytes 8j..8j+7. From 4 tokens an
// mma.m16n8k32 a unit and superblock; below, two a unit for both superblocks (MmaAct), bytes 8j..8j+3 of each, then
// 8j+4..8j+7 accumulated. |256 I_0 + I_1| <= 256 * 32 * 15 * 128 < 2^24: one int -> float conversion is exact.
struct MmaQ4K {
  static constexpr int PIECES = 18, ROW = 16 * PIECES, XLANE = 8;  // 16-byte pieces of a row; B bytes a lane
  static constexpr int SB_BYTES = 144, SLOT = 144;  // SLOT: a superblock's bytes in the tiled layout (quant.cuh)
  static constexpr bool LINEAR = true;              // at(p) = ROW p

  // Pair p's first byte in a row; whether both its superblocks exist (a row's last pair may hold one: the missing
  // one's pieces, past the first LOW of the row, are zero-filled).
  static constexpr int LOW = 9;  // pieces of a pair's first superblock
  __device__ static long long at(int p) { return (long long)p * ROW; }
  __device__ static bool full(int p, long long row_bytes) { return at(p) + ROW <= row_bytes; }

  // tiled: the stage's rows the same either way. Below 4 tokens each mma takes both superblocks (MmaAct: a missing
  // second one's weights are zero-filled, its B zero); from 4 on, one superblock at a time.
  template <int TILES, int TPT>
  __device__ static void pair(fx::Sum (&acc)[TILES][Own<TPT>::RH], const MmaAct<TILES>& x, const uint8_t* stage,
                              int p, int nsb, int g, int j, bool) {
    using O = Own<TPT>;
    constexpr int RH = O::RH;
    static_assert(TPT == 4 || TILES == 1, "below 4 tokens, one column tile");
    const bool second = 2 * p + 1 < nsb;
    const int8_t *k0 = nullptr, *k1 = nullptr;  // below 4 tokens: B of k 0-15 and 16-31
    if constexpr (TPT < 4) x.pair_b(p, second, k0, k1);
#pragma unroll
    for (int q = 0; q < O::SBS; ++q) {
      if (TPT == 4 && q == 1 && !second) break;
      const int own = O::sb(j, q), sb = 2 * p + own;
      const bool live = sb < nsb;               // a lane of a missing second superblock adds nothing
      const int grp0 = 8 * min(sb, nsb - 1);    // its first activation group (read in range either way)
      float d[RH], dmin[RH];
      uint4 hd[RH];
#pragma unroll
      for (int h = 0; h < RH; ++h) {
        hd[h] = *reinterpret_cast<const uint4*>(stage + 144 * own + (g + 8 * O::half(j, h)) * ROW);
        d[h] = f16_lo(hd[h].x);
        dmin[h] = f16_hi(hd[h].x);
      }
      float part[TILES][RH][3];  // uv::span_step's partials of each (tile, row) span
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float A[2][RH], B[2][RH];  // units 2c and 2c + 1 of this lane's rows
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int h = 0; h < RH; ++h) {
            int sc, m;
            scale_min(hd[h], c, u, sc, m);
            A[u][h] = __fmul_rn(d[h], (float)sc);  // exact: fp16 times a 6-bit integer
            B[u][h] = __fmul_rn(-dmin[h], (float)m);
          }
#pragma unroll
        for (int nt = 0; nt < TILES; ++nt) {
          int lo[4], hi[4];  // this lane's superblock's dots of units 2c and 2c + 1 (high nibbles: 16x)
          if constexpr (TPT < 4) {
            // Two mma a unit: qs bytes 8j..8j+3 of both superblocks (k 0-15, 16-31), then bytes 8j+4..8j+7.
            uint2 wa[2], wb[2];
#pragma unroll
            for (int s = 0; s < 2; ++s) {
              wa[s] = *reinterpret_cast<const uint2*>(stage + 144 * s + g * ROW + 16 + 32 * c + 8 * j);
              wb[s] = *reinterpret_cast<const uint2*>(stage + 144 * s + (g + 8) * ROW + 16 + 32 * c + 8 * j);
            }
            const uint32_t w1[4] = {wa[0].x, wb[0].x, wa[1].x, wb[1].x}, w2[4] = {wa[0].y, wb[0].y, wa[1].y, wb[1].y};
            uint32_t lo1[4], lo2[4], hi1[4], hi2[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              lo1[i] = w1[i] & 0x0F0F0F0Fu;
              lo2[i] = w2[i] & 0x0F0F0F0Fu;
              hi1[i] = w1[i] & 0xF0F0F0F0u;
              hi2[i] = w2[i] & 0xF0F0F0F0u;
            }
            // B words one at a time: each mma's pair of them from two loads (8-byte loads cost a move each).
            auto b = [&](const int8_t* k, int at) { return *reinterpret_cast<const uint32_t*>(k + 64 * c + at); };
            tc::mma_16832_u8s8(lo, lo1, b(k0, 0), b(k1, 0));
            mma_16832_u8s8_acc(lo, lo2, b(k0, 4), b(k1, 4));
            tc::mma_16832_u8s8(hi, hi1, b(k0, 32), b(k1, 32));
            mma_16832_u8s8_acc(hi, hi2, b(k0, 36), b(k1, 36));
          } else {
            const uint8_t* blocks = stage + 144 * q;
            const uint2 wa = *reinterpret_cast<const uint2*>(blocks + g * ROW + 16 + 32 * c + 8 * j);
            const uint2 wb = *reinterpret_cast<const uint2*>(blocks + (g + 8) * ROW + 16 + 32 * c + 8 * j);
            const uint32_t alo[4] = {wa.x & 0x0F0F0F0Fu, wb.x & 0x0F0F0F0Fu, wa.y & 0x0F0F0F0Fu, wb.y & 0x0F0F0F0Fu};
            const uint32_t ahi[4] = {wa.x & 0xF0F0F0F0u, wb.x & 0xF0F0F0F0u, wa.y & 0xF0F0F0F0u, wb.y & 0xF0F0F0F0u};
            const int8_t* b = x.xa + x.xb[nt] + 32 * (8 * sb + 2 * c);  // the group of sub-block 2c
            const uint2 blo = *reinterpret_cast<const uint2*>(b), bhi = *reinterpret_cast<const uint2*>(b + 32);
            tc::mma_16832_u8s8(lo, alo, blo.x, blo.y);
            tc::mma_16832_u8s8(hi, ahi, bhi.x, bhi.y);
          }
#pragma unroll
          for (int u = 0; u < 2; ++u) {  // unit 2c + u of the span
            const int4 act = *(reinterpret_cast<const int4*>(x.sa + x.xt[nt]) + grp0 + 2 * c + u);  // {D, s0, D, s1}
            const float D = __int_as_float(act.x), M = (float)(act.y + act.w);
#pragma unroll
            for (int h = 0; h < RH; ++h) {
              const int(&r)[4] = u ? hi : lo;
              const int q0 = own_dot<TPT>(r, j, h, 0), q1 = own_dot<TPT>(r, j, h, 1);
              const int t = u ? (256 * q0 + q1) >> 4 : 256 * q0 + q1;
              uv::span_step(part[nt][h], uv::value_t(D, A[u][h], B[u][h], (float)t, M), 2 * c + u);
            }
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < TILES; ++nt)
#pragma unroll
        for (int h = 0; h < RH; ++h)
          if (live) fx::add(acc[nt][h], part[nt][h][0]);
    }
  }
  // Sub-block 2c + p's 6-bit scale and min from a header (words: d | dmin, scales 0-3, 4-7, 8-11).
  __device__ static void scale_min(const uint4& hd, int c, int p, int& sc, int& m) {
    const int sh = 16 * (c & 1) + 8 * p;
    if (c < 2) {
      sc = (int)((hd.y >> sh) & 63u);
      m = (int)((hd.z >> sh) & 63u);
    } else {
      const uint32_t b = hd.w >> sh;
      sc = (int)((b & 0xFu) | ((((hd.y >> sh) >> 6) & 3u) << 4));
      m = (int)(((b >> 4) & 0xFu) | ((((hd.z >> sh) >> 6) & 3u) << 4));
    }
  }
};

// Q6_K: a stage row is a superblock pair, 420 bytes at 420 p of the row: the 27 16-byte pieces around it (rows are
// 16-byte aligned: 210 nsb bytes with nsb % 8 == 0), so the pair starts o = 4p % 16 bytes into the stage row, its
// second superblock 2 bytes off a word (a word of it: two aligned loads and a byte permute). Tiled (MmaCopy), a stage
// row is the pair's two 216-byte slots and both superblocks are word-aligned. The pitch, 432 bytes (108 words, 12 mod
// 32), puts the 8 rows a load touches on distinct banks. Half h of a superblock (ql[64h..], qh[32h..]) holds elements
// 128h + i; a lane's words (h, m) are qh word 4m + j with ql words 4m + j and 4m + j + 8, which give the 4-element runs
// of sub-blocks 8h + m + {0, 2, 4, 6} (qword). Unit u = 4h + k (sub-blocks 2u and 2u + 1, the runs of scales sc[2u],
// sc[2u + 1]) is qword k of m = 0 (run a) and of m = 1 (run b). From 4 tokens one mma.m16n8k32 takes run a at k 0-15
// and run b at 16-31, issued once per run with the other's B zero; below, an mma a run takes both superblocks'
// (MmaAct). Either way each run's plane dots come apart. With w = q - 32 (unit_value.cuh), run r's 256 dot_0 + dot_1 -
// 32 s_r (s_r: the half's ActScale sum of 256 q0 + q1) is 256 D_0 + D_1 of q - 32, below 2^24 in magnitude, and 256 I_0
// + I_1 = sc_a X_a + sc_b X_b exactly in 64 bits (each product below 2^31, their sum not): one conversion. (Two runs an
// mma told apart by the B columns, sub-blocks c and c + 2, halved the mma count when each lane scaled runs in a float
// sum; a unit's runs must meet in one lane now.)
struct MmaQ6K {
  static constexpr int PIECES = 27, ROW = 16 * PIECES, XLANE = 4, SB_BYTES = 210;
  static constexpr int SLOT = 216;      // tiled (quant.cuh): a superblock and 6 zero bytes, so a pair is a stage row
  static constexpr bool LINEAR = false;  // at(p) is not ROW p

  // The 16-byte piece holding pair p's first byte. A row of 8i superblocks has 4i pairs, so its last pair starts 12
  // bytes into a piece and that pair's 27 pieces end with the row: every piece lies inside its row.
  static constexpr int LOW = PIECES;
  __device__ static long long at(int p) { return (420LL * p) & ~15LL; }
  __device__ static bool full(int, long long) { return true; }

  // (lo & 0x0F0F0F0F) | (hi & 0xF0F0F0F0).
  __device__ static uint32_t nibbles(uint32_t lo, uint32_t hi) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, 0x0F0F0F0F, 0xE4;" : "=r"(r) : "r"(lo), "r"(hi));
    return r;
  }

  // The word at p; odd: p is 2 bytes off a word (a constant after unrolling).
  __device__ static uint32_t word(const uint8_t* p, bool odd) {
    if (!odd) return *reinterpret_cast<const uint32_t*>(p);
    const uint32_t* a = reinterpret_cast<const uint32_t*>(p - 2);
    return __byte_perm(a[0], a[1], 0x5432);
  }

  // A lane's words (h, m) of a row: ql at 16m + 4j and 32 + 16m + 4j of half h, qh at 16m + 4j.
  __device__ static void words(uint32_t (&w)[3], const uint8_t* row, int h, int m, int j, bool odd) {
    w[0] = word(row + 64 * h + 16 * m + 4 * j, odd);
    w[1] = word(row + 64 * h + 32 + 16 * m + 4 * j, odd);
    w[2] = word(row + 128 + 32 * h + 16 * m + 4 * j, odd);
  }

  // The 6-bit weights of sub-block 8h + m + 2k (this lane's 4 elements) from words (h, m): the low nibbles from ql,
  // the high bits from bit pairs 0, 2 (k even) or 1, 3 of each qh byte, each weight byte one lop3 (written as C, the
  // compiler re-derived the masks and spent a third instruction per byte).
  __device__ static uint32_t qword(const uint32_t (&w)[3], int k) {
    const uint32_t hb = (k & 1 ? w[2] >> 2 : w[2]) & 0x33333333u, l = w[k & 1];
    return k < 2 ? nibbles(l, hb << 4) : nibbles(l >> 4, hb);
  }

  // a b + c in 64 bits (as C, a widening product of ints took the unsigned multiply and four fix-ups).
  __device__ static long long mad_wide(int a, int b, long long c) {
    long long d;
    asm("mad.wide.s32 %0, %1, %2, %3;" : "=l"(d) : "r"(a), "r"(b), "l"(c));
    return d;
  }

  // tiled: the pair's superblocks at 0 and SLOT of the stage row, both on 8-byte boundaries (no realignment).
  template <int TILES, int TPT>
  __device__ static void pair(fx::Sum (&acc)[TILES][Own<TPT>::RH], const MmaAct<TILES>& x, const uint8_t* stage,
                              int p, int, int g, int j, bool tiled) {
    const uint8_t* first = stage + (tiled ? 0 : (4 * p) & 15);
    if (tiled)
      pair_of<TILES, TPT>(acc, x, first, first + SLOT, false, p, g, j);
    else
      pair_of<TILES, TPT>(acc, x, first, first + SB_BYTES, true, p, g, j);
  }

  // odd: the second superblock is 2 bytes off a word. Every pair is whole (nsb % 8 == 0). Below 4 tokens each mma
  // takes both superblocks (MmaAct); from 4 on, one superblock at a time.
  template <int TILES, int TPT>
  __device__ static __forceinline__ void pair_of(fx::Sum (&acc)[TILES][Own<TPT>::RH], const MmaAct<TILES>& x,
                                                 const uint8_t* first, const uint8_t* second, bool odd, int p, int g,
                                                 int j) {
    using O = Own<TPT>;
    constexpr int RH = O::RH, HELD = TPT == 4 ? 1 : 2;  // superblocks whose weights a step holds
    static_assert(TPT == 4 || TILES == 1, "below 4 tokens, one column tile");
    const int8_t *k0 = nullptr, *k1 = nullptr;  // below 4 tokens: B of k 0-15 and 16-31
    if constexpr (TPT < 4) x.pair_b(p, true, k0, k1);
#pragma unroll
    for (int q = 0; q < O::SBS; ++q) {
      const int own = O::sb(j, q), sb = 2 * p + own;
      float d[RH];
      const int8_t* scales[RH];
#pragma unroll
      for (int h = 0; h < RH; ++h) {
        const uint8_t* b = (own ? second : first) + (g + 8 * O::half(j, h)) * ROW;
        d[h] = __half2float(*reinterpret_cast<const __half*>(b + 208));
        scales[h] = reinterpret_cast<const int8_t*>(b + 192);
      }
      float part[TILES][RH][3];  // uv::span_step's partials of each (tile, row) span
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        uint32_t w[HELD][2][2][3];  // per superblock held, m and m-row g / g + 8: words (hf, m)
#pragma unroll
        for (int s = 0; s < HELD; ++s) {
          const int qq = TPT == 4 ? q : s;
#pragma unroll
          for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r)
              words(w[s][m][r], (qq ? second : first) + (g + 8 * r) * ROW, hf, m, j, qq && odd);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int u = 4 * hf + k;
          // Below 4 tokens an mma a run, both superblocks' (ra: run a, m = 0; rb: run b, m = 1; k 0-15 superblock
          // 0's, 16-31 superblock 1's); from 4, an mma takes run a at k 0-15 and run b at 16-31 (ra), issued once
          // per run with the other's B zero.
          uint32_t ra[4], rb[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            ra[i] = qword(w[HELD == 2 ? i >> 1 : 0][HELD == 2 ? 0 : i >> 1][i & 1], k);
            if constexpr (HELD == 2) rb[i] = qword(w[i >> 1][1][i & 1], k);
          }
          int sa[RH], sbs[RH];
#pragma unroll
          for (int h = 0; h < RH; ++h) {
            sa[h] = scales[h][2 * u];
            sbs[h] = scales[h][2 * u + 1];
          }
#pragma unroll
          for (int nt = 0; nt < TILES; ++nt) {
            int da[4], db[4];  // this lane's superblock's runs a (sub-block 2u) and b (2u + 1)
            if constexpr (HELD == 2) {
              auto b = [&](const int8_t* kb, int at) { return *reinterpret_cast<const uint32_t*>(kb + 32 * u + at); };
              tc::mma_16832_u8s8(da, ra, b(k0, 0), b(k1, 0));
              tc::mma_16832_u8s8(db, rb, b(k0, 16), b(k1, 16));
            } else {
              const int8_t* bx = x.xa + x.xb[nt] + 256 * sb + 32 * u;
              tc::mma_16832_u8s8(da, ra, *reinterpret_cast<const uint32_t*>(bx), 0u);
              tc::mma_16832_u8s8(db, ra, 0u, *reinterpret_cast<const uint32_t*>(bx + 16));
            }
            const int4 act = *(reinterpret_cast<const int4*>(x.sa + x.xt[nt]) + 8 * sb + u);  // {D, s_a, D, s_b}
#pragma unroll
            for (int h = 0; h < RH; ++h) {
              const int a0 = own_dot<TPT>(da, j, h, 0), a1 = own_dot<TPT>(da, j, h, 1);
              const int b0 = own_dot<TPT>(db, j, h, 0), b1 = own_dot<TPT>(db, j, h, 1);
              const int xa = 256 * a0 + a1 - 32 * act.y, xb = 256 * b0 + b1 - 32 * act.w;
              const float t = __ll2float_rn(mad_wide(sbs[h], xb, mad_wide(sa[h], xa, 0)));
              uv::span_step(part[nt][h], uv::value_t(__int_as_float(act.x), d[h], 0.f, t, 0.f), u);
            }
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < TILES; ++nt)
#pragma unroll
        for (int h = 0; h < RH; ++h) fx::add(acc[nt][h], part[nt][h][0]);
    }
  }
};

template <int T>
using MmaFormat = typename Pick<T == GGML_Q4_K, MmaQ4K, MmaQ6K>::type;

// A warp's copies into its ring: piece lane + 32 i (slot i) of the stage's 16 rows laid end to end, so consecutive
// lanes copy consecutive 16-byte pieces of a row (an instruction covers whole lines of one or two rows; copying 128
// bytes of each of 4 rows an instruction instead ran 2-6% slower on Q6_K). A slot's row and offset are fixed per
// lane, so each copy is the pair's offset plus a precomputed one: ~3 instructions a copy where recomputing the
// piece's row and address took ~17 (a third of Q6_K's loop).
// Tiled (chosen per segment at run time: Segments::tiled): the weights stored as [rows / 8][pairs][8][F::ROW bytes],
// each group of 8 rows pair after pair, a pair's two superblocks F::SLOT bytes apart (quant.cuh's tiled layout: the
// GGUF rows' bytes reordered when the weights are loaded, Q6_K's superblocks padded from 210 to 216 bytes; rows a
// multiple of 16 and an even count of superblocks, so a group is 8 row_bytes: cuda/weight_layout.py), so that each
// half of a stage is one contiguous copy of 8 F::ROW bytes: on the H200 (three machine starts) the 8B's Q4_K gate + up
// -1.6 to -2.1 us of ~25, its down -1.0 to -1.2 of ~12.7, o -0.45 to -0.6 of ~6.6, bitwise the same sums
// (scripts/bench_tiled.py, retired: git show 66c861b:scripts/bench_tiled.py).
template <class F>
struct MmaCopy {
  static constexpr int PIECES = 16 * F::PIECES, SLOTS = (PIECES + 31) / 32, HALF = PIECES / 2;
  static_assert(F::ROW == 16 * F::PIECES && F::ROW == 2 * F::SLOT, "stage rows end to end, a tiled pair a row");
  const uint8_t* base[2];  // the tile's first row of each half (m-rows 0 and 8)
  unsigned off[SLOTS];     // slot i's piece: bytes past its half's base (under 8 rows: 32 bits hold it)
  unsigned low;            // bit i: slot i's piece lies in the first F::LOW pieces of its row
  unsigned pair_bytes;     // from one pair of a half's rows to the next: F::ROW in GGUF rows, 8 F::ROW tiled

  __device__ bool tiled() const { return pair_bytes != F::ROW; }

  // Half h's rows from weight_h (the same matrix, or gate and up for matvec_mma_glu).
  __device__ MmaCopy(const uint8_t* weight0, const uint8_t* weight1, int base0, int base1, int rows, long long row_bytes,
                     int lane, bool tiled) {
    if (tiled) {  // half h's rows (base_h a multiple of 8): one group, its first byte base_h row_bytes on
      base[0] = weight0 + (long long)base0 * row_bytes;
      base[1] = weight1 + (long long)base1 * row_bytes;
      low = ~0u;
      pair_bytes = 8 * F::ROW;
#pragma unroll
      for (int i = 0; i < SLOTS; ++i) {
        const int piece = lane + 32 * i;
        off[i] = 16u * (piece >= HALF ? piece - HALF : piece);
      }
      return;
    }
    pair_bytes = F::ROW;
    const int first0 = min(base0, rows - 1), first1 = min(base1, rows - 1);
    base[0] = weight0 + (long long)first0 * row_bytes;
    base[1] = weight1 + (long long)first1 * row_bytes;
    low = 0;
#pragma unroll
    for (int i = 0; i < SLOTS; ++i) {
      const int piece = lane + 32 * i, r = piece / F::PIECES, o = piece % F::PIECES, h = r >= 8;
      const int row = min((h ? base1 : base0) + (r & 7), rows - 1);
      off[i] = (unsigned)((row - (h ? first1 : first0)) * row_bytes) + 16 * o;
      low |= (unsigned)(o < F::LOW) << i;
    }
  }

  // shift: bytes past the tile's rows (another tile of the same rows' layout: matvec_mma_glu's split). A tiled
  // matrix's pairs are all full (an even count of superblocks).
  __device__ void issue(uint8_t* stage, int p, long long row_bytes, int lane, long long shift = 0) const {
    const long long at = (F::LINEAR || tiled() ? (long long)pair_bytes * p : F::at(p)) + shift;
    const bool full = F::full(p, row_bytes);
    const uint8_t *h0 = base[0] + at, *h1 = base[1] + at;
    const unsigned s = tc::smem_addr(stage) + 16 * lane;
#pragma unroll
    for (int i = 0; i < SLOTS; ++i) {
      const int piece = lane + 32 * i;
      if (piece >= PIECES) break;
      const uint8_t* h = 32 * i + 31 < HALF ? h0 : 32 * i >= HALF ? h1 : piece >= HALF ? h1 : h0;
      tc::cp_async_16(s + 512 * i, h + off[i], full || (low >> i & 1));
    }
  }
};

// The activation as the fragments read it: below 3 tokens first copied by the whole block into shared memory at sx
// (every thread must call, after its PDL wait); plane P of token t at xa + (P n + t) cols, its scales at sa + t cols /
// 16. deferred: the activation is residual * norm weight as matvec_mma_norm (or add_rms_norm's DEFER) wrote it, its
// scales followed in memory by each 32-element group's sum of squares of the residual [n, cols / 32] (cols % 128 == 0),
// which below 3 tokens are staged with them (from 3 tokens on read where they are); a warp adds a token's (norm_factor)
// and leaves RMSNorm's 1 / rms in inv_rms[t] for the caller's epilogue, which scales
// each output by it after its block barrier (the quantization is scale invariant: the planes of r w and of r w / rms
// differ only in rounding). Scaling the staged group scales instead cost two more barriers and a pass over them:
// ~0.8-1.3 us a launch on the H200 (scripts/bench_norm_fold.py).
// Staging: `threads` threads (tid: this one's index), every one of which must call.
// Below 3 tokens it also zeroes the 256 bytes of zero_act (MmaAct).
__device__ __forceinline__ int8_t* zero_act() {
  __shared__ uint4 zeros[16];
  return reinterpret_cast<int8_t*>(zeros);
}

// RMSNorm's 1 / rms of one token from its groups' sums of squares: lane i adds groups i, i + 32, ... in order, then an
// xor butterfly, so every reader (and linear_mma's lm::inv_rms) gets the same factor. All 32 lanes must call.
__device__ __forceinline__ float norm_factor(const float* sums, int groups, int cols, float eps, int lane) {
  float total = 0.f;
  for (int i = lane; i < groups; i += 32) total = __fadd_rn(total, sums[i]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total = __fadd_rn(total, __shfl_xor_sync(0xFFFFFFFFu, total, o));
  return 1.0f / sqrtf(total / (float)cols + eps);
}

template <int N>
__device__ __forceinline__ void stage_activation(int8_t* sx, const int8_t* __restrict__ xq,
                                                 const ActScale* __restrict__ xs, int n, int cols, int deferred,
                                                 float norm_eps, float* inv_rms, int tid, int threads) {
  if constexpr (N <= 2) {
    const int q16 = n * cols / 8, s16 = n * cols / 32 + (deferred ? n * cols / 128 : 0);
    auto load = [](const void* p, int i) {
      const uint4* from = reinterpret_cast<const uint4*>(p) + i;
      return __ldg(from);
    };
    // Up to BATCH loads a thread in flight at once, then their stores. Loading and storing piece after piece, the
    // 8B's decode step took 9 us longer (scripts/ab_step.py, 7 alternations).
    constexpr int BATCH = 8;
    const int total = q16 + s16;
    for (int first = tid; first < total; first += BATCH * threads) {
      uint4 piece[BATCH];
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        const int i = first + k * threads;
        if (i < total) piece[k] = i < q16 ? load(xq, i) : load(xs, i - q16);
      }
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        const int i = first + k * threads;
        if (i < total) reinterpret_cast<uint4*>(sx)[i] = piece[k];
      }
    }
    if (tid < 16) reinterpret_cast<uint4*>(zero_act())[tid] = make_uint4(0u, 0u, 0u, 0u);
    __syncthreads();
    TRACE_MARK(2);
    const int warp = tid >> 5, lane = tid & 31, groups = cols / 32;
    if (deferred && warp < n) {
      const float* sums = reinterpret_cast<const float*>(sx + 2 * n * cols + n * cols / 2) + warp * groups;
      const float f = norm_factor(sums, groups, cols, norm_eps, lane);
      if (lane == 0) inv_rms[warp] = f;
    }
  } else if (deferred) {  // the sums right after the scales in global memory; the caller's barrier precedes their use
    const int warp = tid >> 5, lane = tid & 31, groups = cols / 32;
    const float* sums = reinterpret_cast<const float*>(xs + n * cols / 16);
    for (int t = warp; t < n; t += threads >> 5) {
      const float f = norm_factor(sums + t * groups, groups, cols, norm_eps, lane);
      if (lane == 0) inv_rms[t] = f;
    }
  }
}

template <class F, int N, int TILES, int TPT>
__device__ __forceinline__ MmaAct<TILES> act_view(const int8_t* sx, const int8_t* __restrict__ xq,
                                                  const ActScale* __restrict__ xs, int n, int cols, int g, int j) {
  constexpr bool STAGE_X = N <= 2;
  MmaAct<TILES> x;
  x.xa = STAGE_X ? sx : xq;
  x.sa = STAGE_X ? reinterpret_cast<const ActScale*>(sx + 2 * n * cols) : xs;
#pragma unroll
  for (int nt = 0; nt < TILES; ++nt) {
    x.xb[nt] = ((g & 1) * n + min(4 * nt + (g >> 1) % TPT, n - 1)) * cols + F::XLANE * j;
    x.xt[nt] = min(4 * nt + j % TPT, n - 1) * (cols / 16);
  }
  x.zero = nullptr;
  x.col_sb = 0;
  if constexpr (STAGE_X) {
    x.zero = zero_act();
    x.col_sb = Own<TPT>::column_sb(g);
  }
  return x;
}

template <class F, int N, int TILES, int TPT, int THREADS>
__device__ __forceinline__ MmaAct<TILES> mma_activation(int8_t* sx, const int8_t* __restrict__ xq,
                                                        const ActScale* __restrict__ xs, int n, int cols, int g, int j,
                                                        int deferred, float norm_eps, float* inv_rms) {
  stage_activation<N>(sx, xq, xs, n, cols, deferred, norm_eps, inv_rms, threadIdx.x, THREADS);
  return act_view<F, N, TILES, TPT>(sx, xq, xs, n, cols, g, j);
}

// A warp's sums over pairs [p0, p0 + count) of its tile, streamed through its ring (the first STAGES - 1 pairs
// issued by the caller, before its PDL wait).
template <class F, int STAGES, int STAGE, int TILES, int TPT, class Copy>
__device__ __forceinline__ void mma_stream(fx::Sum (&acc)[TILES][Own<TPT>::RH], const Copy& copy, uint8_t* ring,
                                           int p0, int count, long long row_bytes, const MmaAct<TILES>& x, int nsb,
                                           int g, int j, int lane) {
#pragma unroll
  for (int nt = 0; nt < TILES; ++nt)
#pragma unroll
    for (int h = 0; h < Own<TPT>::RH; ++h) acc[nt][h] = fx::zero();
  for (int i = 0; i < count; ++i) {
    tc::cp_async_wait<STAGES - 2>();
    __syncwarp();  // pair i has landed for every lane, and every lane is done with the stage refilled next
    if (i + STAGES - 1 < count)
      copy.issue(ring + (i + STAGES - 1) % STAGES * STAGE, p0 + i + STAGES - 1, row_bytes, lane);
    tc::cp_async_commit();
    F::template pair<TILES, TPT>(acc, x, ring + i % STAGES * STAGE, p0 + i, nsb, g, j, copy.tiled());
  }
}

// Warp w's pairs of a row split over W warps: [w pairs / W, (w + 1) pairs / W), contiguous ranges.
template <int W>
__device__ __forceinline__ void warp_pairs(int w, int nsb, int& p0, int& count) {
  const int pairs = (nsb + 1) / 2;
  p0 = w * pairs / W;
  count = (w + 1) * pairs / W - p0;
}

// A warp's first STAGES - 1 pairs of [p0, p0 + count) into its ring. The weights are immutable, so these copies
// may start before the PDL wait, overlapping what runs before.
template <int STAGES, int STAGE, class Copy>
__device__ __forceinline__ void mma_first_copies(const Copy& copy, uint8_t* ring, int p0, int count,
                                                 long long row_bytes, int lane) {
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < count) copy.issue(ring + i * STAGE, p0 + i, row_bytes, lane);
    tc::cp_async_commit();
  }
}

// The matvec_mma kernels' blocks are written as Work structs (TileWork, GluWork, NormWork: the block's copies before
// its PDL wait, then the rest). A persistent kernel running them as the phases of one launch (a slot of its block a
// Work, named barriers) measured slower than these launches chained with PDL: +11-16 us a decode layer of the 8B
// (docs/performance.md, "Tried and measured"; git show edb531a:scripts/bench_layer.py).
//
// The threads that run one block's work: the launch's whole block.
struct Group {
  int tid;
  __device__ __forceinline__ void sync() const { __syncthreads(); }
};

__device__ __forceinline__ Group whole_block() { return Group{(int)threadIdx.x}; }

// The work of matvec_mma's block `tile` of segment s (format F; STAGE: the bytes of a ring stage, the launch's
// largest), in two steps: first_copies (before the PDL wait) and rest (after the activation is staged).
template <class F, int N, int W, int STAGES, bool ROPE, int STAGE>
struct TileWork {
  static constexpr int TILES = (N + 3) / 4, TPT = N < 4 ? N : 4;  // mma column tiles; tokens in each (= combinations)
  int base0, base1, p0, count;
  MmaCopy<F> copy;

  __device__ __forceinline__ TileWork(const Segments& seg, const Rope& rope, int cols, long long row_bytes, int s,
                                      int tile, int warp, int lane)
      : base0(bases(rope, s, tile).x),
        base1(bases(rope, s, tile).y),
        copy(pick(seg.weight, s), pick(seg.weight, s), base0, base1, pick(seg.rows, s), row_bytes, lane,
             pick(seg.tiled, s)) {
    warp_pairs<W>(warp, cols / 256, p0, count);
  }

  // m-rows 0-7 from base0, 8-15 from base1: 16 consecutive rows, or neox rotation pairs (head h's j and j +
  // head_dim / 2, head_dim / 16 tiles a head).
  __device__ static int2 bases(const Rope& rope, int s, int tile) {
    const bool neox_pairs = ROPE && rope.neox && pick(rope.role, s) != ROPE_V;
    const int b0 = neox_pairs ? tile / (rope.head_dim / 16) * rope.head_dim + 8 * (tile % (rope.head_dim / 16))
                              : 16 * tile;
    return make_int2(b0, neox_pairs ? b0 + rope.head_dim / 2 : b0 + 8);
  }

  __device__ __forceinline__ void first_copies(uint8_t* rings, long long row_bytes, int warp, int lane) const {
    mma_first_copies<STAGES, STAGE>(copy, rings + warp * STAGES * STAGE, p0, count, row_bytes, lane);
  }

  __device__ __forceinline__ void rest(const Segments& seg, const MmaAct<TILES>& x, int n, int cols,
                                       long long row_bytes, const Rope& rope, int deferred, const float* inv_rms,
                                       int s, uint8_t* rings, Parts<W, N>& part, const Group& gr) const {
    const int lane = gr.tid & 31, warp = gr.tid >> 5, g = lane >> 2, j = lane & 3;
    const int rows = pick(seg.rows, s);
    float* out = pick(seg.out, s);
    const float* bias = pick(seg.bias, s);
    auto row_of = [&](int mr) { return mr < 8 ? base0 + mr : base1 + mr - 8; };
    // ROPE: thread i < 8 N stores rotation pair i & 7 (m-rows 2i, 2i + 1; i, i + 8 for neox pairs) of token i >> 3,
    // as rope_store does it. What it reads besides the sums is loaded before the stream: loaded in the epilogue, on
    // the path of the launch's last block, those loads and the norm weight's (NormWork) cost the 8B's decode step
    // 35 us (scripts/ab_step.py, 7 alternations).
    const int role = ROPE ? pick(rope.role, s) : ROPE_V;
    const bool neox_pairs = ROPE && rope.neox && role != ROPE_V;
    const int pi = gr.tid & 7, pair_t = gr.tid >> 3;
    const int m0 = neox_pairs ? pi : 2 * pi, m1 = neox_pairs ? pi + 8 : 2 * pi + 1;
    const bool pair_live = ROPE && gr.tid < 8 * N && pair_t < n && row_of(m1) < rows;
    static_assert(!ROPE || 8 * N <= 32 * W, "a rotation pair a thread");
    const RopePairIn pair_in =
        pair_live ? rope_pair_in(pair_t, bias, row_of(m0), row_of(m1), role, rope) : RopePairIn{0.f, 0.f, 0.f, 0, -1};
    fx::Sum acc[TILES][Own<TPT>::RH];
    mma_stream<F, STAGES, STAGE, TILES, TPT>(acc, copy, rings + warp * STAGES * STAGE, p0, count, row_bytes, x,
                                             cols / 256, g, j, lane);
    put_sums<TILES, TPT>(part, acc, warp, g, j);
    gr.sync();
    TRACE_MARK(4);

    // m-row mr of token t (times a deferred norm's factor).
    auto total = [&](int mr, int t) {
      const float v = part.total(t, mr);
      return deferred ? __fmul_rn(v, inv_rms[t]) : v;
    };
    if constexpr (!ROPE) {
      for (int i = gr.tid; i < 16 * N; i += 32 * W) {
        const int mr = i & 15, t = i >> 4, row = row_of(mr);
        if (t >= n || row >= rows) continue;
        const float v = total(mr, t);
        out[(long long)t * rows + row] = bias != nullptr ? __fadd_rn(v, __ldg(bias + row)) : v;
      }
    } else if (pair_live) {
      rope_pair_store(total(m0, pair_t), total(m1, pair_t), pair_in, pair_t, out, bias != nullptr, rows, row_of(m0),
                      row_of(m1), role, rope);
    }
  }
};

// (segment, tile) of matvec_mma's block b: the segments' tiles one after another.
__device__ __forceinline__ int2 segment_tile(const Segments& seg, int b) {
  const int t0 = (seg.rows[0] + 15) / 16, t1 = t0 + (seg.rows[1] + 15) / 16;
  const int s = (b >= t0) + (b >= t1);
  return make_int2(s, b - (s == 0 ? 0 : s == 1 ? t0 : t1));
}

}  // namespace mv

// The tile of 16 rows at (segment s, tile) in format F; STAGE: the bytes of a ring stage (the launch's largest).
template <class F, int N, int W, int STAGES, bool ROPE, int STAGE>
__device__ __forceinline__ void mma_tile(const mv::Segments& seg, const int8_t* __restrict__ xq,
                                         const ActScale* __restrict__ xs, int n, int cols, long long row_bytes,
                                         const mv::Rope& rope, int deferred, float norm_eps, int s, int tile,
                                         mv::Parts<W, N>& part) {
  using Work = mv::TileWork<F, N, W, STAGES, ROPE, STAGE>;
  extern __shared__ uint4 dyn[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, j = lane & 3;
  uint8_t* rings = reinterpret_cast<uint8_t*>(dyn);
  TRACE_BEGIN();
  const Work work(seg, rope, cols, row_bytes, s, tile, warp, lane);
  work.first_copies(rings, row_bytes, warp, lane);
  pdl_enter();
  TRACE_MARK(1);

  int8_t* sx = reinterpret_cast<int8_t*>(dyn) + W * STAGES * STAGE;
  __shared__ float inv_rms[N];  // a deferred norm's factor per token (mma_activation)
  const mv::MmaAct<Work::TILES> x = mv::mma_activation<F, N, Work::TILES, Work::TPT, 32 * W>(
      sx, xq, xs, n, cols, g, j, deferred, norm_eps, inv_rms);
  TRACE_MARK(3);
  work.rest(seg, x, n, cols, row_bytes, rope, deferred, inv_rms, s, rings, part, mv::whole_block());
  TRACE_END(ROPE ? TRACE_MATVEC_ROPE : TRACE_MATVEC);
}

// T: Q4_K or Q6_K; T2: segment 2's format where it differs (a q/k/v launch whose v is stored in the other type:
// Q4_K_M's Q6_K layers of v). grid: the segments' tiles of 16 rows one after another (a neox-rotated segment:
// head_dim / 16 tiles a head), block: 32 * W; dynamic shared memory: W * STAGES * 16 * (the larger F::ROW) bytes,
// plus 5 n cols / 2 for N <= 2 (the staged activation; n cols / 8 more for a deferred norm's sums).
// Launch bounds: below 3 tokens at 4 warps, 4 blocks an SM (at most 128 registers, which the rings' shared memory
// allows anyway): left to itself ptxas held some of them to 80 and spilled in the loop (up to 44 bytes); elsewhere
// its own choice (a minimum of 0: none given), which a bound of 4 or 3 blocks made spill hundreds of bytes at 8 warps
// or 8 and 16 tokens.
template <int T, int N, int W, int STAGES, bool ROPE = false, int T2 = T>
__global__ void __launch_bounds__(32 * W, N <= 2 && W == 4 ? 4 : 0)
    matvec_mma(const __grid_constant__ mv::Segments seg, const int8_t* __restrict__ xq, const ActScale* __restrict__ xs,
               int n, int cols, long long row_bytes, const __grid_constant__ mv::Rope rope, int deferred,
               float norm_eps) {
  static_assert((T == GGML_Q4_K || T == GGML_Q6_K) && (T2 == GGML_Q4_K || T2 == GGML_Q6_K), "Q4_K or Q6_K");
  static_assert(N == 1 || N == 2 || N % 4 == 0, "token buckets 1, 2, 4, 8, 16");
  static_assert(STAGES >= 2 && (!ROPE || N <= 2), "a ring; the ROPE epilogue for one or two tokens");
  using F = mv::MmaFormat<T>;
  using F2 = mv::MmaFormat<T2>;
  constexpr int STAGE = 16 * (F::ROW > F2::ROW ? F::ROW : F2::ROW);
  __shared__ mv::Parts<W, N> part;  // each warp's sums
  const int2 st = mv::segment_tile(seg, blockIdx.x);
  if constexpr (T2 != T) {
    if (st.x == 2) {  // its rows are those of its own type (GGUF rows, or tiled)
      const long long row_bytes2 = (long long)(cols / 256) * (seg.tiled[2] ? F2::SLOT : F2::SB_BYTES);
      mma_tile<F2, N, W, STAGES, ROPE, STAGE>(seg, xq, xs, n, cols, row_bytes2, rope, deferred, norm_eps, st.x, st.y,
                                              part);
      return;
    }
  }
  mma_tile<F, N, W, STAGES, ROPE, STAGE>(seg, xq, xs, n, cols, row_bytes, rope, deferred, norm_eps, st.x, st.y, part);
}

// matvec_mma_glu<T>: a decode step's gate and up projections (segments 0 and 1, the same type, width and rows) and
// SwiGLU after them, out = silu(gate) * up (+ biases first), also written in the down projection's activation format
// (yq, ys; act_quant.cuh), so that no SwiGLU kernel runs between the two mat-vecs: that kernel and its place in the
// chain cost ~2.6 us a layer of llama-3.1-8b's batch-1 step on the H200 (scripts/ab_skip_ops.py).
//
// Blocks. A block computes 4 tiles: tile q's m-rows 0-7 are gate rows base + 8 q + i, 8-15 the up rows base + 8 q +
// i, base = 32 blockIdx.x. So a block's 32 outputs are one group of the activation format, which it quantizes itself;
// and gate + up of an 8B model (448 blocks at 2 stages, 4 blocks an SM) run in one wave, where matvec_mma's tiles of
// 16 rows over 4 warps took 3.4: the 8B's step on the H200 2,447 -> 2,287 us against linears + swiglu (3 stages, two
// waves: 2,500). Warp w streams pairs w, w + 4, ... of tile 0, then of tile 1, ... through its ring, so that the
// block's warps read neighbouring pieces of the same rows at a time: with each warp walking its own tile's whole rows
// (pieces 2.3 KB apart in each row at a time) the step took 53.1 us longer (8 alternations, every pair).
// Rows: gate and up each matvec_mma's (unit_value.cuh's definition: the warps' spans in fixed point, bias last). Then
// SwiGLU as the swiglu kernel computes it, and the same quantization.
// grid rows / 32, block 128, dynamic shared memory 4 * STAGES * 16 F::ROW + 5 n cols / 2 (+ n cols / 8
// for a deferred norm's sums); rows % 32 == 0.
namespace mv {

template <class F, int N, int STAGES>
struct GluWork {
  static constexpr int W = 4, STAGE = 16 * F::ROW, TILES = 1, TPT = N;
  int count, items;   // a tile's pairs for this warp (w, w + 4, ...), and all four tiles' (items)
  MmaCopy<F> copy;
  // From a tile's rows to the next tile's (8 rows on; in the tiled layout the next group's, 8 row_bytes on as well).
  __device__ static long long tile_bytes(long long row_bytes) { return 8 * row_bytes; }

  __device__ __forceinline__ GluWork(const Segments& seg, int cols, long long row_bytes, int block, int warp,
                                     int lane)
      : copy(seg.weight[0], seg.weight[1], 32 * block, 32 * block, seg.rows[0], row_bytes, lane, seg.tiled[0]) {
    const int pairs = (cols / 256 + 1) / 2;
    count = (pairs - warp + W - 1) / W;
    items = 4 * count;
  }

  // Item i: pair warp + W (i % count) of tile i / count (the tile's rows 8 row_bytes on), issued in order.
  struct Issuer {
    int k = 0;
    long long shift = 0;
    __device__ __forceinline__ void issue(const GluWork& w, uint8_t* ring, int item, long long row_bytes, int warp,
                                          int lane) {
      w.copy.issue(ring + item % STAGES * STAGE, warp + W * k, row_bytes, lane, shift);
      if (++k == w.count) {
        k = 0;
        shift += tile_bytes(row_bytes);
      }
    }
  };

  __device__ __forceinline__ void first_copies(uint8_t* rings, long long row_bytes, int warp, int lane) const {
    Issuer next;
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
      if (i < items) next.issue(*this, rings + warp * STAGES * STAGE, i, row_bytes, warp, lane);
      tc::cp_async_commit();
    }
  }

  __device__ __forceinline__ void rest(const Segments& seg, const MmaAct<TILES>& x, int n, int cols,
                                       long long row_bytes, int8_t* __restrict__ yq, ActScale* __restrict__ ys,
                                       int deferred, const float* inv_rms, int block, uint8_t* rings,
                                       Parts<W, N> (&part)[4], const Group& gr) const {
    const int lane = gr.tid & 31, warp = gr.tid >> 5, g = lane >> 2, j = lane & 3;
    const int rows = seg.rows[0], nsb = cols / 256;
    uint8_t* ring = rings + warp * STAGES * STAGE;
    Issuer next;  // where first_copies left off
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i)
      if (i < items && ++next.k == count) {
        next.k = 0;
        next.shift += tile_bytes(row_bytes);
      }
    constexpr int RH = Own<TPT>::RH;
    fx::Sum acc[TILES][RH];
    auto keep = [&](int q) { put_sums<TILES, TPT>(part[q], acc, warp, g, j); };  // this warp's sums of tile q
#pragma unroll
    for (int h = 0; h < RH; ++h) acc[0][h] = fx::zero();
    if (count == 0)  // fewer pairs than warps: this one adds zeros
      for (int q = 0; q < 4; ++q) keep(q);
    for (int item = 0, q = 0, k = 0; item < items; ++item) {
      tc::cp_async_wait<STAGES - 2>();
      __syncwarp();  // item has landed for every lane, and every lane is done with the stage refilled next
      if (item + STAGES - 1 < items) next.issue(*this, ring, item + STAGES - 1, row_bytes, warp, lane);
      tc::cp_async_commit();
      F::template pair<TILES, TPT>(acc, x, ring + item % STAGES * STAGE, warp + W * k, nsb, g, j, copy.tiled());
      if (++k == count) {
        keep(q++);
        k = 0;
#pragma unroll
        for (int h = 0; h < RH; ++h) acc[0][h] = fx::zero();
      }
    }
    gr.sync();
    TRACE_MARK(4);

    // Warp t: token t's 32 outputs, lane l the row 32 block + l (tile l / 8's m-rows l % 8 and l % 8 + 8).
    if (warp < n) {
      const int t = warp, q = lane >> 3, i = lane & 7, row = 32 * block + lane;
      float gate = part[q].total(t, i), up = part[q].total(t, i + 8);
      if (deferred) {
        gate = __fmul_rn(gate, inv_rms[t]);
        up = __fmul_rn(up, inv_rms[t]);
      }
      if (seg.bias[0] != nullptr) gate = __fadd_rn(gate, __ldg(seg.bias[0] + row));
      if (seg.bias[1] != nullptr) up = __fadd_rn(up, __ldg(seg.bias[1] + row));
      const float h = gate / (1.0f + expf(-gate)) * up;
      seg.out[0][(long long)t * rows + row] = h;
      const float v[1] = {h};
      aq::quantize_store<1>(v, true, yq, ys, n, rows, t, row);
    }
  }
};

}  // namespace mv

// 4 blocks an SM (matvec_mma's launch bounds): ptxas' own choice spilled 16 bytes at two tokens.
template <int T, int N, int STAGES>
__global__ void __launch_bounds__(128, 4) matvec_mma_glu(const __grid_constant__ mv::Segments seg,
                                                        const int8_t* __restrict__ xq, const ActScale* __restrict__ xs,
                                                        int n, int cols, long long row_bytes, int8_t* __restrict__ yq,
                                                        ActScale* __restrict__ ys, int deferred, float norm_eps) {
  static_assert(T == GGML_Q4_K || T == GGML_Q6_K, "Q4_K or Q6_K");
  static_assert(N == 1 || N == 2, "a decode step of one or two tokens (the activation staged in shared memory)");
  using F = mv::MmaFormat<T>;
  using Work = mv::GluWork<F, N, STAGES>;
  __shared__ mv::Parts<Work::W, N> part[4];  // per tile, each warp's sums
  extern __shared__ uint4 dyn[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, j = lane & 3;
  uint8_t* rings = reinterpret_cast<uint8_t*>(dyn);
  TRACE_BEGIN();
  const Work work(seg, cols, row_bytes, blockIdx.x, warp, lane);
  work.first_copies(rings, row_bytes, warp, lane);
  pdl_enter();  // the weights are immutable: their first copies above overlap the previous kernel's tail
  TRACE_MARK(1);

  int8_t* sx = reinterpret_cast<int8_t*>(dyn) + Work::W * STAGES * Work::STAGE;
  __shared__ float inv_rms[N];  // a deferred norm's factor per token (mma_activation)
  const mv::MmaAct<Work::TILES> x = mv::mma_activation<F, N, Work::TILES, Work::TPT, 32 * Work::W>(
      sx, xq, xs, n, cols, g, j, deferred, norm_eps, inv_rms);
  TRACE_MARK(3);
  work.rest(seg, x, n, cols, row_bytes, yq, ys, deferred, inv_rms, blockIdx.x, rings, part, mv::whole_block());
  TRACE_END(TRACE_GLU);
}

// matvec_mma_norm<T>: a decode step's linear layer whose output joins the residual stream and then goes through
// RMSNorm into the next mat-vecs (the attention output projection before the FFN norm, the down projection before
// the next layer's attention norm), with add_rms_norm's work in its epilogue: residual += x W^T, written back, and
// residual * norm_weight written in the activation format (yq, ys; act_quant.cuh) with each 32-element group's sum
// of squares of the residual in norm_ss [n, rows / 32] (right after ys's scales, where the readers stage them). The
// norm's 1 / rms needs the whole row, so its readers apply it (mma_activation's inv_rms, in their epilogues). No add_rms_norm
// kernel, nor its place in the chain of dependent launches, runs between the mat-vecs: ~3.2 us a layer each of
// llama-3.1-8b's two norms on the H200 (scripts/ab_skip_ops.py).
//
// Blocks. Two tiles of 16 rows (32 rows: one activation group, which the block quantizes itself) of W warps each,
// the warps of a tile splitting its rows' superblock pairs as matvec_mma with the same W does: each row is
// unit_value.cuh's, and the residual bitwise that row plus the residual. grid rows / 32, block 64 W, dynamic shared memory
// 2 W * STAGES * 16 F::ROW + 5 n cols / 2; rows % 32 == 0.
namespace mv {

template <class F, int N, int W, int STAGES>
struct NormWork {
  static constexpr int STAGE = 16 * F::ROW, TILES = 1, TPT = N;
  int p0, count;
  MmaCopy<F> copy;

  // warp: of the block's 2 W (tile warp / W, its warp warp % W).
  __device__ __forceinline__ NormWork(const Segments& seg, int cols, long long row_bytes, int block, int warp,
                                      int lane)
      : copy(seg.weight[0], seg.weight[0], 32 * block + 16 * (warp / W), 32 * block + 16 * (warp / W) + 8,
             seg.rows[0], row_bytes, lane, seg.tiled[0]) {
    warp_pairs<W>(warp % W, cols / 256, p0, count);
  }

  __device__ __forceinline__ void first_copies(uint8_t* rings, long long row_bytes, int warp, int lane) const {
    mma_first_copies<STAGES, STAGE>(copy, rings + warp * STAGES * STAGE, p0, count, row_bytes, lane);
  }

  // Warp t < n's residual of token t (lane l: row 32 block + l), loaded before the activation is staged.
  __device__ __forceinline__ static float residual_in(const float* residual, int n, int rows, int block, int tid) {
    return tid >> 5 < n ? __ldcg(residual + (long long)(tid >> 5) * rows + 32 * block + (tid & 31)) : 0.f;
  }

  __device__ __forceinline__ void rest(const Segments& seg, const MmaAct<TILES>& x, int n, int cols,
                                       long long row_bytes, float r, float* __restrict__ residual,
                                       const float* __restrict__ norm_weight, int8_t* __restrict__ yq,
                                       ActScale* __restrict__ ys, float* __restrict__ norm_ss, int block,
                                       uint8_t* rings, Parts<W, N> (&part)[2], const Group& gr) const {
    const int lane = gr.tid & 31, warp = gr.tid >> 5, g = lane >> 2, j = lane & 3;
    const int half = warp / W, wi = warp % W, rows = seg.rows[0];
    const float weight = warp < n ? __ldg(norm_weight + 32 * block + lane) : 0.f;  // before the stream (TileWork)
    fx::Sum acc[TILES][Own<TPT>::RH];
    mma_stream<F, STAGES, STAGE, TILES, TPT>(acc, copy, rings + warp * STAGES * STAGE, p0, count, row_bytes, x,
                                             cols / 256, g, j, lane);
    put_sums<TILES, TPT>(part[half], acc, wi, g, j);
    gr.sync();
    TRACE_MARK(4);

    if (warp < n) {
      const int t = warp, h = lane >> 4, mr = lane & 15, row = 32 * block + lane;
      r = __fadd_rn(r, part[h].total(t, mr));  // matvec_mma's row
      residual[(long long)t * rows + row] = r;
      float ss = __fmul_rn(r, r);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xFFFFFFFFu, ss, o));
      if (lane == 0) norm_ss[t * (rows / 32) + block] = ss;
      const float y[1] = {__fmul_rn(r, weight)};
      aq::quantize_store<1>(y, true, yq, ys, n, rows, t, row);
    }
  }
};

}  // namespace mv

template <int T, int N, int W, int STAGES>
__global__ void __launch_bounds__(64 * W) matvec_mma_norm(const __grid_constant__ mv::Segments seg,
                                                         const int8_t* __restrict__ xq, const ActScale* __restrict__ xs,
                                                         int n, int cols, long long row_bytes,
                                                         float* __restrict__ residual,
                                                         const float* __restrict__ norm_weight,
                                                         int8_t* __restrict__ yq, ActScale* __restrict__ ys,
                                                         float* __restrict__ norm_ss) {
  static_assert(T == GGML_Q4_K || T == GGML_Q6_K, "Q4_K or Q6_K");
  static_assert(N == 1 || N == 2, "a decode step of one or two tokens (the activation staged in shared memory)");
  using F = mv::MmaFormat<T>;
  using Work = mv::NormWork<F, N, W, STAGES>;
  __shared__ mv::Parts<W, N> part[2];  // per tile, each warp's sums
  extern __shared__ uint4 dyn[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, j = lane & 3;
  uint8_t* rings = reinterpret_cast<uint8_t*>(dyn);
  TRACE_BEGIN();
  const Work work(seg, cols, row_bytes, blockIdx.x, warp, lane);
  work.first_copies(rings, row_bytes, warp, lane);
  pdl_enter();
  TRACE_MARK(1);

  const float r = Work::residual_in(residual, n, seg.rows[0], blockIdx.x, threadIdx.x);  // used at the end
  int8_t* sx = reinterpret_cast<int8_t*>(dyn) + 2 * W * STAGES * Work::STAGE;
  const mv::MmaAct<Work::TILES> x =
      mv::mma_activation<F, N, Work::TILES, Work::TPT, 64 * W>(sx, xq, xs, n, cols, g, j, 0, 0.f, nullptr);
  TRACE_MARK(3);
  work.rest(seg, x, n, cols, row_bytes, r, residual, norm_weight, yq, ys, norm_ss, blockIdx.x, rings, part,
            mv::whole_block());
  TRACE_END(TRACE_NORM);
}
