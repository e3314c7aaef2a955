// Types shared by the ISA-independent driver (cpu_attention.cpp) and the per-ISA kernels (attention_impl.h).
#pragma once

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "abi.h"

namespace neo {

// Storage tags: 16-bit KV elements are carried as raw bits and widened to fp32 in registers.
struct F16 { uint16_t bits; };
struct BF16 { uint16_t bits; };

struct AttnParams {
  const void* q;              // [B, Hq, D] with rows q_row_stride elements apart, dtype q_dtype (also the output's)
  int q_dtype;
  const void* k_cache;        // [num_blocks, block_size, Hkv, D], dtype kv_dtype
  const void* v_cache;
  int kv_dtype;
  const int32_t* block_tables;  // [B, max_blocks]
  const int32_t* context_lens;  // [B]
  void* out;                  // [B, Hq, D], dtype q_dtype
  int B, Hq, Hkv, D, block_size, max_blocks;
  float scale;
  int64_t q_row_stride;       // Hq * D for a contiguous q
};

// One unit of parallel work: KV heads [h_begin, h_end) of blocks [blk_begin, blk_end) of one sequence.
// segment >= 0 when the sequence was split into several block ranges: the item then leaves an
// unnormalised partial result (acc, running max, running sum) in Segments::buf, and the last item of
// the same (sequence, head range) to finish merges them (counted down in Segments::pending[merge_slot]).
struct WorkItem {
  int seq, blk_begin, blk_end, h_begin, h_end, segment, merge_slot;
};

struct Segments {
  float* buf;                 // [num_segments, Hq, D + 2]: acc[D], m, l per query head
  std::atomic<int>* pending;  // per merge slot: items still running
  const int* first;           // per sequence: its first segment
  const int* count;           // per sequence: its number of segments
};

// Per-thread fp32 working memory. acc/m/l/q are indexed by absolute query head (Hq rows); part and s
// hold one block's scores for up to kMaxGroup query heads.
struct Scratch {
  float* q;     // [Hq, D] query * scale * log2(e)
  float* acc;   // [Hq, D] unnormalised output
  float* m;     // [Hq] running max of scores (log2 units: q carries log2(e))
  float* l;     // [Hq] running sum of 2^(score - m)
  float* part;  // [kMaxGroup, bsp, kMaxLanes] per-token partial dot products
  float* s[2];  // [kMaxGroup, bsp] each: scores, then probabilities, of a step and of the deferred one
  int bsp;      // block_size rounded up to kMaxLanes
};

// Taylor coefficients of 2^f = e^(f ln 2), highest first: degree 6 is within 2e-7 on [-1/2, 1/2].
constexpr float kExp2Poly[7] = {1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
                                5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f};
constexpr float kLog2e = 1.44269504088896341f;

constexpr int kMaxGroup = 8;   // query heads handled together against one KV head
constexpr int kMaxLanes = 16;  // widest vector (AVX-512 fp32)

// Runs one work item: loads its queries, attends over its blocks, writes its output (or partials).
using ItemFn = void (*)(const AttnParams&, const WorkItem&, Scratch&, const Segments&);
// Sums n floats (the STREAM-like read used as the bandwidth yardstick).
using ReadSumFn = double (*)(const float*, size_t);

inline float f16_to_f32(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}
inline uint16_t f32_to_f16(float f) {
  _Float16 x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}
inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

}  // namespace neo
