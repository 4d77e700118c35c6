// Which of a step's tokens take which form of the gated delta rule (docs/kernels.md, batch invariance rule 4).
// Chunks are the 64-position spans [64 m, 64 m + 64) counted from the sequence's start; the step tokens that fill
// a whole chunk take the chunked form (delta_rule_chunked.cu), the others the recurrent one (delta_net.cu's
// gated_delta_rule): those before the first whole chunk (the head) and those after the last (the tail). The
// scheduler splits a hybrid model's prompts at multiples of 64 positions, so a prompt's whole chunks are the same
// however it is split. delta_rule_chunked.py's whole_chunks counts them on the host with the same arithmetic.
#pragma once

namespace dchunk {
constexpr int CHUNK = 64;
enum Part { ALL = 0, HEAD = 1, TAIL = 2 };  // gated_delta_rule's `part`: which of a sequence's tokens it takes

// A sequence's n > 0 step tokens at positions first .. first + n - 1: tokens [0, head) come before its first
// whole chunk, [head, tail) are whole chunks, [tail, n) come after the last; head = tail = n without one.
__device__ __forceinline__ void whole_chunks(int first, int n, int& head, int& tail) {
    const int a = (first + CHUNK - 1) / CHUNK * CHUNK - first, b = (first + n) / CHUNK * CHUNK - first;
    head = b > a ? a : n;
    tail = b > a ? b : n;
}
}  // namespace dchunk
