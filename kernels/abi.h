// The numbers of the C ABI, defined here only: neo_backend/cpu/abi.py mirrors them for ctypes and
// tests/test_cpu_abi.py checks the mirror against this file.
#pragma once

#include <cstdint>

namespace neo {

// Bumped whenever a signature or a number of the ABI changes; the Python binding refuses a mismatched library.
constexpr int kAbiVersion = 5;

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// SIMD paths: scalar, AVX2+FMA+F16C, AVX-512.
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// What neo_paged_attention returns (and neo_decode_iteration, besides an IterationStatus).
enum Status : int { kOk = 0, kUnsupported = 1, kNoMemory = 2, kBadArgument = 3 };

// What neo_wait_flag returns.
enum WaitStatus : int { kSet = 0, kFailed = 1, kTimedOut = 2 };

// What neo_decode_iteration returns when a hand-off, not a kernel, stopped it.
enum IterationStatus : int { kHandOffTimedOut = 12, kAbandoned = 20 };

// A hand-off flag holding this (any negative value) means the side that should set it gave up.
constexpr int64_t kFlagFailed = -1;

// The fields of one step of neo_decode_iteration's table, each an int64 (pointers travel as int64). q's rows are
// kQRowStride elements apart, k/v's kKVRowStride: views of one buffer of every row's q, k and v, as the device
// copies them down in one piece.
enum StepField : int {
  kReady, kDone, kQ, kKNew, kVNew, kOut, kKCache, kVCache, kSlots, kTables, kLens, kBatch, kMaxBlocks,
  kQRowStride, kKVRowStride, kStepFields
};

}  // namespace neo
