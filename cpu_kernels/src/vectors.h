// The target's float vectors (GCC vector extensions), shared by the attention kernels and the encoder: each
// file including this is compiled once per instruction set, so the lanes are that build's (16, 8 or 4 floats).
#pragma once

#include <cstdint>
#include <cstring>

#include "numerics.h"

namespace rq {
namespace {

// Lanes of the target's float register: vectors of kLanes are the working width, and the link functions'
// byte blocks are at most kLanes wide (wider vectors are lowered lane by lane on narrower targets).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

template <int W>
struct V {
  typedef float f __attribute__((vector_size(4 * W)));
  typedef int32_t i __attribute__((vector_size(4 * W)));
};
using vf = V<kLanes>::f;
using vi = V<kLanes>::i;

template <class T>
inline T load(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
inline void store(void* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

// float8_e4m3fn values (the bits in each lane's low byte) as float32, branch-free: numerics.h's from_fp8 lane by
// lane, except that a NaN keeps its sign.
inline vf fp8_lanes(vi x) {
  const vi mag = x & 0x7f, sign = (x & 0x80) << 24;
  const vi sub = bits_as<vi>(__builtin_convertvector(mag, vf) * 0x1p-9f);
  const vi normal = (mag << 20) + (120 << 23);
  const vi nan = vi{} + 0x7fc00000;
  return bits_as<vf>((mag < 8 ? sub : (mag == 0x7f ? nan : normal)) | sign);
}

}  // namespace
}  // namespace rq
