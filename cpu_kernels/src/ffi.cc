// XLA FFI handlers of the CPU kernels (registered by cpu_kernels/__init__.py):
//
//   RqDenseAttention     q, lengths, slot, block table, k, v         -> acc, m, l
//   RqQuantAttention     q, lengths, slot, block table, key links (codes, scale, offset)..., key α...,
//                        value links..., value α..., [mean scores], [key and value rotations]
//                                                                    -> acc, m, l
//   RqEncode             z [O, K, L, B, T, D], num_new [B], [mean]   -> per stored loop: codes, scale, offset;
//                        [α]; lost
//                        (kernels.h, EncodeProblem; encode.cc)
//   RqStore              lengths [B], num_new [B], block table [B, N], new leaves..., pool leaves...
//                        -> the pool leaves (aliased to their inputs: written in place)
//
// The block table [B, N] names each row's pages (a contiguous cache passes the identity [B, 1]); a page a
// row's length reaches must lie in the pool, else the call fails naming it.
//
// Attention work is split into items of (row, kv head, query-row block, context split of kSplit tokens);
// only items holding stored tokens run. Items go to the calling thread and as many of XLA's CPU pool threads
// as the call's estimated work pays for, and their partials are merged in a fixed order, so the result does
// not depend on the thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace rq {
namespace {

constexpr int64_t kSplit = 512;  // context tokens per work item

const Kernels& kernels() {
  static const Kernels chosen = [] {
    const char* want = std::getenv("RQ_CPU_ISA");
    const std::string w = want ? want : "";
#if defined(__x86_64__)
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    const bool avx512 = false, avx2 = false;
#endif
    if (w == "generic") return kernels_generic();
    if (w == "avx2" && avx2) return kernels_avx2();
    if (avx512 && (w.empty() || w == "avx512")) return kernels_avx512();
    if (avx2) return kernels_avx2();
    return kernels_generic();
  }();
  return chosen;
}

// The estimated cost of a call's work, from this machine's kernels (Xeon, AVX-512, float32): a stored token
// of one query row ~40 ns of attention (dense or a residual chain alike), a vector of one loop ~150 ns of
// encoding (`perf` of Ouro-small's decode step: 147 µs for the 1,024 loop vectors of 32 rows).
constexpr double kTokenRowNs = 40, kLoopVectorNs = 150;

// A helper thread is worth waking for each this many ns of estimated work ($RQ_CPU_HELPER_NS overrides; 0:
// one per item, as many as the pool has). Waking one and waiting for the item it claimed costs more than a
// short call's work: Ouro-small's decode step at one row of 20 tokens took 0.38-0.42 ms on the calling thread
// alone against 0.47-0.52 with every call split (two runs, modes alternating in one process), at 8 rows 1.03-
// 1.12 against 1.08-1.30; at 32 rows of 20 tokens and at 8 and 32 rows of 200 they were within 2%.
double helper_ns() {
  const char* v = std::getenv("RQ_CPU_HELPER_NS");
  return v && *v ? std::atof(v) : 100e3;
}

// Runs fn(0) .. fn(n - 1) on this thread and as many of the pool's threads as `work_ns` (the estimated cost
// of all n) pays for; returns when every call has finished. Work is claimed from a shared counter, so a pool
// task that starts late finds nothing left and exits.
void parallel_for(ffi::ThreadPool& pool, int64_t n, double work_ns, const std::function<void(int64_t)>& fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    int64_t n = 0;
    const std::function<void(int64_t)>* fn = nullptr;
    std::mutex mu;
    std::condition_variable cv;
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  if (const char* cap = std::getenv("RQ_CPU_THREADS"); cap && *cap) helpers = std::min<int64_t>(helpers, std::atoll(cap) - 1);
  if (const double per = helper_ns(); per > 0) helpers = std::min<int64_t>(helpers, int64_t(work_ns / per));
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto st = std::make_shared<State>();
  st->n = n;
  st->fn = &fn;
  auto work = [](const std::shared_ptr<State>& s) {
    for (int64_t i; (i = s->next.fetch_add(1)) < s->n;) {
      (*s->fn)(i);
      if (s->done.fetch_add(1) + 1 == s->n) {
        std::lock_guard<std::mutex> lock(s->mu);
        s->cv.notify_all();
      }
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([st, work] { work(st); });
  work(st);
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == st->n; });
}

// Stored values arrive as their bits (unsigned integers of their width: XLA:CPU makes a bitcast-convert of
// a narrow-float leaf a copy, while bits of a cache held as bits are the cache's own buffers); the Meta
// code of a link comes as an attribute. 16-bit K/V (uint16 or bfloat16) are bfloat16.
bool is_bf16(const ffi::AnyBuffer& x) {
  return x.element_type() == ffi::DataType::BF16 || x.element_type() == ffi::DataType::U16;
}

// The error of a block table naming `page` outside a pool of `pages` (row b's logical page n).
ffi::Error page_outside(int64_t page, int64_t pages, int64_t b, int64_t n) {
  return ffi::Error::InvalidArgument("block table names page " + std::to_string(page) + " of a pool of " +
                                     std::to_string(pages) + " (row " + std::to_string(b) + ", page " +
                                     std::to_string(n) + ")");
}

// Runs every item of problem `p` and merges the splits into acc [B, K, R, D], m, l [B, K, R].
ffi::Error run_attention(ffi::ThreadPool& pool, Problem p, ItemFn item, float* acc, float* m, float* l) {
  const int64_t B = p.B, K = p.K, R = p.R, D = p.D;
  const int64_t rblocks = (R + kMaxRows - 1) / kMaxRows;
  const int64_t nsplit = std::max<int64_t>(1, (p.S + kSplit - 1) / kSplit);
  struct Item {
    int64_t b, k, rb, split;
  };
  std::vector<Item> items;
  double work_ns = 0;
  std::vector<int64_t> first(B * K * rblocks + 1, 0);  // items of (b, k, rb) start at first[...]
  const int64_t cols = p.S / p.P;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = std::clamp<int64_t>(p.lengths[b], 0, p.S);
    for (int64_t n = 0; n * p.P < len; ++n)
      if (p.table[b * cols + n] < 0 || p.table[b * cols + n] >= p.NP)
        return page_outside(p.table[b * cols + n], p.NP, b, n);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t rb = 0; rb < rblocks; ++rb) {
        const int64_t rows = std::min<int64_t>(kMaxRows, R - rb * kMaxRows);
        for (int64_t s = 0; s < nsplit && s * kSplit < len; ++s) {
          items.push_back({b, k, rb, s});
          work_ns += kTokenRowNs * double(rows * (std::min(len, (s + 1) * kSplit) - s * kSplit));
        }
        first[(b * K + k) * rblocks + rb + 1] = int64_t(items.size());
      }
  }
  const int64_t stride = std::min<int64_t>(kMaxRows, R) * (D + 2);  // an item's partial: acc, m, l
  std::unique_ptr<float[]> scratch(new float[items.size() * stride]);  // every item writes all of its own
  parallel_for(pool, int64_t(items.size()), work_ns, [&](int64_t i) {
    const Item& it = items[i];
    Problem q = p;
    q.row0 = it.rb * kMaxRows;
    q.rows = std::min<int64_t>(kMaxRows, R - q.row0);
    const int64_t len = std::clamp<int64_t>(p.lengths[it.b], 0, p.S);
    float* out = &scratch[i * stride];
    item(q, it.b, it.k, it.split * kSplit, std::min(len, (it.split + 1) * kSplit), out, out + q.rows * D,
         out + q.rows * (D + 1));
  });
  for (int64_t bk = 0; bk < B * K; ++bk)
    for (int64_t rb = 0; rb < rblocks; ++rb) {
      const int64_t row0 = rb * kMaxRows, rows = std::min<int64_t>(kMaxRows, R - row0);
      const int64_t i0 = first[bk * rblocks + rb], i1 = first[bk * rblocks + rb + 1];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t o = bk * R + row0 + r;
        float mx = kNeg;
        for (int64_t i = i0; i < i1; ++i) mx = std::max(mx, scratch[i * stride + rows * D + r]);
        float* a = acc + o * D;
        std::fill(a, a + D, 0.0f);
        float sum = 0.0f;
        for (int64_t i = i0; i < i1; ++i) {
          const float* part = &scratch[i * stride];
          const float w = std::exp(part[rows * D + r] - mx);
          sum += w * part[rows * (D + 1) + r];
          for (int64_t c = 0; c < D; ++c) a[c] += w * part[r * D + c];
        }
        m[o] = mx;
        l[o] = sum;
      }
    }
  return ffi::Error::Success();
}

Problem base_problem(const ffi::AnyBuffer& q, const ffi::AnyBuffer& lengths, const ffi::AnyBuffer& slot,
                     const ffi::AnyBuffer& table, const ffi::AnyBuffer& stored) {
  Problem p;
  auto qd = q.dimensions();
  auto sd = stored.dimensions();
  auto td = table.dimensions();
  p.B = qd[0];
  p.K = qd[1];
  p.R = qd[2];
  p.D = qd[3];
  const size_t n = sd.size();  // [..., NP, K, P, row]: every axis before NP stacks slots
  p.M = 1;
  for (size_t i = 0; i + 4 < n; ++i) p.M *= sd[i];
  p.NP = sd[n - 4];
  p.P = sd[n - 2];
  p.S = p.P * (td.size() == 2 ? td[1] : 0);
  p.q = q.untyped_data();
  p.q_bf16 = is_bf16(q);
  p.lengths = static_cast<const int32_t*>(lengths.untyped_data());
  p.slot = *static_cast<const int32_t*>(slot.untyped_data());
  p.table = static_cast<const int32_t*>(table.untyped_data());
  return p;
}

ffi::Error check_problem(ffi::Result<ffi::AnyBuffer>& acc, const ffi::AnyBuffer& table, const Problem& p) {
  auto d = acc->dimensions();
  if (d.size() != 4 || d[0] != p.B || d[1] != p.K || d[2] != p.R || d[3] != p.D)
    return ffi::Error::InvalidArgument("acc must be [B, K, R, D]");
  auto td = table.dimensions();
  if (td.size() != 2 || td[0] != p.B || table.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("block table must be int32 [B, N]");
  if (p.slot < 0 || p.slot >= p.M) return ffi::Error::InvalidArgument("slot out of range");
  if (p.D > kMaxDim) return ffi::Error::InvalidArgument("head dim over 512");
  if (p.P < 1) return ffi::Error::InvalidArgument("pages of no tokens");
  return ffi::Error::Success();
}

ffi::Error dense_attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer lengths, ffi::AnyBuffer slot,
                           ffi::AnyBuffer table, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Result<ffi::AnyBuffer> acc, ffi::Result<ffi::AnyBuffer> m,
                           ffi::Result<ffi::AnyBuffer> l) {
  Problem p = base_problem(q, lengths, slot, table, k);
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.kv_bf16 = is_bf16(k);
  if (auto err = check_problem(acc, table, p); !err.success()) return err;
  return run_attention(pool, p, kernels().dense, static_cast<float*>(acc->untyped_data()),
                       static_cast<float*>(m->untyped_data()), static_cast<float*>(l->untyped_data()));
}

ffi::Error quant_attention(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                           ffi::Span<const int64_t> k_bits, ffi::Span<const int64_t> k_groups,
                           ffi::Span<const int64_t> v_bits, ffi::Span<const int64_t> v_groups,
                           ffi::Span<const int64_t> k_alpha, ffi::Span<const int64_t> v_alpha,
                           ffi::Span<const int64_t> k_meta, ffi::Span<const int64_t> v_meta, int64_t has_means,
                           int64_t has_rotations) {
  size_t next = 0;
  std::optional<ffi::AnyBuffer> missing;
  auto arg = [&]() -> std::optional<ffi::AnyBuffer> {
    if (next >= args.size()) return missing;
    auto a = args.get<ffi::AnyBuffer>(next++);
    if (a.has_error()) return missing;
    return *a;
  };
  auto q = arg(), lengths = arg(), slot = arg(), table = arg();
  if (!q || !lengths || !slot || !table) return ffi::Error::InvalidArgument("missing q, lengths, slot or table");
  Problem p;
  bool first = true;
  auto chain = [&](Chain& c, ffi::Span<const int64_t> bits, ffi::Span<const int64_t> groups,
                   ffi::Span<const int64_t> alpha, ffi::Span<const int64_t> metas) -> ffi::Error {
    c.n = int(bits.size());
    if (c.n < 1 || c.n > kMaxLinks || int(groups.size()) != c.n || int(alpha.size()) != c.n - 1 ||
        int(metas.size()) != c.n)
      return ffi::Error::InvalidArgument("chain attributes disagree");
    for (int i = 0; i < c.n; ++i) {
      auto codes = arg(), scale = arg(), offset = arg();
      if (!codes || !scale || !offset) return ffi::Error::InvalidArgument("missing link");
      if (first) {
        p = base_problem(*q, *lengths, *slot, *table, *codes);
        first = false;
      }
      const int meta = int(metas[i]);
      if (meta < kF32 || meta > kFP8 || ffi::ByteWidth(scale->element_type()) != size_t(meta_width(meta)) ||
          offset->element_type() != scale->element_type())
        return ffi::Error::InvalidArgument("metadata dtype not covered");
      c.link[i] = Link{static_cast<const uint8_t*>(codes->untyped_data()), scale->untyped_data(),
                       offset->untyped_data(), meta, int(bits[i]), int(groups[i]),
                       int(q->dimensions()[3])};
    }
    for (int i = 0; i + 1 < c.n; ++i) {
      c.alpha[i] = nullptr;
      if (alpha[i]) {
        auto a = arg();
        if (!a) return ffi::Error::InvalidArgument("missing alpha");
        c.alpha[i] = static_cast<const uint16_t*>(a->untyped_data());
      }
    }
    return ffi::Error::Success();
  };
  Chain keys, values;
  if (auto err = chain(keys, k_bits, k_groups, k_alpha, k_meta); !err.success()) return err;
  if (auto err = chain(values, v_bits, v_groups, v_alpha, v_meta); !err.success()) return err;
  p.keys = keys;
  p.values = values;
  if (has_means) {
    auto means = arg();
    if (!means) return ffi::Error::InvalidArgument("missing mean scores");
    p.mean_scores = static_cast<const float*>(means->untyped_data());
  }
  if (has_rotations) {
    auto key_rot = arg(), value_rot = arg();
    if (!key_rot || !value_rot) return ffi::Error::InvalidArgument("missing rotations");
    for (const auto& u : {*key_rot, *value_rot}) {
      auto d = u.dimensions();
      const size_t n = d.size();
      int64_t slots = 1;
      for (size_t i = 0; i + 3 < n; ++i) slots *= d[i];
      if (u.element_type() != ffi::DataType::F32 || n < 3 || slots != p.M || d[n - 3] != p.K || d[n - 2] != p.D ||
          d[n - 1] != p.D)
        return ffi::Error::InvalidArgument("rotations must be float32 [M, K, D, D]");
    }
    p.key_rot = static_cast<const float*>(key_rot->untyped_data());
    p.value_rot = static_cast<const float*>(value_rot->untyped_data());
  }
  auto acc = rets.get<ffi::AnyBuffer>(0), m = rets.get<ffi::AnyBuffer>(1), l = rets.get<ffi::AnyBuffer>(2);
  if (acc.has_error() || m.has_error() || l.has_error()) return ffi::Error::InvalidArgument("need 3 outputs");
  if (auto err = check_problem(*acc, *table, p); !err.success()) return err;
  return run_attention(pool, p, kernels().quant, static_cast<float*>((*acc)->untyped_data()),
                       static_cast<float*>((*m)->untyped_data()), static_cast<float*>((*l)->untyped_data()));
}

constexpr int64_t kEncodeItem = 64;  // vectors per work item of the encoder

ffi::Error encode(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  ffi::Span<const int64_t> bits, ffi::Span<const int64_t> groups, ffi::Span<const float> clips,
                  ffi::Span<const int64_t> parents, ffi::Span<const int64_t> alpha_rows,
                  ffi::Span<const int64_t> order, int64_t meta, int64_t least_squares) {
  const int n = int(bits.size());
  if (n < 1 || n > kMaxLinks || groups.size() != bits.size() || clips.size() != bits.size() ||
      parents.size() != bits.size() || alpha_rows.size() != bits.size() || order.size() != bits.size())
    return ffi::Error::InvalidArgument("encoder attributes disagree");
  if (meta != kFP8 && meta != kBF16) return ffi::Error::InvalidArgument("metadata dtype not covered");
  auto z = args.get<ffi::AnyBuffer>(0);
  if (z.has_error() || z->element_type() != ffi::DataType::F32 || z->dimensions().size() != 6 ||
      z->dimensions()[2] != n)
    return ffi::Error::InvalidArgument("z must be float32 [O, K, L, B, T, D]");
  const auto dims = z->dimensions();
  EncodeProblem p;
  p.L = n;
  p.K = dims[1], p.B = dims[3], p.T = dims[4];
  p.V = dims[0] * p.K * p.B * p.T;
  p.D = int(dims[5]);
  if (p.D > kMaxDim) return ffi::Error::InvalidArgument("head dim over 512");
  p.meta = int(meta);
  p.least_squares = least_squares != 0;
  p.z = static_cast<const float*>(z->untyped_data());
  auto num_new = args.get<ffi::AnyBuffer>(1);
  if (num_new.has_error() || num_new->element_type() != ffi::DataType::S32 ||
      num_new->element_count() != size_t(p.B))
    return ffi::Error::InvalidArgument("num_new must be int32 [B]");
  p.num_new = static_cast<const int32_t*>(num_new->untyped_data());
  if (args.size() > 2) {
    auto mean = args.get<ffi::AnyBuffer>(2);
    if (mean.has_error()) return ffi::Error::InvalidArgument("bad mean");
    p.mean = static_cast<const float*>(mean->untyped_data());
  }
  size_t next = 0;
  auto ret = [&]() -> void* {
    auto r = rets.get<ffi::AnyBuffer>(next++);
    return r.has_error() ? nullptr : (*r)->untyped_data();
  };
  for (int r = 0; r < n; ++r) {
    EncodeLoop& ln = p.loop[r];
    ln.bits = int(bits[r]);
    ln.group = int(groups[r]);
    ln.clip = clips[r];
    ln.parent = int(parents[r]);
    ln.alpha_row = int(alpha_rows[r]);
    p.order[r] = int(order[r]);
    if (ln.bits && (ln.group < 1 || p.D % ln.group || p.D % (8 / ln.bits)))
      return ffi::Error::InvalidArgument("group or width does not divide the head dim");
    if (ln.bits) {
      ln.codes = static_cast<uint8_t*>(ret());
      ln.scale = ret();
      ln.offset = ret();
      if (!ln.codes || !ln.scale || !ln.offset) return ffi::Error::InvalidArgument("missing a loop's outputs");
    }
  }
  if (p.least_squares) p.alpha = static_cast<uint16_t*>(ret());
  p.lost = static_cast<int32_t*>(ret());
  if (!p.lost || (p.least_squares && !p.alpha)) return ffi::Error::InvalidArgument("missing α or the lost counts");
  const EncodeFn fn = kernels().encode;
  parallel_for(pool, (p.V + kEncodeItem - 1) / kEncodeItem, kLoopVectorNs * double(p.V * p.L), [&](int64_t i) {
    fn(p, i * kEncodeItem, std::min(p.V, (i + 1) * kEncodeItem));
  });
  return ffi::Error::Success();
}

// Stores a call's new tokens in a paged pool, every leaf in one call. Leaf i's new values are [M, B, K, T, E]
// and its pool [M, NP, K, P, E] (M and E products of the leading and trailing axes, E in bytes: any dtype is
// copied as its bytes). Token t < num_new[b] of row b lands at position lengths[b] + t, in page
// table[b, pos / P] at offset pos % P; positions before 0 or past the table's N pages are dropped. A row's
// tokens in one page are one copy per (m, k).
ffi::Error store(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const size_t n = rets.size();
  if (args.size() != 3 + 2 * n) return ffi::Error::InvalidArgument("want lengths, num_new, table, new and pool leaves");
  auto lengths = args.get<ffi::AnyBuffer>(0), num_new = args.get<ffi::AnyBuffer>(1);
  auto table = args.get<ffi::AnyBuffer>(2);
  if (lengths.has_error() || num_new.has_error() || table.has_error() ||
      lengths->element_type() != ffi::DataType::S32 || num_new->element_type() != ffi::DataType::S32 ||
      table->element_type() != ffi::DataType::S32 || table->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("lengths, num_new must be int32 [B] and the table int32 [B, N]");
  const int64_t B = table->dimensions()[0], cols = table->dimensions()[1];
  const auto* len = static_cast<const int32_t*>(lengths->untyped_data());
  const auto* fresh = static_cast<const int32_t*>(num_new->untyped_data());
  const auto* pages = static_cast<const int32_t*>(table->untyped_data());
  for (size_t i = 0; i < n; ++i) {
    auto src = args.get<ffi::AnyBuffer>(3 + i);
    auto dst = rets.get<ffi::AnyBuffer>(i);
    if (src.has_error() || dst.has_error()) return ffi::Error::InvalidArgument("bad leaf");
    const auto sd = src->dimensions(), dd = (*dst)->dimensions();
    const std::string leaf = "leaf " + std::to_string(i);
    if (sd.size() < 5 || sd.size() != dd.size() || src->element_type() != (*dst)->element_type() || sd[2] != B)
      return ffi::Error::InvalidArgument(leaf + ": new [M.., B, K, T, ..] and pool [M.., NP, K, P, ..] disagree");
    int64_t M = 1, E = ffi::ByteWidth(src->element_type());
    for (size_t a = 0; a < sd.size(); ++a) {
      if (a != 2 && a != 4 && sd[a] != dd[a])
        return ffi::Error::InvalidArgument(leaf + ": new and pool differ past rows and tokens");
      if (a < 2) M *= sd[a];
      if (a > 4) E *= sd[a];
    }
    const int64_t NP = dd[2], K = dd[3], P = dd[4], T = sd[4];
    const auto* from = static_cast<const uint8_t*>(src->untyped_data());
    auto* to = static_cast<uint8_t*>((*dst)->untyped_data());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t end = std::min<int64_t>(fresh[b], T);
      for (int64_t t = std::max<int64_t>(0, -int64_t(len[b])); t < end;) {  // positions before 0 dropped
        const int64_t pos = int64_t(len[b]) + t, j = pos / P, at = pos % P;
        if (j >= cols) break;
        const int64_t page = pages[b * cols + j], run = std::min(P - at, end - t);
        if (page < 0 || page >= NP) return page_outside(page, NP, b, j);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t k = 0; k < K; ++k)
            std::memcpy(to + (((m * NP + page) * K + k) * P + at) * E, from + (((m * B + b) * K + k) * T + t) * E,
                        run * E);
        t += run;
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace rq

XLA_FFI_DEFINE_HANDLER_SYMBOL(RqEncode, rq::encode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("bits")
                                  .Attr<ffi::Span<const int64_t>>("groups")
                                  .Attr<ffi::Span<const float>>("clips")
                                  .Attr<ffi::Span<const int64_t>>("parents")
                                  .Attr<ffi::Span<const int64_t>>("alpha_rows")
                                  .Attr<ffi::Span<const int64_t>>("order")
                                  .Attr<int64_t>("meta")
                                  .Attr<int64_t>("least_squares"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RqDenseAttention, rq::dense_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RqQuantAttention, rq::quant_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("k_bits")
                                  .Attr<ffi::Span<const int64_t>>("k_groups")
                                  .Attr<ffi::Span<const int64_t>>("v_bits")
                                  .Attr<ffi::Span<const int64_t>>("v_groups")
                                  .Attr<ffi::Span<const int64_t>>("k_alpha")
                                  .Attr<ffi::Span<const int64_t>>("v_alpha")
                                  .Attr<ffi::Span<const int64_t>>("k_meta")
                                  .Attr<ffi::Span<const int64_t>>("v_meta")
                                  .Attr<int64_t>("has_means")
                                  .Attr<int64_t>("has_rotations"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RqStore, rq::store, ffi::Ffi::Bind().RemainingArgs().RemainingRets());

extern "C" const char* RqCpuIsa() { return rq::kernels().isa; }
