// The write's encoder: a loop group of rotated K or V vectors coded as ResidualQuant stores them (an anchor,
// residuals against least-squares scaled references, planar-packed codes, FP8 or bfloat16 metadata), the
// same bits as rq_jax's XLA encoder (`rq_jax.quant.residual.encode_decode_group` with `affine.quantize`
// and `packing.pack`). Compiled once per instruction set like attention.cc, but with every operation
// rounded as written (-ffp-contract=off, no reassociation): what it computes is fixed by the encoder's
// definition, not left to the compiler.
//
// Per vector (one token of one head of one layer) and loop r, in encode order (the anchor first):
//
//   pred   = bf16(<z_r, R> / |R|²) · R     R the parent's reconstruction (no α without least squares)
//   target = (z_r − pred) − μ_r
//   per channel group: lo, hi = min, max;  rad = (hi/2 − lo/2)·clip;  offset = meta((hi/2 + lo/2) − rad)
//                      (clip 1: rad = hi/2 − lo/2, offset = meta(lo));  scale = meta(2·rad / (2^b − 1))
//                      code = clamp(round_half_down((target − offset) / scale), 0, 2^b − 1)
//   recon  = (offset + scale · code + pred) + μ_r
//
// with the dot products summed pairwise in one fixed order, metadata saturating at the dtype's max, and
// the values it could not store counted (saturated or flushed metadata, non-finite targets).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "kernels.h"
#include "numerics.h"
#include "vectors.h"

#ifndef RQ_ISA
#error "compile with -DRQ_ISA=generic|avx2|avx512"
#endif
#define RQ_CAT2(a, b) a##b
#define RQ_CAT(a, b) RQ_CAT2(a, b)

namespace rq {
namespace {

constexpr float kBf16Max = 3.38953139e38f;

// Σ x over n values in one fixed order: zero-padded to a power of two, then halves added elementwise
// (`rq_jax.quant.residual.pairwise_sum`). Destroys `x` (capacity a power of two >= n).
float pairwise_sum(float* x, int n) {
  int width = 1;
  while (width < n) width *= 2;
  std::fill(x + n, x + width, 0.0f);
  for (int h = width / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) x[i] = x[i] + x[i + h];
  return x[0];
}

inline float clamp_finite(float x) { return std::min(std::max(x, -FLT_MAX), FLT_MAX); }

// bfloat16(<x, ref> / |ref|²), 0 where |ref|² underflows (`ls_alpha`).
uint16_t ls_alpha(const float* x, const float* ref, int d, float* scratch) {
  for (int c = 0; c < d; ++c) scratch[c] = x[c] * ref[c];
  const float num = pairwise_sum(scratch, d);
  for (int c = 0; c < d; ++c) scratch[c] = ref[c] * ref[c];
  const float den = pairwise_sum(scratch, d);
  float a = den > FLT_MIN ? num / den : 0.0f;
  if (std::isnan(a)) a = 0.0f;
  return to_bf16(std::min(std::max(clamp_finite(a), -kBf16Max), kBf16Max));
}

// The stored metadata value of v and it back as float32; `lost` counts a saturated or flushed one.
inline float store_meta(float v, int meta, void* out, int64_t i, int& lost) {
  const float m = meta == kFP8 ? 448.0f : kBf16Max;
  const float clipped = std::min(std::max(v, -m), m);
  float back;
  if (meta == kFP8) {
    const uint8_t bits = to_fp8(clipped);
    static_cast<uint8_t*>(out)[i] = bits;
    back = from_fp8(bits);
  } else {
    const uint16_t bits = to_bf16(clipped);
    static_cast<uint16_t*>(out)[i] = bits;
    back = from_bf16(bits);
  }
  lost += (std::fabs(v) > m) + (v != 0.0f && back == 0.0f);
  return back;
}

// The least and greatest finite values of x[0, n) (+inf and -inf when there are none), a vector of lanes at a
// time: min and max are exact, so their order changes no value (only which of a -0 and a +0 tie returns).
void finite_range(const float* x, int n, float* lo, float* hi) {
  vf vlo = vf{} + INFINITY, vhi = vf{} - INFINITY;
  int c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    const vf v = load<vf>(x + c);
    const vi finite = (v - v) == (v - v);  // x − x is NaN for an infinity or a NaN
    vlo = (finite & (v < vlo)) ? v : vlo;
    vhi = (finite & (v > vhi)) ? v : vhi;
  }
  float l = INFINITY, h = -INFINITY;
  for (int i = 0; i < kLanes; ++i) l = std::min(l, vlo[i]), h = std::max(h, vhi[i]);
  for (; c < n; ++c)
    if (std::isfinite(x[c])) l = std::min(l, x[c]), h = std::max(h, x[c]);
  *lo = l;
  *hi = h;
}

// The codes of one group's n values as floats: clamp(round_half_down((x − o) / div), 0, top), NaN quotients
// coded as 0 and infinite ones as the finite extremes.
void code_values(const float* __restrict x, int n, float o, float div, float top, float* __restrict out) {
  for (int c = 0; c < n; ++c) {
    float u = (x[c] - o) / div;
    u = u != u ? 0.0f : u;
    u = u > FLT_MAX ? FLT_MAX : (u < -FLT_MAX ? -FLT_MAX : u);
    const float f = std::floor(u);
    const float r = u - f > 0.5f ? f + 1.0f : f;
    out[c] = std::min(std::max(r, 0.0f), top);
  }
}

// One loop of one vector: target [D] quantized group by group into `codes` [D] (unpacked) and the
// metadata rows of `ln` at vector v, its dequantized values into `deq` [D]; returns the values lost.
int quantize(const EncodeLoop& ln, int meta, int d, int64_t v, const float* target, uint8_t* codes, float* deq) {
  int lost = 0;
  for (int c = 0; c < d; ++c) lost += !std::isfinite(target[c]);
  if (ln.bits == 0) {  // nothing stored: the loop reads its reference alone
    std::fill(deq, deq + d, 0.0f);
    return lost;
  }
  const int g = ln.group, ng = d / g, top = (1 << ln.bits) - 1;
  for (int gi = 0; gi < ng; ++gi) {
    const float* x = target + gi * g;
    float lo, hi;
    finite_range(x, g, &lo, &hi);
    if (!(lo <= hi)) lo = hi = 0.0f;  // no finite value
    float rad, low;
    if (ln.clip == 1.0f) {
      rad = hi / 2 - lo / 2;
      low = lo;
    } else {
      rad = clamp_finite((hi / 2 - lo / 2) * ln.clip);
      low = (hi / 2 + lo / 2) - rad;
    }
    const float s = store_meta(2 * rad / float(top), meta, ln.scale, v * ng + gi, lost);
    const float o = store_meta(low, meta, ln.offset, v * ng + gi, lost);
    const float div = s > 0.0f ? s : 1.0f;
    float* cf = deq + gi * g;  // the codes as floats first (branch-free loops the compiler vectorizes)
    code_values(x, g, o, div, float(top), cf);
    for (int c = 0; c < g; ++c) codes[gi * g + c] = uint8_t(int32_t(cf[c]));
    for (int c = 0; c < g; ++c) cf[c] = o + s * cf[c];
  }
  return lost;
}

// Planar packing (`packing.pack`): byte j holds channel j + kJ in bits [k·bits, (k+1)·bits).
void pack(const uint8_t* codes, int bits, int d, uint8_t* out) {
  const int planes = 8 / bits, j_max = d / planes;
  for (int j = 0; j < j_max; ++j) {
    uint8_t byte = 0;
    for (int k = 0; k < planes; ++k) byte |= uint8_t(codes[j + k * j_max] << (k * bits));
    out[j] = byte;
  }
}

// Vector v's results zeroed: every stored loop's codes and metadata, its α rows and its lost count.
void clear_vector(const EncodeProblem& p, int64_t v) {
  const int meta_bytes = p.meta == kFP8 ? 1 : 2;
  for (int r = 0; r < p.L; ++r) {
    const EncodeLoop& ln = p.loop[r];
    if (ln.bits) {
      const int64_t code_bytes = p.D * ln.bits / 8, meta_row = int64_t(p.D / ln.group) * meta_bytes;
      std::memset(ln.codes + v * code_bytes, 0, code_bytes);
      std::memset(static_cast<uint8_t*>(ln.scale) + v * meta_row, 0, meta_row);
      std::memset(static_cast<uint8_t*>(ln.offset) + v * meta_row, 0, meta_row);
    }
    if (p.alpha && ln.parent >= 0) p.alpha[int64_t(ln.alpha_row) * p.V + v] = 0;
  }
  p.lost[v] = 0;
}

void encode_vectors(const EncodeProblem& p, int64_t v0, int64_t v1) {
  const int d = p.D;
  float recon[kMaxLinks][kMaxDim], target[kMaxDim], deq[kMaxDim], pred[kMaxDim], scratch[2 * kMaxDim];
  uint8_t codes[kMaxDim];
  const int64_t rows = p.B * p.T;  // the vectors of one loop of one head, [B, T]
  for (int64_t v = v0; v < v1; ++v) {
    // v = ((o·B + b)·K + k)·T + t in the results; in z, loop r of it lies at ((o·K + k)·L + r)·B·T + b·T + t.
    const int64_t t = v % p.T, k = v / p.T % p.K, b = v / (p.T * p.K) % p.B, o = v / (p.T * p.K * p.B);
    if (t >= p.num_new[b]) {  // padding: nothing coded, every result zero
      clear_vector(p, v);
      continue;
    }
    const int64_t first = (o * p.K + k) * p.L * rows + b * p.T + t;
    int lost = 0;
    for (int i = 0; i < p.L; ++i) {
      const int r = p.order[i];
      const EncodeLoop& ln = p.loop[r];
      const float* z = p.z + (first + r * rows) * d;
      const float* mu = p.mean ? p.mean + (first + r * rows) * d : nullptr;
      const bool has_pred = ln.parent >= 0;
      if (has_pred) {
        const float* ref = recon[ln.parent];
        if (p.least_squares) {
          const uint16_t a = ls_alpha(z, ref, d, scratch);
          p.alpha[int64_t(ln.alpha_row) * p.V + v] = a;
          const float af = from_bf16(a);
          for (int c = 0; c < d; ++c) pred[c] = af * ref[c];
        } else {
          std::copy(ref, ref + d, pred);
        }
      }
      for (int c = 0; c < d; ++c) {
        float t = has_pred ? z[c] - pred[c] : z[c];
        target[c] = mu ? t - mu[c] : t;
      }
      lost += quantize(ln, p.meta, d, v, target, codes, deq);
      if (ln.bits) pack(codes, ln.bits, d, ln.codes + v * (d * ln.bits / 8));
      for (int c = 0; c < d; ++c) {
        float x = has_pred ? deq[c] + pred[c] : deq[c];
        recon[r][c] = mu ? x + mu[c] : x;
      }
    }
    p.lost[v] = lost;
  }
}

}  // namespace

EncodeFn RQ_CAT(encoder_, RQ_ISA)() { return encode_vectors; }

}  // namespace rq
