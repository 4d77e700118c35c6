// SwiGLU's elementwise step, silu(g) * u, in one place: the swiglu kernel and the fused feed-forward mat-vec
// (matvec_mlp) must give the same bits.
#pragma once

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }
