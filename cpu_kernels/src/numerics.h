// Scalar conversions between float32 and the stored narrow types (bfloat16, float16, float8_e4m3fn), shared
// by the attention kernels (reading) and the encoder (writing). Rounding is to nearest, ties to even, as
// XLA converts.
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

// A finite float32 rounded to bfloat16 (its bits).
inline uint16_t to_bf16(float x) {
  const uint32_t a = bits_as<uint32_t>(x);
  return uint16_t((a + 0x7fffu + ((a >> 16) & 1u)) >> 16);
}

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

// A float32 of magnitude at most 448 (e4m3fn's largest) rounded to float8_e4m3fn (its bits); NaN to NaN.
inline uint8_t to_fp8(float x) {
  const uint32_t bits = bits_as<uint32_t>(x), a = bits & 0x7fffffffu;
  const uint8_t sign = uint8_t((bits >> 24) & 0x80);
  if (a > 0x7f800000u) return sign | 0x7f;
  if (a < 0x3c800000u)  // below 2^-6: a subnormal m · 2^-9 (m = 8 is the smallest normal, 0x08)
    return sign | uint8_t(std::nearbyint(bits_as<float>(a) * 512.0f));
  const uint32_t rounded = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;  // exponent and 3 mantissa bits
  return sign | uint8_t(rounded - (120u << 3));
}

}  // namespace rq
