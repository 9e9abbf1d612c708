// Decode attention over rq_jax's cache layouts on a CPU, and the write's encoder: the problem descriptions the
// FFI handlers fill in (ffi.cc) and the per-work-item kernels, compiled once per instruction set
// (attention.cc, encode.cc).
//
// Layouts (rq_jax's, the Pallas kernels' too; M stacks the slots, `slot` picks one):
//   q              [B, K, R, D]       float32 | bfloat16 (rotated key basis for the quantized chains)
//   dense k, v     [M, NP, K, P, D]   float32 | bfloat16
//   link codes     [M, NP, K, P, D·bits/8] uint8, planar packing (plane p of a byte row: channels [pJ, (p+1)J))
//   link metadata  [M, NP, K, P, D/g] float8_e4m3fn | bfloat16 | float16 | float32 (scale, offset)
//   alpha          [M, NP, K, P]      bfloat16 bits (link i's α scales link i + 1), or absent (α = 1)
//   mean scores    [B, K, R, links]   float32 (q·μ_i per key link), or absent
//   rotations      [M, K, D, D]       float32 key and value rotations U (z = U x) of every slot, or absent:
//                                     given them, q comes in the original basis, is rotated per row by its
//                                     slot's U, and acc is un-rotated per row
//   block table    [B, N]             int32: row b's tokens [nP, (n+1)P) lie in page table[b, n]; absent: the
//                                     contiguous layout, NP = B and P = S (the identity table [B, 1])
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
inline int meta_width(int meta) { return meta == kFP8 ? 1 : meta == kF32 ? 4 : 2; }  // bytes

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
  int64_t B = 0, K = 0, R = 0, D = 0, M = 0;
  int64_t NP = 0, P = 0;  // pages in the pool and tokens per page (contiguous: NP = B, P = S)
  int64_t S = 0;          // positions a row can hold: P × table columns (contiguous: P)
  int64_t slot = 0;
  const int32_t* lengths = nullptr;
  const int32_t* table = nullptr;  // [B, S / P], or nullptr: page b of row b
  const void* q = nullptr;
  bool q_bf16 = false;
  int64_t row0 = 0, rows = 0;  // the query rows [row0, row0 + rows) of R this call's items cover
  // dense
  const void* k = nullptr;
  const void* v = nullptr;
  bool kv_bf16 = false;
  int64_t kv_bytes() const { return kv_bf16 ? 2 : 4; }  // of one dense K or V value
  // quantized chains
  Chain keys, values;
  const float* mean_scores = nullptr;  // [B, K, R, keys.n]
  const float* key_rot = nullptr;      // [M, K, D, D] or nullptr: q already rotated
  const float* value_rot = nullptr;    // [M, K, D, D] or nullptr: acc left in the rotated value basis

  // The slot's rotation of kv head k in u (key_rot or value_rot).
  const float* slot_rotation(const float* u, int64_t k) const { return u + (slot * K + k) * D * D; }

  // Flat index of token s of (b, k) in the slot: rows of every [M, NP, K, P, ...] leaf. Tokens of one page
  // are consecutive rows.
  int64_t token(int64_t b, int64_t k, int64_t s) const {
    const int64_t page = table ? table[b * (S / P) + s / P] : b;
    return ((slot * NP + page) * K + k) * P + s % P;
  }
};

using ItemFn = void (*)(const Problem&, int64_t b, int64_t k, int64_t s0, int64_t s1, float* acc, float* m,
                        float* l);

// The encoder (encode.cc): the V = O·B·K·T vectors of a loop group of L loops, z and mean [O, K, L, B, T, D]
// float32 (the rotation's dot product lays them out so: per head, the loops, then rows and tokens), coded loop
// by loop in `order` (references first); every result is laid out by vector [O, B, K, T] (the cache's order).
// Only the tokens t < num_new[b] of each row are coded: the others' results are zeros (a call's padding).
// Per loop: its codes [V, D·bits/8] (planar packed; none at 0 bits), metadata scale/offset [V, D/g] (kFP8:
// uint8 bits, kBF16: uint16 bits), its parent in the group (-1: none, the anchor or a loop coded on its own)
// and, with least squares, its α row of alpha [L', V] (bfloat16 bits); lost [V] counts the values no stored
// field could hold.
struct EncodeLoop {
  int bits;   // 0, 1, 2, 4 or 8
  int group;  // channels per scale/offset
  float clip;
  int parent;
  int alpha_row;
  uint8_t* codes;
  void* scale;
  void* offset;
};

struct EncodeProblem {
  int64_t V = 0, K = 0, B = 0, T = 0;  // V = O·B·K·T vectors
  int L = 0, D = 0, meta = kFP8;
  bool least_squares = false;
  const float* z = nullptr;
  const int32_t* num_new = nullptr;
  const float* mean = nullptr;
  int order[kMaxLinks] = {};
  EncodeLoop loop[kMaxLinks];
  uint16_t* alpha = nullptr;
  int32_t* lost = nullptr;
};

using EncodeFn = void (*)(const EncodeProblem&, int64_t v0, int64_t v1);

struct Kernels {
  ItemFn dense;
  ItemFn quant;
  EncodeFn encode;
  const char* isa;
};

Kernels kernels_generic();
EncodeFn encoder_generic();
#if defined(__x86_64__)
Kernels kernels_avx512();
Kernels kernels_avx2();
EncodeFn encoder_avx512();
EncodeFn encoder_avx2();
#else  // one build on other CPUs: the portable kernels stand in for the x86 ones
inline Kernels kernels_avx512() { return kernels_generic(); }
inline Kernels kernels_avx2() { return kernels_generic(); }
#endif

}  // namespace rq
