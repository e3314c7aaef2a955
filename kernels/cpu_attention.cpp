// NEO CPU paged decode-attention library: plain C ABI, runtime ISA dispatch, OpenMP threads.
// Layout, dispatch and the work split are described in README.md; the per-ISA kernel is attention_impl.h.
#include <immintrin.h>
#include <omp.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <new>
#include <vector>

#include "common.h"

// Each ISA gets its own namespace holding a `struct Vec` and the kernel templates, compiled inside a
// target region: one .so carries all three and runs on any x86-64.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12's AVX-512 headers self-initialise `undefined` registers, which -Wmaybe-uninitialized flags.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace isa_avx512 {
using namespace neo;
#include "simd_avx512.h"
#include "attention_impl.h"
}  // namespace isa_avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
using namespace neo;
#include "simd_avx2.h"
#include "attention_impl.h"
}  // namespace isa_avx2
#pragma GCC pop_options

namespace isa_scalar {
using namespace neo;
#include "simd_scalar.h"
#include "attention_impl.h"
}  // namespace isa_scalar

namespace {

using namespace neo;

int detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kAvx2;
  return kScalar;
}

const int g_max_isa = detect_isa();
std::atomic<int> g_isa{g_max_isa};

ItemFn select_item_fn(int kv_dtype, int D) {
  switch (g_isa.load()) {
    case kAvx512: return isa_avx512::item_fn(kv_dtype, D);
    case kAvx2: return isa_avx2::item_fn(kv_dtype, D);
    default: return isa_scalar::item_fn(kv_dtype, D);
  }
}

ReadSumFn select_read_sum() {
  switch (g_isa.load()) {
    case kAvx512: return &isa_avx512::read_sum;
    case kAvx2: return &isa_avx2::read_sum;
    default: return &isa_scalar::read_sum;
  }
}

// Work split. With split_long, sequences longer than kPartTokens become segments of at most that many
// tokens, merged afterwards by log-sum-exp, so one long request does not serialise the batch. The split
// depends on the batch alone, never on the thread count: results are bitwise the same for any number
// of threads. With few work units the KV heads are split too (exact: heads are independent). Items run
// longest first (dynamic schedule, LPT order).
struct Plan {
  std::vector<WorkItem> items;
  std::vector<int> seg_first;  // per sequence: first segment index (unused when not split)
  std::vector<int> seg_count;  // per sequence: number of segments
  std::vector<int> pending;    // per merge slot (split sequence x head range): items to wait for
  int num_segments = 0;
};

// About 2 MiB of fp16 KV for 8 KV heads of 128: long enough that the merge (one [Hq, D] row set per
// segment) costs little, short enough to balance a handful of long requests over 16 threads. A batch with
// fewer than kMinLongSegments such segments is split into kShortPartTokens instead: a few requests then
// balance better over the threads than longer runs read (bench/RESULTS.md, "CPU attention kernel").
constexpr long kPartTokens = 512;
constexpr long kShortPartTokens = 128;
constexpr long kMinLongSegments = 32;

long segment_blocks(const std::vector<int>& nblocks, int block_size) {
  const long part = std::max(1L, kPartTokens / block_size);
  long segments = 0;
  for (int n : nblocks) segments += (n + part - 1) / part;
  return segments >= kMinLongSegments ? part : std::max(1L, kShortPartTokens / block_size);
}

// The KV heads are split until there are 2 items per thread, but past 1.5 items per thread not into runs of
// less than this many bytes of each token's row: a longer run read in one pass pays more than the finer
// balance (bench/RESULTS.md, "CPU attention kernel").
constexpr long kMinHeadRunBytes = 2048;

Plan make_plan(const AttnParams& P, int threads, bool split_long) {
  Plan plan;
  std::vector<int> nblocks(P.B);
  for (int b = 0; b < P.B; ++b) nblocks[b] = (P.context_lens[b] + P.block_size - 1) / P.block_size;
  const long part = split_long ? segment_blocks(nblocks, P.block_size) : long(P.max_blocks) + 1;
  plan.seg_first.assign(P.B, 0);
  plan.seg_count.assign(P.B, 1);
  struct Range { int seq, begin, end, segment; };
  std::vector<Range> ranges;
  for (int b = 0; b < P.B; ++b) {
    const int k = int((nblocks[b] + part - 1) / part);
    if (k <= 1) {
      ranges.push_back({b, 0, nblocks[b], -1});
      continue;
    }
    plan.seg_first[b] = plan.num_segments;
    plan.seg_count[b] = k;
    for (int i = 0; i < k; ++i)
      ranges.push_back({b, int(long(nblocks[b]) * i / k), int(long(nblocks[b]) * (i + 1) / k), plan.num_segments++});
  }
  const long kv_row_bytes = long(P.Hkv) * P.D * (P.kv_dtype == kF32 ? 4 : 2);
  int hsplit = 1;
  while (threads > 1 && long(ranges.size()) * hsplit < 2L * threads && hsplit < P.Hkv) {
    int next = hsplit;
    do ++next; while (P.Hkv % next != 0);
    const bool balanced = 2 * long(ranges.size()) * hsplit >= 3L * threads;
    if (balanced && kv_row_bytes / next < kMinHeadRunBytes) break;
    hsplit = next;
  }
  const int hstep = P.Hkv / hsplit;
  std::vector<int> slot_of_seq(P.B, -1);
  plan.items.reserve(ranges.size() * hsplit);
  for (const Range& r : ranges) {
    if (r.segment >= 0 && slot_of_seq[r.seq] < 0) {
      slot_of_seq[r.seq] = int(plan.pending.size());
      plan.pending.insert(plan.pending.end(), hsplit, plan.seg_count[r.seq]);
    }
    for (int h = 0, hg = 0; h < P.Hkv; h += hstep, ++hg)
      plan.items.push_back({r.seq, r.begin, r.end, h, h + hstep, r.segment, r.segment >= 0 ? slot_of_seq[r.seq] + hg : -1});
  }
  std::stable_sort(plan.items.begin(), plan.items.end(), [](const WorkItem& a, const WorkItem& b) {
    return a.blk_end - a.blk_begin > b.blk_end - b.blk_begin;
  });
  return plan;
}

// Per-thread scratch, kept between calls (OpenMP pool threads persist) and grown on demand, so calls
// allocate nothing in steady state. Returns false when memory ran out.
bool thread_scratch(const AttnParams& P, Scratch& sc) {
  thread_local void* mem = nullptr;
  thread_local size_t cap = 0;
  const int bsp = (P.block_size + kMaxLanes - 1) / kMaxLanes * kMaxLanes;
  const size_t hd = size_t(P.Hq) * P.D, group = size_t(kMaxGroup) * bsp;
  struct Buffer {
    float** dst;
    size_t floats;
  };
  const Buffer buffers[] = {{&sc.q, hd}, {&sc.acc, hd}, {&sc.m, size_t(P.Hq)}, {&sc.l, size_t(P.Hq)},
                            {&sc.part, group * kMaxLanes}, {&sc.s[0], group}, {&sc.s[1], group}};
  auto padded = [](size_t floats) { return (floats * sizeof(float) + 63) / 64 * 64; };
  size_t bytes = 0;
  for (const Buffer& b : buffers) bytes += padded(b.floats);
  if (bytes > cap) {
    std::free(mem);
    mem = std::aligned_alloc(64, bytes);
    cap = mem ? bytes : 0;
    if (!mem) return false;
  }
  char* p = static_cast<char*>(mem);
  for (const Buffer& b : buffers) {
    *b.dst = reinterpret_cast<float*>(p);
    p += padded(b.floats);
  }
  sc.bsp = bsp;
  return true;
}

// One call's work: its plan, and the buffers its split sequences merge through.
struct Job {
  Plan plan;
  std::vector<float> seg_buf;
  std::vector<std::atomic<int>> pending;
  Segments segs{};
  ItemFn fn = nullptr;
  int num_items = 0;
};

bool bad_shape(const AttnParams& P, int num_threads) {
  return P.B < 0 || P.Hq <= 0 || P.Hkv <= 0 || P.Hq % P.Hkv != 0 || P.Hq / P.Hkv > 4096 || P.block_size <= 0 ||
         P.max_blocks < 0 || num_threads <= 0;
}

int prepare_job(const AttnParams& P, int num_threads, bool split_long, Job& job) {
  job.fn = select_item_fn(P.kv_dtype, P.D);
  if (!job.fn) return kUnsupported;
  job.plan = make_plan(P, num_threads, split_long);
  job.seg_buf.resize(size_t(job.plan.num_segments) * P.Hq * (P.D + 2));
  std::vector<std::atomic<int>> pending(job.plan.pending.size());
  for (size_t i = 0; i < pending.size(); ++i) pending[i].store(job.plan.pending[i], std::memory_order_relaxed);
  job.pending.swap(pending);
  job.segs = {job.seg_buf.data(), job.pending.data(), job.plan.seg_first.data(), job.plan.seg_count.data()};
  job.num_items = int(job.plan.items.size());
  return kOk;
}

int run_attention(const AttnParams& P, int num_threads, bool split_long) {
  thread_local Job caller_job;  // per calling thread: concurrent callers stay independent
  Job& job = caller_job;        // the team shares the caller's, not their own thread_local copies
  const int prepared = prepare_job(P, num_threads, split_long, job);
  if (prepared != kOk) return prepared;
  const int threads = std::max(1, std::min(num_threads, job.num_items));
  std::atomic<int> status{kOk};
#pragma omp parallel num_threads(threads)
  {
    Scratch sc{};
    const bool ok = thread_scratch(P, sc);
    if (!ok) status.store(kNoMemory);
    // Split sequences are merged by their last item, so there is no barrier between items and merges.
#pragma omp for schedule(dynamic, 1) nowait
    for (int i = 0; i < job.num_items; ++i)
      if (ok) job.fn(P, job.plan.items[i], sc, job.segs);
  }
  return status.load();
}

constexpr double kNoTimeout = -1.0;

// Spins until done() holds: for spin_s with a pause per check, then with a 20 us nap between checks (a waiter
// without a core of its own). Returns false once timeout_s has passed (never with kNoTimeout).
template <typename Done>
bool wait_until(Done done, double spin_s, double timeout_s) {
  using Clock = std::chrono::steady_clock;
  using Seconds = std::chrono::duration<double>;
  const auto start = Clock::now();
  const auto spin_end = start + std::chrono::duration_cast<Clock::duration>(Seconds(spin_s));
  const auto deadline = timeout_s < 0 ? Clock::time_point::max()
                                      : start + std::chrono::duration_cast<Clock::duration>(Seconds(timeout_s));
  const timespec nap{0, 20000};
  for (unsigned checks = 0;; ++checks) {
    if (done()) return true;
    if ((checks & 255) != 255) {
      _mm_pause();
      continue;
    }
    const auto now = Clock::now();
    if (now >= deadline) return false;
    if (now >= spin_end) nanosleep(&nap, nullptr);
  }
}

}  // namespace

#define NEO_API extern "C" __attribute__((visibility("default")))

NEO_API int neo_abi_version(void) { return kAbiVersion; }

// The Isa in use, and the best one this CPU supports.
NEO_API int neo_isa(void) { return g_isa.load(); }
NEO_API int neo_max_isa(void) { return g_max_isa; }

// Forces a path at or below neo_max_isa() (tests use it to cover every path). Returns 0, or -1 if refused.
NEO_API int neo_set_isa(int isa) {
  if (isa < kScalar || isa > g_max_isa) return -1;
  g_isa.store(isa);
  return 0;
}

// Decode attention for B sequences, one query token each. Inputs are validated by the Python binding;
// this only refuses what it cannot compute. Returns a Status code.
NEO_API int neo_paged_attention(const void* q, int q_dtype, const void* k_cache, const void* v_cache, int kv_dtype,
                                const int32_t* block_tables, const int32_t* context_lens, void* out, int B, int Hq,
                                int Hkv, int D, int block_size, int max_blocks, float scale, int num_threads,
                                int split_long) {
  const AttnParams P{q, q_dtype, k_cache, v_cache, kv_dtype, block_tables, context_lens, out,
                     B, Hq, Hkv, D, block_size, max_blocks, scale, int64_t(Hq) * D};
  if (bad_shape(P, num_threads)) return kBadArgument;
  if (B == 0) return kOk;
  try {
    return run_attention(P, num_threads, split_long != 0);
  } catch (const std::bad_alloc&) {
    return kNoMemory;
  }
}

// Writes each new token's k/v rows ([Hkv, D], row_bytes each, src_stride bytes apart in k and v) at
// slot = block_id * block_size + offset.
static void append_rows(const void* k, const void* v, void* k_cache, void* v_cache, const int64_t* slots, int B,
                        size_t row_bytes, size_t src_stride) {
  for (int i = 0; i < B; ++i) {
    const size_t dst = size_t(slots[i]) * row_bytes, src = size_t(i) * src_stride;
    std::memcpy(static_cast<char*>(k_cache) + dst, static_cast<const char*>(k) + src, row_bytes);
    std::memcpy(static_cast<char*>(v_cache) + dst, static_cast<const char*>(v) + src, row_bytes);
  }
}

// append_rows of contiguous k and v.
NEO_API int neo_append_kv(const void* k, const void* v, void* k_cache, void* v_cache, const int64_t* slots, int B,
                          size_t row_bytes) {
  append_rows(k, v, k_cache, v_cache, slots, B, row_bytes, row_bytes);
  return kOk;
}

// STREAM-like read: sums n floats with num_threads threads (static split, same ISA path as the kernel).
// The sum is returned so the reads cannot be optimised away.
NEO_API double neo_stream_read(const float* p, size_t n, int num_threads) {
  const ReadSumFn fn = select_read_sum();
  const int threads = std::max(1, num_threads);
  double total = 0.0;
#pragma omp parallel for num_threads(threads) schedule(static, 1) reduction(+ : total)
  for (int i = 0; i < threads; ++i) {
    const size_t begin = n * i / threads / 16 * 16, end = i + 1 == threads ? n : n * (i + 1) / threads / 16 * 16;
    total += fn(p + begin, end - begin);
  }
  return total;
}

// Waits until *flag >= target (returns kSet), *flag < 0 (kFailed: the other side gave up) or timeout_s passes
// (kTimedOut). The hand-off between the engine's launching thread and its CPU-attention thread: for spin_s it
// spins, so it sees the store within a cache-line transfer, where a futex wake-up costs tens of microseconds
// on a host whose cores the attention team keeps busy; after that it sleeps 20 us between checks. Spin only
// where the waiter has a core of its own.
NEO_API int neo_wait_flag(const int64_t* flag, int64_t target, double spin_s, double timeout_s) {
  int64_t value = 0;
  const bool seen = wait_until(
      [&] {
        value = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
        return value >= target || value < 0;
      },
      spin_s, timeout_s);
  if (!seen) return kTimedOut;
  return value < 0 ? kFailed : kSet;
}

// The leader's part of an iteration's step before the team runs it: wait for the device's q/k/v (`start` is
// when they came), append k/v, and plan the step's work into `P` and `job`. Returns a Status or IterationStatus.
static int begin_step(const int64_t* f, size_t row_bytes, int team, double spin_s, double timeout_s, AttnParams& P,
                      Job& job, std::chrono::steady_clock::time_point& start) {
  auto ptr = [f](int field) { return reinterpret_cast<void*>(f[field]); };
  const int waited = neo_wait_flag(static_cast<const int64_t*>(ptr(kReady)), 1, spin_s, timeout_s);
  start = std::chrono::steady_clock::now();
  if (waited != kSet) return waited == kFailed ? kAbandoned : kHandOffTimedOut;
  P.B = int(f[kBatch]);
  const size_t kv_stride = size_t(f[kKVRowStride]) * (row_bytes / (size_t(P.Hkv) * P.D));
  append_rows(ptr(kKNew), ptr(kVNew), ptr(kKCache), ptr(kVCache), static_cast<const int64_t*>(ptr(kSlots)), P.B,
              row_bytes, kv_stride);
  P.q = ptr(kQ), P.k_cache = ptr(kKCache), P.v_cache = ptr(kVCache), P.out = ptr(kOut);
  P.q_row_stride = f[kQRowStride];
  P.block_tables = static_cast<const int32_t*>(ptr(kTables));
  P.context_lens = static_cast<const int32_t*>(ptr(kLens));
  P.max_blocks = int(f[kMaxBlocks]);
  try {
    return bad_shape(P, team) ? kBadArgument : prepare_job(P, team, true, job);
  } catch (const std::bad_alloc&) {
    return kNoMemory;
  }
}

// The CPU side of a whole pipelined iteration in one call, so no Python (and no GIL) sits between layers:
// for each step in order, wait until *ready >= 1 (the device has copied its q/k/v down), append k/v, attend,
// record its seconds and publish *done = 1. On an error or a ready flag < 0 (the launching side gave up)
// every remaining done flag is set to kFlagFailed and the status returned (a kernel status, or kHandOffTimedOut /
// kAbandoned for a wait that timed out / a step the launching side never gave).
// The OpenMP team stays in one parallel region for the whole iteration: between steps its threads spin on the
// step counter (as the ready flag's waiter does, for spin_s), where a region per step let them fall asleep
// during each layer's device work and paid their wake-up in every step.
NEO_API int neo_decode_iteration(const int64_t* steps, int num_steps, int q_dtype, int kv_dtype, int Hq, int Hkv,
                                 int D, int block_size, float scale, int num_threads, double spin_s,
                                 double timeout_s, double* seconds) {
  const size_t row_bytes = size_t(Hkv) * D * (kv_dtype == kF32 ? 4 : 2);
  Job job;
  AttnParams P{nullptr, q_dtype, nullptr, nullptr, kv_dtype, nullptr, nullptr, nullptr, 0, Hq, Hkv, D, block_size, 0,
               scale, int64_t(Hq) * D};
  std::atomic<int> published{-1};  // the step whose job the team may run
  std::atomic<int> finished{0};    // threads through the current step's items
  std::atomic<int> next_item{0};
  std::atomic<bool> stop{false};
  std::atomic<bool> out_of_memory{false};
  int status = kOk;
  int s = 0;
#pragma omp parallel num_threads(std::max(1, num_threads))
  {
    const bool leader = omp_get_thread_num() == 0;
    const int team = omp_get_num_threads();
    Scratch sc{};
    bool have_scratch = false;
    for (int step = 0; step < num_steps; ++step) {
      const int64_t* f = steps + size_t(step) * kStepFields;
      std::chrono::steady_clock::time_point start;
      if (leader) {
        if (status == kOk) status = begin_step(f, row_bytes, team, spin_s, timeout_s, P, job, start);
        if (status != kOk) stop.store(true, std::memory_order_relaxed);
        next_item.store(0, std::memory_order_relaxed);
        finished.store(0, std::memory_order_relaxed);
        published.store(step, std::memory_order_release);
      } else {
        wait_until([&] { return published.load(std::memory_order_acquire) >= step; }, spin_s, kNoTimeout);
      }
      if (stop.load(std::memory_order_relaxed)) break;
      if (!have_scratch) {
        have_scratch = thread_scratch(P, sc);
        if (!have_scratch) out_of_memory.store(true, std::memory_order_relaxed);
      }
      for (int i; (i = next_item.fetch_add(1, std::memory_order_relaxed)) < job.num_items;)
        if (have_scratch) job.fn(P, job.plan.items[i], sc, job.segs);
      finished.fetch_add(1, std::memory_order_acq_rel);
      if (leader) {
        wait_until([&] { return finished.load(std::memory_order_acquire) == team; }, spin_s, kNoTimeout);
        seconds[step] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (out_of_memory.load(std::memory_order_relaxed)) status = kNoMemory;
        if (status == kOk) {
          __atomic_store_n(reinterpret_cast<int64_t*>(f[kDone]), int64_t(1), __ATOMIC_RELEASE);
          s = step + 1;
        }
      }
    }
  }
  for (; s < num_steps; ++s)
    __atomic_store_n(reinterpret_cast<int64_t*>(steps[size_t(s) * kStepFields + kDone]), kFlagFailed, __ATOMIC_RELEASE);
  return status;
}
