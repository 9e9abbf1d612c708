// The target's float vectors (GCC vector extensions), shared by the attention kernels and the encoder: each
// file including this is compiled once per instruction set, so the lanes are that build's (16, 8 or 4 floats).
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace
}  // namespace rq
