// A decode step's timeline, block by block (scripts/trace_step.py). Built only with -DINFERO_TRACE (the script sets
// runtime.defines before anything compiles); without it every macro below is empty and the kernels are unchanged.
//
// Thread 0 of an instrumented block takes a slot at its start (so the slots give the order in which blocks started,
// across every module: the host points each module's infero_trace_buffer / infero_trace_count at one shared buffer and
// counter) and, at its exit, writes the global timer and its SM's clock at its marks: 0 start, 1 PDL wait released,
// 2 activation staged (decode attention: its Q fragments built; the split merge: its partials loaded), 3 ready to
// stream (a deferred norm's factor computed too; attention: its first K/V tile landed), 4 sums complete, 5 exit. A
// mark the kernel does not reach stays 0. TRACE_BEGIN declares a variable: it opens the kernel's (or the block
// function's) outermost scope, where TRACE_END is.
#pragma once

#ifdef INFERO_TRACE
namespace trace {
constexpr int MARKS = 6;
struct Record {
  unsigned long long t[MARKS];  // %globaltimer, ns (common to every SM; it advances in steps of 32 ns or more)
  unsigned long long c[MARKS];  // clock64 of the block's SM: the marks' spacing to the cycle
  unsigned kind, block, sm, slot;
};
__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
}  // namespace trace

__device__ trace::Record* infero_trace_buffer;
__device__ unsigned* infero_trace_count;
__device__ unsigned infero_trace_capacity;
__shared__ unsigned long long infero_trace_marks[2][trace::MARKS];

// The slot's atomic is not waited for until the block's exit (its result stays in a register), and the exit's time
// is read before that wait: while the weights stream, a block's atomic may return only after its work, and read
// after it, that wait showed as the block's epilogue (on the H200 the split merge's 2.1 us, 1.2 read first). The
// block still holds its SM until then, so the traced step runs longer than the plain build's (~2,040 against ~1,950
// us for the 8B).
#define TRACE_BEGIN()                                                                                      \
  const unsigned infero_trace_slot_ =                                                                      \
      threadIdx.x == 0 && infero_trace_count != nullptr ? atomicAdd(infero_trace_count, 1u) : ~0u;         \
  if (threadIdx.x == 0) {                                                                                  \
    infero_trace_marks[0][0] = trace::now();                                                               \
    infero_trace_marks[1][0] = clock64();                                                                  \
    for (int i_ = 1; i_ < trace::MARKS; ++i_) infero_trace_marks[0][i_] = infero_trace_marks[1][i_] = 0;  \
  }
#define TRACE_MARK(i)                          \
  do {                                         \
    if (threadIdx.x == 0) {                    \
      infero_trace_marks[0][i] = trace::now(); \
      infero_trace_marks[1][i] = clock64();    \
    }                                          \
  } while (0)
#define TRACE_END(what)                                                            \
  do {                                                                             \
    TRACE_MARK(trace::MARKS - 1);                                                  \
    if (threadIdx.x == 0 && infero_trace_slot_ < infero_trace_capacity) {          \
      trace::Record r;                                                             \
      for (int i_ = 0; i_ < trace::MARKS; ++i_) {                                  \
        r.t[i_] = infero_trace_marks[0][i_];                                       \
        r.c[i_] = infero_trace_marks[1][i_];                                       \
      }                                                                            \
      r.kind = (what);                                                             \
      r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);    \
      r.sm = trace::sm_id();                                                       \
      r.slot = infero_trace_slot_;                                                 \
      infero_trace_buffer[infero_trace_slot_] = r;                                 \
    }                                                                              \
  } while (0)
#else
#define TRACE_BEGIN()
#define TRACE_MARK(i) \
  do {                \
  } while (0)
#define TRACE_END(what) \
  do {                  \
  } while (0)
#endif

// Kinds (scripts/trace_step.py names them).
#define TRACE_MATVEC 1
#define TRACE_MATVEC_ROPE 2
#define TRACE_GLU 3
#define TRACE_NORM 4
#define TRACE_ATTENTION 5
#define TRACE_MERGE 6
