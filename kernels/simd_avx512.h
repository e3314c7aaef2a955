// AVX-512 vector traits (16 fp32 lanes). Included inside the AVX-512 target region of cpu_attention.cpp.
struct Vec {
  static constexpr int W = 16;
  static constexpr int kAccRegs = 16;  // accumulators a kernel loop may keep live (of 32 registers)
  using R = __m512;

  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R load(const neo::F16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static R load(const neo::BF16* p) {  // bf16 -> fp32 is a 16-bit left shift
    __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static void store(neo::F16* p, R v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store(neo::BF16* p, R v) {  // round to nearest even; NaN stays NaN
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  // v, kept in a register: GCC otherwise folds a load that feeds several FMAs into each of them, and in
  // the score loop those repeated loads, not the FMAs, set the pace.
  static R in_register(R v) {
    __asm__("" : "+v"(v));
    return v;
  }
  // Into L2 (T1): measured no worse than T0, and it keeps prefetched rows out of an 8-way L1 where the
  // 2 KiB token stride of one KV head maps many rows onto few sets.
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

  static float hsum(R v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static float hmax(R v) {
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }

  static R round(R x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p * 2^n for integral n >= kPow2Min (scalef underflows to 0 below the fp32 range).
  static constexpr float kPow2Min = -150.0f;
  static R pow2_scale(R p, R n) { return _mm512_scalef_ps(p, n); }

  // rows: 16 consecutive vectors; lane i of the result is the sum of the 16 lanes of row i.
  static R reduce_rows(const float* rows) {
    R b[4];
    for (int q = 0; q < 4; ++q) {
      const float* r = rows + q * 4 * W;
      R v0 = load(r), v1 = load(r + W), v2 = load(r + 2 * W), v3 = load(r + 3 * W);
      R a01 = add(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
      R a23 = add(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
      __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23));
      __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23));
      b[q] = add(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // 128-bit lane k: rows 4q..4q+3, part k
    }
    R c0 = add(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
               _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    R c1 = add(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
               _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return add(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
               _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
  }

  static double read_sum(const float* p, size_t n) {
    R a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
    size_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W) {
      a0 = add(a0, load(p + i));
      a1 = add(a1, load(p + i + W));
      a2 = add(a2, load(p + i + 2 * W));
      a3 = add(a3, load(p + i + 3 * W));
    }
    double s = hsum(add(add(a0, a1), add(a2, a3)));
    for (; i < n; ++i) s += p[i];
    return s;
  }
};
