// CPU optimizer kernels: Adam/AdamW, Lion and Adagrad over lists of contiguous fp32 tensors.
//
// One call updates every tensor of a list in place in a single pass over memory (param, grad and
// optimizer state are each read once and written once), optionally writing a bf16 or fp16 copy of
// the updated params in the same pass. The work over all tensors of the list is split across
// at::parallel_for's threads (torch.set_num_threads applies). The vector width is chosen at run
// time: AVX-512, AVX2 or scalar (see simd.h); the result is bit-identical across them.
//
// Built and loaded by framework/ops/_loader.py (torch.utils.cpp_extension.load, -ffp-contract=off).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "framework_ops/simd.h"


namespace framework_ops {

// The 16-bit copy of the params, if any; the *Stream variants are chosen per call where the copy's
// vector stores are aligned (non-temporal stores).
enum OutKind : int { kOutNone = 0, kOutBf16 = 1, kOutFp16 = 2, kOutBf16Stream = 3, kOutFp16Stream = 4 };

// One tensor of the list, as raw pointers (s1, s2: the optimizer state tensors it uses).
struct Segment {
  float* p;
  const float* g;
  float* s1;
  float* s2;
  uint16_t* out;
  int out_kind;
  int64_t n;
  bool decayed;  // weight decay applies (decay_mask[i], or true without a mask)
};

// Per-call constants, in fp32 exactly as torch passes its Python-float scalars to ATen.
struct AdamCoef {
  bool l2, decoupled, lerp_small;
  float wd, decay, lerp_coeff, b2, one_minus_b2, inv_bc2_sqrt, eps, neg_step_size;
};

struct LionCoef {
  bool decayed;
  float b1, one_minus_b1, b2, one_minus_b2, wd, neg_lr;
};

struct AdagradCoef {
  bool l2;
  float wd, eps, neg_clr;
};

namespace scalar {
using V = Scalar;
#include "framework_ops/optim_kernels.h"
}  // namespace scalar

#ifdef FRAMEWORK_OPS_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using V = Avx2;
#include "framework_ops/optim_kernels.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
using V = Avx512;
#include "framework_ops/optim_kernels.h"
}  // namespace avx512
#pragma GCC pop_options
#endif

// --- instruction set --------------------------------------------------------------------------

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
const char* const kIsaNames[] = {"scalar", "avx2", "avx512"};

Isa detect_isa() {
#ifdef FRAMEWORK_OPS_X86
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the AVX/AVX-512 registers (XGETBV).
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return kAvx512;
  if (avx2) return kAvx2;
#endif
  return kScalar;
}

Isa parse_isa(const std::string& name) {
  for (int i = 0; i <= kAvx512; ++i)
    if (name == kIsaNames[i]) return static_cast<Isa>(i);
  TORCH_CHECK_VALUE(false, "unknown ISA '", name, "': expected one of scalar, avx2, avx512 (or auto)");
  return kScalar;  // not reached
}

// The ISA the kernels run: the best one the CPU has, capped by set_isa() (the loader applies
// FRAMEWORK_OPS_ISA, validated there, so a bad value never reaches a training step).
std::atomic<int>& active_isa() {
  static std::atomic<int> isa(static_cast<int>(detect_isa()));
  return isa;
}

std::string isa() { return kIsaNames[active_isa().load()]; }
std::string detected() { return kIsaNames[detect_isa()]; }

void set_isa(const std::string& name) {
  const Isa best = detect_isa();
  if (name.empty() || name == "auto") {
    active_isa().store(best);
    return;
  }
  const Isa want = parse_isa(name);
  TORCH_CHECK_VALUE(want <= best, "set_isa('", name, "'): this CPU supports at most ", kIsaNames[best]);
  active_isa().store(want);
}

// --- software prefetch ------------------------------------------------------------------------

// How far ahead (in floats) the loops prefetch each stream, 0 for not at all. An Adam step over
// data far larger than the caches is bound by how many cache misses one core keeps in flight.
// Intel: measured on a Xeon (Emerald Rapids, 2 cores), fp32 AdamW at 10 M and 100 M params,
// 1 and 2 threads, 1 KiB ahead (256 floats) is 11-13% faster than leaving the streams to the
// hardware prefetchers (BENCHMARKS.md, "CPU AdamW step"). AMD (and any other CPU): off,
// as in the peer kernels (torch's fused Adam, DeepSpeedCPUAdam), which were 15-19% faster than
// this kernel with prefetching on an AMD EPYC (AVX-512) at 100 M params, 1 thread;
// prefetching was the one difference in memory access between them. Not yet re-measured on AMD.
int64_t default_prefetch() {
#ifdef FRAMEWORK_OPS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_is("intel")) return 256;
#endif
  return 0;
}

// The distance the kernels use: default_prefetch(), or set_prefetch() (the loader applies
// FRAMEWORK_OPS_PREFETCH, validated there; tests and benchmarks compare distances). The results do
// not depend on it.
std::atomic<int64_t>& active_prefetch() {
  static std::atomic<int64_t> ahead(default_prefetch());
  return ahead;
}

int64_t prefetch_distance() { return active_prefetch().load(); }

void set_prefetch(int64_t floats) {
  TORCH_CHECK_VALUE(floats >= -1, "set_prefetch(", floats, "): pass a number of floats >= 0, or -1 for the default");
  active_prefetch().store(floats < 0 ? default_prefetch() : floats);
}

// --- validation --------------------------------------------------------------------------------

using TensorList = std::vector<at::Tensor>;

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  return std::string(c10::toString(t.scalar_type())) + " tensor on " + t.device().str() +
         (t.is_contiguous() ? ", contiguous" : ", not contiguous") + ", " + std::to_string(t.numel()) + " elements";
}

void check_fp32(const char* op, const char* list, size_t i, const at::Tensor& t, int64_t numel) {
  TORCH_CHECK_TYPE(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", list, "[", i,
                   "] must be a CPU float32 tensor, got ", describe(t));
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", list, "[", i, "] must be contiguous, got ", describe(t));
  TORCH_CHECK_VALUE(numel < 0 || t.numel() == numel, op, ": ", list, "[", i, "] has ", t.numel(),
                    " elements but params[", i, "] has ", numel);
}

// One tensor's memory, for check_disjoint.
struct Span {
  uintptr_t begin, end;
  bool written;
  const char* list;
  size_t index;
};

// Refuse tensors that share memory (the same tensor twice, or overlapping views) where one of them is
// written: the threads split the work by tensor, so one thread would write what another reads or
// writes, and the result would change from run to run. Read-only tensors (grads) may share memory.
// O(n log n): sorted by address, one sweep keeps the furthest-reaching span of each kind so far.
void check_disjoint(const char* op, const TensorList& params, const TensorList& grads, const char* s1_name,
                    const TensorList& s1, const char* s2_name, const TensorList* s2, const TensorList& out16) {
  std::vector<Span> spans;
  spans.reserve(params.size() * 5);
  auto add = [&](const char* list, const TensorList& ts, bool written) {
    for (size_t i = 0; i < ts.size(); ++i) {
      if (ts[i].numel() == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(ts[i].data_ptr());
      spans.push_back(Span{begin, begin + static_cast<uintptr_t>(ts[i].nbytes()), written, list, i});
    }
  };
  add("params", params, true);
  add("grads", grads, false);
  add(s1_name, s1, true);
  if (s2 != nullptr) add(s2_name, *s2, true);
  add("out16", out16, true);
  std::stable_sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  const Span* reach_any = nullptr;      // the span reaching furthest so far
  const Span* reach_written = nullptr;  // the written span reaching furthest so far
  for (const Span& s : spans) {
    const Span* other = s.written ? reach_any : reach_written;
    TORCH_CHECK_VALUE(other == nullptr || s.begin >= other->end, op, ": ", other == nullptr ? "" : other->list, "[",
                      other == nullptr ? 0 : other->index, "] and ", s.list, "[", s.index,
                      "] share memory (the same tensor twice, or overlapping views); the op writes one of them, "
                      "so pass separate tensors");
    if (reach_any == nullptr || s.end > reach_any->end) reach_any = &s;
    if (s.written && (reach_written == nullptr || s.end > reach_written->end)) reach_written = &s;
  }
}

// Check every list against params and turn them into raw-pointer segments.
std::vector<Segment> segments(const char* op, const TensorList& params, const TensorList& grads,
                              const char* s1_name, const TensorList& s1, const char* s2_name,
                              const TensorList* s2, const TensorList& out16, const std::vector<bool>& decay_mask) {
  const size_t n = params.size();
  auto check_len = [&](const char* name, size_t len) {
    TORCH_CHECK_VALUE(len == n, op, ": ", name, " has ", len, " tensors but params has ", n);
  };
  check_len("grads", grads.size());
  check_len(s1_name, s1.size());
  if (s2 != nullptr) check_len(s2_name, s2->size());
  TORCH_CHECK_VALUE(out16.empty() || out16.size() == n, op, ": out16 has ", out16.size(),
                    " tensors but params has ", n, " (pass none, or one per param)");
  TORCH_CHECK_VALUE(decay_mask.empty() || decay_mask.size() == n, op, ": decay_mask has ", decay_mask.size(),
                    " entries but params has ", n, " tensors (pass none, or one per param)");
  std::vector<Segment> segs(n);
  for (size_t i = 0; i < n; ++i) {
    check_fp32(op, "params", i, params[i], -1);
    const int64_t numel = params[i].numel();
    check_fp32(op, "grads", i, grads[i], numel);
    check_fp32(op, s1_name, i, s1[i], numel);
    if (s2 != nullptr) check_fp32(op, s2_name, i, (*s2)[i], numel);
    Segment& sg = segs[i];
    sg = Segment{params[i].data_ptr<float>(), grads[i].data_ptr<float>(), s1[i].data_ptr<float>(),
                 s2 != nullptr ? (*s2)[i].data_ptr<float>() : nullptr, nullptr, kOutNone, numel,
                 decay_mask.empty() || decay_mask[i]};
    if (!out16.empty()) {
      const at::Tensor& o = out16[i];
      const bool half = o.defined() && (o.scalar_type() == at::kBFloat16 || o.scalar_type() == at::kHalf);
      TORCH_CHECK_TYPE(half && o.device().is_cpu(), op, ": out16[", i,
                       "] must be a CPU bfloat16 or float16 tensor, got ", describe(o));
      TORCH_CHECK_VALUE(o.is_contiguous(), op, ": out16[", i, "] must be contiguous, got ", describe(o));
      TORCH_CHECK_VALUE(o.numel() == numel, op, ": out16[", i, "] has ", o.numel(), " elements but params[", i,
                        "] has ", numel);
      sg.out = reinterpret_cast<uint16_t*>(o.data_ptr());
      sg.out_kind = o.scalar_type() == at::kBFloat16 ? kOutBf16 : kOutFp16;
    }
  }
  check_disjoint(op, params, grads, s1_name, s1, s2_name, s2, out16);
  // Every tensor the op writes gets one version bump per call, as torch's in-place ops do, so that
  // autograd refuses a backward through a saved tensor the step changed. Here, after the checks and
  // before any write: an inference tensor outside inference mode is refused (by the bump) with
  // nothing changed.
  for (size_t i = 0; i < n; ++i) {
    torch::autograd::impl::bump_version(params[i]);
    torch::autograd::impl::bump_version(s1[i]);
    if (s2 != nullptr) torch::autograd::impl::bump_version((*s2)[i]);
    if (!out16.empty()) torch::autograd::impl::bump_version(out16[i]);
  }
  return segs;
}

// segments() when the tensors fit; otherwise, unless `strict`, nothing (instead of the error), so
// that the optimizers' dispatch learns "fall back" from the one call it makes anyway rather than
// checking every tensor from Python before the call (about 1 us per tensor there).
template <class... Args>
std::optional<std::vector<Segment>> segments_if(bool strict, Args&&... args) {
  if (strict) return segments(std::forward<Args>(args)...);
  try {
    return segments(std::forward<Args>(args)...);
  } catch (const c10::Error&) {  // TypeError / ValueError from the checks above
    return std::nullopt;
  }
}

// --- threading ---------------------------------------------------------------------------------

// Work is cut in blocks of kBlock elements counted from each tensor's start, so that every thread
// starts on a cache-line (and vector) boundary of an aligned tensor; kGrainBlocks blocks is the
// least work worth a thread.
constexpr int64_t kBlock = 2048;
constexpr int64_t kGrainBlocks = 16;

// fn(segment, begin, end) over all elements of all segments, on torch's intra-op threads.
template <class Fn>
void for_each_block(const std::vector<Segment>& segs, const Fn& fn) {
  std::vector<int64_t> first(segs.size() + 1, 0);  // first block of each segment
  for (size_t i = 0; i < segs.size(); ++i) first[i + 1] = first[i] + (segs[i].n + kBlock - 1) / kBlock;
  const int64_t blocks = first.back();
  if (blocks == 0) return;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t b, int64_t e) {
    size_t k = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
    while (b < e) {
      const int64_t stop = std::min(e, first[k + 1]);
      if (stop > b) {
        const Segment& sg = segs[k];
        fn(sg, (b - first[k]) * kBlock, std::min(sg.n, (stop - first[k]) * kBlock));
      }
      b = stop;
      ++k;
    }
  });
}

template <class Coef>
using KernelFn = void (*)(const Coef&, const Segment&, int64_t, int64_t, int64_t);

template <class Coef>
KernelFn<Coef> pick(KernelFn<Coef> s, KernelFn<Coef> a2, KernelFn<Coef> a512) {
  switch (active_isa().load()) {
    case kAvx512: return a512;
    case kAvx2: return a2;
    default: return s;
  }
}

#ifdef FRAMEWORK_OPS_X86
#define FRAMEWORK_OPS_PICK(Coef, fn) pick<Coef>(&scalar::fn, &avx2::fn, &avx512::fn)
#else
#define FRAMEWORK_OPS_PICK(Coef, fn) pick<Coef>(&scalar::fn, &scalar::fn, &scalar::fn)
#endif

// --- the ops -----------------------------------------------------------------------------------

// Each op builds its coefficients twice, with and without weight decay, and every segment takes
// the pair's member its decay_mask entry names: one parallel pass over all tensors of the list,
// decayed or not, and one call from the optimizers' dispatch.

AdamCoef adam_coef(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool decoupled, bool bias_correction) {
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  const float w1 = static_cast<float>(1.0 - beta1);
  AdamCoef c;
  c.l2 = !decoupled && weight_decay != 0.0;
  c.decoupled = decoupled && weight_decay != 0.0;
  c.lerp_small = std::abs(w1) < 0.5f;
  c.wd = static_cast<float>(weight_decay);
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.lerp_coeff = c.lerp_small ? w1 : w1 - 1.0f;
  c.b2 = static_cast<float>(beta2);
  c.one_minus_b2 = static_cast<float>(1.0 - beta2);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));  // 1 without bias correction
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-(lr / bc1));
  return c;
}

bool adam_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& exp_avg_sqs, const TensorList& out16, int64_t step, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool decoupled, bool bias_correction,
               const std::vector<bool>& decay_mask, bool strict) {
  TORCH_CHECK_VALUE(step >= 1, "adam_step: step must be >= 1 (the count after this step), got ", step);
  const auto found = segments_if(strict, "adam_step", params, grads, "exp_avgs", exp_avgs, "exp_avg_sqs",
                                 &exp_avg_sqs, out16, decay_mask);
  if (!found) return false;
  const AdamCoef coef[2] = {adam_coef(step, lr, beta1, beta2, eps, 0.0, decoupled, bias_correction),
                            adam_coef(step, lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction)};
  const auto fn = FRAMEWORK_OPS_PICK(AdamCoef, adam);
  const int64_t ahead = active_prefetch().load();
  for_each_block(*found, [&](const Segment& sg, int64_t b, int64_t e) { fn(coef[sg.decayed], sg, b, e, ahead); });
  return true;
}

LionCoef lion_coef(double lr, double beta1, double beta2, double weight_decay) {
  LionCoef c;
  c.decayed = weight_decay != 0.0;
  c.b1 = static_cast<float>(beta1);
  c.one_minus_b1 = static_cast<float>(1.0 - beta1);
  c.b2 = static_cast<float>(beta2);
  c.one_minus_b2 = static_cast<float>(1.0 - beta2);
  c.wd = static_cast<float>(weight_decay);
  c.neg_lr = static_cast<float>(-lr);
  return c;
}

bool lion_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& out16, double lr, double beta1, double beta2, double weight_decay,
               const std::vector<bool>& decay_mask, bool strict) {
  const auto found = segments_if(strict, "lion_step", params, grads, "exp_avgs", exp_avgs, nullptr, nullptr, out16,
                                 decay_mask);
  if (!found) return false;
  const LionCoef coef[2] = {lion_coef(lr, beta1, beta2, 0.0), lion_coef(lr, beta1, beta2, weight_decay)};
  const auto fn = FRAMEWORK_OPS_PICK(LionCoef, lion);
  const int64_t ahead = active_prefetch().load();
  for_each_block(*found, [&](const Segment& sg, int64_t b, int64_t e) { fn(coef[sg.decayed], sg, b, e, ahead); });
  return true;
}

AdagradCoef adagrad_coef(int64_t step, double lr, double lr_decay, double weight_decay, double eps) {
  AdagradCoef c;
  c.l2 = weight_decay != 0.0;
  c.wd = static_cast<float>(weight_decay);
  c.eps = static_cast<float>(eps);
  c.neg_clr = static_cast<float>(-(lr / (1.0 + static_cast<double>(step - 1) * lr_decay)));
  return c;
}

bool adagrad_step(const TensorList& params, const TensorList& grads, const TensorList& state_sums,
                  const TensorList& out16, int64_t step, double lr, double lr_decay, double weight_decay,
                  double eps, const std::vector<bool>& decay_mask, bool strict) {
  TORCH_CHECK_VALUE(step >= 1, "adagrad_step: step must be >= 1 (the count after this step), got ", step);
  const auto found = segments_if(strict, "adagrad_step", params, grads, "state_sums", state_sums, nullptr, nullptr,
                                 out16, decay_mask);
  if (!found) return false;
  const AdagradCoef coef[2] = {adagrad_coef(step, lr, lr_decay, 0.0, eps),
                               adagrad_coef(step, lr, lr_decay, weight_decay, eps)};
  const auto fn = FRAMEWORK_OPS_PICK(AdagradCoef, adagrad);
  const int64_t ahead = active_prefetch().load();
  for_each_block(*found, [&](const Segment& sg, int64_t b, int64_t e) { fn(coef[sg.decayed], sg, b, e, ahead); });
  return true;
}

}  // namespace framework_ops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace fo = framework_ops;
  namespace py = pybind11;
  m.doc() = "framework's CPU optimizer kernels (Adam/AdamW, Lion, Adagrad) over lists of contiguous fp32 tensors";
  m.def("adam_step", &fo::adam_step, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("out16"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"),
        py::arg("bias_correction"), py::arg("decay_mask") = std::vector<bool>{},
        py::arg("strict") = true, py::call_guard<py::gil_scoped_release>(),
        "Adam (L2 decay) or AdamW (decoupled decay) step in place; `step` is the count after this step. "
        "decay_mask (one bool per param, or empty for all): which params get weight_decay. Returns true; with "
        "strict=false, returns false (and changes nothing) where a tensor does not fit.");
  m.def("lion_step", &fo::lion_step, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("out16"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"),
        py::arg("decay_mask") = std::vector<bool>{}, py::arg("strict") = true,
        py::call_guard<py::gil_scoped_release>(), "Lion step in place (decoupled decay); strict: as adam_step.");
  m.def("adagrad_step", &fo::adagrad_step, py::arg("params"), py::arg("grads"), py::arg("state_sums"),
        py::arg("out16"), py::arg("step"), py::arg("lr"), py::arg("lr_decay"), py::arg("weight_decay"),
        py::arg("eps"), py::arg("decay_mask") = std::vector<bool>{}, py::arg("strict") = true, py::call_guard<py::gil_scoped_release>(),
        "Adagrad step in place (L2 decay, lr decay); `step` is the count after this step; strict: as adam_step.");
  m.def("prefetch_distance", &fo::prefetch_distance,
        "How many floats ahead the kernels prefetch each stream (0: not at all).");
  m.def("set_prefetch", &fo::set_prefetch, py::arg("floats"),
        "Set the prefetch distance in floats (0: off; -1: this CPU's default): for tests and benchmarks.");
  m.def("isa", &fo::isa, "The instruction set the kernels use now: avx512, avx2 or scalar.");
  m.def("detected_isa", &fo::detected, "The best instruction set this CPU supports.");
  m.def("set_isa", &fo::set_isa, py::arg("name"),
        "Cap the instruction set (scalar, avx2, avx512; auto or '' for the best): for tests and benchmarks.");
}
