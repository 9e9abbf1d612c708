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
//
// kLanes vectors are coded at once, one to a lane: their values are transposed so that a register holds one
// channel of every lane's vector, and each step above is applied lane by lane — the same operations in the
// same order as for one vector, with no sum or min across lanes. (A group's min and max run over its channels
// in order, so a -0 and +0 tie returns the first; the result's value does not depend on the order.)
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "numerics.h"
#include "vectors.h"

#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef RQ_ISA
#error "compile with -DRQ_ISA=generic|avx2|avx512"
#endif
#define RQ_CAT2(a, b) a##b
#define RQ_CAT(a, b) RQ_CAT2(a, b)

namespace rq {
namespace {

constexpr float kBf16Max = 3.38953139e38f;

typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));

inline vf sel(vi m, vf a, vf b) { return m ? a : b; }
inline vi finite(vf x) { return (bits_as<vi>(x) & 0x7f800000) != 0x7f800000; }
// std::min and std::max lane by lane: the first argument on a tie or a NaN second.
inline vf vmin(vf a, vf b) { return b < a ? b : a; }
inline vf vmax(vf a, vf b) { return a < b ? b : a; }
inline vf clamp_finite(vf x) { return vmin(vmax(x, vf{} - FLT_MAX), vf{} + FLT_MAX); }

inline vf vfloor(vf u) {
#if defined(__AVX512F__)
  return (vf)_mm512_roundscale_ps((__m512)u, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#elif defined(__AVX2__)
  return (vf)_mm256_floor_ps((__m256)u);
#else
  // Truncated (exact below 2^23; at or above it u is whole), u's sign on a zero, then one down where that is
  // above u.
  const vf t = __builtin_convertvector(__builtin_convertvector(u, vi), vf);
  const vf z = bits_as<vf>(bits_as<vi>(t) | (bits_as<vi>(u) & int32_t(0x80000000)));
  const vf f = z > u ? z - 1.0f : z;
  return (u < 0x1p23f) & (u > -0x1p23f) ? f : u;
#endif
}

// Lane by lane, the stored bits in each lane's low bits: float32 to float8_e4m3fn (magnitudes up to 448,
// e4m3fn's largest; NaN to NaN; back with vectors.h's fp8_lanes) and a finite float32 to bfloat16. Rounding
// is to nearest, ties to even, as XLA converts.
inline vu to_fp8(vf x) {
  const vu bits = bits_as<vu>(x), a = bits & 0x7fffffffu, sign = (bits >> 24) & 0x80u;
  // below 2^-6 a subnormal m · 2^-9: a · 512 < 8, rounded to the nearest integer (ties to even) by 2^23
  const vf m = (bits_as<vf>(a) * 512.0f + 0x1p23f) - 0x1p23f;
  const vu sub = bits_as<vu>(__builtin_convertvector(m, vi));
  const vu normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  return sign | (a > 0x7f800000u ? vu{} + 0x7fu : (a < 0x3c800000u ? sub : normal));
}
inline vu to_bf16(vf x) {
  const vu a = bits_as<vu>(x);
  return (a + 0x7fffu + ((a >> 16) & 1u)) >> 16;
}

// The stored metadata of each lane's v (its bits) and it back as float32 (`back`); `lost` counts a saturated
// or flushed one.
inline vu store_meta(vf v, int meta, vf& back, vi& lost) {
  const float m = meta == kFP8 ? 448.0f : kBf16Max;
  const vf clipped = vmin(vmax(v, vf{} - m), vf{} + m);
  vu bits;
  if (meta == kFP8) {
    bits = to_fp8(clipped);
    back = fp8_lanes(bits_as<vi>(bits));
  } else {
    bits = to_bf16(clipped);
    back = bits_as<vf>(bits << 16);
  }
  lost -= bits_as<vf>(bits_as<vi>(v) & 0x7fffffff) > m;  // a true compare is -1
  lost -= (v != 0.0f) & (back == 0.0f);
  return bits;
}

// Σ x over n channels in one fixed order: zero-padded to a power of two, then halves added elementwise
// (`rq_jax.quant.residual.pairwise_sum`). Destroys `x` (capacity a power of two >= n).
vf pairwise_sum(vf* x, int n) {
  int width = 1;
  while (width < n) width *= 2;
  std::fill(x + n, x + width, vf{});
  for (int h = width / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) x[i] = x[i] + x[i + h];
  return x[0];
}

// bfloat16(<x, ref> / |ref|²) (its bits), 0 where |ref|² underflows (`ls_alpha`).
vu ls_alpha(const vf* x, const vf* ref, int d, vf* scratch) {
  for (int c = 0; c < d; ++c) scratch[c] = x[c] * ref[c];
  const vf num = pairwise_sum(scratch, d);
  for (int c = 0; c < d; ++c) scratch[c] = ref[c] * ref[c];
  const vf den = pairwise_sum(scratch, d);
  vf a = sel(den > FLT_MIN, num / den, vf{});
  a = sel(a != a, vf{}, a);
  return to_bf16(vmin(vmax(clamp_finite(a), vf{} - kBf16Max), vf{} + kBf16Max));
}

// Where a batch's lanes write: lane j is vector v0 + j when active[j], and its loop r's values (z or mean)
// start at row[j] + r·rows of them.
struct Batch {
  int64_t v0 = 0;
  int n = 0;  // lanes in use
  bool active[kLanes] = {};
  int64_t row[kLanes] = {};
};

// The batch's loop-r values of `base` [.., D] transposed: out[c] lane j = channel c of lane j's vector (0 for
// a lane not active).
void transpose_in(const float* base, int64_t rows, int r, int d, const Batch& bt, vf* out) {
  float* o = reinterpret_cast<float*>(out);
  for (int j = 0; j < kLanes; ++j) {
    if (!bt.active[j]) {
      for (int c = 0; c < d; ++c) o[c * kLanes + j] = 0.0f;
      continue;
    }
    const float* x = base + (bt.row[j] + r * rows) * d;
    for (int c = 0; c < d; ++c) o[c * kLanes + j] = x[c];
  }
}

// Each active lane's element i of metadata leaf `out` (uint8 or uint16 bits): stride elements a lane.
void scatter_meta(void* out, int meta, int64_t stride, int64_t i, const Batch& bt, vu bits) {
  for (int j = 0; j < bt.n; ++j)
    if (bt.active[j]) {
      const int64_t at = (bt.v0 + j) * stride + i;
      if (meta == kFP8) static_cast<uint8_t*>(out)[at] = uint8_t(bits[j]);
      else static_cast<uint16_t*>(out)[at] = uint16_t(bits[j]);
    }
}

// One loop of the batch: target [D] quantized group by group, its codes packed into `ln.codes` and its
// metadata into `ln.scale`/`ln.offset` (active lanes), its dequantized values into `deq` [D] (`codes` [D]
// scratch); returns the values lost per lane.
vi quantize(const EncodeLoop& ln, int meta, int d, const Batch& bt, const vf* target, vu* codes, vf* deq) {
  vi lost = vi{};
  for (int c = 0; c < d; ++c) lost -= ~finite(target[c]);
  if (ln.bits == 0) {  // nothing stored: the loop reads its reference alone
    std::fill(deq, deq + d, vf{});
    return lost;
  }
  const int g = ln.group, ng = d / g;
  const float top = float((1 << ln.bits) - 1);
  for (int gi = 0; gi < ng; ++gi) {
    const vf* x = target + gi * g;
    vf lo = vf{} + INFINITY, hi = vf{} - INFINITY;
    for (int c = 0; c < g; ++c) {
      const vi f = finite(x[c]);
      lo = sel(f & (x[c] < lo), x[c], lo);
      hi = sel(f & (x[c] > hi), x[c], hi);
    }
    const vi none = ~(lo <= hi);  // no finite value
    lo = sel(none, vf{}, lo);
    hi = sel(none, vf{}, hi);
    vf rad, low;
    if (ln.clip == 1.0f) {
      rad = hi / 2 - lo / 2;
      low = lo;
    } else {
      rad = clamp_finite((hi / 2 - lo / 2) * ln.clip);
      low = (hi / 2 + lo / 2) - rad;
    }
    vf s, o;
    scatter_meta(ln.scale, meta, ng, gi, bt, store_meta(2 * rad / top, meta, s, lost));
    scatter_meta(ln.offset, meta, ng, gi, bt, store_meta(low, meta, o, lost));
    const vf div = sel(s > 0.0f, s, vf{} + 1.0f);
    for (int c = gi * g; c < (gi + 1) * g; ++c) {  // clamp(round_half_down((x − o) / div), 0, top)
      vf u = (target[c] - o) / div;
      u = sel(u != u, vf{}, u);
      u = sel(u > FLT_MAX, vf{} + FLT_MAX, sel(u < -FLT_MAX, vf{} - FLT_MAX, u));
      const vf f = vfloor(u);
      const vf code = vmin(vmax(sel(u - f > 0.5f, f + 1.0f, f), vf{}), vf{} + top);
      codes[c] = bits_as<vu>(__builtin_convertvector(code, vi));
      deq[c] = o + s * code;
    }
  }
  // Planar packing (`packing.pack`): byte j holds channel j + kJ in bits [k·bits, (k+1)·bits).
  const int planes = 8 / ln.bits, bytes = d / planes;
  for (int j = 0; j < bytes; ++j) {
    vu byte = vu{};
    for (int k = 0; k < planes; ++k) byte |= codes[j + k * bytes] << (k * ln.bits);
    for (int l = 0; l < bt.n; ++l)
      if (bt.active[l]) ln.codes[(bt.v0 + l) * bytes + j] = uint8_t(byte[l]);
  }
  return lost;
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

// Scratch vectors of a thread, kept for its next calls: recon [L, D], then z, mean, pred, target, deq, codes
// [D] each and the pairwise sums' [2D].
vf* scratch(int links, int d) {
  thread_local std::vector<vf> buf;
  const size_t want = size_t(links + 8) * d;
  if (buf.size() < want) buf.resize(want);
  return buf.data();
}

void encode_vectors(const EncodeProblem& p, int64_t v0, int64_t v1) {
  const int d = p.D;
  vf* recon = scratch(p.L, d);
  vf *z = recon + p.L * d, *mu = z + d, *pred = mu + d, *target = pred + d, *deq = target + d;
  vu* codes = reinterpret_cast<vu*>(deq + d);
  vf* sums = deq + 2 * d;
  const int64_t rows = p.B * p.T;  // the vectors of one loop of one head, [B, T]
  for (int64_t first = v0; first < v1; first += kLanes) {
    Batch bt;
    bt.v0 = first;
    bt.n = int(std::min<int64_t>(kLanes, v1 - first));
    bool any = false;
    for (int j = 0; j < bt.n; ++j) {
      // v = ((o·B + b)·K + k)·T + t in the results; in z, loop r of it lies at ((o·K + k)·L + r)·B·T + b·T + t.
      const int64_t v = first + j, t = v % p.T, k = v / p.T % p.K, b = v / (p.T * p.K) % p.B,
                    o = v / (p.T * p.K * p.B);
      bt.active[j] = t < p.num_new[b];  // padding: nothing coded, every result zero
      if (!bt.active[j]) clear_vector(p, v);
      bt.row[j] = (o * p.K + k) * p.L * rows + b * p.T + t;
      any |= bt.active[j];
    }
    if (!any) continue;
    vi lost = vi{};
    for (int i = 0; i < p.L; ++i) {
      const int r = p.order[i];
      const EncodeLoop& ln = p.loop[r];
      transpose_in(p.z, rows, r, d, bt, z);
      if (p.mean) transpose_in(p.mean, rows, r, d, bt, mu);
      const bool has_pred = ln.parent >= 0;
      if (has_pred) {
        const vf* ref = recon + ln.parent * d;
        if (p.least_squares) {
          const vu a = ls_alpha(z, ref, d, sums);
          for (int j = 0; j < bt.n; ++j)
            if (bt.active[j]) p.alpha[int64_t(ln.alpha_row) * p.V + first + j] = uint16_t(a[j]);
          const vf af = bits_as<vf>(a << 16);
          for (int c = 0; c < d; ++c) pred[c] = af * ref[c];
        } else {
          std::copy(ref, ref + d, pred);
        }
      }
      for (int c = 0; c < d; ++c) {
        const vf t = has_pred ? z[c] - pred[c] : z[c];
        target[c] = p.mean ? t - mu[c] : t;
      }
      lost += quantize(ln, p.meta, d, bt, target, codes, deq);
      vf* out = recon + r * d;
      for (int c = 0; c < d; ++c) {
        const vf x = has_pred ? deq[c] + pred[c] : deq[c];
        out[c] = p.mean ? x + mu[c] : x;
      }
    }
    for (int j = 0; j < bt.n; ++j)
      if (bt.active[j]) p.lost[first + j] = lost[j];
  }
}

}  // namespace

EncodeFn RQ_CAT(encoder_, RQ_ISA)() { return encode_vectors; }

}  // namespace rq
