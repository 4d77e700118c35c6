// The routing and the weighted sum of a mixture-of-experts layer (Qwen3-MoE), around the expert mat-vecs of
// matvec.cu (matvec_experts): moe.py launches moe_route, the experts' gate + up, SwiGLU, down, then moe_combine.
//
// moe_route. logits float32 [n, experts] (the router's linear) -> ids int32 [n, k] and weights float32 [n, k]:
// per row, p = softmax(logits) (p_e = exp(l_e - max) / sum, the sum over the lanes' experts in increasing order
// then a fixed xor butterfly), the k largest p in decreasing order, equal p the lower expert id first (numpy's
// stable argsort of -p), their p divided by their sum (added in rank order). A NaN p ranks below every number, so
// the ids are always k distinct experts. One warp a row (block of 32), p in shared memory [experts]; lane l owns
// experts l, l + 32, ... and is the only thread to touch their entries.
// shared (Qwen3.5-MoE's shared expert folded in as expert `experts`): a row's logits are experts + 1 wide, the last
// the shared expert's gate; the routing is over the first `experts`, and a (k + 1)-th pair follows the k chosen:
// expert id `experts` with weight sigmoid(gate) = 1 / (1 + exp(-gate)) (numpy's rounding), not renormalized. ids
// and weights are then [n, k + 1].
//
// moe_router. The router's logits, float32 [n, experts] = h float32 [n, hidden] @ router float32 [experts,
// hidden]^T (hidden % 4 == 0), in one fixed expression: warp w of ROUTER_WARPS sums the float4s of quarter w of
// the row (lane + 32 j order, each float4's products by fmaf in element order), the lanes by the xor butterfly,
// the quarters as (q0 + q1) + (q2 + q3). grid: (experts, ceil(n / ROUTER_TOKENS)), a block an expert row and up to
// ROUTER_TOKENS tokens; nothing depends on n or the grid (batch invariance). With route (n <= ROUTER_WARPS, one
// grid row) the last block to finish also routes every token (moe_route's work, a warp a token): a decode step's
// router and top-k in one launch, where the router had run on a 16-row-per-launch mat-vec and moe_route after it.
//
// moe_router_tiles. The same logits, the same expression, by tiles: a block computes ROUTER_TILE experts x
// ROUTER_TILE tokens, its thread (w, lane) the partial sum that moe_router's lane `lane` of warp w forms (its
// float4s in the same order, by fmaf in element order), for all 64 outputs at once, so each float4 of the router
// and of h it loads serves 8 outputs, where moe_router's block re-reads a token's h for each expert row (at 512
// tokens the L2 bound it: 45 us a qwen3-30b-a3b layer). The partials then meet in shared memory, each output's 32
// lanes of a quarter added in the xor butterfly's pairs (lane i + lane i + off, off = 16, 8, 4, 2, 1: the sums
// every lane of the butterfly holds) and the quarters as (q0 + q1) + (q2 + q3): moe_router's bits at every n.
// grid: (ceil(experts / ROUTER_TILE), ceil(n / ROUTER_TILE)), 32 ROUTER_WARPS threads.
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
constexpr int ROUTER_WARPS = 4;   // moe_router: a block's warps, one quarter of the router row each
constexpr int ROUTER_TOKENS = 16;  // moe_router: tokens a block computes (a grid row); routes up to this many
constexpr int ROUTER_AHEAD = 8;    // moe_router: float4s of its row a lane loads before the PDL wait
constexpr int ROUTER_TILE = 8;     // moe_router_tiles: experts and tokens a block

}  // namespace moe

namespace moe {
// A p's rank as an unsigned key (larger ranks first): 0 taken, 1 NaN (below every number), else p's bits + 2 (p is
// >= 0, so its bits order as it does). Equal keys are equal p: the lower expert id goes first.
__device__ __forceinline__ unsigned rank_key(float v) {
  return v == TAKEN ? 0u : (v >= 0.f ? __float_as_uint(v) + 2u : 1u);
}

// The best untaken expert of a lane (its experts lane, lane + 32, ...): the largest key, the first (lowest id) of
// equal keys. id -1 where the lane has none.
__device__ __forceinline__ void lane_best(const float* p, int experts, int lane, unsigned& best, int& best_id) {
  best = 0u;
  best_id = -1;
  for (int e = lane; e < experts; e += 32) {
    const unsigned key = rank_key(p[e]);
    if (key > best) {
      best = key;
      best_id = e;
    }
  }
}

// One row's routing (moe_route's contract) by one warp: l the row's logits (read through L2: in moe_router they
// are other blocks' output), p the warp's shared memory [experts]. The top-k keeps each lane's best untaken expert;
// a rank is the warp's largest key (__reduce_max_sync) and, among lanes holding it, the lowest id
// (__reduce_min_sync); only the winning lane looks for its next best. Ranks: the larger p first, equal p the lower id first, NaN last.
__device__ __forceinline__ void route_row(int* __restrict__ row_ids, float* __restrict__ row_weights, const float* l, float* p,
                          int experts, int k, int lane, int shared) {
  constexpr int LOADS = 8;  // logits a lane loads before it waits on them
  float m = __int_as_float(0xff800000);  // -inf
  for (int e0 = lane; e0 < experts; e0 += 32 * LOADS) {
    float v[LOADS];
#pragma unroll
    for (int u = 0; u < LOADS; ++u) v[u] = e0 + 32 * u < experts ? __ldcg(l + e0 + 32 * u) : m;
#pragma unroll
    for (int u = 0; u < LOADS; ++u) {
      if (e0 + 32 * u < experts) p[e0 + 32 * u] = v[u];
      m = fmaxf(m, v[u]);
    }
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

  unsigned best;
  int best_id;
  lane_best(p, experts, lane, best, best_id);
  float chosen = 0.f;  // lane 0: the sum of the chosen p, in rank order
  for (int r = 0; r < k; ++r) {
    const unsigned top = __reduce_max_sync(0xFFFFFFFFu, best);
    const int id = __reduce_min_sync(0xFFFFFFFFu, best == top && best_id >= 0 ? best_id : 0x7FFFFFFF);
    const float top_p = top >= 2u ? __uint_as_float(top - 2u) : __int_as_float(0x7fc00000);
    if (lane == (id & 31)) {
      p[id] = TAKEN;
      lane_best(p, experts, lane, best, best_id);
    }
    if (lane == 0) {
      row_ids[r] = id;
      row_weights[r] = top_p;
      chosen = r == 0 ? top_p : __fadd_rn(chosen, top_p);
    }
  }
  if (lane == 0) {
    for (int r = 0; r < k; ++r) row_weights[r] = __fdiv_rn(row_weights[r], chosen);
    if (shared) {
      row_ids[k] = experts;
      row_weights[k] = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-__ldcg(l + experts))));
    }
  }
}

// moe_router's count of finished blocks (route launches only); the last block sets it back to 0, so every launch,
// and every replay of a graph, starts from 0.
__device__ unsigned int router_blocks_done;
}  // namespace moe

extern "C" __global__ void __launch_bounds__(32) moe_route(int* __restrict__ ids, float* __restrict__ weights,
                                                           const float* __restrict__ logits, int experts, int k,
                                                           int shared) {
  extern __shared__ float p[];  // [experts]
  const int row = blockIdx.x;
  pdl_enter();
  moe::route_row(ids + (long long)row * (k + shared), weights + (long long)row * (k + shared),
                 logits + (long long)row * (experts + shared), p, experts, k, threadIdx.x, shared);
}

extern "C" __global__ void __launch_bounds__(32 * moe::ROUTER_WARPS) moe_router(
    float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ weights, const float* __restrict__ h,
    const float* __restrict__ router, int n, int hidden, int experts, int k, int route, int shared) {
  __shared__ float part[moe::ROUTER_WARPS][moe::ROUTER_TOKENS];
  __shared__ int last;
  extern __shared__ float p[];  // route: [ROUTER_WARPS][experts]
  const int e = blockIdx.x, t0 = blockIdx.y * moe::ROUTER_TOKENS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tokens = min(moe::ROUTER_TOKENS, n - t0);
  const int vecs = hidden / 4, per_warp = (vecs + moe::ROUTER_WARPS - 1) / moe::ROUTER_WARPS;
  const int v0 = warp * per_warp, v1 = min(v0 + per_warp, vecs);
  const float4* w4 = reinterpret_cast<const float4*>(router + (long long)e * hidden);
  // The row's first float4s (all of it up to hidden 4096) load before the wait: the router is a weight, and its
  // loads then overlap the previous kernel's tail instead of following it.
  float4 ahead[moe::ROUTER_AHEAD];
#pragma unroll
  for (int j = 0; j < moe::ROUTER_AHEAD; ++j) {
    const int v = v0 + lane + 32 * j;
    ahead[j] = v < v1 ? __ldg(w4 + v) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  pdl_enter();
  for (int t = 0; t < tokens; ++t) {
    const float4* x4 = reinterpret_cast<const float4*>(h + (long long)(t0 + t) * hidden);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < moe::ROUTER_AHEAD; ++j) {
      const int v = v0 + lane + 32 * j;
      if (v < v1) {
        const float4 a = ahead[j], b = x4[v];
        acc = fmaf(a.x, b.x, acc);
        acc = fmaf(a.y, b.y, acc);
        acc = fmaf(a.z, b.z, acc);
        acc = fmaf(a.w, b.w, acc);
      }
    }
#pragma unroll 4
    for (int v = v0 + lane + 32 * moe::ROUTER_AHEAD; v < v1; v += 32) {
      const float4 a = __ldg(w4 + v), b = x4[v];
      acc = fmaf(a.x, b.x, acc);
      acc = fmaf(a.y, b.y, acc);
      acc = fmaf(a.z, b.z, acc);
      acc = fmaf(a.w, b.w, acc);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xFFFFFFFFu, acc, off));
    if (lane == 0) part[warp][t] = acc;
  }
  __syncthreads();
  if (threadIdx.x < tokens) {
    const int t = threadIdx.x;
    static_assert(moe::ROUTER_WARPS == 4, "the quarters' sum below");
    logits[(long long)(t0 + t) * experts + e] =
        __fadd_rn(__fadd_rn(part[0][t], part[1][t]), __fadd_rn(part[2][t], part[3][t]));
  }
  if (!route) return;
  __threadfence();  // this block's logits visible before it counts itself done
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&moe::router_blocks_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // experts counts the router's rows: with shared, the last is the shared expert's gate.
  for (int t = warp; t < n; t += moe::ROUTER_WARPS)
    moe::route_row(ids + (long long)t * (k + shared), weights + (long long)t * (k + shared),
                   logits + (long long)t * experts, p + warp * experts, experts - shared, k, lane, shared);
  if (threadIdx.x == 0) moe::router_blocks_done = 0;
}

extern "C" __global__ void __launch_bounds__(32 * moe::ROUTER_WARPS) moe_router_tiles(
    float* __restrict__ logits, const float* __restrict__ h, const float* __restrict__ router, int n, int hidden,
    int experts) {
  constexpr int TILE = moe::ROUTER_TILE, OUTS = TILE * TILE, STRIDE = OUTS + 1;  // + 1: conflict-free stores
  __shared__ float part[moe::ROUTER_WARPS * 32 * STRIDE];                     // [warp][lane][output]
  __shared__ float halves[2][OUTS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e0 = blockIdx.x * TILE, t0 = blockIdx.y * TILE;
  const int vecs = hidden / 4, per_warp = (vecs + moe::ROUTER_WARPS - 1) / moe::ROUTER_WARPS;
  const int v0 = warp * per_warp, v1 = min(v0 + per_warp, vecs);
  // Rows past the matrix or the tokens read its last one (in bounds; their outputs are never stored). The row
  // offsets are recomputed where they are used: arrays of 16 pointers went to the stack.
  const float4* w4 = reinterpret_cast<const float4*>(router);
  const float4* x4 = reinterpret_cast<const float4*>(h);
  float acc[TILE][TILE];
#pragma unroll
  for (int i = 0; i < TILE; ++i)
#pragma unroll
    for (int t = 0; t < TILE; ++t) acc[i][t] = 0.f;
  pdl_enter();
  for (int v = v0 + lane; v < v1; v += 32) {
    float4 a[TILE], b[TILE];
#pragma unroll
    for (int i = 0; i < TILE; ++i) a[i] = __ldg(w4 + (long long)min(e0 + i, experts - 1) * vecs + v);
#pragma unroll
    for (int t = 0; t < TILE; ++t) b[t] = x4[(long long)min(t0 + t, n - 1) * vecs + v];
#pragma unroll
    for (int i = 0; i < TILE; ++i)
#pragma unroll
      for (int t = 0; t < TILE; ++t) {
        acc[i][t] = fmaf(a[i].x, b[t].x, acc[i][t]);
        acc[i][t] = fmaf(a[i].y, b[t].y, acc[i][t]);
        acc[i][t] = fmaf(a[i].z, b[t].z, acc[i][t]);
        acc[i][t] = fmaf(a[i].w, b[t].w, acc[i][t]);
      }
  }
  float* mine = part + (warp * 32 + lane) * STRIDE;
#pragma unroll
  for (int i = 0; i < TILE; ++i)
#pragma unroll
    for (int t = 0; t < TILE; ++t) mine[i * TILE + t] = acc[i][t];
  __syncthreads();
  // Thread (half, o): output o's quarters 2 half and 2 half + 1, each its lanes' butterfly, then their sum.
  static_assert(moe::ROUTER_WARPS == 4 && 2 * OUTS == 32 * moe::ROUTER_WARPS, "a thread a (half, output)");
  const int o = threadIdx.x % OUTS, half = threadIdx.x / OUTS;
  float q[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const float* col = part + (2 * half + u) * 32 * STRIDE + o;
    float s[16];
#pragma unroll
    for (int l = 0; l < 16; ++l) s[l] = __fadd_rn(col[l * STRIDE], col[(l + 16) * STRIDE]);
#pragma unroll
    for (int l = 0; l < 8; ++l) s[l] = __fadd_rn(s[l], s[l + 8]);
#pragma unroll
    for (int l = 0; l < 4; ++l) s[l] = __fadd_rn(s[l], s[l + 4]);
#pragma unroll
    for (int l = 0; l < 2; ++l) s[l] = __fadd_rn(s[l], s[l + 2]);
    q[u] = __fadd_rn(s[0], s[1]);
  }
  halves[half][o] = __fadd_rn(q[0], q[1]);
  __syncthreads();
  const int e = e0 + o / TILE, t = t0 + o % TILE;
  if (half == 0 && e < experts && t < n) logits[(long long)t * experts + e] = __fadd_rn(halves[0][o], halves[1][o]);
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
