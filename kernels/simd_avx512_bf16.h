// AVX512-BF16 pair operations, for bf16 KV attended by a bf16 query. Included after simd_avx512.h inside the
// AVX512-BF16 target region of cpu_attention.cpp.
//
// vdpbf16ps multiplies 32 bf16 elements by 32 others and adds each adjacent pair's two products into one fp32
// lane: one instruction where widening both halves and two FMAs took six. For scores the pairs are adjacent
// elements of a row (q and a key row as stored); for values they are the same element of two tokens' value
// rows, interleaved by `interleave_lo/hi`, so the accumulator lanes hold the head dimension in the order
// `unpermute` undoes.
struct Pairs {
  static constexpr int kElems = 2 * Vec::W;  // bf16 elements per register
  using P = __m512i;

  static P load(const neo::BF16* p) { return _mm512_loadu_si512(p); }
  static P zero() { return _mm512_setzero_si512(); }
  // acc + a[2i] * b[2i] + a[2i+1] * b[2i+1] in lane i.
  static Vec::R dot(Vec::R acc, P a, P b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  static P in_register(P v) {
    __asm__("" : "+v"(v));
    return v;
  }
  // Per 128-bit lane L, the (a, b) pairs of elements 8L..8L+3 (lo) and 8L+4..8L+7 (hi).
  static P interleave_lo(P a, P b) { return _mm512_unpacklo_epi16(a, b); }
  static P interleave_hi(P a, P b) { return _mm512_unpackhi_epi16(a, b); }
  // The pair (x, y), rounded to bf16, in every lane.
  static P broadcast_pair(neo::BF16 x, neo::BF16 y) { return _mm512_set1_epi32(int(x.bits | uint32_t(y.bits) << 16)); }
  // n floats to bf16, round to nearest even (n a multiple of W).
  static void round_row(const float* src, neo::BF16* dst, int n) {
    for (int i = 0; i < n; i += Vec::W)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(Vec::load(src + i)));
  }
  // One kElems chunk of an accumulator filled through interleave_lo (first W lanes) and interleave_hi (next W)
  // back into head-dimension order.
  static void unpermute(float* chunk) {
    float tmp[kElems];
    for (int lane = 0; lane < 4; ++lane)
      for (int j = 0; j < 4; ++j) {
        tmp[8 * lane + j] = chunk[4 * lane + j];
        tmp[8 * lane + 4 + j] = chunk[Vec::W + 4 * lane + j];
      }
    std::memcpy(chunk, tmp, sizeof(tmp));
  }
};
