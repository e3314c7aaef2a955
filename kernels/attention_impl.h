// The per-ISA body of paged decode attention. cpu_attention.cpp includes this file once per ISA namespace,
// after that ISA's `struct Vec` and inside its target region, so every function here is compiled for it.
//
// Work for one (KV head h, block) step, for a group of GS query heads sharing h (GQA):
//   1. scores: TU tokens at a time, GS x TU dot products accumulated lane-wise in registers (no
//      horizontal sum per dot product); the per-token partial vectors are then reduced W at a time by
//      a transpose-add tree.
//   2. online softmax: the block's max and exponentials are computed for all its tokens at once; the
//      running max/sum (m, l) and the accumulator are rescaled only when the max grows. q is loaded
//      times log2(e), so scores are in log2 units and weights are 2^(s - m): no range-reduction multiply.
//   3. values: acc += p * v with GS x CB independent register accumulators per pass over D; run one step
//      late, after the next step's scores and softmax (see `step`).
// fp16/bf16 elements are widened to fp32 in registers; all arithmetic is fp32.

using R = Vec::R;
constexpr int W = Vec::W;

// 2^x for x <= 0, lane by lane: n = round(x), 2^(x - n) by kExp2Poly on [-1/2, 1/2], times 2^n. Inputs below
// Vec::kPow2Min give about 2^kPow2Min rather than 0, harmless next to a softmax weight of 1.
inline R exp2_lanes(R x) {
  x = Vec::max(x, Vec::set1(Vec::kPow2Min));
  const R n = Vec::round(x);
  const R f = Vec::sub(x, n);
  R p = Vec::set1(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = Vec::fmadd(p, f, Vec::set1(kExp2Poly[i]));
  return Vec::pow2_scale(p, n);
}

template <class T>
void load_row(const T* src, float scale, float* dst, int D) {
  for (int c = 0; c < D; c += W) Vec::store(dst + c, Vec::mul(Vec::load(src + c), Vec::set1(scale)));
}

template <class T>
void store_row(const float* src, float mul, T* dst, int D) {
  for (int c = 0; c < D; c += W) Vec::store(dst + c, Vec::mul(Vec::load(src + c), Vec::set1(mul)));
}

// q/out rows in the caller's dtype (fp32 or the cache's 16-bit type), converted with this ISA.
inline void load_q(const AttnParams& P, size_t off, float* dst) {
  switch (P.q_dtype) {
    case kF16: load_row(static_cast<const F16*>(P.q) + off, P.scale * kLog2e, dst, P.D); break;
    case kBF16: load_row(static_cast<const BF16*>(P.q) + off, P.scale * kLog2e, dst, P.D); break;
    default: load_row(static_cast<const float*>(P.q) + off, P.scale * kLog2e, dst, P.D);
  }
}

inline void store_out(const AttnParams& P, size_t off, const float* src, float mul) {
  switch (P.q_dtype) {
    case kF16: store_row(src, mul, static_cast<F16*>(P.out) + off, P.D); break;
    case kBF16: store_row(src, mul, static_cast<BF16*>(P.out) + off, P.D); break;
    default: store_row(src, mul, static_cast<float*>(P.out) + off, P.D);
  }
}

template <class KT, int D>
struct Kernel {
  static constexpr int NC = D / W;  // vectors per head row
  static_assert(D % W == 0, "head_dim must be a multiple of the vector width");
  static constexpr int kLinesPerRow = (D * int(sizeof(KT)) + 63) / 64;
  // Steps (one KV head of one block) to prefetch ahead; keys through the score loop, values through the
  // value passes, so fewer prefetches wait for memory at once (measured in bench/RESULTS.md).
  static constexpr int kPrefetchSteps = 2;

  static void prefetch_row(const KT* p) {
    for (int i = 0; i < kLinesPerRow; ++i) Vec::prefetch(reinterpret_cast<const char*>(p) + 64 * i);
  }

  // Partial dot products of GS query rows with TU consecutive tokens' key rows -> part[g][t] (W lanes).
  template <int GS, int TU>
  static void dot_tokens(const float* q, const KT* k, size_t row, int bsp, float* part) {
    R a[TU][GS];
    R kk[TU];
    for (int u = 0; u < TU; ++u) kk[u] = Vec::load(k + u * row);
    for (int g = 0; g < GS; ++g) {
      const R qv = Vec::load(q + g * D);
      for (int u = 0; u < TU; ++u) a[u][g] = Vec::mul(qv, kk[u]);
    }
    for (int c = 1; c < NC; ++c) {
      for (int u = 0; u < TU; ++u) kk[u] = Vec::load(k + u * row + c * W);
      for (int g = 0; g < GS; ++g) {
        const R qv = Vec::in_register(Vec::load(q + g * D + c * W));
        for (int u = 0; u < TU; ++u) a[u][g] = Vec::fmadd(qv, kk[u], a[u][g]);
      }
    }
    for (int g = 0; g < GS; ++g)
      for (int u = 0; u < TU; ++u) Vec::store(part + (size_t(g) * bsp + u) * W, a[u][g]);
  }

  // Scores of n tokens for GS query heads into s[g][t] (row stride bsp); tail lanes up to a multiple
  // of W are set to -inf. pf_k (may be null): key rows of a later step, prefetched along the way.
  template <int GS>
  static void scores(const float* q, const KT* k, size_t row, int n, int bsp, const KT* pf_k, float* part,
                     float* s) {
    constexpr int TU = Vec::kAccRegs / GS >= 4 ? 4 : Vec::kAccRegs / GS >= 2 ? 2 : 1;
    int t = 0;
    for (; t + TU <= n; t += TU) {
      if (pf_k)
        for (int u = 0; u < TU; ++u) prefetch_row(pf_k + (t + u) * row);
      dot_tokens<GS, TU>(q, k + t * row, row, bsp, part + size_t(t) * W);
    }
    for (; t < n; ++t) {
      if (pf_k) prefetch_row(pf_k + t * row);
      dot_tokens<GS, 1>(q, k + t * row, row, bsp, part + size_t(t) * W);
    }
    const int npad = (n + W - 1) / W * W;
    for (int g = 0; g < GS; ++g) {
      float* pg = part + size_t(g) * bsp * W;
      for (int t0 = 0; t0 < npad; t0 += W) Vec::store(s + g * bsp + t0, Vec::reduce_rows(pg + t0 * W));
      for (int u = n; u < npad; ++u) s[g * bsp + u] = -INFINITY;
    }
  }

  // Turns the GS score rows into probabilities against the updated running max (tail lanes -> 0);
  // updates m and l and rescales the acc rows when the max grew.
  template <int GS>
  static void softmax(float* s, int n, int bsp, float* m, float* l, float* acc) {
    const int npad = (n + W - 1) / W * W;
    for (int g = 0; g < GS; ++g) {
      float* sg = s + g * bsp;
      R vmax = Vec::load(sg);
      for (int t0 = W; t0 < npad; t0 += W) vmax = Vec::max(vmax, Vec::load(sg + t0));
      const float mb = Vec::hmax(vmax);
      const float mn = mb > m[g] ? mb : m[g];
      const R vm = Vec::set1(mn);
      R vsum = Vec::zero();
      for (int t0 = 0; t0 < npad; t0 += W) {
        const R p = exp2_lanes(Vec::sub(Vec::load(sg + t0), vm));
        Vec::store(sg + t0, p);
        vsum = Vec::add(vsum, p);
      }
      if (npad != n) {  // padded lanes: 2^(-inf) may not be exactly 0 on every ISA
        for (int t = n; t < npad; ++t) sg[t] = 0.0f;
        vsum = Vec::zero();
        for (int t0 = 0; t0 < npad; t0 += W) vsum = Vec::add(vsum, Vec::load(sg + t0));
      }
      if (mn != m[g]) {
        const float alpha = std::exp2(m[g] - mn);  // 0 on the first block (m = -inf)
        const R va = Vec::set1(alpha);
        float* ag = acc + g * D;
        for (int c = 0; c < NC; ++c) Vec::store(ag + c * W, Vec::mul(Vec::load(ag + c * W), va));
        l[g] *= alpha;
        m[g] = mn;
      }
      l[g] += Vec::hsum(vsum);
    }
  }

  // pf_v (may be null): value rows of a later step, prefetched a share per pass over D.
  template <int GS>
  static void values(const float* p, const KT* v, size_t row, int n, int bsp, const KT* pf_v, float* acc) {
    constexpr int kWant = Vec::kAccRegs / GS > 0 ? Vec::kAccRegs / GS : 1;
    constexpr int CB = kWant < NC ? kWant : NC;  // GS x CB live accumulators
    static_assert(NC % CB == 0, "chunking must tile the head row");
    constexpr int kPasses = NC / CB;
    for (int c0 = 0; c0 < NC; c0 += CB) {
      if (pf_v)
        for (int r = n * (c0 / CB) / kPasses; r < n * (c0 / CB + 1) / kPasses; ++r) prefetch_row(pf_v + r * row);
      R a[GS][CB];
      for (int g = 0; g < GS; ++g)
        for (int j = 0; j < CB; ++j) a[g][j] = Vec::load(acc + g * D + (c0 + j) * W);
      for (int t = 0; t < n; ++t) {
        const KT* vr = v + t * row + c0 * W;
        R vv[CB];
        for (int j = 0; j < CB; ++j) vv[j] = Vec::load(vr + j * W);
        for (int g = 0; g < GS; ++g) {
          const R pb = Vec::set1(p[g * bsp + t]);
          for (int j = 0; j < CB; ++j) a[g][j] = Vec::fmadd(pb, vv[j], a[g][j]);
        }
      }
      for (int g = 0; g < GS; ++g)
        for (int j = 0; j < CB; ++j) Vec::store(acc + g * D + (c0 + j) * W, a[g][j]);
    }
  }

  // A step whose probabilities are ready and whose values pass (`values<GS>` of its group size) has not
  // run yet.
  struct Deferred {
    void (*values)(const float*, const KT*, size_t, int, int, const KT*, float*) = nullptr;  // null: none
    const float* p = nullptr;
    const KT* v;
    const KT* pf_v;
    int n, qh;
  };

  static void run_values(const Deferred& d, size_t row, const Scratch& sc) {
    d.values(d.p, d.v, row, d.n, sc.bsp, d.pf_v, sc.acc + size_t(d.qh) * D);
  }

  // Scores and softmax of this step, then the deferred values pass of the step before (normally the
  // previous KV head, so other query heads): the softmax's serial chain (max, exp, sum) then overlaps that
  // pass's FMAs instead of idling the FP pipes. Where both steps have the same query heads (an item of one
  // KV head), the deferred pass runs first, as the softmax may rescale its accumulators.
  template <int GS>
  static void step(const KT* k, const KT* v, size_t row, int n, int qh, const KT* pf_k, const KT* pf_v,
                   Scratch& sc, Deferred& prev) {
    float* s = prev.p == sc.s[0] ? sc.s[1] : sc.s[0];  // not the deferred step's probabilities
    scores<GS>(sc.q + size_t(qh) * D, k, row, n, sc.bsp, pf_k, sc.part, s);
    if (prev.values && prev.qh == qh) {
      run_values(prev, row, sc);
      prev.values = nullptr;
    }
    softmax<GS>(s, n, sc.bsp, sc.m + qh, sc.l + qh, sc.acc + size_t(qh) * D);
    if (prev.values) run_values(prev, row, sc);
    prev = {&values<GS>, s, v, pf_v, n, qh};
  }

  static void attend(const AttnParams& P, const WorkItem& it, Scratch& sc) {
    const KT* K = static_cast<const KT*>(P.k_cache);
    const KT* V = static_cast<const KT*>(P.v_cache);
    const int G = P.Hq / P.Hkv;
    const size_t row = size_t(P.Hkv) * D;           // elements from one token to the next
    const size_t blk = size_t(P.block_size) * row;  // elements per physical block
    const int32_t* bt = P.block_tables + size_t(it.seq) * P.max_blocks;
    const int ctx = P.context_lens[it.seq];
    const int nh = it.h_end - it.h_begin;
    Deferred prev;
    for (int j = it.blk_begin; j < it.blk_end; ++j) {
      const size_t base = size_t(bt[j]) * blk;
      const int n = ctx - j * P.block_size < P.block_size ? ctx - j * P.block_size : P.block_size;
      for (int h = it.h_begin; h < it.h_end; ++h) {
        // Prefetch target: the (block, head) step kPrefetchSteps ahead in this item. Physical blocks are
        // scattered, so the hardware prefetcher cannot guess where the next block lives.
        const KT* pf_k = nullptr;
        const KT* pf_v = nullptr;
        const int ahead = (j - it.blk_begin) * nh + (h - it.h_begin) + kPrefetchSteps;
        if (it.blk_begin + ahead / nh < it.blk_end) {
          const size_t pf = size_t(bt[it.blk_begin + ahead / nh]) * blk + size_t(it.h_begin + ahead % nh) * D;
          pf_k = K + pf;
          pf_v = V + pf;
        }
        const KT* k = K + base + size_t(h) * D;
        const KT* v = V + base + size_t(h) * D;
        for (int g0 = 0; g0 < G;) {  // query heads of this KV head, in groups of 8/4/2/1
          const int left = G - g0, qh = h * G + g0;
          if (left >= 8) { step<8>(k, v, row, n, qh, pf_k, pf_v, sc, prev); g0 += 8; }
          else if (left >= 4) { step<4>(k, v, row, n, qh, pf_k, pf_v, sc, prev); g0 += 4; }
          else if (left >= 2) { step<2>(k, v, row, n, qh, pf_k, pf_v, sc, prev); g0 += 2; }
          else { step<1>(k, v, row, n, qh, pf_k, pf_v, sc, prev); g0 += 1; }
          pf_k = pf_v = nullptr;  // prefetch once per step, not once per query-head group
        }
      }
    }
    if (prev.values) run_values(prev, row, sc);
  }

  // Exact log-sum-exp merge of a split sequence's segments for query heads [q0, q1).
  static void merge(const AttnParams& P, const WorkItem& it, const Segments& segs, int q0, int q1, float* tmp) {
    const size_t stride = size_t(D) + 2;
    const int first = segs.first[it.seq], count = segs.count[it.seq];
    for (int qh = q0; qh < q1; ++qh) {
      auto seg = [&](int i) { return segs.buf + (size_t(first + i) * P.Hq + qh) * stride; };
      float M = -INFINITY;
      for (int i = 0; i < count; ++i) M = seg(i)[D] > M ? seg(i)[D] : M;
      float L = 0.0f;
      for (int c = 0; c < NC; ++c) Vec::store(tmp + c * W, Vec::zero());
      for (int i = 0; i < count; ++i) {
        const float w = std::exp2(seg(i)[D] - M);
        L += w * seg(i)[D + 1];
        const R vw = Vec::set1(w);
        for (int c = 0; c < NC; ++c) Vec::store(tmp + c * W, Vec::fmadd(vw, Vec::load(seg(i) + c * W), Vec::load(tmp + c * W)));
      }
      store_out(P, (size_t(it.seq) * P.Hq + qh) * D, tmp, 1.0f / L);
    }
  }

  static void process(const AttnParams& P, const WorkItem& it, Scratch& sc, const Segments& segs) {
    const int G = P.Hq / P.Hkv;
    const int q0 = it.h_begin * G, q1 = it.h_end * G;
    for (int qh = q0; qh < q1; ++qh) {
      load_q(P, size_t(it.seq) * P.q_row_stride + size_t(qh) * D, sc.q + size_t(qh) * D);
      for (int c = 0; c < NC; ++c) Vec::store(sc.acc + size_t(qh) * D + c * W, Vec::zero());
      sc.m[qh] = -INFINITY;
      sc.l[qh] = 0.0f;
    }
    attend(P, it, sc);
    if (it.segment < 0) {
      for (int qh = q0; qh < q1; ++qh)
        store_out(P, (size_t(it.seq) * P.Hq + qh) * D, sc.acc + size_t(qh) * D, 1.0f / sc.l[qh]);
      return;
    }
    for (int qh = q0; qh < q1; ++qh) {
      float* dst = segs.buf + (size_t(it.segment) * P.Hq + qh) * (D + 2);
      std::memcpy(dst, sc.acc + size_t(qh) * D, D * sizeof(float));
      dst[D] = sc.m[qh];
      dst[D + 1] = sc.l[qh];
    }
    // The last item of this (sequence, head range) to finish merges; acq_rel makes the other items'
    // partials visible to it.
    if (segs.pending[it.merge_slot].fetch_sub(1, std::memory_order_acq_rel) == 1)
      merge(P, it, segs, q0, q1, sc.acc + size_t(q0) * D);
  }
};

template <class KT>
ItemFn item_fn_for_dim(int D) {
  switch (D) {
    case 64: return &Kernel<KT, 64>::process;
    case 128: return &Kernel<KT, 128>::process;
    case 256: return &Kernel<KT, 256>::process;
    default: return nullptr;
  }
}

inline ItemFn item_fn(int kv_dtype, int D) {
  switch (kv_dtype) {
    case kF32: return item_fn_for_dim<float>(D);
    case kF16: return item_fn_for_dim<F16>(D);
    case kBF16: return item_fn_for_dim<BF16>(D);
    default: return nullptr;
  }
}

inline double read_sum(const float* p, size_t n) { return Vec::read_sum(p, n); }
