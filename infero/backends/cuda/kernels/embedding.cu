// Embedding lookup: out[i, :] = dequant(W)[token_ids[i], :], for every GGML type through dequant8 (quant.cuh), so
// each value is bitwise the gguf package's dequantized value.
//
// Layouts. W: GGUF blocks of type T, [vocab, row_bytes] row-major exactly as the file stores them (tensor base
// 16-byte aligned). token_ids: int32 [n]. out: float32 [n, hidden] row-major.
//
// Threads. One thread per 8 consecutive elements of one output row (grid over n * ceil(hidden / 8)); a token id
// outside [0, vocab) writes a row of NaN, so a bad id shows instead of reading outside the table.
// No reduction: each output is one decoded value (batch invariant trivially).
//
// Speed on the H200: one row per decode token, ~3-5 us per step inside a graph (docs/performance.md).

#include "pdl.cuh"
#include "quant.cuh"

namespace emb {
// One element of a float-typed row (the tail of a row whose length is not a multiple of 8).
template <int T>
__device__ __forceinline__ float element(const uint8_t* row, int e) {
  if constexpr (T == GGML_F32) {
    return reinterpret_cast<const float*>(row)[e];
  } else if constexpr (T == GGML_F16) {
    return __half2float(__ushort_as_half(reinterpret_cast<const unsigned short*>(row)[e]));
  } else {
    return __uint_as_float((uint32_t)reinterpret_cast<const unsigned short*>(row)[e] << 16);
  }
}
}  // namespace emb

// vec: out is 16-byte aligned and hidden % 4 == 0 (float4 stores).
template <int T>
__global__ void __launch_bounds__(256) embedding(float* __restrict__ out, const uint8_t* __restrict__ weight,
                                                 const int* __restrict__ token_ids, int n, int vocab, int hidden,
                                                 long long row_bytes, int vec) {
  pdl_enter();
  const int groups = (hidden + 7) / 8;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n * groups) return;
  const int t = (int)(i / groups), g = (int)(i - (long long)t * groups);
  const int id = __ldg(token_ids + t);
  const int e0 = 8 * g;
  float v[8];
  if (id < 0 || id >= vocab) {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __int_as_float(0x7FC00000);
  } else {
    const uint8_t* row = weight + (long long)id * row_bytes;
    if (e0 + 8 <= hidden) {
      dequant8<T>(row, g, v);
    } else {
      if constexpr (BlockInfo<T>::ELEMS == 1) {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = e0 + k < hidden ? emb::element<T>(row, e0 + k) : 0.f;
      }
    }
  }
  float* o = out + (long long)t * hidden + e0;
  if (vec && e0 + 8 <= hidden) {
    reinterpret_cast<float4*>(o)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(o)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (e0 + k < hidden) o[k] = v[k];
  }
}

// Input tokens a step takes from the sampling of the step queued before it (asynchronous scheduling):
// token_ids[i] = sampled[rows[i]] where rows[i] >= 0. A negative sampled id (no token could be sampled; the host
// fails that step when it reads it) is fed as 0, so the step queued behind it still reads inside the embedding.
extern "C" __global__ void feed_tokens(int* __restrict__ token_ids, const int* __restrict__ sampled,
                                       const int* __restrict__ rows, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && rows[i] >= 0) token_ids[i] = max(sampled[rows[i]], 0);
}
