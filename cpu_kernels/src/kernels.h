// Decode attention over rq_jax's cache layouts on a CPU: the problem description the FFI handlers fill in
// (ffi.cc) and the per-work-item kernels, compiled once per instruction set (attention.cc).
//
// Layouts (rq_jax's, the Pallas kernels' too; M stacks the slots, `slot` picks one):
//   q              [B, K, R, D]       float32 | bfloat16 (rotated key basis for the quantized chains)
//   dense k, v     [M, B, K, S, D]    float32 | bfloat16
//   link codes     [M, B, K, S, D·bits/8] uint8, planar packing (plane p of a byte row: channels [pJ, (p+1)J))
//   link metadata  [M, B, K, S, D/g]  float8_e4m3fn | bfloat16 | float16 | float32 (scale, offset)
//   alpha          [M, B, K, S]       bfloat16 bits (link i's α scales link i + 1), or absent (α = 1)
//   mean scores    [B, K, R, links]   float32 (q·μ_i per key link), or absent
// A work item is one (row b, kv head k) over tokens [s0, s1) of row b's stored past (s1 <= lengths[b]):
// it writes the unnormalised partial acc [R, D], m [R], l [R] (float32; m = kNeg, l = 0, acc = 0 when
// s0 == s1).
#pragma once

#include <cstdint>

namespace rq {

constexpr float kNeg = -1e30f;  // finite "minus infinity" of the running max (as pallas_kernels.NEG)
constexpr int kMaxLinks = 8;
constexpr int kMaxDim = 512;
constexpr int kMaxRows = 64;  // query rows per kv head in one item (more rows: the handler splits them)

enum Meta : int { kF32 = 0, kBF16 = 1, kF16 = 2, kFP8 = 3 };

struct Link {
  const uint8_t* codes;
  const void* scale;
  const void* offset;
  int meta;   // Meta of scale and offset
  int bits;   // 1, 2, 4 or 8
  int group;  // channels per scale/offset
  int dim;    // channels D
};

struct Chain {
  int n = 0;
  Link link[kMaxLinks];
  const uint16_t* alpha[kMaxLinks] = {};  // alpha[i] scales link i + 1; nullptr: α = 1
};

struct Problem {
  int64_t B = 0, K = 0, R = 0, D = 0, S = 0, M = 0;
  int64_t slot = 0;
  const int32_t* lengths = nullptr;
  const void* q = nullptr;
  bool q_bf16 = false;
  int64_t row0 = 0, rows = 0;  // the query rows [row0, row0 + rows) of R this call's items cover
  // dense
  const void* k = nullptr;
  const void* v = nullptr;
  bool kv_bf16 = false;
  // quantized chains
  Chain keys, values;
  const float* mean_scores = nullptr;  // [B, K, R, keys.n]

  // Flat index of token s of (b, k) in the slot: rows of every [M, B, K, S, ...] leaf.
  int64_t token(int64_t b, int64_t k, int64_t s) const { return ((slot * B + b) * K + k) * S + s; }
};

using ItemFn = void (*)(const Problem&, int64_t b, int64_t k, int64_t s0, int64_t s1, float* acc, float* m,
                        float* l);

struct Kernels {
  ItemFn dense;
  ItemFn quant;
  const char* isa;
};

Kernels kernels_generic();
#if defined(__x86_64__)
Kernels kernels_avx512();
Kernels kernels_avx2();
#else  // one build on other CPUs: the portable kernels stand in for the x86 ones
inline Kernels kernels_avx512() { return kernels_generic(); }
inline Kernels kernels_avx2() { return kernels_generic(); }
#endif

}  // namespace rq
