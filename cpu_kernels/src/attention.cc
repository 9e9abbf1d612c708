// The work-item kernels of kernels.h, written once and compiled once per instruction set: the build
// compiles this file with -DRQ_ISA=generic (the x86-64 baseline), avx2 (-mavx2 -mfma) and avx512
// (-mavx512f -mavx512bw -mavx512vl -mavx512dq), and ffi.cc picks one at load time by what the CPU
// supports. The loops are plain C++ over contiguous channels, which the compiler vectorizes for the
// target (reductions are reassociated: -fassociative-math, no -ffast-math).
//
// Quantized chains (ResidualQuant, `uniform`, `rotated`): per stored token the codes of each chain link
// are read where they lie and unpacked plane by plane into one float row (plane p of a byte row holds
// channels [pJ, (p+1)J) in bits [p·bits, (p+1)·bits)), then
//
//   score = Σ_i (Π_{j<i} αk_j) · ( Σ_g scale_ig · (q_g · c_ig) + offset_ig · Σ_{c∈g} q_c + q·μ_i ) / √D
//   acc  += Σ_i (Π_{j<i} αv_j) · p · ( scale_ig · c_ig + offset_ig )        (rotated value basis)
//
// with the offsets' part of acc summed per group and spread over the group's channels once at the end.
// The softmax is online over chunks of kChunk tokens.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef RQ_ISA
#error "compile with -DRQ_ISA=generic|avx2|avx512"
#endif
#define RQ_CAT2(a, b) a##b
#define RQ_CAT(a, b) RQ_CAT2(a, b)
#define RQ_STR2(a) #a
#define RQ_STR(a) RQ_STR2(a)

namespace rq {
namespace {

constexpr int kChunk = 64;  // tokens per online-softmax step

inline float from_bf16(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float from_f16(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  float f;
  if (exp == 0) {  // zero or subnormal: man · 2^-24
    f = std::ldexp(float(man), -24);
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    u |= sign;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  uint32_t u = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | (uint32_t(exp + 112) << 23) | (man << 13);
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f / 0xff are NaN.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) {
      const int exp = (i >> 3) & 0xf, man = i & 7;
      float x = exp == 0 ? std::ldexp(float(man), -9) : std::ldexp(float(8 + man), exp - 10);
      if ((i & 0x7f) == 0x7f) x = std::nanf("");
      v[i] = (i & 0x80) ? -x : x;
    }
  }
};
const Fp8Table kFp8;

// Metadata row `row` (n values) of a [.., n] leaf as float32.
inline void meta_row(const void* base, int meta, int64_t row, int n, float* out) {
  switch (meta) {
    case kF32:
      std::memcpy(out, static_cast<const float*>(base) + row * n, n * sizeof(float));
      break;
    case kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + row * n;
      for (int i = 0; i < n; ++i) out[i] = from_bf16(p[i]);
      break;
    }
    case kF16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + row * n;
      for (int i = 0; i < n; ++i) out[i] = from_f16(p[i]);
      break;
    }
    default: {
      const uint8_t* p = static_cast<const uint8_t*>(base) + row * n;
      for (int i = 0; i < n; ++i) out[i] = kFp8.v[p[i]];
    }
  }
}

template <int BITS>
inline void unpack_planes(const uint8_t* __restrict c, int d, float* __restrict out) {
  constexpr int planes = 8 / BITS;
  constexpr unsigned mask = (1u << BITS) - 1;
  const int j_max = d / planes;
  for (int p = 0; p < planes; ++p) {
    float* __restrict o = out + p * j_max;
    for (int j = 0; j < j_max; ++j) o[j] = float((c[j] >> (p * BITS)) & mask);
  }
}

// One token's codes [D·bits/8] as float channels [D].
inline void unpack(const uint8_t* c, int bits, int d, float* out) {
  switch (bits) {
    case 1: unpack_planes<1>(c, d, out); break;
    case 2: unpack_planes<2>(c, d, out); break;
    case 4: unpack_planes<4>(c, d, out); break;
    default: unpack_planes<8>(c, d, out);
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Row x [n] converted from float32 or bfloat16.
inline void load_row(const void* base, bool bf16, int64_t row, int n, float* __restrict out) {
  if (bf16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + row * n;
    for (int i = 0; i < n; ++i) out[i] = from_bf16(p[i]);
  } else {
    std::memcpy(out, static_cast<const float*>(base) + row * n, n * sizeof(float));
  }
}

// The online-softmax step of a chunk: scores [rows, kChunk] (n valid) become p = exp(score − m_new) in
// place; m, l and the accumulators [rows, acc_len] (acc_len floats from `acc` per row, plus `extra`
// per row) are rescaled by exp(m_old − m_new).
inline void softmax_step(int rows, int n, float* scores, float* m, float* l, float* acc, int acc_len, float* extra,
                         int extra_len) {
  for (int r = 0; r < rows; ++r) {
    float* s = scores + r * kChunk;
    float mx = m[r];
    for (int j = 0; j < n; ++j) mx = std::max(mx, s[j]);
    const float corr = std::exp(m[r] - mx);
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - mx);
      sum += s[j];
    }
    l[r] = l[r] * corr + sum;
    m[r] = mx;
    if (corr != 1.0f) {
      float* a = acc + r * acc_len;
      for (int c = 0; c < acc_len; ++c) a[c] *= corr;
      float* e = extra + r * extra_len;
      for (int c = 0; c < extra_len; ++c) e[c] *= corr;
    }
  }
}

void init_partial(int rows, int d, float* acc, float* m, float* l) {
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(m, m + rows, kNeg);
  std::fill(l, l + rows, 0.0f);
}

void dense_item(const Problem& p, int64_t b, int64_t k, int64_t s0, int64_t s1, float* acc, float* m, float* l) {
  const int d = int(p.D), rows = int(p.rows);
  init_partial(rows, d, acc, m, l);
  std::vector<float> q(rows * d), row(d), scores(rows * kChunk);
  for (int r = 0; r < rows; ++r) load_row(p.q, p.q_bf16, (b * p.K + k) * p.R + p.row0 + r, d, &q[r * d]);
  const float inv = 1.0f / std::sqrt(float(d));
  for (int64_t t0 = s0; t0 < s1; t0 += kChunk) {
    const int n = int(std::min<int64_t>(kChunk, s1 - t0));
    for (int j = 0; j < n; ++j) {
      load_row(p.k, p.kv_bf16, p.token(b, k, t0 + j), d, row.data());
      for (int r = 0; r < rows; ++r) scores[r * kChunk + j] = dot(&q[r * d], row.data(), d) * inv;
    }
    softmax_step(rows, n, scores.data(), m, l, acc, d, nullptr, 0);
    for (int j = 0; j < n; ++j) {
      load_row(p.v, p.kv_bf16, p.token(b, k, t0 + j), d, row.data());
      for (int r = 0; r < rows; ++r) {
        const float w = scores[r * kChunk + j];
        float* __restrict a = acc + r * d;
        const float* __restrict v = row.data();
        for (int c = 0; c < d; ++c) a[c] += w * v[c];
      }
    }
  }
}

// ---- the blocked path: head dims 64, 96, 128, 256, groups of 16k channels -----------------------------
//
// A token's channels as 16-float vectors (GCC vector extensions: one zmm on AVX-512, two ymm on AVX2,
// four xmm on the baseline). Codes are unpacked straight from their bytes when a 16-channel block lies in
// one plane (J = D·bits/8 a multiple of 16), else through a float row; each block is scaled by its
// group's scale once and reused by every query row. One horizontal sum per token and row.

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));

inline vf loadf(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storef(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }
inline float hsum(vf v) {
  vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += h[i];
  return s;
}

// 16 unsigned bytes / 16-bit words widened to int32 lanes (GCC's generic widening of these is lane by lane).
inline vi widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  typedef int32_t vi8 __attribute__((vector_size(32)));
  const vi8 lo = (vi8)_mm256_cvtepu8_epi32(x), hi = (vi8)_mm256_cvtepu8_epi32(_mm_srli_si128(x, 8));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  vi w;
  for (int i = 0; i < 16; ++i) w[i] = p[i];
  return w;
#endif
}

inline vi widen_u16(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__)
  typedef int32_t vi8 __attribute__((vector_size(32)));
  const vi8 lo = (vi8)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const vi8 hi = (vi8)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  vi w;
  for (int i = 0; i < 16; ++i) w[i] = p[i];
  return w;
#endif
}

// 16 channels of a row from float32 or bfloat16 values.
inline vf load_block(const void* row, bool bf16, int b) {
  if (!bf16) return loadf(static_cast<const float*>(row) + 16 * b);
  vi u = widen_u16(static_cast<const uint16_t*>(row) + 16 * b) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <int D, int BITS>
struct Codes {  // one token's codes, read as 16-channel float blocks
  static constexpr int kJ = D * BITS / 8;
  static constexpr bool kDirect = BITS == 8 || kJ % 16 == 0;
  const uint8_t* c;
  float row[kDirect ? 1 : D];
  explicit Codes(const uint8_t* codes) : c(codes) {
    if constexpr (!kDirect) unpack_planes<BITS>(c, D, row);
  }
  vf block(int b) const {
    if constexpr (!kDirect) {
      return loadf(row + 16 * b);
    } else {
      const int plane = BITS == 8 ? 0 : 16 * b / kJ;
      vi w = widen_u8(c + 16 * b - plane * kJ);
      if constexpr (BITS < 8) w = (w >> (plane * BITS)) & ((1 << BITS) - 1);
      return __builtin_convertvector(w, vf);
    }
  }
};

// The scaled code blocks scale_g · c of one link at one token, and its offsets [ng].
template <int D, int BITS>
inline void scaled_blocks(const Link& ln, int64_t tok, vf* blk, float* offset) {
  float scale[D / 16];
  const int ng = D / ln.group;
  meta_row(ln.scale, ln.meta, tok, ng, scale);
  meta_row(ln.offset, ln.meta, tok, ng, offset);
  const Codes<D, BITS> codes(ln.codes + tok * Codes<D, BITS>::kJ);
  const int per_group = ln.group / 16;
  for (int b = 0; b < D / 16; ++b) blk[b] = codes.block(b) * splat(scale[b / per_group]);
}

// scores[r][j] += coef[j] · (q_r · D(c_j) + q·μ) of one key link over the n tokens tok0 .. tok0 + n − 1 of a
// chunk (qsum: [rows, ng], means: [rows], scores: [rows, kChunk]).
template <int D, int BITS>
void key_link(const Link& ln, int64_t tok0, int n, int rows, const float* q, const float* qsum, const float* means,
              const float* coef, float* scores) {
  const int ng = D / ln.group;
  vf blk[D / 16];
  float offset[D / 16];
  for (int j = 0; j < n; ++j) {
    scaled_blocks<D, BITS>(ln, tok0 + j, blk, offset);
    for (int r = 0; r < rows; ++r) {
      vf s = vf{};
      for (int b = 0; b < D / 16; ++b) s += loadf(q + r * D + 16 * b) * blk[b];
      float t = hsum(s) + means[r];
      for (int gi = 0; gi < ng; ++gi) t += offset[gi] * qsum[r * ng + gi];
      scores[r * kChunk + j] += coef[j] * t;
    }
  }
}

// acc[r] += Σ_j w[r][j] · scale ⊙ c_j and offacc[r][g] += Σ_j w[r][j] · offset_g of one value link over the n
// tokens of a chunk (w: [rows, kChunk], p times the α chain). One row keeps its accumulator in registers.
template <int D, int BITS>
void value_link(const Link& ln, int64_t tok0, int n, int rows, const float* w, float* acc, float* offacc,
                int offacc_stride) {
  constexpr int NB = D / 16;
  const int ng = D / ln.group;
  vf blk[NB];
  float offset[NB];
  if (rows == 1) {
    vf a[NB];
    for (int b = 0; b < NB; ++b) a[b] = loadf(acc + 16 * b);
    for (int j = 0; j < n; ++j) {
      scaled_blocks<D, BITS>(ln, tok0 + j, blk, offset);
      const vf wj = splat(w[j]);
      for (int b = 0; b < NB; ++b) a[b] += wj * blk[b];
      for (int gi = 0; gi < ng; ++gi) offacc[gi] += w[j] * offset[gi];
    }
    for (int b = 0; b < NB; ++b) storef(acc + 16 * b, a[b]);
    return;
  }
  for (int j = 0; j < n; ++j) {
    scaled_blocks<D, BITS>(ln, tok0 + j, blk, offset);
    for (int r = 0; r < rows; ++r) {
      const float wr = w[r * kChunk + j];
      const vf ws = splat(wr);
      float* ar = acc + r * D;
      for (int b = 0; b < NB; ++b) storef(ar + 16 * b, loadf(ar + 16 * b) + ws * blk[b]);
      for (int gi = 0; gi < ng; ++gi) offacc[r * offacc_stride + gi] += wr * offset[gi];
    }
  }
}

// The channel-by-channel link functions, for head dims and groups the blocked ones do not cover: the same
// contract as key_link / value_link below, over a float row of the token's unpacked codes.
void key_link_any(const Link& ln, int64_t tok0, int n, int rows, const float* q, const float* qsum, const float* means,
                  const float* coef, float* scores) {
  const int d = ln.dim, g = ln.group, ng = d / g;
  std::vector<float> cf(d), scale(ng), offset(ng);
  for (int j = 0; j < n; ++j) {
    const int64_t tok = tok0 + j;
    meta_row(ln.scale, ln.meta, tok, ng, scale.data());
    meta_row(ln.offset, ln.meta, tok, ng, offset.data());
    unpack(ln.codes + tok * (d * ln.bits / 8), ln.bits, d, cf.data());
    for (int r = 0; r < rows; ++r) {
      float s = means[r];
      for (int gi = 0; gi < ng; ++gi)
        s += scale[gi] * dot(q + r * d + gi * g, &cf[gi * g], g) + offset[gi] * qsum[r * ng + gi];
      scores[r * kChunk + j] += coef[j] * s;
    }
  }
}

void value_link_any(const Link& ln, int64_t tok0, int n, int rows, const float* w, float* acc, float* offacc,
                    int offacc_stride) {
  const int d = ln.dim, g = ln.group, ng = d / g;
  std::vector<float> cf(d), scale(ng), offset(ng);
  for (int j = 0; j < n; ++j) {
    const int64_t tok = tok0 + j;
    meta_row(ln.scale, ln.meta, tok, ng, scale.data());
    meta_row(ln.offset, ln.meta, tok, ng, offset.data());
    unpack(ln.codes + tok * (d * ln.bits / 8), ln.bits, d, cf.data());
    for (int r = 0; r < rows; ++r) {
      const float wr = w[r * kChunk + j];
      for (int gi = 0; gi < ng; ++gi) {
        const float ws = wr * scale[gi];
        const float* __restrict cg = &cf[gi * g];
        float* __restrict ag = acc + r * d + gi * g;
        for (int c = 0; c < g; ++c) ag[c] += ws * cg[c];
        offacc[r * offacc_stride + gi] += wr * offset[gi];
      }
    }
  }
}

using KeyFn = void (*)(const Link&, int64_t, int, int, const float*, const float*, const float*, const float*, float*);
using ValueFn = void (*)(const Link&, int64_t, int, int, const float*, float*, float*, int);

template <int D>
bool link_fns(int bits, KeyFn* kf, ValueFn* vf_) {
  switch (bits) {
    case 1: *kf = key_link<D, 1>; *vf_ = value_link<D, 1>; return true;
    case 2: *kf = key_link<D, 2>; *vf_ = value_link<D, 2>; return true;
    case 4: *kf = key_link<D, 4>; *vf_ = value_link<D, 4>; return true;
    case 8: *kf = key_link<D, 8>; *vf_ = value_link<D, 8>; return true;
  }
  return false;
}

bool blocked_fns(int d, int bits, KeyFn* kf, ValueFn* vf_) {
  switch (d) {
    case 64: return link_fns<64>(bits, kf, vf_);
    case 96: return link_fns<96>(bits, kf, vf_);
    case 128: return link_fns<128>(bits, kf, vf_);
    case 256: return link_fns<256>(bits, kf, vf_);
  }
  return false;
}

// A quantized item through its links' functions (kfn per key link, vfn per value link): the α chains per
// chunk of tokens, then every key link into the scores, the softmax step, every value link into acc.
void quant_item(const Problem& p, const KeyFn* kfn, const ValueFn* vfn, int64_t b, int64_t k, int64_t s0,
                        int64_t s1, float* acc, float* m, float* l) {
  const int d = int(p.D), rows = int(p.rows);
  const Chain& kc = p.keys;
  const Chain& vc = p.values;
  init_partial(rows, d, acc, m, l);
  int v_off[kMaxLinks + 1] = {0}, k_off[kMaxLinks + 1] = {0};
  for (int i = 0; i < vc.n; ++i) v_off[i + 1] = v_off[i] + d / vc.link[i].group;
  for (int i = 0; i < kc.n; ++i) k_off[i + 1] = k_off[i] + rows * (d / kc.link[i].group);
  const int v_groups = v_off[vc.n];
  std::vector<float> q(rows * d), scores(rows * kChunk), w(rows * kChunk), offacc(rows * v_groups, 0.0f);
  std::vector<float> qsum(k_off[kc.n]), means(kc.n * rows, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const int64_t qrow = (b * p.K + k) * p.R + p.row0 + r;
    load_row(p.q, p.q_bf16, qrow, d, &q[r * d]);
    for (int i = 0; i < kc.n; ++i) {
      const int g = kc.link[i].group, ng = d / g;
      for (int gi = 0; gi < ng; ++gi) {
        float s = 0.0f;
        for (int c = 0; c < g; ++c) s += q[r * d + gi * g + c];
        qsum[k_off[i] + r * ng + gi] = s;
      }
      if (p.mean_scores) means[i * rows + r] = p.mean_scores[qrow * kc.n + i];
    }
  }
  const float inv = 1.0f / std::sqrt(float(d));
  // Per link, the α chain of each token of a chunk: coef[i][j] = Π_{i' < i} α_{i'}(token j).
  auto chain_coefs = [&](const Chain& c, int64_t tok0, int n, float* coef) {
    for (int j = 0; j < n; ++j) coef[j] = 1.0f;
    for (int i = 1; i < c.n; ++i)
      for (int j = 0; j < n; ++j)
        coef[i * kChunk + j] = c.alpha[i - 1] ? coef[(i - 1) * kChunk + j] * from_bf16(c.alpha[i - 1][tok0 + j])
                                              : coef[(i - 1) * kChunk + j];
  };
  std::vector<float> coef(kMaxLinks * kChunk);
  for (int64_t t0 = s0; t0 < s1; t0 += kChunk) {
    const int n = int(std::min<int64_t>(kChunk, s1 - t0));
    const int64_t tok0 = p.token(b, k, t0);  // a chunk's tokens are consecutive rows of every leaf
    std::fill(scores.begin(), scores.end(), 0.0f);
    chain_coefs(kc, tok0, n, coef.data());
    for (int i = 0; i < kc.n; ++i)
      kfn[i](kc.link[i], tok0, n, rows, q.data(), &qsum[k_off[i]], &means[i * rows], &coef[i * kChunk], scores.data());
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < n; ++j) scores[r * kChunk + j] *= inv;
    softmax_step(rows, n, scores.data(), m, l, acc, d, offacc.data(), v_groups);
    chain_coefs(vc, tok0, n, coef.data());
    for (int i = 0; i < vc.n; ++i) {
      for (int r = 0; r < rows; ++r)
        for (int j = 0; j < n; ++j) w[r * kChunk + j] = scores[r * kChunk + j] * coef[i * kChunk + j];
      vfn[i](vc.link[i], tok0, n, rows, w.data(), acc, &offacc[v_off[i]], v_groups);
    }
  }
  for (int i = 0; i < vc.n; ++i) {
    const int g = vc.link[i].group, ng = d / g;
    for (int r = 0; r < rows; ++r)
      for (int gi = 0; gi < ng; ++gi) {
        const float o = offacc[r * v_groups + v_off[i] + gi];
        for (int c = 0; c < g; ++c) acc[r * d + gi * g + c] += o;
      }
  }
}

// Every quantized item: each link on the blocked path when its head dim and group allow, else channel by channel.
void quant_any(const Problem& p, int64_t b, int64_t k, int64_t s0, int64_t s1, float* acc, float* m, float* l) {
  KeyFn kfn[kMaxLinks];
  ValueFn vfn[kMaxLinks];
  for (int side = 0; side < 2; ++side) {
    const Chain& c = side ? p.values : p.keys;
    for (int i = 0; i < c.n; ++i) {
      KeyFn kf = key_link_any;
      ValueFn vf_ = value_link_any;
      if (c.link[i].group % 16 == 0) blocked_fns(int(p.D), c.link[i].bits, &kf, &vf_);
      if (side) vfn[i] = vf_; else kfn[i] = kf;
    }
  }
  quant_item(p, kfn, vfn, b, k, s0, s1, acc, m, l);
}

template <int D>
void dense_item_blocked(const Problem& p, int64_t b, int64_t k, int64_t s0, int64_t s1, float* acc, float* m,
                        float* l) {
  constexpr int NB = D / 16;
  const int rows = int(p.rows);
  init_partial(rows, D, acc, m, l);
  std::vector<float> q(rows * D), scores(rows * kChunk);
  for (int r = 0; r < rows; ++r) load_row(p.q, p.q_bf16, (b * p.K + k) * p.R + p.row0 + r, D, &q[r * D]);
  const int64_t esize = p.kv_bf16 ? 2 : 4;
  const char* kbase = static_cast<const char*>(p.k);
  const char* vbase = static_cast<const char*>(p.v);
  const float inv = 1.0f / std::sqrt(float(D));
  for (int64_t t0 = s0; t0 < s1; t0 += kChunk) {
    const int n = int(std::min<int64_t>(kChunk, s1 - t0));
    for (int j = 0; j < n; ++j) {
      const void* row = kbase + p.token(b, k, t0 + j) * D * esize;
      vf blk[NB];
      for (int c = 0; c < NB; ++c) blk[c] = load_block(row, p.kv_bf16, c);
      for (int r = 0; r < rows; ++r) {
        vf s = vf{};
        for (int c = 0; c < NB; ++c) s += loadf(&q[r * D + 16 * c]) * blk[c];
        scores[r * kChunk + j] = hsum(s) * inv;
      }
    }
    softmax_step(rows, n, scores.data(), m, l, acc, D, nullptr, 0);
    for (int j = 0; j < n; ++j) {
      const void* row = vbase + p.token(b, k, t0 + j) * D * esize;
      vf blk[NB];
      for (int c = 0; c < NB; ++c) blk[c] = load_block(row, p.kv_bf16, c);
      for (int r = 0; r < rows; ++r) {
        const vf w = splat(scores[r * kChunk + j]);
        float* a = acc + r * D;
        for (int c = 0; c < NB; ++c) storef(a + 16 * c, loadf(a + 16 * c) + w * blk[c]);
      }
    }
  }
}

void dense_any(const Problem& p, int64_t b, int64_t k, int64_t s0, int64_t s1, float* acc, float* m, float* l) {
  switch (p.D) {
    case 64: return dense_item_blocked<64>(p, b, k, s0, s1, acc, m, l);
    case 96: return dense_item_blocked<96>(p, b, k, s0, s1, acc, m, l);
    case 128: return dense_item_blocked<128>(p, b, k, s0, s1, acc, m, l);
    case 256: return dense_item_blocked<256>(p, b, k, s0, s1, acc, m, l);
    default: return dense_item(p, b, k, s0, s1, acc, m, l);
  }
}

}  // namespace

Kernels RQ_CAT(kernels_, RQ_ISA)() { return Kernels{dense_any, quant_any, RQ_STR(RQ_ISA)}; }

}  // namespace rq
