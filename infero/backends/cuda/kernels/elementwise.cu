// Row-wise and elementwise kernels of the decoder layer: residual add + RMSNorm, RMSNorm over any last dim,
// fused rotary + KV-cache write (alone or after Qwen3's per-head q/k RMSNorm), SwiGLU, row gather.
//
// Layouts. Activations are float32, row-major, contiguous. RMSNorm rows have `dim` elements (dim % 4 == 0,
// rows 16-byte aligned). q [n, heads, head_dim], k and v [n, kv_heads, head_dim] float32; the KV cache of one
// layer is K and V as separate fp16 tensors [num_blocks, block_size, kv_heads, head_dim], addressed by the
// int64 slot (block * block_size + offset) of each token: element (slot, h, d) is at (slot * kv_heads + h) *
// head_dim + d, so the kernel never needs block_size. positions int32 [n]; a negative slot skips the token.
//
// Reduction order (batch invariance). A row's sum of squares is the same fixed tree whatever the number of
// rows: each thread adds its own elements in increasing index order (fma), then a butterfly over the 32
// lanes of its warp, then (row-per-block kernels) warp 0 adds the warps' sums with another butterfly. The
// kernel variant (row per warp or per block, VPT) is chosen from `dim` alone, never from n.
//
// Numerics. All math is fp32, IEEE division and square root (no fast math): out = r * (1 / sqrt(mean(r^2) +
// eps)) * w differs from numpy's (r / sqrt(...)) * w by a few ulp. Rotary angles are fp32(position * inv_freq)
// (one correctly rounded fp32 product, as Hugging Face and vLLM build their cos/sin tables) with the accurate
// sincosf (full range reduction); see rotary_store_kv for the error against numpy's float64 angles.
//
// Speed on the H200 (decode, inside a graph; docs/performance.md): a few kilobytes per call, so each kernel costs
// its launch floor, 2-6 us; add_rms_norm on one 4,096-wide row (one CTA, quantizing too) ~6 us.

#include <cuda_fp16.h>

#include "act_quant.cuh"
#include "pdl.cuh"
#include "rope.cuh"
#include "skinny_layout.cuh"

namespace ew {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum over the block in a fixed tree: lanes, then warps (by warp 0). Every thread gets the total.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    constexpr int WARPS = THREADS / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < WARPS ? scratch[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) scratch[WARPS] = w;
    }
    __syncthreads();
    return scratch[WARPS];
}

__device__ __forceinline__ float sum_squares(float4 a, float acc) {
    acc = fmaf(a.x, a.x, acc);
    acc = fmaf(a.y, a.y, acc);
    acc = fmaf(a.z, a.z, acc);
    return fmaf(a.w, a.w, acc);
}

// The sum of squares of a 32-element group held as float4 by 8 consecutive lanes (element e of the group: lane
// e / 4, component e % 4), in the order of an xor butterfly over 32 lanes holding one element each (offsets 16, 8,
// 4, 2, 1: matvec_mma_norm's): element offsets 16, 8, 4 are lane offsets 4, 2, 1, and 2, 1 stay in the float4.
// Every lane of the 8 gets the total. All 32 lanes of the warp must call.
__device__ __forceinline__ float group_sum_squares(float4 r) {
    float e[4] = {__fmul_rn(r.x, r.x), __fmul_rn(r.y, r.y), __fmul_rn(r.z, r.z), __fmul_rn(r.w, r.w)};
#pragma unroll
    for (int lanes = 4; lanes > 0; lanes >>= 1)
#pragma unroll
        for (int c = 0; c < 4; ++c) e[c] = __fadd_rn(e[c], __shfl_xor_sync(0xffffffffu, e[c], lanes));
    const float a = __fadd_rn(e[0], e[2]), b = __fadd_rn(e[1], e[3]);  // offset 2, then offset 1
    return __fadd_rn(a, b);
}

__device__ __forceinline__ float4 scale_mul(float4 r, float s, float4 w) {
    return make_float4(r.x * s * w.x, r.y * s * w.y, r.z * s * w.z, r.w * s * w.w);
}

}  // namespace ew

// One row per block of 256 threads; the row stays in registers (VPT float4 per thread) from the load to the
// store, so it is read from memory once (an earlier engine: 19.4 us with three reads, 8.9 us with one).
// ADD: residual += x, written back, then normalised; otherwise the residual (the input) is only normalised.
// QUANT: out is also written in the mat-vec's activation format (act_quant.cuh) to xq/xs, as rows of n (dim % 32
// == 0), so the mat-vecs that read out need no quantizing kernel of their own. DEFER (with QUANT): what is written
// there is instead the deferred form matvec_mma_norm writes (matvec.cu): the planes of r * w, r the residual after
// the add, and each 32-element group's sum of squares of r in norm_ss [n, dim / 32], summed as that kernel sums it
// (an xor butterfly over the group's 32 elements, offsets 16 ... 1); the readers apply 1 / rms. So a layer whose
// norm the decode step folds into its projection reads the same activation, bit for bit, at every token count
// (docs/kernels.md, batch invariance). xa (or null): out also in the skinny GEMM's fp16 layout for weights of
// xa_type (skinny_layout.cuh, xa_tiles tiles), so its readers there convert nothing; padding tokens' slots are left
// as they are (a B column only reaches its own outputs, which are not stored).
template <int VPT, bool ADD, bool QUANT, bool DEFER = false>
__global__ void __launch_bounds__(256) add_rms_norm(float* __restrict__ out, float* __restrict__ residual,
                                                   const float* __restrict__ x, const float* __restrict__ weight,
                                                   int dim, float eps, int8_t* __restrict__ xq,
                                                   ActScale* __restrict__ xs, int n, float* __restrict__ norm_ss,
                                                   uint32_t* __restrict__ xa, int xa_type, int xa_tiles) {
    static_assert(QUANT || !DEFER, "a deferred norm is a quantized output");
    __shared__ float scratch[9];
    const int vecs = dim / 4;
    const size_t row = blockIdx.x;
    // The norm's weight is immutable: loaded before waiting on the previous kernel, used after the reduction.
    float4 w[VPT];
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int v = threadIdx.x + j * 256;
        w[j] = v < vecs ? __ldg(reinterpret_cast<const float4*>(weight) + v) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    pdl_enter();
    float4* res4 = reinterpret_cast<float4*>(residual + row * dim);
    const float4* x4 = reinterpret_cast<const float4*>(x + (ADD ? row * dim : 0));
    float4 r[VPT];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int v = threadIdx.x + j * 256;
        r[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (v < vecs) {
            r[j] = res4[v];
            if (ADD) {
                const float4 a = x4[v];
                r[j] = make_float4(r[j].x + a.x, r[j].y + a.y, r[j].z + a.z, r[j].w + a.w);
                res4[v] = r[j];
            }
        }
        ss = ew::sum_squares(r[j], ss);
    }
    const float total = ew::block_sum<256>(ss, scratch);
    const float inv = 1.0f / sqrtf(total / (float)dim + eps);
    float4* out4 = reinterpret_cast<float4*>(out + row * dim);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int v = threadIdx.x + j * 256;
        const bool live = v < vecs;
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (live) out4[v] = o = ew::scale_mul(r[j], inv, w[j]);
        if (live && xa != nullptr) skl::store4(xa, xa_type, 4 * v, (int)row, xa_tiles, o);
        if (QUANT && j * 256 < vecs) {  // warp-uniform: a warp's 32 float4 are 4 whole groups or past the row
            if constexpr (DEFER) {
                const float q[4] = {__fmul_rn(r[j].x, w[j].x), __fmul_rn(r[j].y, w[j].y), __fmul_rn(r[j].z, w[j].z),
                                    __fmul_rn(r[j].w, w[j].w)};
                aq::quantize_store<4>(q, live, xq, xs, n, dim, (int)row, 4 * v);
                const float group = ew::group_sum_squares(r[j]);
                if (live && (threadIdx.x & 7) == 0) norm_ss[row * (dim / 32) + v / 8] = group;
            } else {
                const float q[4] = {o.x, o.y, o.z, o.w};
                aq::quantize_store<4>(q, live, xq, xs, n, dim, (int)row, 4 * v);
            }
        }
    }
}

// One row per warp, 8 rows per block of 256 threads: for short rows (per-head q/k norms, dim <= 512).
template <int VPT>
__global__ void __launch_bounds__(256) rms_norm_rows(float* __restrict__ out, const float* __restrict__ x,
                                                    const float* __restrict__ weight, int rows, int dim, float eps) {
    pdl_enter();
    const int lane = threadIdx.x % 32;
    const size_t row = (size_t)blockIdx.x * 8 + threadIdx.x / 32;
    if (row >= (size_t)rows) return;
    const int vecs = dim / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x + row * dim);
    float4 r[VPT];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int v = lane + j * 32;
        r[j] = v < vecs ? x4[v] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        ss = ew::sum_squares(r[j], ss);
    }
    const float total = ew::warp_sum(ss);
    const float inv = 1.0f / sqrtf(total / (float)dim + eps);
    const float4* w4 = reinterpret_cast<const float4*>(weight);
    float4* out4 = reinterpret_cast<float4*>(out + row * dim);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int v = lane + j * 32;
        if (v < vecs) out4[v] = ew::scale_mul(r[j], inv, w4[v]);
    }
}

// Rotary on q (in place) and k (in place), then k and v rounded to fp16 into their cache slots. One block per
// token. Work item (h, j), j < head_dim / 2, covers the element pair
//   j <  rope_dim / 2:  interleaved (2j, 2j + 1), neox (j, j + rope_dim / 2), rotated by angle j
//   j >= rope_dim / 2:  (2j, 2j + 1) unrotated (the tail of a partial rotary passes through)
// so every element of a head is touched exactly once.
//
// Angle error against numpy's float64 angles: fp32(pos * fp32(inv_freq)) is off by at most
// |pos * inv_freq| * 2^-23 (two roundings of 2^-24), i.e. 3.9e-3 rad at position 32768 with inv_freq = 1 (the
// first pair; pairs with smaller inv_freq proportionally less), and sincosf adds <= 2 ulp. A rotated pair thus
// differs from the float64 reference by at most |angle error| * mscale * |(a, b)| plus fp32 rounding; against a
// reference that uses the same fp32 angles it agrees to fp32 rounding (~1e-7 relative).
template <bool NEOX>
__global__ void __launch_bounds__(256) rotary_store_kv(float* __restrict__ q, float* __restrict__ k,
                                                      const float* __restrict__ v, const int* __restrict__ positions,
                                                      const float* __restrict__ inv_freq, float mscale,
                                                      int rope_half, int heads, int kv_heads, int head_dim,
                                                      __half* __restrict__ k_cache, __half* __restrict__ v_cache,
                                                      const long long* __restrict__ slots) {
    pdl_enter();
    __shared__ float cos_s[256], sin_s[256];  // rope_half <= 256 (head_dim <= 512)
    const size_t token = blockIdx.x;
    rope::fill_table(positions[token], inv_freq, mscale, rope_half, cos_s, sin_s);
    const int half_dim = head_dim / 2;
    const long long slot = slots[token];
    // q: only the rotated pairs change.
    float* qt = q + token * heads * head_dim;
    for (int item = threadIdx.x; item < heads * rope_half; item += blockDim.x) {
        const int h = item / rope_half, j = item % rope_half;
        const int i0 = NEOX ? j : 2 * j, i1 = NEOX ? j + rope_half : 2 * j + 1;
        float* p = qt + h * head_dim;
        float a = p[i0], b = p[i1];
        rope::rotate(a, b, cos_s[j], sin_s[j]);
        p[i0] = a;
        p[i1] = b;
    }
    // k: rotate in place, then every element to the cache; v: every element to the cache.
    float* kt = k + token * kv_heads * head_dim;
    const float* vt = v + token * kv_heads * head_dim;
    const size_t cache_base = (size_t)(slot < 0 ? 0 : slot) * kv_heads * head_dim;
    for (int item = threadIdx.x; item < kv_heads * half_dim; item += blockDim.x) {
        const int h = item / half_dim, j = item % half_dim;
        const bool rotated = j < rope_half;
        const int i0 = (rotated && NEOX) ? j : 2 * j, i1 = (rotated && NEOX) ? j + rope_half : 2 * j + 1;
        float* p = kt + h * head_dim;
        float a = p[i0], b = p[i1];
        if (rotated) {
            rope::rotate(a, b, cos_s[j], sin_s[j]);
            p[i0] = a;
            p[i1] = b;
        }
        if (slot >= 0) {
            __half* kc = k_cache + cache_base + h * head_dim;
            __half* vc = v_cache + cache_base + h * head_dim;
            const float* vp = vt + h * head_dim;
            kc[i0] = __float2half_rn(a);
            kc[i1] = __float2half_rn(b);
            vc[2 * j] = __float2half_rn(vp[2 * j]);
            vc[2 * j + 1] = __float2half_rn(vp[2 * j + 1]);
        }
    }
}

// Qwen3's per-head q/k RMSNorm, then rotary_store_kv's work, in one launch: each q head and each k head
// normalised with its weight (q_norm, k_norm float32 [head_dim]), rotated, q written back in place (every element:
// the norm changes the unrotated tail too), k and v rounded to fp16 into their cache slots (negative slots skipped).
// k itself is left as it came: only the cache holds its normed, rotated values. Fused because the three launches
// it replaces (rms_norm_rows on q, on k, rotary_store_kv) each cost their launch floor on a decode step's few
// kilobytes: 4.2 + 4.2 + 6.5 us a layer on the H200 (synthetic qwen3-30b-a3b Q4_K_M, batch 1, 2026-12-03).
//
// Bitwise the unfused sequence: a head's norm is rms_norm_rows<VPT>'s row (VPT from head_dim alone, as its
// launcher picks it): lane l holds the float4s l + 32 j, adds their squares with ew::sum_squares in that order,
// ew::warp_sum's butterfly gives the total, then the same 1 / sqrtf(total / dim + eps) and ew::scale_mul. The
// normed head goes through the warp's shared row because rotation pairs cross lanes; each pair is then rotated
// by rope::rotate with rope::cos_sin's values (explicit _rn operations), as rotary_store_kv does.
//
// Grid (token, group of 8 heads), a warp per head: head g * 8 + w of the token's q heads followed by its k heads
// (a k head's warp also stores its v head), so no warp waits on another head's loads (a decode token is one
// block per 8 heads, not one block walking all of them). Work item j < head_dim / 2 of a head is
// rotary_store_kv's (h, j) pair.
// q head h of a token is read at q_in + (token * heads + h) * q_in_stride and written, contiguous, to q: q_in may be
// q itself (stride head_dim; each warp reads its head whole before writing it, so neither pointer is __restrict__),
// or the q half of Qwen3.5's [q | gate] heads (stride 2 head_dim).
template <int VPT, bool NEOX>
__global__ void __launch_bounds__(256) qk_norm_rotary_store_kv(float* q, const float* q_in, int q_in_stride,
                                                              const float* __restrict__ k,
                                                              const float* __restrict__ v,
                                                              const float* __restrict__ q_norm,
                                                              const float* __restrict__ k_norm, float eps,
                                                              const int* __restrict__ positions,
                                                              const float* __restrict__ inv_freq, float mscale,
                                                              int rope_half, int heads, int kv_heads, int head_dim,
                                                              __half* __restrict__ k_cache,
                                                              __half* __restrict__ v_cache,
                                                              const long long* __restrict__ slots) {
    __shared__ float cos_s[256], sin_s[256];  // rope_half <= 256 (head_dim <= 512)
    __shared__ float4 normed[8][32 * VPT];    // a warp's normed head (head_dim <= 128 * VPT)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int vecs = head_dim / 4;
    // The norm weights are immutable: loaded before waiting on the previous kernel.
    float4 wq[VPT], wk[VPT];
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int i = lane + j * 32;
        const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        wq[j] = i < vecs ? __ldg(reinterpret_cast<const float4*>(q_norm) + i) : zero;
        wk[j] = i < vecs ? __ldg(reinterpret_cast<const float4*>(k_norm) + i) : zero;
    }
    pdl_enter();
    const size_t token = blockIdx.x;
    rope::fill_table(positions[token], inv_freq, mscale, rope_half, cos_s, sin_s);
    const int half_dim = head_dim / 2;
    const long long slot = slots[token];
    const size_t cache_base = (size_t)(slot < 0 ? 0 : slot) * kv_heads * head_dim;
    float* row = reinterpret_cast<float*>(normed[warp]);
    for (int h = blockIdx.y * 8 + warp; h < heads + kv_heads; h += gridDim.y * 8) {
        const bool is_q = h < heads;  // warp-uniform
        const int kh = h - heads;
        const float* src = is_q ? q_in + (token * heads + h) * q_in_stride : k + (token * kv_heads + kh) * head_dim;
        float4 r[VPT];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int i = lane + j * 32;
            r[j] = i < vecs ? reinterpret_cast<const float4*>(src)[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            ss = ew::sum_squares(r[j], ss);
        }
        const float total = ew::warp_sum(ss);
        const float inv = 1.0f / sqrtf(total / (float)head_dim + eps);
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int i = lane + j * 32;
            if (i < vecs) normed[warp][i] = ew::scale_mul(r[j], inv, is_q ? wq[j] : wk[j]);
        }
        __syncwarp();
        for (int j = lane; j < half_dim; j += 32) {
            const bool rotated = j < rope_half;
            const int i0 = (rotated && NEOX) ? j : 2 * j, i1 = (rotated && NEOX) ? j + rope_half : 2 * j + 1;
            float a = row[i0], b = row[i1];
            if (rotated) rope::rotate(a, b, cos_s[j], sin_s[j]);
            if (is_q) {
                float* p = q + (token * heads + h) * head_dim;
                p[i0] = a;
                p[i1] = b;
            } else if (slot >= 0) {
                __half* kc = k_cache + cache_base + kh * head_dim;
                __half* vc = v_cache + cache_base + kh * head_dim;
                const float* vp = v + (token * kv_heads + kh) * head_dim;
                kc[i0] = __float2half_rn(a);
                kc[i1] = __float2half_rn(b);
                vc[2 * j] = __float2half_rn(vp[2 * j]);
                vc[2 * j + 1] = __float2half_rn(vp[2 * j + 1]);
            }
        }
        __syncwarp();  // the row is this warp's next head's
    }
}

// out = silu(gate) * up = gate / (1 + exp(-gate)) * up, four elements per thread (VEC) or one.
// QUANT (with VEC; rows of `cols` elements, cols % 32 == 0): out also in the mat-vec's activation format, as for
// add_rms_norm.
template <bool VEC, bool QUANT>
__global__ void __launch_bounds__(256) swiglu(float* __restrict__ out, const float* __restrict__ gate,
                                             const float* __restrict__ up, long long n, int8_t* __restrict__ xq,
                                             ActScale* __restrict__ xs, int cols) {
    pdl_enter();
    const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
    if (VEC) {
        const bool live = i < n / 4;
        if (!QUANT && !live) return;
        float4 r = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (live) {
            const float4 g = reinterpret_cast<const float4*>(gate)[i], u = reinterpret_cast<const float4*>(up)[i];
            r.x = g.x / (1.0f + expf(-g.x)) * u.x;
            r.y = g.y / (1.0f + expf(-g.y)) * u.y;
            r.z = g.z / (1.0f + expf(-g.z)) * u.z;
            r.w = g.w / (1.0f + expf(-g.w)) * u.w;
            reinterpret_cast<float4*>(out)[i] = r;
        }
        if (QUANT) {  // n % 32 == 0: a group's 8 threads are all live or all past the end
            const float q[4] = {r.x, r.y, r.z, r.w};
            const long long e = live ? 4 * i : 0;
            aq::quantize_store<4>(q, live, xq, xs, (int)(n / cols), cols, (int)(e / cols), (int)(e % cols));
        }
    } else {
        if (i >= n) return;
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// out[i, :] = x[indices[i], :]; rows are `words` words of type W (uint4, unsigned, or unsigned char).
template <typename W>
__global__ void __launch_bounds__(256) gather_rows(W* __restrict__ out, const W* __restrict__ x,
                                                  const int* __restrict__ indices, long long words) {
    pdl_enter();
    const size_t row = blockIdx.x;
    const W* src = x + (size_t)indices[row] * words;
    W* dst = out + row * words;
    for (long long i = (long long)blockIdx.y * 256 + threadIdx.x; i < words; i += (long long)gridDim.y * 256)
        dst[i] = src[i];
}
