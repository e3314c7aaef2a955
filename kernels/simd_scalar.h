// Portable "vector" of one lane: the fallback for x86-64 CPUs without AVX2/FMA/F16C.
struct Vec {
  static constexpr int W = 1;
  static constexpr int kAccRegs = 4;
  using R = float;

  static R zero() { return 0.0f; }
  static R set1(float x) { return x; }
  static R load(const float* p) { return *p; }
  static R load(const neo::F16* p) { return neo::f16_to_f32(p->bits); }
  static R load(const neo::BF16* p) { return neo::bf16_to_f32(p->bits); }
  static void store(float* p, R v) { *p = v; }
  static void store(neo::F16* p, R v) { p->bits = neo::f32_to_f16(v); }
  static void store(neo::BF16* p, R v) { p->bits = neo::f32_to_bf16(v); }
  static R add(R a, R b) { return a + b; }
  static R sub(R a, R b) { return a - b; }
  static R mul(R a, R b) { return a * b; }
  static R max(R a, R b) { return a > b ? a : b; }
  static float hsum(R v) { return v; }
  static float hmax(R v) { return v; }
  static R fmadd(R a, R b, R c) { return a * b + c; }
  static R in_register(R v) { return v; }
  static void prefetch(const void* p) { __builtin_prefetch(p); }
  static R round(R x) { return std::nearbyint(x); }
  static constexpr float kPow2Min = -150.0f;
  static R pow2_scale(R p, R n) { return std::ldexp(p, int(n)); }
  static R reduce_rows(const float* rows) { return rows[0]; }

  static double read_sum(const float* p, size_t n) {
    float a[4] = {0, 0, 0, 0};
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
      for (int j = 0; j < 4; ++j) a[j] += p[i + j];
    double s = double(a[0]) + a[1] + a[2] + a[3];
    for (; i < n; ++i) s += p[i];
    return s;
  }
};
