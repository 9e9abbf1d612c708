// The work-item kernels of kernels.h, written once and compiled once per instruction set: the build
// compiles this file with -DRQ_ISA=generic (the x86-64 baseline), avx2 (-mavx2 -mfma -mf16c) and avx512
// (-mavx512f -mavx512bw -mavx512vl -mavx512dq), and ffi.cc picks one at load time by what the CPU
// supports. Vectors are GCC vector extensions as wide as the target's registers (kLanes: 16, 8 or 4 floats);
// a few widenings use intrinsics where GCC's generic lowering goes lane by lane.
//
// An item walks its tokens in chunks of up to kChunk, each read a page's run of rows at a time (`Segment`:
// a chunk spans pages). Per chunk: every link's metadata is decoded to float32 (token-major), the α chains
// multiplied out per token, then
//
//   score = Σ_i (Π_{j<i} αk_j) · ( q · D_i(c) + q·μ_i ) / √D,   D_i(c) = scale_ig · c + offset_ig per group g
//   acc  += Σ_i (Π_{j<i} αv_j) · p · D_i(c)                       (rotated value basis)
//
// with an online softmax across chunks. Given the rotations, an item rotates its query rows first (q̃ = U_k q)
// and takes acc back to the original basis last (acc·U_v).
//
// An item has one query row per query head of its kv head in a decode step, and that times the chunk's
// tokens for a prompt chunk (R = T·H/K). One row reads the chain link by link (key and value functions).
// Many rows rebuild the chunk's K and V rows once, Σ_i (Π αs) · D_i(c), and attend over them as over dense
// rows: kLanes tokens at a time, each row's values accumulating in registers over them and the keys' products
// from `row_scores` (transposed blocks, four rows at a time), so that every link's codes are decoded once
// rather than once per row.
//
// Codes are read where they lie (planar packing: byte j of a token holds channel pJ + j of every plane p,
// J = D·bits/8). Blocked links (J and the group size multiples of the block width W <= kLanes bytes) widen
// W bytes once and take every plane out of them with a shift and a mask: each plane is W channels of one
// group, converted to float. With 16-lane blocks of codes up to 4 bits wide (AVX-512) they are looked up
// instead, in a per-token table of the group's dequantized values (`Blocks::lookup`). One row's keys sum each
// token's products across lanes W tokens at once (`hsums`); its blocked values, when not looked up, keep a
// link's offsets apart (summed per group and spread over the group's channels once at the end). Other shapes
// run channel by channel over the token's unpacked codes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
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
#define RQ_STR2(a) #a
#define RQ_STR(a) RQ_STR2(a)

namespace rq {
namespace {

constexpr int kChunk = 64;  // tokens per online-softmax step

// ---- vectors ----------------------------------------------------------------------------------------

inline float hsum(V<4>::f v) { return (v[0] + v[2]) + (v[1] + v[3]); }
inline float hsum(V<8>::f v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
}
inline float hsum(V<16>::f v) {
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// The even and the odd lanes of a then b: lane i < W/2 is a[2i] (a[2i+1]), lane W/2 + i is b[2i] (b[2i+1]).
template <class F, size_t... I>
inline F evens(F a, F b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, (2 * I)...);
}
template <class F, size_t... I>
inline F odds(F a, F b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, (2 * I + 1)...);
}

// Lane j: the sum of t[j]'s lanes (t is overwritten), in W − 1 pairings where W hsums take W·log2(W)
// shuffles; a vector's lanes are summed in the same order wherever it stands in t.
template <int W>
inline typename V<W>::f hsums(typename V<W>::f (&t)[W]) {
  constexpr auto lanes = std::make_index_sequence<W>{};
  for (int n = W; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i) t[i] = evens(t[2 * i], t[2 * i + 1], lanes) + odds(t[2 * i], t[2 * i + 1], lanes);
  return t[0];
}

// t as a W × W matrix, transposed in place: log2(W) rounds of splitting every pair of rows into evens and odds.
template <int W>
inline void transpose(typename V<W>::f (&t)[W]) {
  constexpr auto lanes = std::make_index_sequence<W>{};
  for (int n = 1; n < W; n *= 2) {
    typename V<W>::f u[W];
    for (int i = 0; i < W / 2; ++i) {
      u[i] = evens(t[2 * i], t[2 * i + 1], lanes);
      u[W / 2 + i] = odds(t[2 * i], t[2 * i + 1], lanes);
    }
    for (int i = 0; i < W; ++i) t[i] = u[i];
  }
}

// The dot products of `rows` query rows (q [rows, d]) with m <= W tokens given token-major, blk[j·N + i]
// channels ch[i] .. ch[i] + W − 1 of token j (blocks past m are not read): emit(r, sums) with lane j of sums
// query row r's product with token j (0 past m).
// Four rows or more take the blocks transposed (lanes become tokens) and four rows at a time multiply each
// channel's W tokens by their query values, with no horizontal sum; fewer sum each row's W products at once.
template <int W, int N, class Emit>
inline void row_scores(const typename V<W>::f* blk, int m, const int* ch, const float* q, int d, int rows,
                       Emit emit) {
  using F = typename V<W>::f;
  if (rows < 4) {
    for (int r = 0; r < rows; ++r) {
      F lanes[W];
      for (int j = 0; j < W; ++j) {
        F a = F{};
        for (int i = 0; i < N && j < m; ++i) a += blk[j * N + i] * load<F>(q + r * d + ch[i]);
        lanes[j] = a;
      }
      emit(r, hsums<W>(lanes));
    }
    return;
  }
  F kt[N][W];  // kt[i][c]: channel ch[i] + c of the W tokens
  for (int i = 0; i < N; ++i) {
    for (int j = 0; j < W; ++j) kt[i][j] = j < m ? blk[j * N + i] : F{};
    transpose<W>(kt[i]);
  }
  for (int r = 0; r < rows; r += 4) {
    const int r0 = std::min(r, rows - 4);  // the last four rows again when rows is not a multiple of four
    F a0 = F{}, a1 = F{}, a2 = F{}, a3 = F{}, b0 = F{}, b1 = F{}, b2 = F{}, b3 = F{};  // two sums a row
    for (int i = 0; i < N; ++i)
      for (int c = 0; c < W; c += 2) {
        const float* x = q + r0 * d + ch[i] + c;
        const F k = kt[i][c], l = kt[i][c + 1];
        a0 += x[0] * k, b0 += x[1] * l;
        a1 += x[d] * k, b1 += x[d + 1] * l;
        a2 += x[2 * d] * k, b2 += x[2 * d + 1] * l;
        a3 += x[3 * d] * k, b3 += x[3 * d + 1] * l;
      }
    const F sums[4] = {a0 + b0, a1 + b1, a2 + b2, a3 + b3};
    for (int rr = r - r0; rr < 4; ++rr) emit(r0 + rr, sums[rr]);
  }
}

// W unsigned bytes (or 16-bit words) widened to int32 lanes: one instruction where the target has it (GCC's
// generic widening goes lane by lane).
template <int W, class T>
inline typename V<W>::i widen(const T* p) {
  static_assert(sizeof(T) <= 2);
#if defined(__AVX512F__)
  if constexpr (W == 16 && sizeof(T) == 1)
    return (typename V<W>::i)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (W == 16 && sizeof(T) == 2)
    return (typename V<W>::i)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
#if defined(__AVX2__)
  if constexpr (W == 8 && sizeof(T) == 1)
    return (typename V<W>::i)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if constexpr (W == 8 && sizeof(T) == 2)
    return (typename V<W>::i)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
  typename V<W>::i w;
  for (int i = 0; i < W; ++i) w[i] = p[i];
  return w;
}

// exp(x) of softmax arguments (x <= 0; NaN stays NaN): 2^n · e^r with n = round(x / ln 2), |r| <= ln 2 / 2,
// e^r by Cephes' degree-6 polynomial (relative error ~1e-7); 0 below -87, where 2^n would leave the normal
// floats (e^-87 ~ 1.6e-38).
inline vf vexp(vf x) {
  const vf k = x * 1.44269504088896341f;
  const vi n = __builtin_convertvector(k + (k < 0 ? vf{} - 0.5f : vf{} + 0.5f), vi);
  const vf r = x - __builtin_convertvector(n, vf) * 0.693147180559945309f;
  vf y = vf{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const vf out = bits_as<vf>(bits_as<vi>(y) + (n << 23));
  return x != x ? x : (x < -87.0f ? vf{} : out);
}

// ---- metadata and α -------------------------------------------------------------------------------------

// `count` consecutive values of a metadata leaf from flat element `first`, as float32.
void decode_meta(const void* base, int meta, int64_t first, int count, float* out) {
  int i = 0;
  switch (meta) {
    case kF32:
      std::memcpy(out, static_cast<const float*>(base) + first, count * sizeof(float));
      return;
    case kFP8: {
      const uint8_t* p = static_cast<const uint8_t*>(base) + first;
      for (; i + kLanes <= count; i += kLanes) store(out + i, fp8_lanes(widen<kLanes>(p + i)));
      for (; i < count; ++i) out[i] = from_fp8(p[i]);
      return;
    }
    case kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + first;
      for (; i + kLanes <= count; i += kLanes) store(out + i, bits_as<vf>(widen<kLanes>(p + i) << 16));
      for (; i < count; ++i) out[i] = from_bf16(p[i]);
      return;
    }
    default: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + first;
#if defined(__F16C__)
      for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
      for (; i < count; ++i) out[i] = from_f16(p[i]);
    }
  }
}

// Scratch floats an item carves its buffers from: one block per thread, kept for the thread's next items
// (allocating a short item's dozen buffers cost more than its arithmetic). Buffers start on 64-byte lines.
class Arena {
 public:
  explicit Arena(size_t floats) : next_(0) {
    if (block().size() < floats) block().resize(floats);
  }
  static size_t rounded(size_t n) { return (n + 15) / 16 * 16; }
  // n floats as the last item left them: for buffers written before they are read.
  float* take(size_t n) {
    float* p = block().data() + next_;
    next_ += rounded(n);
    return p;
  }
  float* zeros(size_t n) {
    float* p = take(n);
    std::fill(p, p + n, 0.0f);
    return p;
  }

 private:
  static std::vector<float>& block() {
    thread_local std::vector<float> floats;
    return floats;
  }
  size_t next_;
};

// Per link, the metadata of a chunk's n tokens as float32, token-major [n, ng] (padded by a vector, so that a
// token's ng <= kLanes offsets load as one).
struct LinkMeta {
  float* scale = nullptr;
  float* offset = nullptr;
  static size_t floats(const Link& ln) { return 2 * Arena::rounded(size_t(kChunk) * (ln.dim / ln.group) + kLanes); }
  void init(const Link& ln, Arena& arena) {
    const size_t n = size_t(kChunk) * (ln.dim / ln.group) + kLanes;
    scale = arena.zeros(n);  // the padding is read (as lanes no result keeps)
    offset = arena.zeros(n);
  }
  // The n tokens from flat token tok0, as the chunk's tokens [j0, j0 + n).
  void decode(const Link& ln, int64_t tok0, int n, int j0) const {
    const int ng = ln.dim / ln.group;
    decode_meta(ln.scale, ln.meta, tok0 * ng, n * ng, scale + j0 * ng);
    decode_meta(ln.offset, ln.meta, tok0 * ng, n * ng, offset + j0 * ng);
  }
};

// The α chain of each link over n tokens from flat token tok0: coef[i][j] = Π_{i' < i} α_{i'}(token j)
// (coef: the chunk's row, from the run's first position).
void chain_coefs(const Chain& c, int64_t tok0, int n, float* coef) {
  for (int j = 0; j < n; ++j) coef[j] = 1.0f;
  for (int i = 1; i < c.n; ++i) {
    float* out = coef + i * kChunk;
    const float* prev = out - kChunk;
    if (!c.alpha[i - 1]) {
      std::copy(prev, prev + n, out);
      continue;
    }
    const uint16_t* a = c.alpha[i - 1] + tok0;
    for (int j = 0; j < n; ++j) out[j] = prev[j] * from_bf16(a[j]);
  }
}

// ---- head dims -------------------------------------------------------------------------------------------

// fn(std::integral_constant<int, D>) for the head dims the kernels are compiled for (D = 64, 96, 128, 256:
// multiples of every build's kLanes), else fn(std::integral_constant<int, 0>): any width, at run time.
template <class Fn>
auto by_dim(int d, Fn fn) {
  static_assert(96 % kLanes == 0);
  switch (d) {
    case 64: return fn(std::integral_constant<int, 64>{});
    case 96: return fn(std::integral_constant<int, 96>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    case 256: return fn(std::integral_constant<int, 256>{});
  }
  return fn(std::integral_constant<int, 0>{});
}

// ---- link functions ---------------------------------------------------------------------------------------
//
// One query row (a decode step) reads a chain link by link:
//   key:     scores[j] += coef[j] · q · D(c_j),   D(c) = scale_g · c + offset_g per channel group g
//   value:   acc += Σ_j w[j] · D(c_j)
// with w the softmax weights × the α chain. Many rows (a prompt chunk, grouped queries) rebuild the chain's
// K or V rows once, out[j] += coef[j] · D(c_j), and attend over them as over dense rows (`rows_scores`).
// Over a chunk's n tokens: `codes` points at the chunk's first token, scale and offset are the chunk's [n, ng]
// (padded by kLanes), qsum [kLanes·⌈ng/kLanes⌉] the query's sum over each group (zero past ng; null for the
// keys that do not read it: q · D(c) = Σ_g scale_g · (q_g · c_g) + offset · qsum), scores and w [n], q and
// acc [D], offacc [ng] (a value's offsets apart: acc += Σ_j w[j] · scale_jg · c_j and
// offacc[g] += Σ_j w[j] · offset_jg, unless looked up), out [n, D].

// A row's length in qsum: ng rounded up to whole vectors.
constexpr int qsum_stride(int ng) { return (ng + kLanes - 1) / kLanes * kLanes; }

using KeyFn = void (*)(const Link&, const uint8_t* codes, int n, const float* q, const float* qsum,
                       const float* scale, const float* offset, const float* coef, float* scores);
using ValueFn = void (*)(const Link&, const uint8_t* codes, int n, const float* w, const float* scale,
                         const float* offset, float* acc, float* offacc);
using RebuildFn = void (*)(const Link&, const uint8_t* codes, int n, const float* scale, const float* offset,
                           const float* coef, float* out);

struct LinkFns {
  KeyFn key;
  ValueFn value;
  RebuildFn rebuild;
  bool qsum;  // key reads the query's group sums (blocked and not looked up)
};

// Blocks of W channels, G to a group: block (h, p) is plane p of bytes [Wh, W(h+1)), channels pJ + Wh ..
// pJ + W(h+1) - 1, in group (pJ + Wh) / (WG). Block i = hP + p.
template <int D, int BITS, int W, int G>
struct Blocks {
  static constexpr int J = D * BITS / 8, P = 8 / BITS, H = J / W, N = H * P, NG = D / (W * G);
  static constexpr int kMask = (1 << BITS) - 1;
  static constexpr int channel(int i) { return (i % P) * J + W * (i / P); }
  static constexpr int group(int i) { return channel(i) / (W * G); }

  // Plane p of a token's widened bytes x0 as float codes.
  static typename V<W>::f codes(typename V<W>::i x0, int p) {
    typename V<W>::i x = x0;
    if constexpr (BITS < 8) {
      if (p) x = x >> (p * BITS);
      if (p < P - 1) x &= kMask;
    }
    return __builtin_convertvector(x, typename V<W>::f);
  }

  // Codes of at most 4 bits in blocks of 16 lanes are looked up rather than converted: a shuffle of 16 floats
  // keeps its index's low 4 bits, so plane p of x0 shifted down indexes a group's table of dequantized values,
  // table(s, o)[i] = s·(i mod 2^BITS) + o, with no mask, no conversion and the offset in it.
  static constexpr bool kLookup = W == 16 && BITS <= 4;
  static typename V<W>::f table(float s, float o) {
    typename V<W>::f iota;
    for (int i = 0; i < W; ++i) iota[i] = float(i & kMask);
    return iota * s + o;
  }
  static typename V<W>::f lookup(typename V<W>::i x0, int p, typename V<W>::f table) {
    return __builtin_shuffle(table, p ? x0 >> (p * BITS) : x0);
  }
};

// A token's offsets times the query's group sums, Σ_g offset_g · qsum_g, as lanes to add before a horizontal
// sum (lanes past NG masked: the padding may hold anything).
template <int W, int NG>
inline typename V<W>::f offset_lanes(const float* offset, const float* qsum) {
  using F = typename V<W>::f;
  F lane;
  for (int i = 0; i < W; ++i) lane[i] = float(i);
  F a = F{};
  for (int g0 = 0; g0 < NG; g0 += W) {
    F o = load<F>(offset + g0);
    if (g0 + W > NG) o = lane < float(NG - g0) ? o : F{};
    a += o * load<F>(qsum + g0);
  }
  return a;
}

template <int D, int BITS, int W, int G>
void key_blocked(const Link&, const uint8_t* codes, int n, const float* q, const float* qsum, const float* scale,
                 const float* offset, const float* coef, float* scores) {
  using B = Blocks<D, BITS, W, G>;
  using F = typename V<W>::f;
  // per token its W lanes of products; W tokens' lanes summed at once (`hsums`)
  F qb[B::N];
  for (int i = 0; i < B::N; ++i) qb[i] = load<F>(q + B::channel(i));
  const auto products = [&](int j) -> F {
    const uint8_t* c = codes + j * B::J;
    const float* s = scale + j * B::NG;
    const float* o = offset + j * B::NG;
    if constexpr (B::kLookup) {  // q × the looked-up values, offsets included
      F table[B::NG], a[2] = {};
      for (int g = 0; g < B::NG; ++g) table[g] = B::table(s[g], o[g]);
      for (int h = 0; h < B::H; ++h) {
        const auto x0 = widen<W>(c + W * h);
        for (int p = 0; p < B::P; ++p) {
          const int i = h * B::P + p;
          a[i % 2] += B::lookup(x0, p, table[B::group(i)]) * qb[i];
        }
      }
      return a[0] + a[1];
    } else {
      F part[B::NG];  // per group, q_g · c_g
      bool first[B::NG];
      for (int g = 0; g < B::NG; ++g) first[g] = true;
      for (int h = 0; h < B::H; ++h) {
        const auto x0 = widen<W>(c + W * h);
        for (int p = 0; p < B::P; ++p) {
          const int i = h * B::P + p, g = B::group(i);
          const F u = B::codes(x0, p) * qb[i];
          part[g] = first[g] ? u : part[g] + u;
          first[g] = false;
        }
      }
      F a = offset_lanes<W, B::NG>(o, qsum);
      for (int g = 0; g < B::NG; ++g) a += part[g] * s[g];
      return a;
    }
  };
  for (int j0 = 0; j0 < n; j0 += W) {
    const int m = std::min(W, n - j0);
    F t[W];
    for (int jj = 0; jj < W; ++jj) t[jj] = jj < m ? products(j0 + jj) : F{};
    const F sums = hsums<W>(t);
    if (m == W) {
      store(scores + j0, load<F>(scores + j0) + load<F>(coef + j0) * sums);
    } else {
      for (int jj = 0; jj < m; ++jj) scores[j0 + jj] += coef[j0 + jj] * sums[jj];
    }
  }
}

// offacc[0 .. ng) += Σ_j w[j] · offset[j][:] over a chunk, as one vector when ng <= kLanes.
inline void add_offsets(int ng, int n, const float* w, const float* offset, float* offacc) {
  if (ng <= kLanes) {  // four sums, so that the adds do not wait on each other
    vf t[4] = {};
    int j = 0;
    for (; j + 4 <= n; j += 4)
      for (int u = 0; u < 4; ++u) t[u] += w[j + u] * load<vf>(offset + (j + u) * ng);
    for (; j < n; ++j) t[0] += w[j] * load<vf>(offset + j * ng);
    const vf sum = (t[0] + t[1]) + (t[2] + t[3]);
    for (int g = 0; g < ng; ++g) offacc[g] += sum[g];
    return;
  }
  for (int j = 0; j < n; ++j)
    for (int g = 0; g < ng; ++g) offacc[g] += w[j] * offset[j * ng + g];
}

template <int D, int BITS, int W, int G>
void value_blocked(const Link&, const uint8_t* codes, int n, const float* w, const float* scale, const float* offset,
                   float* acc, float* offacc) {
  using B = Blocks<D, BITS, W, G>;
  using F = typename V<W>::f;
  if constexpr (!B::kLookup) add_offsets(B::NG, n, w, offset, offacc);
  F a[B::N];  // the accumulator in registers across the chunk
  for (int i = 0; i < B::N; ++i) a[i] = load<F>(acc + B::channel(i));
  for (int j = 0; j < n; ++j) {
    const uint8_t* c = codes + j * B::J;
    const float* s = scale + j * B::NG;
    const float wj = w[j];
    F table[B::NG];  // looked up: w·D(c), offsets included
    if constexpr (B::kLookup)
      for (int g = 0; g < B::NG; ++g) table[g] = B::table(wj * s[g], wj * offset[j * B::NG + g]);
    for (int h = 0; h < B::H; ++h) {
      const auto x0 = widen<W>(c + W * h);
      for (int p = 0; p < B::P; ++p) {
        const int i = h * B::P + p;
        if constexpr (B::kLookup) {
          a[i] += B::lookup(x0, p, table[B::group(i)]);
        } else {
          a[i] += B::codes(x0, p) * (wj * s[B::group(i)]);
        }
      }
    }
  }
  for (int i = 0; i < B::N; ++i) store(acc + B::channel(i), a[i]);
}

template <int D, int BITS, int W, int G>
void rebuild_blocked(const Link&, const uint8_t* codes, int n, const float* scale, const float* offset,
                     const float* coef, float* out) {
  using B = Blocks<D, BITS, W, G>;
  using F = typename V<W>::f;
  for (int j = 0; j < n; ++j) {
    const uint8_t* c = codes + j * B::J;
    const float *s = scale + j * B::NG, *o = offset + j * B::NG;
    float* x = out + j * D;
    F table[B::NG];  // looked up: coef·D(c)
    if constexpr (B::kLookup)
      for (int g = 0; g < B::NG; ++g) table[g] = B::table(coef[j] * s[g], coef[j] * o[g]);
    for (int h = 0; h < B::H; ++h) {
      const auto x0 = widen<W>(c + W * h);
      for (int p = 0; p < B::P; ++p) {
        const int i = h * B::P + p, g = B::group(i);
        F v;
        if constexpr (B::kLookup) {
          v = B::lookup(x0, p, table[g]);
        } else {
          v = (B::codes(x0, p) * s[g] + o[g]) * coef[j];
        }
        store(x + B::channel(i), load<F>(x + B::channel(i)) + v);
      }
    }
  }
}

// One token's codes [D·bits/8] as float channels [D].
void unpack(const uint8_t* c, int bits, int d, float* out) {
  const int planes = 8 / bits, per = d / planes;
  const unsigned mask = (1u << bits) - 1;
  for (int p = 0; p < planes; ++p)
    for (int j = 0; j < per; ++j) out[p * per + j] = float((c[j] >> (p * bits)) & mask);
}

// Channel by channel, for head dims and groups the blocked functions do not cover: token j's D(c) [d].
void dequantize(const Link& ln, const uint8_t* codes, const float* scale, const float* offset, int j, float* out) {
  const int d = ln.dim, g = ln.group, ng = d / g;
  unpack(codes + j * (d * ln.bits / 8), ln.bits, d, out);
  for (int c = 0; c < d; ++c) out[c] = out[c] * scale[j * ng + c / g] + offset[j * ng + c / g];
}

void key_any(const Link& ln, const uint8_t* codes, int n, const float* q, const float*, const float* scale,
             const float* offset, const float* coef, float* scores) {
  float x[kMaxDim];
  for (int j = 0; j < n; ++j) {
    dequantize(ln, codes, scale, offset, j, x);
    float s = 0.0f;
    for (int c = 0; c < ln.dim; ++c) s += q[c] * x[c];
    scores[j] += coef[j] * s;
  }
}

void value_any(const Link& ln, const uint8_t* codes, int n, const float* w, const float* scale,
               const float* offset, float* acc, float*) {
  float x[kMaxDim];
  for (int j = 0; j < n; ++j) {
    dequantize(ln, codes, scale, offset, j, x);
    for (int c = 0; c < ln.dim; ++c) acc[c] += w[j] * x[c];
  }
}

void rebuild_any(const Link& ln, const uint8_t* codes, int n, const float* scale, const float* offset,
                 const float* coef, float* out) {
  float x[kMaxDim];
  for (int j = 0; j < n; ++j) {
    dequantize(ln, codes, scale, offset, j, x);
    for (int c = 0; c < ln.dim; ++c) out[j * ln.dim + c] += coef[j] * x[c];
  }
}

template <int D, int BITS, int W, int G>
constexpr LinkFns blocked_fns{key_blocked<D, BITS, W, G>, value_blocked<D, BITS, W, G>, rebuild_blocked<D, BITS, W, G>,
                               !Blocks<D, BITS, W, G>::kLookup};

template <int D, int W, int G>
bool blocked_bits(int bits, LinkFns* fns) {
  if constexpr (D % (W * G)) {
    return false;
  } else {
    switch (bits) {
      case 1: *fns = blocked_fns<D, 1, W, G>; return true;
      case 2: *fns = blocked_fns<D, 2, W, G>; return true;
      case 4: *fns = blocked_fns<D, 4, W, G>; return true;
      case 8: *fns = blocked_fns<D, 8, W, G>; return true;
    }
    return false;
  }
}

template <int W, int G>
bool blocked_dim(int d, int bits, LinkFns* fns) {
  return by_dim(d, [&](auto D) {
    if constexpr (D == 0) {
      return false;
    } else {
      return blocked_bits<D, W, G>(bits, fns);
    }
  });
}

// Blocks of W bytes (the target's width or half of it, at least 4: D = 96 at 2 bits has 24 bytes a token),
// groups of 1 to 8 blocks.
template <int W>
bool blocked(const Link& ln, LinkFns* fns) {
  if constexpr (W < 4) {
    return false;
  } else {
    if ((ln.dim * ln.bits / 8) % W || ln.group % W) return false;
    switch (ln.group / W) {
      case 1: return blocked_dim<W, 1>(ln.dim, ln.bits, fns);
      case 2: return blocked_dim<W, 2>(ln.dim, ln.bits, fns);
      case 4: return blocked_dim<W, 4>(ln.dim, ln.bits, fns);
      case 8: return blocked_dim<W, 8>(ln.dim, ln.bits, fns);
    }
    return false;
  }
}

// The link's functions: blocked with the widest block its bytes and groups allow, else channel by channel.
LinkFns link_fns(const Link& ln) {
  LinkFns fns{key_any, value_any, rebuild_any, false};
  if (!blocked<kLanes>(ln, &fns)) blocked<kLanes / 2>(ln, &fns);
  return fns;
}

// ---- the online softmax ---------------------------------------------------------------------------------

// A chunk's step: scores [rows, kChunk] (n valid) become p = exp(score − m_new) in place (0 past n, up to the
// next whole vector); m, l and the accumulators [rows, acc_len] (plus `extra` [rows, extra_len]) are rescaled by
// exp(m_old − m_new).
void softmax_step(int rows, int n, float* scores, float* m, float* l, float* acc, int acc_len, float* extra,
                  int extra_len) {
  const int width = (n + kLanes - 1) / kLanes * kLanes;
  for (int r = 0; r < rows; ++r) {
    float* s = scores + r * kChunk;
    std::fill(s + n, s + width, kNeg);
    vf mv = vf{} + m[r];
    for (int j = 0; j < width; j += kLanes) {
      const vf x = load<vf>(s + j);
      mv = x > mv ? x : mv;
    }
    float mx = mv[0];
    for (int i = 1; i < kLanes; ++i) mx = std::max(mx, mv[i]);
    const float corr = std::exp(m[r] - mx);
    vf sum = vf{};
    for (int j = 0; j < width; j += kLanes) {
      const vf e = vexp(load<vf>(s + j) - mx);
      store(s + j, e);
      sum += e;
    }
    l[r] = l[r] * corr + hsum(sum);
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

// Row x [n] converted from float32 or bfloat16.
void load_row(const void* base, bool bf16, int64_t row, int n, float* out) {
  if (!bf16) {
    std::memcpy(out, static_cast<const float*>(base) + row * n, n * sizeof(float));
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(base) + row * n;
  for (int i = 0; i < n; ++i) out[i] = from_bf16(p[i]);
}

// A run of a chunk's tokens that lie in one page: its first flat token (rows of every leaf), its first
// position in the chunk and its length.
struct Segment {
  int64_t tok;
  int j0, n;
};

// The segments of the chunk of tokens [t0, t0 + n) of (b, k); returns their count (0 when n <= 0).
inline int chunk_segments(const Problem& p, int64_t b, int64_t k, int64_t t0, int n, Segment* seg) {
  int count = 0;
  for (int j = 0; j < n;) {
    const int m = int(std::min(int64_t(n - j), p.P - (t0 + j) % p.P));
    seg[count++] = {p.token(b, k, t0 + j), j, m};
    j += m;
  }
  return count;
}

// Prefetch the cache line at `p`: an asm statement, since GCC counts __builtin_prefetch free of side effects,
// finds a function that only prefetches `const` and deletes its calls.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p);
#endif
}

// The lines a chunk's tokens fill in each leaf an item reads (`leaf`: its base and bytes a token), requested
// while the chunk before it runs: `queue` takes the chunk's segments and splits their lines into `steps`
// shares, `step` requests one share (the item calls it between the parts of its work), `drain` the rest.
// Requested all at once before a chunk, a residual chunk's ~200 lines at 128 channels filled the core's
// line-fill buffers, and the core waited on its prefetches before computing anything: spread over the
// chunk's work, Ouro-1.4B's residual decode step at 20 rows × 3k tokens took 12% less time, dense's at
// 128 rows × 600 tokens 30% less (the section "Prefetches spread over a chunk's work" of docs/performance.md).
class LineQueue {
 public:
  void leaf(const void* base, int64_t row_bytes) { leaf_[leaves_++] = {static_cast<const char*>(base), row_bytes}; }

  void queue(const Segment* seg, int count, int64_t steps) {
    seg_ = seg;
    count_ = count;
    li_ = 0;
    gi_ = -1;
    x_ = end_ = nullptr;
    int64_t lines = 0;
    for (int l = 0; l < leaves_; ++l)
      for (int g = 0; g < count; ++g) lines += seg[g].n * leaf_[l].row_bytes / 64 + 2;
    share_ = (lines + steps - 1) / std::max<int64_t>(steps, 1);
  }
  void step() { issue(share_); }
  void drain() { issue(std::numeric_limits<int64_t>::max()); }

 private:
  struct Leaf {
    const char* base;
    int64_t row_bytes;
  };
  static constexpr int kMaxLeaves = 2 * kMaxLinks * 4;  // two chains of links: codes, scale, offset, α

  void issue(int64_t lines) {
    for (; lines > 0; --lines, x_ += 64) {
      while (x_ >= end_) {  // the next segment's rows: segment by segment, leaf by leaf
        if (++gi_ >= count_) gi_ = 0, ++li_;
        if (li_ >= leaves_ || count_ == 0) {
          li_ = leaves_;
          return;
        }
        const char* first = leaf_[li_].base + seg_[gi_].tok * leaf_[li_].row_bytes;
        x_ = first - (reinterpret_cast<uintptr_t>(first) & 63);
        end_ = first + seg_[gi_].n * leaf_[li_].row_bytes;
      }
      prefetch_line(x_);
    }
  }

  Leaf leaf_[kMaxLeaves];
  int leaves_ = 0;
  const Segment* seg_ = nullptr;
  int count_ = 0, li_ = 0, gi_ = -1;
  const char *x_ = nullptr, *end_ = nullptr;
  int64_t share_ = 0;
};

// The item's tokens [s0, s1) in chunks of at most kChunk, each in the segments of the pages it spans:
// fn(segments, count, n). A chunk is one online-softmax step whatever the page size (chunks of a 16-token
// page each: a dense decode call of 16 rows at 3k tokens took 372 rather than 350 ms; residual's the same).
// The first chunk's lines are requested together, not one miss after another; each later chunk's are queued
// in `lines` in steps(count, n) shares while the chunk before it runs (fn calls lines.step()), the rest
// requested before it starts: a paged row's pages lie anywhere in the pool, where the hardware's prefetchers
// cannot follow (residual's chains at 64 rows × 1k tokens in 16-token pages took twice as long as contiguous
// without prefetching; Ouro-1.4B's at 20 rows × 3k tokens in 64-token pages 22% longer).
template <class Steps, class Fn>
void for_chunks(const Problem& p, int64_t b, int64_t k, int64_t s0, int64_t s1, LineQueue& lines, Steps steps, Fn fn) {
  Segment seg[2][kChunk];
  int n = int(std::min(int64_t(kChunk), s1 - s0)), cur = 0;
  int count = chunk_segments(p, b, k, s0, n, seg[0]);
  lines.queue(seg[0], count, 1);
  lines.drain();
  for (int64_t t0 = s0; t0 < s1; cur ^= 1) {
    const int next = int(std::min(int64_t(kChunk), s1 - t0 - n));
    const int next_count = chunk_segments(p, b, k, t0 + n, next, seg[cur ^ 1]);
    lines.queue(seg[cur ^ 1], next_count, steps(next_count, next));
    fn(seg[cur], count, n);
    lines.drain();
    t0 += n;
    n = next;
    count = next_count;
  }
}

// The flat token of a chunk's token j.
inline int64_t flat(const Segment* seg, int count, int j) {
  int g = 0;
  while (g + 1 < count && seg[g + 1].j0 <= j) ++g;
  return seg[g].tok + (j - seg[g].j0);
}

// ---- attention over float rows --------------------------------------------------------------------------
//
// A chunk's n tokens as float32 rows: dense reads them from the pool, a quantized chain's many-row item rebuilds
// them. `rows_scores`: scores [rows, kChunk] = inv · q_r · K_j; `rows_values`: acc [rows, d] += Σ_j w[r][j] · V_j.
// With D a multiple of kLanes, kLanes tokens are read at a time (read(j, blocks [D / kLanes])) and serve every
// row (`row_scores`); D = 0 runs channel by channel over read(j, floats [d]).

template <int D, class Read>
void rows_scores(int d, int rows, const float* q, int n, float inv, float* scores, Read read) {
  if constexpr (D == 0) {
    float x[kMaxDim];
    for (int j = 0; j < n; ++j) {
      read(j, x);
      for (int r = 0; r < rows; ++r) {
        float s = 0.0f;
        for (int c = 0; c < d; ++c) s += q[r * d + c] * x[c];
        scores[r * kChunk + j] = s * inv;
      }
    }
  } else {
    constexpr int NB = D / kLanes;
    int ch[NB];
    for (int c = 0; c < NB; ++c) ch[c] = kLanes * c;
    vf blk[kLanes][NB];  // up to kLanes tokens' rows, read once for every query row
    for (int j0 = 0; j0 < n; j0 += kLanes) {
      const int nb = std::min(kLanes, n - j0);
      for (int j = 0; j < nb; ++j) read(j0 + j, blk[j]);
      row_scores<kLanes, NB>(&blk[0][0], nb, ch, q, D, rows, [&](int r, vf sums) {
        float* out = scores + r * kChunk + j0;
        if (nb == kLanes) {
          store(out, sums * inv);
        } else {
          for (int j = 0; j < nb; ++j) out[j] = sums[j] * inv;
        }
      });
    }
  }
}

template <int D, class Read>
void rows_values(int d, int rows, const float* w, int n, float* acc, Read read) {
  if constexpr (D == 0) {
    float x[kMaxDim];
    for (int j = 0; j < n; ++j) {
      read(j, x);
      for (int r = 0; r < rows; ++r) {
        const float wr = w[r * kChunk + j];
        for (int c = 0; c < d; ++c) acc[r * d + c] += wr * x[c];
      }
    }
  } else {
    constexpr int NB = D / kLanes;
    vf blk[kLanes][NB];
    for (int j0 = 0; j0 < n; j0 += kLanes) {
      const int nb = std::min(kLanes, n - j0);
      for (int j = 0; j < nb; ++j) read(j0 + j, blk[j]);
      for (int r = 0; r < rows; ++r) {  // each row's accumulator in registers over the tokens
        float* a = acc + r * D;
        vf ar[NB];
        for (int c = 0; c < NB; ++c) ar[c] = load<vf>(a + kLanes * c);
        for (int j = 0; j < nb; ++j) {
          const float wr = w[r * kChunk + j0 + j];
          for (int c = 0; c < NB; ++c) ar[c] += blk[j][c] * wr;
        }
        for (int c = 0; c < NB; ++c) store(a + kLanes * c, ar[c]);
      }
    }
  }
}

// Reading rows x [n, d] from a buffer, in the form rows_scores<D> and rows_values<D> take.
template <int D>
auto row_reader(int d, const float* x) {
  if constexpr (D == 0) {
    return [d, x](int j, float* out) { std::copy(x + j * d, x + (j + 1) * d, out); };
  } else {
    return [x](int j, vf* out) {
      for (int c = 0; c < D / kLanes; ++c) out[c] = load<vf>(x + j * D + kLanes * c);
    };
  }
}

// The two over rows x [n, d] in a buffer, picked once per item by d (`buffer_fns`).
struct BufferFns {
  void (*scores)(int d, int rows, const float* q, int n, float* scores, const float* x);
  void (*values)(int d, int rows, const float* w, int n, float* acc, const float* x);
};

template <int D>
constexpr BufferFns buffer_fns_of{
    [](int d, int rows, const float* q, int n, float* scores, const float* x) {
      rows_scores<D>(d, rows, q, n, 1.0f, scores, row_reader<D>(d, x));
    },
    [](int d, int rows, const float* w, int n, float* acc, const float* x) {
      rows_values<D>(d, rows, w, n, acc, row_reader<D>(d, x));
    }};

BufferFns buffer_fns(int d) {
  return by_dim(d, [](auto D) { return buffer_fns_of<D>; });
}

// ---- quantized chains --------------------------------------------------------------------------------------

// The rotations of an item's rows, x [rows, d] with u [d, d] (z = U x): `rotation<false>` takes the queries into
// the rotated key basis, out[r, e] = Σ_c u[e, c] · x[r, c]; `rotation<true>` takes the accumulator back from
// the rotated value basis, out[r, c] = Σ_e x[r, e] · u[e, c]. When d is a multiple of kLanes (64, 96 or 128
// channels on every build), rotating keeps a row's NC = d / kLanes registers and sums kLanes outputs' products
// at once (`hsums`; NC a template argument up to 8, so that the kLanes·NC products unroll into independent
// chains), and un-rotating adds each input's row of u into up to 8 registers of outputs at a time (even and odd
// inputs apart: two chains of FMAs). Other widths go channel by channel.
template <int NC>  // 0: d / kLanes registers, read from x as they are used (wider than 8 registers)
void rotate_row(const float* u, int d, const float* x, float* out) {
  const int nc = NC ? NC : d / kLanes;
  vf xr[NC ? NC : 1];
  for (int c = 0; c < NC; ++c) xr[c] = load<vf>(x + c * kLanes);
  const auto xv = [&](int c) { return NC ? xr[c] : load<vf>(x + c * kLanes); };
  for (int e = 0; e < d; e += kLanes) {
    vf t[kLanes];
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) {
      const float* ur = u + (e + j) * d;
      vf a = load<vf>(ur) * xv(0);
      for (int c = 1; c < nc; ++c) a += load<vf>(ur + c * kLanes) * xv(c);
      t[j] = a;
    }
    store(out + e, hsums<kLanes>(t));
  }
}

void rotate_vectors(const float* u, int d, int rows, const float* x, float* out) {
  using Row = void (*)(const float*, int, const float*, float*);
  static constexpr Row by_width[9] = {rotate_row<0>, rotate_row<1>, rotate_row<2>, rotate_row<3>, rotate_row<4>,
                                      rotate_row<5>, rotate_row<6>, rotate_row<7>, rotate_row<8>};
  const Row row = by_width[d / kLanes <= 8 ? d / kLanes : 0];
  for (int r = 0; r < rows; ++r) row(u, d, x + r * d, out + r * d);
}

// Outputs [c0, c0 + NV·kLanes) of one row of `rotation<true>` (d, a multiple of kLanes, is even).
template <int NV>
void unrotate_block(const float* u, int d, int c0, const float* xr, float* out) {
  vf even[NV] = {}, odd[NV] = {};
  for (int e = 0; e < d; e += 2)
    for (int v = 0; v < NV; ++v) {
      even[v] += xr[e] * load<vf>(u + e * d + c0 + v * kLanes);
      odd[v] += xr[e + 1] * load<vf>(u + (e + 1) * d + c0 + v * kLanes);
    }
  for (int v = 0; v < NV; ++v) store(out + c0 + v * kLanes, even[v] + odd[v]);
}

void unrotate_vectors(const float* u, int d, int rows, const float* x, float* out) {
  using Block = void (*)(const float*, int, int, const float*, float*);
  static constexpr Block blocks[8] = {unrotate_block<1>, unrotate_block<2>, unrotate_block<3>, unrotate_block<4>,
                                      unrotate_block<5>, unrotate_block<6>, unrotate_block<7>, unrotate_block<8>};
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < d; c += 8 * kLanes)
      blocks[std::min(8, (d - c) / kLanes) - 1](u, d, c, x + r * d, out + r * d);
}

template <bool Back>
void rotation(const float* u, int d, int rows, const float* x, float* out) {
  if (d % kLanes == 0) return (Back ? unrotate_vectors : rotate_vectors)(u, d, rows, x, out);
  for (int r = 0; r < rows; ++r)
    for (int o = 0; o < d; ++o) {
      float a = 0.0f;
      for (int c = 0; c < d; ++c) a += x[r * d + c] * (Back ? u[c * d + o] : u[o * d + c]);
      out[r * d + o] = a;
    }
}

void quant_item(const Problem& p, int64_t b, int64_t k, int64_t s0, int64_t s1, float* acc, float* m, float* l) {
  const int d = int(p.D), rows = int(p.rows);
  const bool one = rows == 1;  // link by link; else the chain's rows rebuilt in kx and vx
  const Chain& kc = p.keys;
  const Chain& vc = p.values;
  init_partial(rows, d, acc, m, l);
  LinkFns kfn[kMaxLinks], vfn[kMaxLinks];
  for (int i = 0; i < kc.n; ++i) kfn[i] = link_fns(kc.link[i]);
  for (int i = 0; i < vc.n; ++i) vfn[i] = link_fns(vc.link[i]);
  const BufferFns rebuilt = buffer_fns(d);
  int v_off[kMaxLinks + 1] = {0};  // value link i's groups start at v_off[i] of the offset accumulator
  for (int i = 0; i < vc.n; ++i) v_off[i + 1] = v_off[i] + d / vc.link[i].group;
  const int v_groups = one ? v_off[vc.n] : 0;
  const int row_bufs = p.key_rot || p.value_rot ? 2 : 1;  // q, and the rotations' other buffer
  size_t floats = row_bufs * Arena::rounded(rows * d) + Arena::rounded(rows * kChunk) + Arena::rounded(kChunk) +
                  Arena::rounded(v_groups) + Arena::rounded(kc.n * rows) + 2 * Arena::rounded(kMaxLinks * kChunk) +
                  (one ? 0 : 2 * Arena::rounded(kChunk * d));
  for (int i = 0; i < kc.n; ++i)
    floats += (one && kfn[i].qsum ? Arena::rounded(qsum_stride(d / kc.link[i].group)) : 0) +
              LinkMeta::floats(kc.link[i]);
  for (int i = 0; i < vc.n; ++i) floats += LinkMeta::floats(vc.link[i]);
  Arena arena(floats);
  float *q = arena.take(rows * d), *scores = arena.take(rows * kChunk), *w = arena.take(kChunk);  // w: one row
  float *offacc = arena.zeros(v_groups), *means = arena.take(kc.n * rows);
  float *k_coef = arena.take(kMaxLinks * kChunk), *v_coef = arena.take(kMaxLinks * kChunk);
  float* rotated = row_bufs == 2 ? arena.take(rows * d) : nullptr;
  float* kx = one ? nullptr : arena.take(kChunk * d);
  float* vx = one ? nullptr : arena.take(kChunk * d);
  for (int r = 0; r < rows; ++r) {
    const int64_t qrow = (b * p.K + k) * p.R + p.row0 + r;
    load_row(p.q, p.q_bf16, qrow, d, &(p.key_rot ? rotated : q)[r * d]);
    if (p.mean_scores)
      for (int i = 0; i < kc.n; ++i) means[i * rows + r] = p.mean_scores[qrow * kc.n + i];
  }
  if (p.key_rot) rotation<false>(p.slot_rotation(p.key_rot, k), d, rows, rotated, q);
  float* qsum[kMaxLinks] = {};  // one row: Σ_{c∈g} q_c per group, for the key links that read it
  for (int i = 0; i < kc.n && one; ++i) {
    if (!kfn[i].qsum) continue;
    const int g = kc.link[i].group;
    qsum[i] = arena.zeros(qsum_stride(d / g));  // zero past the groups
    for (int gi = 0; gi < d / g; ++gi)
      for (int c = gi * g; c < (gi + 1) * g; ++c) qsum[i][gi] += q[c];
  }
  LinkMeta k_meta[kMaxLinks], v_meta[kMaxLinks];
  for (int i = 0; i < kc.n; ++i) k_meta[i].init(kc.link[i], arena);
  for (int i = 0; i < vc.n; ++i) v_meta[i].init(vc.link[i], arena);
  const float inv = 1.0f / std::sqrt(float(d));
  LineQueue lines;
  for (const Chain* c : {&kc, &vc})
    for (int i = 0; i < c->n; ++i) {
      const Link& ln = c->link[i];
      const int64_t meta_row = int64_t(d / ln.group) * meta_width(ln.meta);
      lines.leaf(ln.codes, d * ln.bits / 8);
      lines.leaf(ln.scale, meta_row);
      lines.leaf(ln.offset, meta_row);
      if (c->alpha[i]) lines.leaf(c->alpha[i], 2);
    }
  const auto steps = [&](int count, int) { return int64_t(kc.n + vc.n) * count; };  // a share per link's segment
  // fn(i, ln, segment, its codes, scales, offsets) for each link of chain c over a chunk's segments
  const auto each_link = [&](const Chain& c, LinkMeta* meta, const Segment* seg, int count, auto fn) {
    for (int i = 0; i < c.n; ++i) {
      const Link& ln = c.link[i];
      const int ng = d / ln.group;
      for (int g = 0; g < count; ++g) {
        const Segment& sg = seg[g];
        lines.step();
        meta[i].decode(ln, sg.tok, sg.n, sg.j0);
        fn(i, ln, sg, ln.codes + sg.tok * (d * ln.bits / 8), meta[i].scale + sg.j0 * ng, meta[i].offset + sg.j0 * ng);
      }
    }
  };
  // The chunk's rows of chain c, Σ_i coef_i · D_i(c), rebuilt in x [n, d].
  const auto rebuild = [&](const Chain& c, const LinkFns* fns, LinkMeta* meta, const float* coef, const Segment* seg,
                           int count, int n, float* x) {
    std::fill(x, x + n * d, 0.0f);
    each_link(c, meta, seg, count, [&](int i, const Link& ln, const Segment& sg, const uint8_t* codes,
                                       const float* scale, const float* offset) {
      fns[i].rebuild(ln, codes, sg.n, scale, offset, &coef[i * kChunk + sg.j0], x + sg.j0 * d);
    });
  };
  for_chunks(p, b, k, s0, s1, lines, steps, [&](const Segment* seg, int count, int n) {
    for (int g = 0; g < count; ++g) chain_coefs(kc, seg[g].tok, seg[g].n, k_coef + seg[g].j0);
    if (one) {
      std::fill(scores, scores + kChunk, 0.0f);
      each_link(kc, k_meta, seg, count, [&](int i, const Link& ln, const Segment& sg, const uint8_t* codes,
                                             const float* scale, const float* offset) {
        kfn[i].key(ln, codes, sg.n, q, qsum[i], scale, offset, &k_coef[i * kChunk + sg.j0], scores + sg.j0);
      });
    } else {
      rebuild(kc, kfn, k_meta, k_coef, seg, count, n, kx);
      rebuilt.scores(d, rows, q, n, scores, kx);
    }
    if (p.mean_scores)
      for (int i = 0; i < kc.n; ++i)
        for (int r = 0; r < rows; ++r) {  // + coef · q·μ
          const float mu = means[i * rows + r];
          for (int j = 0; j < n; ++j) scores[r * kChunk + j] += k_coef[i * kChunk + j] * mu;
        }
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < n; ++j) scores[r * kChunk + j] *= inv;
    softmax_step(rows, n, scores, m, l, acc, d, offacc, v_groups);
    for (int g = 0; g < count; ++g) chain_coefs(vc, seg[g].tok, seg[g].n, v_coef + seg[g].j0);
    if (one) {
      each_link(vc, v_meta, seg, count, [&](int i, const Link& ln, const Segment& sg, const uint8_t* codes,
                                             const float* scale, const float* offset) {
        for (int j = 0; j < sg.n; ++j) w[sg.j0 + j] = scores[sg.j0 + j] * v_coef[i * kChunk + sg.j0 + j];
        vfn[i].value(ln, codes, sg.n, w + sg.j0, scale, offset, acc, &offacc[v_off[i]]);
      });
    } else {
      rebuild(vc, vfn, v_meta, v_coef, seg, count, n, vx);
      rebuilt.values(d, rows, scores, n, acc, vx);
    }
  });
  for (int i = 0; i < vc.n && one; ++i) {  // the offsets' sums spread over their groups' channels
    const int g = vc.link[i].group;
    for (int gi = 0; gi < d / g; ++gi)
      for (int c = 0; c < g; ++c) acc[gi * g + c] += offacc[v_off[i] + gi];
  }
  if (p.value_rot) {
    rotation<true>(p.slot_rotation(p.value_rot, k), d, rows, acc, rotated);
    std::copy(rotated, rotated + rows * d, acc);
  }
}

// ---- dense K/V -------------------------------------------------------------------------------------------

// Channels [W·c, W·(c+1)) of a row of float32 or bfloat16 values.
inline vf dense_block(const void* row, bool bf16, int c) {
  if (!bf16) return load<vf>(static_cast<const float*>(row) + kLanes * c);
  return bits_as<vf>(widen<kLanes>(static_cast<const uint16_t*>(row) + kLanes * c) << 16);
}

// D = 0: any head dim, channel by channel.
template <int D>
void dense_item_of(const Problem& p, int64_t b, int64_t k, int64_t s0, int64_t s1, float* acc, float* m, float* l) {
  const int d = int(p.D), rows = int(p.rows);
  init_partial(rows, d, acc, m, l);
  Arena arena(Arena::rounded(rows * d) + Arena::rounded(rows * kChunk));
  float *q = arena.take(rows * d), *scores = arena.take(rows * kChunk);
  for (int r = 0; r < rows; ++r) load_row(p.q, p.q_bf16, (b * p.K + k) * p.R + p.row0 + r, d, &q[r * d]);
  const int64_t row_bytes = d * p.kv_bytes();
  const float inv = 1.0f / std::sqrt(float(d));
  LineQueue lines;
  lines.leaf(p.k, row_bytes);
  lines.leaf(p.v, row_bytes);
  const auto steps = [](int, int n) { return int64_t(2) * n; };  // a share per K or V row read
  for_chunks(p, b, k, s0, s1, lines, steps, [&](const Segment* seg, int count, int n) {
    const auto reader = [&](const void* base) {  // the chunk's rows where they lie in the pool
      const auto row = [&, base](int j) {
        lines.step();
        return static_cast<const char*>(base) + flat(seg, count, j) * row_bytes;
      };
      if constexpr (D == 0) {
        return [&, row](int j, float* out) { load_row(row(j), p.kv_bf16, 0, d, out); };
      } else {
        return [&, row](int j, vf* out) {
          const char* r = row(j);
          for (int c = 0; c < D / kLanes; ++c) out[c] = dense_block(r, p.kv_bf16, c);
        };
      }
    };
    rows_scores<D>(d, rows, q, n, inv, scores, reader(p.k));
    softmax_step(rows, n, scores, m, l, acc, d, nullptr, 0);
    rows_values<D>(d, rows, scores, n, acc, reader(p.v));
  });
}

void dense_item(const Problem& p, int64_t b, int64_t k, int64_t s0, int64_t s1, float* acc, float* m, float* l) {
  by_dim(int(p.D), [&](auto D) { dense_item_of<D>(p, b, k, s0, s1, acc, m, l); });
}

}  // namespace

Kernels RQ_CAT(kernels_, RQ_ISA)() { return Kernels{dense_item, quant_item, RQ_CAT(encoder_, RQ_ISA)(), RQ_STR(RQ_ISA)}; }

}  // namespace rq
