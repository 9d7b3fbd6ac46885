// Vector types for the CPU optimizer kernels: one struct per instruction set, each with the same
// static functions, so that one kernel body (optim_kernels.h) serves every ISA.
//
// Every operation is a single IEEE-754 operation (fma included), correctly rounded, so a kernel
// gives bit-identical results whichever struct runs it: the vector body and the scalar tail agree,
// and so do AVX-512, AVX2 and the scalar fallback. Build with -ffp-contract=off so that the
// compiler does not fuse a mul and an add of the scalar code on its own.
//
// The AVX2 and AVX-512 structs are compiled for their instruction set with `#pragma GCC target`
// (the rest of the library stays baseline x86-64); they may only run after a run-time check.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#define FRAMEWORK_OPS_X86 1
#include <immintrin.h>
#endif

namespace framework_ops {

// One float at a time: the fallback ISA and the tail of every vector loop.
struct Scalar {
  using T = float;
  static constexpr int64_t W = 1;
  static inline T load(const float* p) { return *p; }
  static inline void store(float* p, T x) { *p = x; }
  static inline T set1(float x) { return x; }
  static inline T add(T a, T b) { return a + b; }
  static inline T sub(T a, T b) { return a - b; }
  static inline T mul(T a, T b) { return a * b; }
  static inline T div(T a, T b) { return a / b; }
  static inline T sqrt(T a) { return __builtin_sqrtf(a); }
  static inline T fma(T a, T b, T c) { return __builtin_fmaf(a, b, c); }  // a * b + c, one rounding
  // torch.sign: 1, -1 or 0 (for +-0 and NaN).
  static inline T sign(T a) { return static_cast<float>((0.f < a) - (a < 0.f)); }
  // As Tensor.to(torch.bfloat16) / .to(torch.float16): round to nearest even.
  static inline void store_bf16(uint16_t* p, T x) { *p = c10::BFloat16(x).x; }
  static inline void store_fp16(uint16_t* p, T x) { *p = c10::Half(x).x; }
  // Non-temporal variants (vector structs: aligned stores that bypass the cache; here plain).
  static inline void stream_bf16(uint16_t* p, T x) { store_bf16(p, x); }
  static inline void stream_fp16(uint16_t* p, T x) { store_fp16(p, x); }
  static inline void fence() {}
};

#ifdef FRAMEWORK_OPS_X86

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
struct Avx2 {
  using T = __m256;
  static constexpr int64_t W = 8;
  static inline T load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static inline T set1(float x) { return _mm256_set1_ps(x); }
  static inline T add(T a, T b) { return _mm256_add_ps(a, b); }
  static inline T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static inline T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static inline T div(T a, T b) { return _mm256_div_ps(a, b); }
  static inline T sqrt(T a) { return _mm256_sqrt_ps(a); }
  static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static inline T sign(T a) {
    const T one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    return _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), one),
                         _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ), one));
  }
  static inline __m128i to_bf16(T x) {
    // Round to nearest even on the bit pattern: add 0x7fff plus the lowest kept bit, keep the top
    // 16 bits; NaN becomes the canonical quiet NaN 0x7fc0 (as c10::BFloat16).
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    // packus works per 128-bit lane: elements 0-3 land in qword 0 and 4-7 in qword 2.
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
  }
  static inline __m128i to_fp16(T x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static inline void store_bf16(uint16_t* p, T x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static inline void store_fp16(uint16_t* p, T x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_fp16(x)); }
  // p 16-byte aligned.
  static inline void stream_bf16(uint16_t* p, T x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static inline void stream_fp16(uint16_t* p, T x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_fp16(x)); }
  static inline void fence() { _mm_sfence(); }
};
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
struct Avx512 {
  using T = __m512;
  static constexpr int64_t W = 16;
  static inline T load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static inline T set1(float x) { return _mm512_set1_ps(x); }
  static inline T add(T a, T b) { return _mm512_add_ps(a, b); }
  static inline T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static inline T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static inline T div(T a, T b) { return _mm512_div_ps(a, b); }
  static inline T sqrt(T a) { return _mm512_sqrt_ps(a); }
  static inline T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static inline T sign(T a) {
    const T one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
    return _mm512_sub_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ), one),
                         _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), one));
  }
  static inline __m256i to_bf16(T x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
  }
  static inline __m256i to_fp16(T x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static inline void store_bf16(uint16_t* p, T x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  static inline void store_fp16(uint16_t* p, T x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_fp16(x)); }
  // p 32-byte aligned.
  static inline void stream_bf16(uint16_t* p, T x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  static inline void stream_fp16(uint16_t* p, T x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_fp16(x)); }
  static inline void fence() { _mm_sfence(); }
};
#pragma GCC pop_options

#endif  // FRAMEWORK_OPS_X86

}  // namespace framework_ops
