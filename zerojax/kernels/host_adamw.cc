// AdamW over host buffers in one pass, split across threads: an XLA FFI handler for the CPU.
//
// Operands: scalars (f32[10]), then for each of `leaves` leaves: p, g, m, v, and o16 when
// `out16` is set.  Results per leaf: p' (in place), m', v', and o16' when `out16` is set; in
// moments mode (`moments` = 1) only m' and v' (the caller computes the optax updates from them,
// where XLA can fuse that with what reads them).  The Python side (zerojax/kernels/_native.py)
// aliases every result to the operand it replaces, so the pass reads p, g, m, v once and writes
// each result over the memory it came from.
//
// scalars: b1, c1 = (1 - b1) * s, b2, c2 = (1 - b2) * s^2, eps_hat = eps * sqrt(bc2),
//          step = lr * sqrt(bc2) / bc1, decay = 1 - lr * wd, lr_wd = lr * wd (not read here:
//          adamw_updates in _native.py makes moments mode's updates with it),
//          root_hat = eps_root * bc2, apply (0: a skipped step, nothing is touched)
//   m' = b1 m + c1 g;  v' = b2 v + c2 g^2;  d = step m' / (sqrt(v' + root_hat) + eps_hat)
//   params mode:  p' = decay p - d        moments mode: m' and v' only (p is not read)
// g is f32 or bf16 (u16 bits); o16 receives p' rounded to nearest even as bf16 bits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Leaf {
  const float* in_p;  // params (their memory is `out`'s in params mode)
  const void* g;
  const float* in_m;
  const float* in_v;
  float* out;      // p' (m's memory in moments mode, never written)
  float* m;
  float* v;
  uint16_t* o16;
  int64_t n;
};

struct Coefs {
  float b1, c1, b2, c2, eps_hat, step, decay, root_hat;
};

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  uint32_t rounded = (bits + (0x7FFFu + ((bits >> 16) & 1u))) >> 16;
  uint32_t nan = ((bits >> 16) & 0x8000u) | 0x7FC0u;
  return static_cast<uint16_t>(x != x ? nan : rounded);
}

template <bool kBf16Grads, bool kMoments, bool kOut16>
void Run(const Leaf& L, int64_t lo, int64_t hi, const Coefs& c) {
  // Each result may be its operand's memory (p and out, in_m and m, in_v and v), read
  // at i before i is written: no __restrict; ivdep tells the vectoriser it is safe.
  const float* p = L.in_p;
  const float* gf = static_cast<const float*>(L.g);
  const uint16_t* gh = static_cast<const uint16_t*>(L.g);
  float* out = L.out;
  const float* in_m = L.in_m;
  const float* in_v = L.in_v;
  float* m = L.m;
  float* v = L.v;
  uint16_t* __restrict o16 = L.o16;
  const float b1 = c.b1, c1 = c.c1, b2 = c.b2, c2 = c.c2, eps = c.eps_hat, step = c.step,
              decay = c.decay, root = c.root_hat;
#pragma GCC ivdep
  for (int64_t i = lo; i < hi; ++i) {
    const float g = kBf16Grads ? bf16_to_f32(gh[i]) : gf[i];
    const float mi = b1 * in_m[i] + c1 * g;
    const float vi = b2 * in_v[i] + c2 * (g * g);
    m[i] = mi;
    v[i] = vi;
    if (kMoments) continue;
    const float d = step * mi / (std::sqrt(vi + root) + eps);
    const float r = decay * p[i] - d;
    out[i] = r;
    if (kOut16) o16[i] = f32_to_bf16(r);
  }
}

using RunFn = void (*)(const Leaf&, int64_t, int64_t, const Coefs&);

RunFn Pick(bool bf16_grads, bool moments, bool out16) {
  static const RunFn table[6] = {Run<false, false, false>, Run<false, false, true>, Run<false, true, false>,
                                 Run<true, false, false>,  Run<true, false, true>,  Run<true, true, false>};
  return table[(bf16_grads ? 3 : 0) + (moments ? 2 : (out16 ? 1 : 0))];
}

// Elements [lo, hi) of the leaves laid end to end.
void RunRange(const std::vector<Leaf>& leaves, const std::vector<RunFn>& fns, int64_t lo, int64_t hi,
              const Coefs& c) {
  int64_t base = 0;
  for (size_t k = 0; k < leaves.size() && base < hi; ++k) {
    const int64_t n = leaves[k].n;
    const int64_t a = std::max(lo, base), b = std::min(hi, base + n);
    if (a < b) fns[k](leaves[k], a - base, b - base, c);
    base += n;
  }
}

ffi::Error AdamWImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t leaves, int64_t moments,
                     int64_t out16, int64_t threads) {
  if (moments && out16) {
    return ffi::Error::InvalidArgument("zerojax_host_adamw: out16 is for params mode (moments = 0)");
  }
  const int64_t per_arg = out16 ? 5 : 4, per_ret = out16 ? 4 : (moments ? 2 : 3);
  if (static_cast<int64_t>(args.size()) != 1 + per_arg * leaves ||
      static_cast<int64_t>(rets.size()) != per_ret * leaves) {
    return ffi::Error::InvalidArgument("zerojax_host_adamw: operand/result count does not match `leaves`");
  }
  auto scal = args.get<ffi::AnyBuffer>(0);
  if (!scal.has_value() || scal->element_type() != ffi::F32 || scal->element_count() != 10) {
    return ffi::Error::InvalidArgument("zerojax_host_adamw: scalars must be f32[10]");
  }
  const float* s = static_cast<const float*>(scal->untyped_data());
  const Coefs c{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[8]};  // s[7] is lr_wd
  // A skipped step (fp16 overflow) leaves every result as its operand: the results are
  // aliased to the operands, so untouched they hold the old values bit for bit.
  const bool apply = s[9] != 0.0f;
  std::vector<Leaf> ls(leaves);
  std::vector<RunFn> fns(leaves);
  int64_t total = 0;
  for (int64_t k = 0; k < leaves; ++k) {
    auto p = args.get<ffi::AnyBuffer>(1 + per_arg * k);
    auto g = args.get<ffi::AnyBuffer>(2 + per_arg * k);
    // moments mode has no first result: `out` is then m's (never written as such)
    const int64_t first = moments ? -1 : 0;
    auto out = rets.get<ffi::AnyBuffer>(per_ret * k + std::max<int64_t>(first, 0));
    auto m = rets.get<ffi::AnyBuffer>(per_ret * k + 1 + first);
    auto v = rets.get<ffi::AnyBuffer>(per_ret * k + 2 + first);
    if (!p.has_value() || !g.has_value() || !out.has_value() || !m.has_value() || !v.has_value()) {
      return ffi::Error::InvalidArgument("zerojax_host_adamw: missing buffer");
    }
    const int64_t n = p->element_count();
    const auto gt = g->element_type();
    if (p->element_type() != ffi::F32 || (*m)->element_type() != ffi::F32 || (*v)->element_type() != ffi::F32 ||
        (*out)->element_type() != ffi::F32 || (gt != ffi::F32 && gt != ffi::BF16 && gt != ffi::U16) ||
        g->element_count() != n || (*m)->element_count() != n || (*v)->element_count() != n ||
        (*out)->element_count() != n) {
      return ffi::Error::InvalidArgument(
          "zerojax_host_adamw: each leaf needs f32 p, m, v and f32 or bf16 grads of one size");
    }
    Leaf& L = ls[k];
    L.in_p = static_cast<const float*>(p->untyped_data());
    L.g = g->untyped_data();
    L.out = static_cast<float*>((*out)->untyped_data());
    L.m = static_cast<float*>((*m)->untyped_data());
    L.v = static_cast<float*>((*v)->untyped_data());
    L.o16 = nullptr;
    L.n = n;
    if (out16) {
      auto o = rets.get<ffi::AnyBuffer>(per_ret * k + 3);
      if (!o.has_value() || (*o)->element_count() != n ||
          ((*o)->element_type() != ffi::BF16 && (*o)->element_type() != ffi::U16)) {
        return ffi::Error::InvalidArgument("zerojax_host_adamw: out16 must be bf16 (or u16 bits) of p's size");
      }
      L.o16 = static_cast<uint16_t*>((*o)->untyped_data());
    }
    // Operands are read and results written; aliased, they are the same memory.
    auto mi = args.get<ffi::AnyBuffer>(3 + per_arg * k);
    auto vi = args.get<ffi::AnyBuffer>(4 + per_arg * k);
    if (!mi.has_value() || !vi.has_value() || mi->element_count() != n || vi->element_count() != n) {
      return ffi::Error::InvalidArgument("zerojax_host_adamw: missing or mis-sized moments");
    }
    L.in_m = static_cast<const float*>(mi->untyped_data());
    L.in_v = static_cast<const float*>(vi->untyped_data());
    fns[k] = Pick(gt != ffi::F32, moments != 0, out16 != 0);
    total += n;
  }
  if (!apply) return ffi::Error::Success();
  const int64_t min_per_thread = 1 << 16;
  int64_t k = std::max<int64_t>(1, std::min<int64_t>(threads, total / min_per_thread));
  if (k == 1) {
    RunRange(ls, fns, 0, total, c);
    return ffi::Error::Success();
  }
  std::vector<int64_t> cuts(k + 1);
  for (int64_t i = 0; i <= k; ++i) cuts[i] = (i == k) ? total : (total * i / k) / 16 * 16;
  std::vector<std::thread> pool;
  pool.reserve(k - 1);
  for (int64_t i = 1; i < k; ++i) {
    pool.emplace_back([&, i] { RunRange(ls, fns, cuts[i], cuts[i + 1], c); });
  }
  RunRange(ls, fns, cuts[0], cuts[1], c);
  for (auto& t : pool) t.join();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZerojaxHostAdamW, AdamWImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("leaves")
                                  .Attr<int64_t>("moments")
                                  .Attr<int64_t>("out16")
                                  .Attr<int64_t>("threads"));
