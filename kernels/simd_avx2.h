// AVX2 + FMA + F16C vector traits (8 fp32 lanes). Included inside the AVX2 target region of cpu_attention.cpp.
struct Vec {
  static constexpr int W = 8;
  static constexpr int kAccRegs = 8;  // accumulators a kernel loop may keep live (of 16 registers)
  using R = __m256;

  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const neo::F16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static R load(const neo::BF16* p) {  // bf16 -> fp32 is a 16-bit left shift
    __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static void store(neo::F16* p, R v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store(neo::BF16* p, R v) {  // round to nearest even; NaN stays NaN
    const __m256i u = _mm256_castps_si256(v);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                          _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  // v, kept in a register: GCC otherwise folds a load that feeds several FMAs into each of them, and in
  // the score loop those repeated loads, not the FMAs, set the pace.
  static R in_register(R v) {
    __asm__("" : "+x"(v));
    return v;
  }
  // Into L2 (T1): measured no worse than T0, and it keeps prefetched rows out of an 8-way L1 where the
  // 2 KiB token stride of one KV head maps many rows onto few sets.
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

  static float hsum(R v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static float hmax(R v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }

  static R round(R x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p * 2^n for integral n >= kPow2Min: 2^n built in the exponent field, so n below -126 is not representable.
  static constexpr float kPow2Min = -126.0f;
  static R pow2_scale(R p, R n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }

  // rows: 8 consecutive vectors; lane i of the result is the sum of the 8 lanes of row i.
  static R reduce_rows(const float* rows) {
    R b[2];
    for (int q = 0; q < 2; ++q) {
      const float* r = rows + q * 4 * W;
      R v0 = load(r), v1 = load(r + W), v2 = load(r + 2 * W), v3 = load(r + 3 * W);
      R a01 = add(_mm256_unpacklo_ps(v0, v1), _mm256_unpackhi_ps(v0, v1));
      R a23 = add(_mm256_unpacklo_ps(v2, v3), _mm256_unpackhi_ps(v2, v3));
      __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(a01), _mm256_castps_pd(a23));
      __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(a01), _mm256_castps_pd(a23));
      b[q] = add(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));  // 128-bit lane k: rows 4q..4q+3, part k
    }
    return add(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
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
