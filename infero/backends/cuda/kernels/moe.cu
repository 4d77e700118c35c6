// The routing and the weighted sum of a mixture-of-experts layer (Qwen3-MoE), around the expert mat-vecs of
// matvec.cu (matvec_experts): moe.py launches moe_route, the experts' gate + up, SwiGLU, down, then moe_combine.
//
// moe_route. logits float32 [n, experts] (the router's linear) -> ids int32 [n, k] and weights float32 [n, k]:
// per row, p = softmax(logits) (p_e = exp(l_e - max) / sum, the sum over the lanes' experts in increasing order
// then a fixed xor butterfly), the k largest p in decreasing order, equal p the lower expert id first (numpy's
// stable argsort of -p), their p divided by their sum (added in rank order). A NaN p ranks below every number, so
// the ids are always k distinct experts. One warp a row (block of 32), p in shared memory [experts]; lane l owns
// experts l, l + 32, ... and is the only thread to touch their entries.
//
// moe_combine. y float32 [n * k, cols] (pair t k + r: token t's rank-r expert output), weights [n, k] -> out
// [n, cols] = weights[t, 0] y[t k] + weights[t, 1] y[t k + 1] + ..., each product rounded, then added in rank
// order (__fmul_rn, __fadd_rn): numpy's out = w0 * y0; out += w1 * y1; ... One thread an element.
//
// moe_sort. ids int32 [pairs] (moe_route's, flattened: pair t k + r) -> the pairs grouped by expert for
// matvec_experts_grouped: order int32 [pairs] lists expert 0's pairs, then expert 1's, ...; groups int4 [...]
// holds (expert, first index into order, count <= group_tokens, 0) for each run of at most group_tokens pairs of
// one expert, experts in increasing order; num_groups[0] their number. An expert no pair chose has no group (its
// matrices are never read). One block; shared memory 4 ints an expert. The order of pairs inside an expert's run
// comes from shared-memory atomics and may differ from launch to launch: nothing depends on it, since each pair's
// output is computed alone (matvec_experts_grouped) and lands in its own row.
//
// Nothing reduces across rows: a token's ids, weights and output are functions of its own row (batch invariance).
#include "pdl.cuh"

namespace moe {
constexpr float TAKEN = -2.f;  // a chosen expert's p in shared memory (p is in [0, 1] or NaN)

// The order of the top-k: (p, id) before (p', id') iff p > p', or p == p' and id < id'; NaN p as -1 (below all).
__device__ __forceinline__ bool before(float p, int id, float q, int jd) {
  return jd < 0 || (id >= 0 && (p > q || (p == q && id < jd)));
}

__device__ __forceinline__ float key(float p) { return p >= 0.f ? p : -1.f; }
}  // namespace moe

extern "C" __global__ void __launch_bounds__(32) moe_route(int* __restrict__ ids, float* __restrict__ weights,
                                                           const float* __restrict__ logits, int experts, int k) {
  extern __shared__ float p[];  // [experts]
  const int lane = threadIdx.x, row = blockIdx.x;
  const float* l = logits + (long long)row * experts;
  pdl_enter();
  float m = __int_as_float(0xff800000);  // -inf
  for (int e = lane; e < experts; e += 32) {
    p[e] = l[e];
    m = fmaxf(m, p[e]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  float sum = 0.f;
  for (int e = lane; e < experts; e += 32) {
    p[e] = expf(__fsub_rn(p[e], m));
    sum = __fadd_rn(sum, p[e]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xFFFFFFFFu, sum, off));
  for (int e = lane; e < experts; e += 32) p[e] = __fdiv_rn(p[e], sum);

  int* row_ids = ids + (long long)row * k;
  float* row_weights = weights + (long long)row * k;
  float chosen = 0.f;  // lane 0: the sum of the chosen p, in rank order
  for (int r = 0; r < k; ++r) {
    float best = -1.f, best_p = 0.f;  // best: the key of best_id's p
    int best_id = -1;
    for (int e = lane; e < experts; e += 32) {
      const float v = p[e];
      if (v != moe::TAKEN && moe::before(moe::key(v), e, best, best_id)) {
        best = moe::key(v);
        best_p = v;
        best_id = e;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float other = __shfl_xor_sync(0xFFFFFFFFu, best, off);
      const float other_p = __shfl_xor_sync(0xFFFFFFFFu, best_p, off);
      const int other_id = __shfl_xor_sync(0xFFFFFFFFu, best_id, off);
      if (moe::before(other, other_id, best, best_id)) {
        best = other;
        best_p = other_p;
        best_id = other_id;
      }
    }
    if (lane == (best_id & 31)) p[best_id] = moe::TAKEN;
    if (lane == 0) {
      row_ids[r] = best_id;
      row_weights[r] = best_p;
      chosen = r == 0 ? best_p : __fadd_rn(chosen, best_p);
    }
  }
  if (lane == 0)
    for (int r = 0; r < k; ++r) row_weights[r] = __fdiv_rn(row_weights[r], chosen);
}

extern "C" __global__ void moe_combine(float* __restrict__ out, const float* __restrict__ y,
                                       const float* __restrict__ weights, int n, int k, int cols) {
  pdl_enter();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n * cols) return;
  const long long t = i / cols, c = i - t * cols;
  const float* w = weights + t * k;
  const float* yt = y + t * k * cols + c;
  float acc = __fmul_rn(w[0], yt[0]);
  for (int r = 1; r < k; ++r) acc = __fadd_rn(acc, __fmul_rn(w[r], yt[(long long)r * cols]));
  out[i] = acc;
}

// Exclusive prefix sums of v[0..n) and of w[0..n) in place, by warp 0 (32 entries a round, Kogge-Stone in shuffles).
namespace moe {
__device__ __forceinline__ void scan2(int* v, int* w, int n, int& total_v, int& total_w) {
  const int lane = threadIdx.x & 31;
  int base_v = 0, base_w = 0;
  for (int at = 0; at < n; at += 32) {
    const int i = at + lane;
    const int a = i < n ? v[i] : 0, b = i < n ? w[i] : 0;
    int sa = a, sb = b;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int ua = __shfl_up_sync(0xFFFFFFFFu, sa, off), ub = __shfl_up_sync(0xFFFFFFFFu, sb, off);
      if (lane >= off) {
        sa += ua;
        sb += ub;
      }
    }
    if (i < n) {
      v[i] = base_v + sa - a;
      w[i] = base_w + sb - b;
    }
    base_v += __shfl_sync(0xFFFFFFFFu, sa, 31);
    base_w += __shfl_sync(0xFFFFFFFFu, sb, 31);
  }
  total_v = base_v;
  total_w = base_w;
}
}  // namespace moe

extern "C" __global__ void __launch_bounds__(1024) moe_sort(int* __restrict__ order, int4* __restrict__ groups,
                                                            int* __restrict__ num_groups, const int* __restrict__ ids,
                                                            int pairs, int experts, int group_tokens) {
  extern __shared__ int sh[];  // count, first, first group, cursor: [experts] each
  int *count = sh, *first = sh + experts, *first_group = sh + 2 * experts, *cursor = sh + 3 * experts;
  pdl_enter();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    first[e] = count[e];
    first_group[e] = (count[e] + group_tokens - 1) / group_tokens;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    int total_pairs, total_groups;
    moe::scan2(first, first_group, experts, total_pairs, total_groups);
    if (threadIdx.x == 0) *num_groups = total_groups;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    cursor[e] = first[e];
    for (int g = 0, at = 0; at < count[e]; ++g, at += group_tokens)
      groups[first_group[e] + g] = make_int4(e, first[e] + at, min(group_tokens, count[e] - at), 0);
  }
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) order[atomicAdd(&cursor[ids[p]], 1)] = p;
}
