// Optimizer kernels over one contiguous run of elements, written once for any vector struct.
//
// No include guard on purpose: cpu_optim.cpp includes this file once per instruction set, inside
// a namespace that defines `V` (a struct from simd.h) and under that ISA's `#pragma GCC target`,
// so that every function here is compiled for that ISA. Coefficients (Adam/Lion/AdagradCoef) and
// Segment come from cpu_optim.cpp.
//
// Each element is loaded once, updated in registers and stored once (param, state, optional
// 16-bit copy of the param): a single pass over memory. The operation order follows
// torch.optim's single-tensor implementations op for op, see the comments.

template <class S, int OUT>
inline void store_out(uint16_t* o, typename S::T p) {
  if constexpr (OUT == kOutBf16) S::store_bf16(o, p);
  else if constexpr (OUT == kOutFp16) S::store_fp16(o, p);
  else if constexpr (OUT == kOutBf16Stream) S::stream_bf16(o, p);
  else if constexpr (OUT == kOutFp16Stream) S::stream_fp16(o, p);
}

// torch.optim.Adam / AdamW (foreach=False), with ATen's roundings up to the denominator, then one
// division per element instead of torch's three (sqrt(v) / sqrt(bc2), (-lr/bc1 * m) / denom):
// divisions and square roots share one unit that handles a 512-bit vector every 5-12 cycles, the
// costliest part of the arithmetic. Differs from torch by an ulp or two of the update, far inside
// the tests' tolerances (tests/unit/test_cpu_ops.py: 100 steps against torch.optim).
//   L2:        g = fma(p, wd, g)                    grad.add(param, alpha=wd)
//   decoupled: p = p * (1 - lr * wd)                param.mul_(...)
//   m = fma(w, g - m, m)                            exp_avg.lerp_(grad, w = 1 - b1); fma(w - 1, g - m, g) if w >= 0.5
//   v = fma((1 - b2) * g, g, v * b2)                exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
//   denom = fma(sqrt(v), 1 / sqrt(bc2), eps)        (sqrt(v) / sqrt(bc2) + eps; 1 / sqrt(bc2) = 1 without
//                                                    bias correction, then exactly sqrt(v) + eps)
//   p = fma(m / denom, -lr / bc1, p)                param.addcdiv_(m, denom, value=-lr / bc1)
template <class S, int OUT>
inline void adam_block(const AdamCoef& c, float* p, const float* g, float* m, float* v, uint16_t* o) {
  using T = typename S::T;
  T gv = S::load(g), pv = S::load(p), mv = S::load(m), vv = S::load(v);
  if (c.l2) gv = S::fma(pv, S::set1(c.wd), gv);
  if (c.decoupled) pv = S::mul(pv, S::set1(c.decay));
  mv = S::fma(S::set1(c.lerp_coeff), S::sub(gv, mv), c.lerp_small ? mv : gv);
  vv = S::fma(S::mul(S::set1(c.one_minus_b2), gv), gv, S::mul(vv, S::set1(c.b2)));
  const T denom = S::fma(S::sqrt(vv), S::set1(c.inv_bc2_sqrt), S::set1(c.eps));
  pv = S::fma(S::div(mv, denom), S::set1(c.neg_step_size), pv);
  S::store(p, pv);
  S::store(m, mv);
  S::store(v, vv);
  store_out<S, OUT>(o, pv);
}

// Lion as framework.optimizers' chain (scale_by_lion, add_decayed_weights, scale_by_lr):
//   u = sign(fma(g, 1 - b1, m * b1));  m = fma(g, 1 - b2, m * b2)
//   decayed: u = fma(p, wd, u);  p = p + u * (-lr)
template <class S, int OUT>
inline void lion_block(const LionCoef& c, float* p, const float* g, float* m, uint16_t* o) {
  using T = typename S::T;
  const T gv = S::load(g);
  T pv = S::load(p), mv = S::load(m);
  T u = S::sign(S::fma(gv, S::set1(c.one_minus_b1), S::mul(mv, S::set1(c.b1))));
  mv = S::fma(gv, S::set1(c.one_minus_b2), S::mul(mv, S::set1(c.b2)));
  if (c.decayed) u = S::fma(pv, S::set1(c.wd), u);
  pv = S::add(pv, S::mul(u, S::set1(c.neg_lr)));
  S::store(p, pv);
  S::store(m, mv);
  store_out<S, OUT>(o, pv);
}

// torch.optim.Adagrad (foreach=False), with ATen's roundings as for Adam (sqrt aside):
//   L2: g = fma(p, wd, g);  s = fma(g, g, s);  p = p + ((-clr) * g) / (sqrt(s) + eps),
//   clr = lr / (1 + (step - 1) * lr_decay)
template <class S, int OUT>
inline void adagrad_block(const AdagradCoef& c, float* p, const float* g, float* s, uint16_t* o) {
  using T = typename S::T;
  T gv = S::load(g), pv = S::load(p), sv = S::load(s);
  if (c.l2) gv = S::fma(pv, S::set1(c.wd), gv);
  sv = S::fma(gv, gv, sv);
  const T std_ = S::add(S::sqrt(sv), S::set1(c.eps));
  pv = S::add(pv, S::div(S::mul(S::set1(c.neg_clr), gv), std_));
  S::store(p, pv);
  S::store(s, sv);
  store_out<S, OUT>(o, pv);
}

// The loops walk one 64-byte cache line (16 floats) at a time and, when `ahead` > 0, prefetch
// each input stream `ahead` floats ahead (cpu_optim.cpp chooses the distance per CPU vendor, see
// default_prefetch there). Then whole vectors, then the scalar tail with the same (bit-identical)
// math. Pointers and coefficients are copied to locals so that the compiler keeps them in
// registers across stores; `pf_end` turns "prefetch only inside the segment" into one compare.
constexpr int64_t kLine = 16;

inline void prefetch(const float* x) { __builtin_prefetch(x, 0, 3); }

template <int OUT>
void adam_range(const AdamCoef& coef, const Segment& sg, int64_t i, int64_t end, int64_t ahead) {
  const AdamCoef c = coef;
  float* __restrict p = sg.p;
  const float* __restrict g = sg.g;
  float* __restrict m = sg.s1;
  float* __restrict v = sg.s2;
  uint16_t* __restrict o = sg.out;
  const int64_t pf_end = ahead > 0 ? end - ahead : i;
  for (; i + kLine <= end; i += kLine) {
    if (i < pf_end) {
      prefetch(p + i + ahead);
      prefetch(g + i + ahead);
      prefetch(m + i + ahead);
      prefetch(v + i + ahead);
    }
    for (int64_t j = i; j < i + kLine; j += V::W)
      adam_block<V, OUT>(c, p + j, g + j, m + j, v + j, OUT ? o + j : nullptr);
  }
  for (; i + V::W <= end; i += V::W) adam_block<V, OUT>(c, p + i, g + i, m + i, v + i, OUT ? o + i : nullptr);
  for (; i < end; ++i) adam_block<Scalar, OUT>(c, p + i, g + i, m + i, v + i, OUT ? o + i : nullptr);
}

template <int OUT>
void lion_range(const LionCoef& coef, const Segment& sg, int64_t i, int64_t end, int64_t ahead) {
  const LionCoef c = coef;
  float* __restrict p = sg.p;
  const float* __restrict g = sg.g;
  float* __restrict m = sg.s1;
  uint16_t* __restrict o = sg.out;
  const int64_t pf_end = ahead > 0 ? end - ahead : i;
  for (; i + kLine <= end; i += kLine) {
    if (i < pf_end) {
      prefetch(p + i + ahead);
      prefetch(g + i + ahead);
      prefetch(m + i + ahead);
    }
    for (int64_t j = i; j < i + kLine; j += V::W) lion_block<V, OUT>(c, p + j, g + j, m + j, OUT ? o + j : nullptr);
  }
  for (; i + V::W <= end; i += V::W) lion_block<V, OUT>(c, p + i, g + i, m + i, OUT ? o + i : nullptr);
  for (; i < end; ++i) lion_block<Scalar, OUT>(c, p + i, g + i, m + i, OUT ? o + i : nullptr);
}

template <int OUT>
void adagrad_range(const AdagradCoef& coef, const Segment& sg, int64_t i, int64_t end, int64_t ahead) {
  const AdagradCoef c = coef;
  float* __restrict p = sg.p;
  const float* __restrict g = sg.g;
  float* __restrict s = sg.s1;
  uint16_t* __restrict o = sg.out;
  const int64_t pf_end = ahead > 0 ? end - ahead : i;
  for (; i + kLine <= end; i += kLine) {
    if (i < pf_end) {
      prefetch(p + i + ahead);
      prefetch(g + i + ahead);
      prefetch(s + i + ahead);
    }
    for (int64_t j = i; j < i + kLine; j += V::W)
      adagrad_block<V, OUT>(c, p + j, g + j, s + j, OUT ? o + j : nullptr);
  }
  for (; i + V::W <= end; i += V::W) adagrad_block<V, OUT>(c, p + i, g + i, s + i, OUT ? o + i : nullptr);
  for (; i < end; ++i) adagrad_block<Scalar, OUT>(c, p + i, g + i, s + i, OUT ? o + i : nullptr);
}

// Elements [begin, end) of one segment; the 16-bit copy's dtype picks the instantiation. The copy
// is write-only: where its vector stores are aligned they bypass the cache (non-temporal), which
// saves reading each of its lines before writing it; the fence orders them before we return.
// (p, m and v are read before they are written, so bypassing the cache saves them nothing:
// measured 1.3x slower on the machine of BENCHMARKS.md's "CPU AdamW step".)
inline int out_variant(const Segment& sg, int64_t begin) {
  if (sg.out_kind == kOutNone) return kOutNone;
  const bool stream = V::W > 1 && reinterpret_cast<uintptr_t>(sg.out + begin) % (V::W * sizeof(uint16_t)) == 0;
  if (sg.out_kind == kOutBf16) return stream ? kOutBf16Stream : kOutBf16;
  return stream ? kOutFp16Stream : kOutFp16;
}

#define FRAMEWORK_OPS_DISPATCH_OUT(range)                                                       \
  switch (out_variant(sg, begin)) {                                                            \
    case kOutBf16: range<kOutBf16>(c, sg, begin, end, ahead); break;                           \
    case kOutFp16: range<kOutFp16>(c, sg, begin, end, ahead); break;                           \
    case kOutBf16Stream: range<kOutBf16Stream>(c, sg, begin, end, ahead); V::fence(); break;   \
    case kOutFp16Stream: range<kOutFp16Stream>(c, sg, begin, end, ahead); V::fence(); break;   \
    default: range<kOutNone>(c, sg, begin, end, ahead);                                        \
  }

inline void adam(const AdamCoef& c, const Segment& sg, int64_t begin, int64_t end, int64_t ahead) {
  FRAMEWORK_OPS_DISPATCH_OUT(adam_range)
}

inline void lion(const LionCoef& c, const Segment& sg, int64_t begin, int64_t end, int64_t ahead) {
  FRAMEWORK_OPS_DISPATCH_OUT(lion_range)
}

inline void adagrad(const AdagradCoef& c, const Segment& sg, int64_t begin, int64_t end, int64_t ahead) {
  FRAMEWORK_OPS_DISPATCH_OUT(adagrad_range)
}

#undef FRAMEWORK_OPS_DISPATCH_OUT
