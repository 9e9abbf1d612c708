// Scalar conversions from the stored narrow types (bfloat16, float16, float8_e4m3fn) to float32, as the
// attention kernels read them. The encoder's conversions the other way are in encode.cc, a vector per lane.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace rq {

template <class To, class From>
inline To bits_as(From x) {
  static_assert(sizeof(To) == sizeof(From));
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}

inline float from_bf16(uint16_t h) { return bits_as<float>(uint32_t(h) << 16); }

inline float from_f16(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  if (exp == 0) return bits_as<float>(bits_as<uint32_t>(std::ldexp(float(man), -24)) | sign);  // zero, subnormal
  return bits_as<float>(exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | (uint32_t(exp + 112) << 23) | (man << 13));
#endif
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f / 0xff are NaN.
inline float from_fp8(uint8_t x) {
  const uint32_t mag = x & 0x7f, sign = uint32_t(x & 0x80) << 24;
  if (mag == 0x7f) return std::nanf("");
  const float f = mag < 8 ? float(mag) * 0x1p-9f : bits_as<float>((mag << 20) + (120u << 23));
  return bits_as<float>(bits_as<uint32_t>(f) | sign);
}

}  // namespace rq
