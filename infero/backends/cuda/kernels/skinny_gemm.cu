// Skinny GEMM for batches of a few tokens (decode steps of many sequences): out[n, rows] = x[n, cols] @
// dequant(W)[rows, cols]^T (+ bias), n <= 64, W in its GGUF encoding: Q4_K, Q6_K (256-column superblocks) or Q8_0
// (superblocks of 4 blocks, 128 columns).
//
// Why not the GEMM of gemm.cu: at 3-64 tokens a weight byte feeds so few MMAs that the kernel must stream weights
// like a mat-vec, and gemm.cu's blocks (weights copied to shared memory, dequantized to a shared fp16 tile, a
// barrier per 64-k slice) ran at 200-370 GB/s there. Here each warp loads its own rows' blocks straight from global
// memory into registers (16-byte loads that skip L1; the next superblock's in flight while this one is multiplied)
// and dequantizes them in registers to the fp16 A fragments of mma.sync.m16n8k16; the activations (B), the same
// for every warp of a block, are copied per superblock into shared memory (cp.async, double buffered, two
// barriers per superblock) in a layout made for them.
//
// The k permutation. An MMA sums over its 16 k slots; which weight column sits in which slot is free as long as A
// and B agree. Lane (g = lane / 4, c = lane % 4) holds A's slots {2c, 2c+1, 2c+8, 2c+9} of rows g and g + 8, and
// B's same slots of token g; so each lane c owns a fixed quarter of every superblock's columns (Fmt<T>::column),
// chosen so its weight bytes are contiguous, and consumes them as WORDS words of 8 columns: a word's low halves (4
// columns) in one MMA, its high halves in the next. skinny_x_to_f16 writes x in exactly that order,
// [sb][word][tile][lane][8] fp16 (a word of the 4 lanes is 32 columns whatever the format), so a lane's B operands
// for both MMAs of a word are one 16-byte shared-memory load, and the 32 lanes' loads are 512 contiguous bytes (no
// bank conflict).
//
// Dequantization in fp16 registers: quants are OR-ed (nibbles) or byte-permuted (Q8_0's q + 128) into the mantissa
// of a magic fp16 (1024 + q, or 64 + q for high nibbles, which sit 4 bits up), the magic is subtracted exactly, and
// one fma.f16x2 / mul.f16x2 applies the sub-block's scale and min (fp16: d * sc and dmin * m rounded once, as
// gemm.cu rounds each dequantized weight).
//
// Blocks and split-k. A block is 8 warps x ROWS_PER_WARP rows (Q4_K, Q8_0 32, Q6_K 16) x all tokens (NT = 8 NI, n
// rounded up: the weights are read once). Where rows / block rows would leave SMs idle, the superblocks are split
// into SPLITS contiguous ranges (the launcher picks SPLITS from rows and cols only): each block writes its fp32
// partial sums to `part`, and skinny_reduce adds the SPLITS partials in split order and the bias, one thread an
// output over the whole GPU. (A first version let the last block of a row tile do that sum alone: at 32 tokens
// and 8 splits its 65k dependent loads took ~30 us, more than the multiplication.)
//
// Reduction order (batch invariance). Each output is one fp32 accumulator per split, updated by one MMA per word
// half in increasing k, then the splits summed in order, then bias: nothing depends on n, NI or the token's
// position, so a row's result is bitwise the same for every batch that runs this kernel
// (tests/cuda/test_skinny_gemm.py).
//
// Rows past `rows` reload the last row and are not stored; tokens past n are zero columns of x and not stored.
// Q4_K and Q6_K weights may be stored in quant.cuh's tiled layout instead of GGUF rows (tiled: the launcher says
// which; a tiled Q6_K superblock starts 0 or 8 bytes into a 16-byte chunk, so its fetch stays inside its pair).
//
// Speed on the H200 (scripts/bench_skinny.py, llama-3.1-8b shapes): Q4_K 14336 x 4096 21.5 us at 1-8 tokens, 30
// us at 32 (1.1-1.5 TB/s of weights), vs 47 / 90 us before (batched mat-vec / gemm.cu); flat in n up to ~16:
// bound by bytes in flight (one superblock per warp ahead, 8 warps an SM at ~230 registers), not by the MMAs.

#include "pdl.cuh"
#include "quant.cuh"
#include "skinny_layout.cuh"
#include "tensor_core.cuh"

namespace sk {

constexpr int WARPS = 8;

__device__ __forceinline__ uint4 ld_stream(const void* p) {  // weights: read once, past L1
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

template <int LUT>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return r;
}
constexpr int AND_OR = (0xF0 & 0xCC) | 0xAA;  // (a & b) | c

__device__ __forceinline__ uint32_t hsub2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t half2_of(float v) {  // (v, v) in fp16, rounded to nearest, saturating
  uint32_t r;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(v));
  return r;
}
__device__ __forceinline__ float f16_lo(uint32_t w) {
  return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFFu)));
}
__device__ __forceinline__ float f16_hi(uint32_t w) {
  return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}

// Magic fp16 pairs: 1024 + q for a nibble in bits 0-3 of each half, 64 + q for one in bits 4-7 (or, Q6_K, a 6-bit
// q in bits 4-9), and the values to subtract (Q6_K: also its -32 offset).
constexpr uint32_t MAGIC_LO = 0x64006400u, MAGIC_HI = 0x54005400u;
constexpr uint32_t Q6_LO = 0x64206420u /* 1056 */, Q6_HI = 0x56005600u /* 96 */;

// OUT little-endian words starting at byte o (even, at most MAX_O) of the IN words v, v holding aligned chunks
// around a 2-byte-aligned run: a barrel rotation by 4, 2 and 1 words (selects on o's bits, no local memory), then
// by 2 bytes.
template <int OUT, int IN, int MAX_O>
__device__ __forceinline__ void words_at(uint32_t (&out)[OUT], const uint32_t (&v)[IN], int o) {
  static_assert(MAX_O + 4 * OUT <= 4 * IN && OUT < IN, "the run lies inside v");
  uint32_t a[IN], b[IN], c[IN];
#pragma unroll
  for (int k = 0; k < IN; ++k) a[k] = (MAX_O >= 16 && (o & 16)) ? v[k + 4 < IN ? k + 4 : IN - 1] : v[k];
#pragma unroll
  for (int k = 0; k < IN; ++k) b[k] = (o & 8) ? a[k + 2 < IN ? k + 2 : IN - 1] : a[k];
#pragma unroll
  for (int k = 0; k < IN; ++k) c[k] = (o & 4) ? b[k + 1 < IN ? k + 1 : IN - 1] : b[k];
  const uint32_t sel = (o & 2) ? 0x5432u : 0x3210u;
#pragma unroll
  for (int k = 0; k < OUT; ++k) out[k] = __byte_perm(c[k], c[k + 1], sel);
}

template <int T>
struct Fmt;

// Q4_K: lane c owns qs bytes [32c, 32c + 32) of each block: word i's low nibbles are columns 64c + 4i + p, its high
// nibbles 64c + 32 + 4i + p (p = byte 0..3), sub-blocks 2c and 2c + 1.
template <>
struct Fmt<GGML_Q4_K> {
  static constexpr int SB = 256, WORDS = SB / 32, BYTES = 144, ROWS_PER_WARP = 32;
  struct Raw { uint32_t h[4], q[8]; };
  using Bits = Raw;  // the words decode straight from the loaded bytes
  struct Scale { uint32_t s_lo, m_lo, s_hi, m_hi; };  // fp16 pairs: d * sc, -dmin * m per sub-block
  __host__ __device__ static constexpr int column(int c, int word, int high, int p) {
    return 64 * c + 32 * high + 4 * word + p;
  }
  __device__ static void fetch(Raw& r, const uint8_t* block, int c) {
    const uint4 h = ld_stream(block), a = ld_stream(block + 16 + 32 * c), b = ld_stream(block + 32 + 32 * c);
    r.h[0] = h.x; r.h[1] = h.y; r.h[2] = h.z; r.h[3] = h.w;
    r.q[0] = a.x; r.q[1] = a.y; r.q[2] = a.z; r.q[3] = a.w;
    r.q[4] = b.x; r.q[5] = b.y; r.q[6] = b.z; r.q[7] = b.w;
  }
  __device__ static void scales(Scale& s, const Raw& r, int c) {
    int sc[2], m[2];
    quant::k4_scales_mins(r.h, c, sc, m);
    const float d = f16_lo(r.h[0]), dmin = f16_hi(r.h[0]);
    s.s_lo = half2_of(d * (float)sc[0]);
    s.m_lo = half2_of(-dmin * (float)m[0]);
    s.s_hi = half2_of(d * (float)sc[1]);
    s.m_hi = half2_of(-dmin * (float)m[1]);
  }
  __device__ static void bits(Bits& b, const Raw& r) { b = r; }
  // Word i as four fp16 pairs: (p0, p2) and (p1, p3) of the low nibbles, then of the high nibbles.
  __device__ static void word(uint32_t (&a)[4], const Raw& r, const Scale& s, int i, int) {
    const uint32_t w = r.q[i], w8 = w >> 8;
    a[0] = hfma2(hsub2(lop3<AND_OR>(w, 0x000F000Fu, MAGIC_LO), MAGIC_LO), s.s_lo, s.m_lo);
    a[1] = hfma2(hsub2(lop3<AND_OR>(w8, 0x000F000Fu, MAGIC_LO), MAGIC_LO), s.s_lo, s.m_lo);
    a[2] = hfma2(hsub2(lop3<AND_OR>(w, 0x00F000F0u, MAGIC_HI), MAGIC_HI), s.s_hi, s.m_hi);
    a[3] = hfma2(hsub2(lop3<AND_OR>(w8, 0x00F000F0u, MAGIC_HI), MAGIC_HI), s.s_hi, s.m_hi);
  }
};

// Q6_K: lane c owns ql bytes [64h + 16c, +16) and qh bytes [32h + 16 (c % 2), +16) of each half h: word i (h = i / 4,
// j = i % 4) holds columns 128h + 16c + 4j + p (low nibbles, sub-block 8h + c) and 128h + 64 + 16c + 4j + p (high
// nibbles, sub-block 8h + 4 + c); their top 2 bits are qh's bits 2 (c / 2) and 2 (c / 2) + 4. Blocks (210 bytes) are
// only 2-byte aligned: each 16-byte run is two aligned 16-byte loads, shifted into place in registers. The chunk
// holding d may reach up to 14 bytes past the block, never past the 16-byte chunk of its last byte (so never
// outside the tensor's 256-byte-aligned allocation).
template <>
struct Fmt<GGML_Q6_K> {
  static constexpr int SB = 256, WORDS = SB / 32, BYTES = 210, ROWS_PER_WARP = 16;
  struct Raw { uint4 ql[2][2], qh[2][2], sd[2]; int off; };
  struct Scale { uint32_t s[4]; };  // fp16 pairs d * sc for sub-blocks c, 4 + c, 8 + c, 12 + c
  struct Bits { uint32_t ql[8], qh[8]; };
  __host__ __device__ static constexpr int column(int c, int word, int high, int p) {
    return 128 * (word / 4) + 64 * high + 16 * c + 4 * (word % 4) + p;
  }
  __device__ static void fetch(Raw& r, const uint8_t* block, int c) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(block);
    const uint8_t* base = reinterpret_cast<const uint8_t*>(a & ~15ull);
    r.off = (int)(a & 15);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      r.ql[h][0] = ld_stream(base + 64 * h + 16 * c);
      r.ql[h][1] = ld_stream(base + 64 * h + 16 * c + 16);
      r.qh[h][0] = ld_stream(base + 128 + 32 * h + 16 * (c & 1));
      r.qh[h][1] = ld_stream(base + 128 + 32 * h + 16 * (c & 1) + 16);
    }
    r.sd[0] = ld_stream(base + 192);
    r.sd[1] = ld_stream(base + 208);  // the chunk holding d (bytes 208-209 of the block), inside the tensor
  }
  // The 4 words at byte `off` (even, <= 14) of the 32 bytes lo, hi.
  __device__ static void align(uint32_t (&out)[4], const uint4& lo, const uint4& hi, int off) {
    const uint32_t v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    words_at<4, 8, 14>(out, v, off);
  }
  __device__ static void bits(Bits& b, const Raw& r) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t q[4], e[4];
      align(q, r.ql[h][0], r.ql[h][1], r.off);
      align(e, r.qh[h][0], r.qh[h][1], r.off);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        b.ql[4 * h + k] = q[k];
        b.qh[4 * h + k] = e[k];
      }
    }
  }
  __device__ static void scales(Scale& s, const Raw& r, int c) {
    uint32_t sd[4];
    align(sd, r.sd[0], r.sd[1], r.off);  // the 16 scale bytes
    const uint4 hi = r.sd[1];  // d: block bytes 208-209, at byte `off` of the chunk loaded from base + 208
    const int o = r.off;
    const uint32_t dword = (o & 8) ? ((o & 4) ? hi.w : hi.z) : ((o & 4) ? hi.y : hi.x);
    const float d = (o & 2) ? f16_hi(dword) : f16_lo(dword);
#pragma unroll
    for (int k = 0; k < 4; ++k) s.s[k] = half2_of(d * (float)quant::byte_s8(sd[k], c));
  }
  __device__ static void word(uint32_t (&a)[4], const Bits& b, const Scale& s, int i, int c) {
    const int shift = 2 * (c >> 1);
    const uint32_t ql = b.ql[i], qh = b.qh[i], ql8 = ql >> 8;
    const uint32_t t = qh << (4 - shift), t8 = qh >> (4 + shift);  // the 2 top bits at 4-5 (low) / 8-9 (high)
    const uint32_t s_lo = s.s[2 * (i >> 2)], s_hi = s.s[2 * (i >> 2) + 1];
    a[0] = hmul2(hsub2(lop3<AND_OR>(ql, 0x000F000Fu, lop3<AND_OR>(t, 0x00300030u, MAGIC_LO)), Q6_LO), s_lo);
    a[1] = hmul2(hsub2(lop3<AND_OR>(ql8, 0x000F000Fu, lop3<AND_OR>(t8, 0x00300030u, MAGIC_LO)), Q6_LO), s_lo);
    a[2] = hmul2(hsub2(lop3<AND_OR>(ql, 0x00F000F0u, lop3<AND_OR>(t, 0x03000300u, MAGIC_HI)), Q6_HI), s_hi);
    a[3] = hmul2(hsub2(lop3<AND_OR>(ql8, 0x00F000F0u, lop3<AND_OR>(t8, 0x03000300u, MAGIC_HI)), Q6_HI), s_hi);
  }
};


// Q8_0: superblocks of 128 columns (4 blocks of 34 bytes); lane c owns block c: word i's low half is columns
// 32c + 8i + p, its high half 32c + 8i + 4 + p. Blocks are only 2-byte aligned: a lane loads the three aligned
// 16-byte chunks holding its 34 bytes (each holds some of them) and shifts d and the 32 quants into place.
// int8 -> fp16: q + 128 OR-ed into the magic 1024, minus 1152, times d.
template <>
struct Fmt<GGML_Q8_0> {
  static constexpr int SB = 128, WORDS = SB / 32, BYTES = 4 * 34, ROWS_PER_WARP = 32;
  struct Raw { uint32_t v[12]; int off; };
  struct Scale { uint32_t d; };
  struct Bits { uint32_t q[8]; };
  __host__ __device__ static constexpr int column(int c, int word, int high, int p) {
    return 32 * c + 8 * word + 4 * high + p;
  }
  __device__ static void fetch(Raw& r, const uint8_t* superblock, int c) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(superblock + 34 * c);
    const uint8_t* base = reinterpret_cast<const uint8_t*>(a & ~15ull);
    r.off = (int)(a & 15);
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const uint4 v = ld_stream(base + 16 * k);
      r.v[4 * k] = v.x; r.v[4 * k + 1] = v.y; r.v[4 * k + 2] = v.z; r.v[4 * k + 3] = v.w;
    }
  }
  // The 32 quants start at byte off + 2 (even, 2..16) of the 48 loaded.
  __device__ static void bits(Bits& b, const Raw& r) { words_at<8, 12, 16>(b.q, r.v, r.off + 2); }
  __device__ static void scales(Scale& s, const Raw& r, int) {
    const int o = r.off;  // d: bytes o, o + 1 of the loaded 48 (o even, <= 14)
    const uint32_t dword = (o & 8) ? ((o & 4) ? r.v[3] : r.v[2]) : ((o & 4) ? r.v[1] : r.v[0]);
    s.d = half2_of((o & 2) ? f16_hi(dword) : f16_lo(dword));
  }
  __device__ static void word(uint32_t (&a)[4], const Bits& b, const Scale& s, int i, int) {
    const uint32_t lo = b.q[2 * i] ^ 0x80808080u, hi = b.q[2 * i + 1] ^ 0x80808080u;
    constexpr uint32_t MAGIC = 0x64646464u, OFFSET = 0x64806480u;  // 1024 in the high bytes; 1152
    a[0] = hmul2(hsub2(__byte_perm(lo, MAGIC, 0x4240u), OFFSET), s.d);
    a[1] = hmul2(hsub2(__byte_perm(lo, MAGIC, 0x4341u), OFFSET), s.d);
    a[2] = hmul2(hsub2(__byte_perm(hi, MAGIC, 0x4240u), OFFSET), s.d);
    a[3] = hmul2(hsub2(__byte_perm(hi, MAGIC, 0x4341u), OFFSET), s.d);
  }
};

}  // namespace sk

// x float32 [n, cols] -> xa fp16 in Fmt<T>'s column order, 16 bytes per (superblock, word, token tile, lane):
// slot ((sb * WORDS + word) * tiles + tile) * 32 + lane holds token 8 tile + lane / 4's columns (p0, p2, p1, p3) of the
// word's low half, then of its high half, for c = lane % 4. Tokens in [n, 8 tiles) are zeros. One thread a slot.
// UP: x holds SwiGLU's gate and `up` its up projection, and the slot holds silu(gate) * up (elementwise.cu's swiglu
// expression): the expert kernels' down input in one launch, not swiglu's then this one's.
template <int T, bool UP>
__device__ __forceinline__ void to_f16(uint4* __restrict__ xa, const float* __restrict__ x,
                                       const float* __restrict__ up, int n, int cols, int tiles,
                                       float* __restrict__ out = nullptr) {
  using F = sk::Fmt<T>;
  pdl_enter();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)(cols / 32) * tiles * 32) return;
  const int lane = (int)(i & 31);
  const long long rest = i >> 5;
  const int tile = (int)(rest % tiles), word = (int)((rest / tiles) % F::WORDS);
  const long long sb = rest / tiles / F::WORDS;
  const int token = tile * 8 + (lane >> 2), c = lane & 3;
  uint4 o = make_uint4(0, 0, 0, 0);
  if (token < n) {
    const long long at = (long long)token * cols + sb * F::SB;
    float4 lo = *reinterpret_cast<const float4*>(x + at + F::column(c, word, 0, 0));
    float4 hi = *reinterpret_cast<const float4*>(x + at + F::column(c, word, 1, 0));
    if (UP) {
      const float4 ulo = *reinterpret_cast<const float4*>(up + at + F::column(c, word, 0, 0));
      const float4 uhi = *reinterpret_cast<const float4*>(up + at + F::column(c, word, 1, 0));
      auto glu = [](float g, float u) { return g / (1.0f + expf(-g)) * u; };
      lo = make_float4(glu(lo.x, ulo.x), glu(lo.y, ulo.y), glu(lo.z, ulo.z), glu(lo.w, ulo.w));
      hi = make_float4(glu(hi.x, uhi.x), glu(hi.y, uhi.y), glu(hi.z, uhi.z), glu(hi.w, uhi.w));
      if (out != nullptr) {  // the float SwiGLU output too, for readers of another kind
        *reinterpret_cast<float4*>(out + at + F::column(c, word, 0, 0)) = lo;
        *reinterpret_cast<float4*>(out + at + F::column(c, word, 1, 0)) = hi;
      }
    }
    o.x = tc::pack_half2_sat(lo.x, lo.z);
    o.y = tc::pack_half2_sat(lo.y, lo.w);
    o.z = tc::pack_half2_sat(hi.x, hi.z);
    o.w = tc::pack_half2_sat(hi.y, hi.w);
  }
  xa[i] = o;
}

template <int T>
__global__ void skinny_x_to_f16(uint4* __restrict__ xa, const float* __restrict__ x, int n, int cols, int tiles) {
  to_f16<T, false>(xa, x, nullptr, n, cols, tiles);
}

// xa = skinny_x_to_f16's layout of silu(gate) * up (gate, up float32 [n, cols]); out (or null): the same float32.
template <int T>
__global__ void skinny_swiglu_to_f16(uint4* __restrict__ xa, const float* __restrict__ gate,
                                     const float* __restrict__ up, int n, int cols, int tiles,
                                     float* __restrict__ out) {
  to_f16<T, true>(xa, gate, up, n, cols, tiles, out);
}

// grid row_tiles * splits blocks (1-D; the row tiles of one split consecutive, so blocks in flight read the same
// activations; splits <= cols / SB, so every split holds a superblock), 256 threads, dynamic shared memory
// 2 * WORDS * NI * 512 bytes. xa: skinny_x_to_f16's layout with NI tiles. splits == 1: out = x W^T + bias.
// splits > 1: part[split] (float32 [splits, n, rows]) = this split's sum, for skinny_reduce to add up.
template <int T, int NI>
__global__ void __launch_bounds__(sk::WARPS * 32)
    skinny_gemm(float* __restrict__ out, float* __restrict__ part, const uint8_t* __restrict__ weight,
                const uint4* __restrict__ xa, const float* __restrict__ bias, int n, int rows, int cols,
                int row_bytes, int splits, int tiled) {
  using namespace sk;
  using F = Fmt<T>;
  constexpr int RW = F::ROWS_PER_WARP, MI = RW / 16, RPL = 2 * MI, BLOCK_ROWS = WARPS * RW;
  constexpr int X_SLOTS = F::WORDS * NI * 32;  // 16-byte activation slots per superblock
  extern __shared__ uint4 x_tiles[];    // [2][X_SLOTS]: superblock sb's activations in buffer (sb - sb0) % 2
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int row_tiles = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
  const int tile = blockIdx.x % row_tiles, split = blockIdx.x / row_tiles;
  const int sbs = cols / F::SB;
  const int sb0 = (int)((long long)split * sbs / splits), sb1 = (int)((long long)(split + 1) * sbs / splits);
  const int row0 = tile * BLOCK_ROWS + warp * RW;

  // Lane rows: g, g + 8 (MMA tile 0), g + 16, g + 24 (tile 1) of the warp's rows; rowp: superblock 0 of each.
  constexpr int TILED_T = T == GGML_Q6_K ? GGML_Q6_K : GGML_Q4_K;  // the tiled layout's type (Q8_0 is never tiled)
  const bool tiled_k = T != GGML_Q8_0 && tiled;
  const uint8_t* rowp[RPL];
#pragma unroll
  for (int r = 0; r < RPL; ++r) {
    const int row = min(row0 + 8 * r + g, rows - 1);
    rowp[r] = weight + (tiled_k ? tiled_offset<TILED_T>(row, 0, row_bytes) : (long long)row * row_bytes);
  }

  typename F::Raw raw[2][RPL];
  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][j][e] = 0.f;

  auto fetch = [&](typename F::Raw (&rw)[RPL], int sb) {
    const long long at = tiled_k ? tiled_offset<TILED_T>(0, sb, row_bytes) : (long long)sb * F::BYTES;
#pragma unroll
    for (int r = 0; r < RPL; ++r) F::fetch(rw[r], rowp[r] + at, c);
  };
  auto load_x = [&](int sb, int buf) {
    const uint4* src = xa + (long long)sb * X_SLOTS;
    uint4* dst = x_tiles + buf * X_SLOTS;
#pragma unroll
    for (int k = threadIdx.x; k < X_SLOTS; k += WARPS * 32) tc::cp_async<16>(dst + k, src + k);
    tc::cp_async_commit();
  };
  auto compute = [&](const typename F::Raw (&rw)[RPL], const uint4* xs) {
    typename F::Scale s[RPL];
    typename F::Bits bits[RPL];
#pragma unroll
    for (int r = 0; r < RPL; ++r) {
      F::scales(s[r], rw[r], c);
      F::bits(bits[r], rw[r]);
    }
#pragma unroll
    for (int i = 0; i < F::WORDS; ++i) {
      uint4 b[NI];
#pragma unroll
      for (int j = 0; j < NI; ++j) b[j] = xs[(i * NI + j) * 32 + lane];
      uint32_t a[RPL][4];
#pragma unroll
      for (int r = 0; r < RPL; ++r) F::word(a[r], bits[r], s[r], i, c);
      // A fragments of MMA tile mi: rows g, g + 8 at slots (2c, 2c+1), then (2c+8, 2c+9); low halves, then high.
      unsigned lo[MI][4], hi[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const unsigned (&r0)[4] = a[2 * mi], (&r1)[4] = a[2 * mi + 1];
        lo[mi][0] = r0[0]; lo[mi][1] = r1[0]; lo[mi][2] = r0[1]; lo[mi][3] = r1[1];
        hi[mi][0] = r0[2]; hi[mi][1] = r1[2]; hi[mi][2] = r0[3]; hi[mi][3] = r1[3];
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int j = 0; j < NI; ++j)
          tc::mma_16816(acc[mi][j], lo[mi], b[j].x, b[j].y);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int j = 0; j < NI; ++j)
          tc::mma_16816(acc[mi][j], hi[mi], b[j].z, b[j].w);
    }
  };
  // One superblock: the next one's weights (registers) and activations (shared memory) go in flight, then this
  // one is multiplied. The first barrier: every warp is done with the buffer the copy refills; the second: this
  // superblock's copies (each thread's own, waited for) are all in.
  auto step = [&](const typename F::Raw (&cur)[RPL], typename F::Raw (&next)[RPL], int sb, int buf) {
    __syncthreads();
    if (sb + 1 < sb1) {
      fetch(next, sb + 1);
      load_x(sb + 1, buf ^ 1);
      tc::cp_async_wait<1>();
    } else {
      tc::cp_async_wait<0>();
    }
    __syncthreads();
    compute(cur, x_tiles + buf * X_SLOTS);
  };

  // Weights are immutable: the first superblock's loads start before the previous kernel has finished.
  fetch(raw[0], sb0);
  pdl_enter();
  load_x(sb0, 0);
  for (int sb = sb0; sb < sb1; sb += 2) {
    step(raw[0], raw[1], sb, 0);
    if (sb + 1 >= sb1) break;
    step(raw[1], raw[0], sb + 1, 1);
  }

  // Accumulator e of tile (mi, j): row mi * 16 + g (+ 8 for e >= 2), token 8 j + 2 c + e % 2.
  float* dst = splits == 1 ? out : part + (long long)split * n * rows;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + mi * 16 + g + (e >= 2 ? 8 : 0);
      if (row >= rows) continue;
      const float b = (splits == 1 && bias != nullptr) ? bias[row] : 0.f;
#pragma unroll
      for (int j = 0; j < NI; ++j) {
        const int token = 8 * j + 2 * c + (e & 1);
        if (token < n) dst[(long long)token * rows + row] = splits == 1 ? acc[mi][j][e] + b : acc[mi][j][e];
      }
    }
  }
}

// skinny_gemv: skinny_gemm's numbers for 1-8 tokens (one 8-token tile), streamed like a mat-vec. Its blocks stage
// x through shared memory with two barriers a superblock and hold one superblock a warp in flight at ~230
// registers, which at one token leaves it at 1.5 TB/s where the mat-vecs stream 2.3-2.6. Here every warp streams
// on its own: 16 rows (one MMA tile), a ring of RING superblocks a lane (RING - 1 in flight while one is
// multiplied), x's B fragments read straight from skinny_x_to_f16's layout (the L1 serves a block's warps; the
// padding tokens' zeros are loaded like the rest, which costs less than selecting them), no barrier until the end.
//
// Same bits as skinny_gemm (tests/cuda/test_skinny_gemm.py), by construction: a row's MMA tile holds the same 16
// rows (rows 16 t .. 16 t + 15), A and B the same fragments (Fmt<T>::word, the same x), each output's accumulator
// the same chain (from zero, one MMA a word half in increasing k over the split's superblocks), the splits the
// launcher's skinny_gemm.splits(rows, cols) and added the same way: a block holds G row tiles x S splits (a warp
// each) and sums a row's S partials in split order, then the bias, exactly as skinny_reduce does (S = 1: acc +
// bias or + 0, as skinny_gemm's own epilogue). Where S warps do not fit a block (SB < S) every warp writes its
// partial to `part` for skinny_reduce, as skinny_gemm does.
namespace sk {
template <int T> struct Gemv;
template <> struct Gemv<GGML_Q4_K> { static constexpr int RING = 3, MAX_WARPS = 16; };  // 24 registers a superblock
template <> struct Gemv<GGML_Q8_0> { static constexpr int RING = 3, MAX_WARPS = 16; };  // 26
template <> struct Gemv<GGML_Q6_K> { static constexpr int RING = 2, MAX_WARPS = 8; };   // 82: two 16-byte loads a run

__device__ __forceinline__ uint4 ld_x(const uint4* p) {  // x: every warp of the SM reads it, so through L1
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// A warp's 16-row MMA tile (its lane's rows g and g + 8 in rw) times one superblock into acc, skinny_gemm's chain:
// per word, its low halves' MMA for every 8-token tile j, then its high halves'; b_at(i, j): word i's B fragment
// of tile j (16 bytes). The gemv and expert kernels' inner loop.
template <int T, int NI, class B>
__device__ __forceinline__ void tile_superblock(float (&acc)[NI][4], const typename Fmt<T>::Raw (&rw)[2], int c,
                                                B b_at) {
  using F = Fmt<T>;
  typename F::Scale s[2];
  typename F::Bits bits[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    F::scales(s[r], rw[r], c);
    F::bits(bits[r], rw[r]);
  }
#pragma unroll
  for (int i = 0; i < F::WORDS; ++i) {
    uint4 b[NI];
#pragma unroll
    for (int j = 0; j < NI; ++j) b[j] = b_at(i, j);
    uint32_t a[2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) F::word(a[r], bits[r], s[r], i, c);
    const unsigned lo[4] = {a[0][0], a[1][0], a[0][1], a[1][1]}, hi[4] = {a[0][2], a[1][2], a[0][3], a[1][3]};
#pragma unroll
    for (int j = 0; j < NI; ++j) tc::mma_16816(acc[j], lo, b[j].x, b[j].y);
#pragma unroll
    for (int j = 0; j < NI; ++j) tc::mma_16816(acc[j], hi, b[j].z, b[j].w);
  }
}

// Superblocks [sb0, sb1) through a ring of RING register buffers: fetch(raw, sb) issues a superblock's loads,
// step(raw, sb) multiplies it, RING - 1 in flight while one is multiplied (the loop unrolled by the ring, so the
// buffers do not move); started() runs once the first ones' loads are issued (pdl_enter where the weights may be
// read before the previous kernel ends).
template <int T, int RING, class Fetch, class Step, class Started>
__device__ __forceinline__ void ring_walk(int sb0, int sb1, Fetch fetch, Step step, Started started) {
  typename Fmt<T>::Raw ring[RING][2];
#pragma unroll
  for (int k = 0; k < RING - 1; ++k)
    if (sb0 + k < sb1) fetch(ring[k], sb0 + k);
  started();
  for (int sb = sb0; sb < sb1; sb += RING) {
#pragma unroll
    for (int k = 0; k < RING; ++k) {
      if (sb + k >= sb1) break;
      if (sb + k + RING - 1 < sb1) fetch(ring[(k + RING - 1) % RING], sb + k + RING - 1);
      step(ring[k], sb + k);
    }
  }
}
}  // namespace sk

// Up to GEMV_SEGMENTS matrices of one type and width on the same x (q/k/v, gate and up), each as it would run alone:
// segment m takes blocks[m] consecutive blocks, ceil(ceil(rows / 16) / G) * (S / SB) of G * SB warps each (warp w:
// row tile G * (block % row_blocks) + w % G, split (block / row_blocks) * SB + w / G; a block's warps past G * SB of
// its segment only wait at the barrier). xa: skinny_x_to_f16's layout with one tile (n <= 8).
namespace sk {
constexpr int GEMV_SEGMENTS = 3;
struct GemvSegments {
  const uint8_t* weight[GEMV_SEGMENTS];
  float* out[GEMV_SEGMENTS];
  const float* bias[GEMV_SEGMENTS];
  float* part[GEMV_SEGMENTS];
  int rows[GEMV_SEGMENTS], row_bytes[GEMV_SEGMENTS], splits[GEMV_SEGMENTS], tiles_per_block[GEMV_SEGMENTS];
  int splits_per_block[GEMV_SEGMENTS], tiled[GEMV_SEGMENTS], blocks[GEMV_SEGMENTS];
};
template <class V>
__device__ __forceinline__ V pick3(const V (&v)[GEMV_SEGMENTS], int m) {  // selects, not a local-memory index
  return m == 0 ? v[0] : m == 1 ? v[1] : v[2];
}
}  // namespace sk

// GLU: segments 0 and 1 are gate and up of one shape and layout, a block their same row tiles (its first G * SB
// warps gate's, the rest up's, every split in the block), and the epilogue writes silu(gate) * up (elementwise.cu's
// swiglu expression on the sums skinny_reduce would form) to out[0] and, as skinny_x_to_f16 would from it, into
// glu_xa, down's fp16 input for weights of glu_type (skinny_layout.cuh); rows % 4 == 0.
template <int T, bool GLU = false>
__global__ void __launch_bounds__(sk::Gemv<T>::MAX_WARPS * 32, 1)
    skinny_gemv(const __grid_constant__ sk::GemvSegments seg, const uint4* __restrict__ xa, int n, int cols,
                uint32_t* __restrict__ glu_xa, int glu_type) {
  using namespace sk;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  int block = (int)blockIdx.x, m = 0;
  if (!GLU && block >= seg.blocks[0]) block -= seg.blocks[0], m = 1;
  if (!GLU && m == 1 && block >= seg.blocks[1]) block -= seg.blocks[1], m = 2;
  const int per = GLU ? seg.tiles_per_block[0] * seg.splits_per_block[0] : 0;
  if (GLU) m = warp >= per;  // gate's warps, then up's
  const int lw = GLU ? warp - m * per : warp;  // the warp's place among its matrix's
  const uint8_t* const weight = pick3(seg.weight, m);
  const int rows = pick3(seg.rows, m), row_bytes = pick3(seg.row_bytes, m), splits = pick3(seg.splits, m);
  const int G = pick3(seg.tiles_per_block, m), SB = pick3(seg.splits_per_block, m), tiled = pick3(seg.tiled, m);
  using F = Fmt<T>;
  constexpr int RING = Gemv<T>::RING, MAX_WARPS = Gemv<T>::MAX_WARPS;
  __shared__ float partial[MAX_WARPS][8][16];  // [warp][token][row of the tile]
  const bool working = lw < G * SB;
  const int row_tiles = (rows + 15) / 16, row_blocks = (row_tiles + G - 1) / G;
  const int tile = (block % row_blocks) * G + lw % G;
  const int split = min((block / row_blocks) * SB + lw / G, splits - 1);
  const int sbs = cols / F::SB;
  const int sb0 = (int)((long long)split * sbs / splits), sb1 = (int)((long long)(split + 1) * sbs / splits);

  constexpr int TILED_T = T == GGML_Q6_K ? GGML_Q6_K : GGML_Q4_K;
  const bool tiled_k = T != GGML_Q8_0 && tiled;
  const uint8_t* rowp[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = min(tile * 16 + 8 * r + g, rows - 1);  // a tile past the last reloads the last row
    rowp[r] = weight + (tiled_k ? tiled_offset<TILED_T>(row, 0, row_bytes) : (long long)row * row_bytes);
  }
  auto fetch = [&](typename F::Raw (&rw)[2], int sb) {
    const long long at = tiled_k ? tiled_offset<TILED_T>(0, sb, row_bytes) : (long long)sb * F::BYTES;
#pragma unroll
    for (int r = 0; r < 2; ++r) F::fetch(rw[r], rowp[r] + at, c);
  };
  float acc_tile[1][4] = {{0.f, 0.f, 0.f, 0.f}};
  float (&acc)[4] = acc_tile[0];
  auto step = [&](const typename F::Raw (&rw)[2], int sb) {
    const uint4* xs = xa + (long long)sb * F::WORDS * 32 + lane;
    tile_superblock<T, 1>(acc_tile, rw, c, [&](int i, int) { return ld_x(xs + i * 32); });
  };
  // Weights are immutable: the first superblocks' loads start before the previous kernel has finished. A spare
  // warp multiplies nothing.
  ring_walk<T, RING>(sb0, working ? sb1 : sb0, fetch, step, [] { pdl_enter(); });

  // Accumulator e: row g (+ 8 for e >= 2) of the tile, token 2 c + e % 2.
  float* const out = pick3(seg.out, m);
  const float* const bias = pick3(seg.bias, m);
  if (SB < splits) {
    if (!working) return;
    float* dst = pick3(seg.part, m) + (long long)split * n * rows;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = tile * 16 + g + (e >= 2 ? 8 : 0), token = 2 * c + (e & 1);
      if (row < rows && token < n) dst[(long long)token * rows + row] = acc[e];
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) partial[warp][2 * c + (e & 1)][g + (e >= 2 ? 8 : 0)] = acc[e];
  __syncthreads();
  if constexpr (GLU) {
    auto sum = [&](int first, int t, int token, int r) {  // skinny_gemm's epilogue, or skinny_reduce's order
      float v = partial[first + t][token][r];
      if (splits == 1) return v + 0.f;
      for (int s = 1; s < splits; ++s) v += partial[first + s * G + t][token][r];
      return v;
    };
    for (int i = threadIdx.x; i < G * n * 4; i += blockDim.x) {
      const int t = i / (n * 4), token = i / 4 % n, q = i % 4;  // four consecutive rows a thread
      const int row = ((block % row_blocks) * G + t) * 16 + 4 * q;
      if (row >= rows) continue;
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float gate = sum(0, t, token, 4 * q + j), up = sum(per, t, token, 4 * q + j);
        v[j] = gate / (1.0f + expf(-gate)) * up;
      }
      const float4 o = make_float4(v[0], v[1], v[2], v[3]);
      *reinterpret_cast<float4*>(seg.out[0] + (long long)token * rows + row) = o;
      skl::store4(glu_xa, glu_type, row, token, 1, o);
    }
  } else {
    for (int i = threadIdx.x; i < G * n * 16; i += blockDim.x) {
      const int t = i / (n * 16), token = i / 16 % n, r = i % 16;  // consecutive threads: consecutive rows
      const int row = ((block % row_blocks) * G + t) * 16 + r;
      if (row >= rows) continue;
      float v = partial[t][token][r];
      if (splits == 1) {
        v = v + (bias != nullptr ? bias[row] : 0.f);
      } else {
        for (int s = 1; s < splits; ++s) v += partial[s * G + t][token][r];
        if (bias != nullptr) v += bias[row];
      }
      out[(long long)token * rows + row] = v;
    }
  }
}

// skinny_experts: a mixture-of-experts layer's expert matrices (gate and up, or down) on the skinny GEMM's numbers,
// every (token, expert) pair's output row one chain over all its columns (no split: expert rows are at most a few
// thousand columns), so a pair's bits are the same in a group of one as of 64 and whatever shares its group.
// groups: moe_sort's runs of one expert's pairs, (expert, first index into order, count <= 8 NI); null: pair b is
// group b alone (ids[b] its expert; a decode step, no sort launch). Pair p reads activation row p / per_token of
// xa (skinny_x_to_f16's layout of x_tiles tiles: any row of any tile, each lane loading its own pair's fragments)
// and writes row p of its segment's out [pairs, rows]. A warp: 16 rows of the group's expert x the group's pairs
// (NI tiles of 8; pairs past count compute the group's last pair again and are not stored), its weights through a
// ring in registers as skinny_gemv's. Expert matrices are GGUF rows (never tiled), expert e's from row e rows.
namespace sk {
struct ExpertOut {
  const uint8_t* weight[2];
  float* out[2];
};
// Warps a block of skinny_experts: 64 rows, so that a decode step's few pairs still spread over every SM (gate and
// up of 768 rows for 8 pairs: 192 blocks).
constexpr int EXPERT_WARPS = 4;
// Superblocks a lane holds (RING - 1 in flight): fewer as the pairs' accumulators and fragments take registers
// (no spill on sm_90a; Q6_K's raw superblock is 41 registers a row).
template <int T, int NI>
constexpr int experts_ring() {
  if (T == GGML_Q6_K) return NI == 1 ? 2 : 1;
  return NI == 1 ? Gemv<T>::RING : NI <= 4 ? 2 : 1;
}
}  // namespace sk

// grid (ceil(rows / 64) x segments, groups or pairs), 128 threads.
template <int T, int NI>
__global__ void __launch_bounds__(sk::EXPERT_WARPS * 32)
    skinny_experts(const __grid_constant__ sk::ExpertOut mats, const int* __restrict__ ids,
                   const int* __restrict__ order, const int4* __restrict__ groups, const int* __restrict__ num_groups,
                   int per_token, const uint4* __restrict__ xa, int x_tiles, int rows, int cols, long long row_bytes) {
  using namespace sk;
  using F = Fmt<T>;
  constexpr int RING = experts_ring<T, NI>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  pdl_enter();  // the groups, the ids and the activation are earlier kernels' output
  int expert, first, count;
  if (groups != nullptr) {
    if ((int)blockIdx.y >= *num_groups) return;
    const int4 group = groups[blockIdx.y];
    expert = group.x, first = group.y, count = group.z;
  } else {
    expert = ids[blockIdx.y], first = (int)blockIdx.y, count = 1;
  }
  const int blocks_per_seg = (rows + EXPERT_WARPS * 16 - 1) / (EXPERT_WARPS * 16);
  const int seg = (int)blockIdx.x / blocks_per_seg;
  const int row0 = ((int)blockIdx.x % blocks_per_seg) * EXPERT_WARPS * 16 + warp * 16;
  const uint8_t* base = (seg == 0 ? mats.weight[0] : mats.weight[1]) + (long long)expert * rows * row_bytes;
  const uint8_t* rowp[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) rowp[r] = base + (long long)min(row0 + 8 * r + g, rows - 1) * row_bytes;
  // Lane g of tile j holds pair first + 8 j + g (the group's last where the group is shorter): its activation
  // row's slot within a (superblock, word): tile * 32 + lane within the tile.
  int slot[NI];
#pragma unroll
  for (int j = 0; j < NI; ++j) {
    const int q = first + min(8 * j + g, count - 1);
    const int pair = groups != nullptr ? order[q] : q;
    const int row = pair / per_token;
    slot[j] = (row >> 3) * 32 + (row & 7) * 4 + c;
  }
  auto fetch = [&](typename F::Raw (&rw)[2], int sb) {
#pragma unroll
    for (int r = 0; r < 2; ++r) F::fetch(rw[r], rowp[r] + (long long)sb * F::BYTES, c);
  };
  float acc[NI][4];
#pragma unroll
  for (int j = 0; j < NI; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  auto step = [&](const typename F::Raw (&rw)[2], int sb) {
    const uint4* xs = xa + (long long)sb * F::WORDS * x_tiles * 32;
    tile_superblock<T, NI>(acc, rw, c, [&](int i, int j) { return ld_x(xs + i * x_tiles * 32 + slot[j]); });
  };
  ring_walk<T, RING>(0, cols / F::SB, fetch, step, [] {});

  // Accumulator e of tile j: row g (+ 8 for e >= 2), the group's pair 8 j + 2 c + e % 2.
  float* const out = seg == 0 ? mats.out[0] : mats.out[1];
#pragma unroll
  for (int j = 0; j < NI; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + g + (e >= 2 ? 8 : 0), p = 8 * j + 2 * c + (e & 1);
      if (row < rows && p < count) {
        const int pair = groups != nullptr ? order[first + p] : first + p;
        out[(long long)pair * rows + row] = acc[j][e];
      }
    }
  }
}

// skinny_experts_combine: down and moe_combine in one launch for a few tokens (each pair its own group, as
// skinny_experts with ids). Block (row tile of 16, token t): warp w computes pairs t k + w, t k + w + warps, ... (the
// pair's expert's 16 rows, skinny_experts' chain and fragments, so each pair's row is the bits skinny_experts gives
// it), into shared memory; then out[t, row] = weights[t, 0] y_0 + weights[t, 1] y_1 + ..., each product rounded and
// added in rank order, as moe_combine. k <= 16.
template <int T>
__global__ void __launch_bounds__(sk::WARPS * 32)
    skinny_experts_combine(float* __restrict__ out, const uint8_t* __restrict__ weight, const int* __restrict__ ids,
                           const float* __restrict__ weights, int k, const uint4* __restrict__ xa, int x_tiles,
                           int rows, int cols, long long row_bytes) {
  using namespace sk;
  using F = Fmt<T>;
  constexpr int RING = experts_ring<T, 1>();
  __shared__ float y[16][16];  // [rank][row of the tile]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int warps = blockDim.x >> 5, t = (int)blockIdx.y, row0 = (int)blockIdx.x * 16;
  pdl_enter();  // the ids, the weights and the activation are earlier kernels' output
  const int sbs = cols / F::SB;
  for (int r = warp; r < k; r += warps) {
    const int pair = t * k + r;
    const uint8_t* base = weight + (long long)ids[pair] * rows * row_bytes;
    const uint8_t* rowp[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) rowp[h] = base + (long long)min(row0 + 8 * h + g, rows - 1) * row_bytes;
    const int slot = (pair >> 3) * 32 + (pair & 7) * 4 + c;  // every lane the pair's row: all 8 columns alike
    auto fetch = [&](typename F::Raw (&rw)[2], int sb) {
#pragma unroll
      for (int h = 0; h < 2; ++h) F::fetch(rw[h], rowp[h] + (long long)sb * F::BYTES, c);
    };
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    auto step = [&](const typename F::Raw (&rw)[2], int sb) {
      const uint4* xs = xa + (long long)sb * F::WORDS * x_tiles * 32 + slot;
      tile_superblock<T, 1>(acc, rw, c, [&](int i, int) { return ld_x(xs + i * x_tiles * 32); });
    };
    ring_walk<T, RING>(0, sbs, fetch, step, [] {});
    if (c == 0) {  // column 0: accumulators 0 (row g) and 2 (row g + 8)
      y[r][g] = acc[0][0];
      y[r][g + 8] = acc[0][2];
    }
  }
  __syncthreads();
  if (threadIdx.x < 16 && row0 + (int)threadIdx.x < rows) {
    const float* w = weights + (long long)t * k;
    float v = __fmul_rn(w[0], y[0][threadIdx.x]);
    for (int r = 1; r < k; ++r) v = __fadd_rn(v, __fmul_rn(w[r], y[r][threadIdx.x]));
    out[(long long)t * rows + row0 + threadIdx.x] = v;
  }
}

// out[i] = part[0][i] + part[1][i] + ... (in split order) + bias[row], for the n * rows outputs of a split launch.
// One thread an output.
extern "C" __global__ void skinny_reduce(float* __restrict__ out, const float* __restrict__ part,
                                         const float* __restrict__ bias, int n, int rows, int splits) {
  pdl_enter();
  const long long size = (long long)n * rows, i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= size) return;
  float v = part[i];
#pragma unroll 4
  for (int s = 1; s < splits; ++s) v += part[s * size + i];
  if (bias != nullptr) v += bias[i % rows];
  out[i] = v;
}
