// Fused CPU kernels for ucp's kernels package: Adam(W) over flat fp32 partitions in one pass over
// memory (with an optional bf16/fp16 copy-back of the updated weights), and copy + CRC-32C.
//
// Numerics: the per-element arithmetic repeats torch.optim's single-tensor Adam(W) op for op, with
// the roundings of torch's vectorised CPU kernels (lerp and add(alpha) use a fused multiply-add,
// addcmul too, addcdiv does not). Built with -ffp-contract=off so the compiler adds no other fusions;
// the FMAs are explicit (__builtin_fmaf); sqrt is MKL's when torch uses it (see below). Loops are written in scalar form and auto-vectorised,
// compiled three times (AVX-512, AVX2+FMA, baseline) and chosen at run time.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define UCP_X86 1
#else
#define UCP_X86 0
#endif

namespace {

struct AdamScalars {
  float decay_mul;   // AdamW: 1 - lr*wd (1 when no decay)
  float decay_add;   // Adam: wd (0 when none or decoupled)
  float weight;      // lerp weight 1 - beta1
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;    // sqrt(1 - beta2^step)
  float eps;
  float neg_step;    // -lr / (1 - beta1^step)
  float grad_scale;  // unscale * clip, applied first (1: none)
};

inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN -> 0x7FC0: c10::BFloat16's conversion.
__attribute__((always_inline)) inline uint16_t to_bf16(float f) {
  uint32_t u = f2u(f);
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7FC0) : uint16_t(r);
}

// IEEE half, round to nearest even (c10's fp16_ieee_from_fp32_value, branch-free); NaN -> 0x7E00.
__attribute__((always_inline)) inline uint16_t to_fp16(float f) {
  const float scale_to_inf = u2f(0x77800000u);   // 2^112
  const float scale_to_zero = u2f(0x08800000u);  // 2^-110
  float base = (__builtin_fabsf(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f2u(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = u2f((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f2u(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// torch.sqrt on float goes through MKL's vmsSqrt (VML_HA: within 1 ulp, not always correctly
// rounded) wherever torch is built with MKL, and libtorch_cpu exports it: with torch_sqrt the kernel
// calls it on each cache-resident block and is bit-equal to torch.optim's single-tensor path (at a
// cost: MKL's sqrt is slow). Otherwise sqrt is IEEE (correctly rounded), as torch's fused Adam and
// every non-MKL build of torch compute it.
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode) __attribute__((weak));
constexpr long long VML_MODE = 0x2 /*HA*/ | 0x00140000 /*FTZDAZ_OFF*/ | 0x100 /*ERRMODE_IGNORE*/;
constexpr int64_t BLOCK = 2048;  // elements per L1/L2-resident block (the MKL sqrt call's unit)

// OUT: 0 none, 1 bf16, 2 fp16, 3 fp32. DECAY: 1 decoupled (AdamW; multiplier 1 = no decay), 2 L2 (Adam).
// SMALL: lerp weight < 0.5 (torch's lerp picks its formula by that). MKL: sqrt by vmsSqrt per block.
// Per element, as torch's vectorised kernels round:
//   g *= scale;  AdamW: p *= 1 - lr*wd  |  Adam: g = fma(p, wd, g)          (add with alpha)
//   m = fma(w, g - m, m)  (w < .5)  |  fma(w - 1, g - m, g)                   (lerp)
//   v = fma((1 - b2) * g, g, v * b2)                                            (mul_, addcmul_)
//   p = p + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)                      (sqrt, div, add, addcdiv)
template <int OUT, int DECAY, bool SMALL, bool MKL>
__attribute__((always_inline)) inline void adam_loop(float* __restrict p, const float* __restrict g,
                                                     float* __restrict m, float* __restrict v,
                                                     void* __restrict out, int64_t n, const AdamScalars& s) {
  const float decay_mul = s.decay_mul, decay_add = s.decay_add, w = s.weight, b2 = s.beta2,
              omb2 = s.one_minus_beta2, bc2 = s.bc2_sqrt, eps = s.eps, neg_step = s.neg_step,
              gs = s.grad_scale;
  uint16_t* __restrict o16 = static_cast<uint16_t*>(out);
  float* __restrict o32 = static_cast<float*>(out);
  if (!MKL) {
#pragma GCC ivdep
    for (int64_t i = 0; i < n; ++i) {
      float gi = g[i] * gs;  // x * 1.0f == x: no scale costs nothing but the multiply
      float pi = p[i];
      if (DECAY == 1) pi = pi * decay_mul;
      if (DECAY == 2) gi = __builtin_fmaf(pi, decay_add, gi);
      const float mi = m[i];
      const float mn = SMALL ? __builtin_fmaf(w, gi - mi, mi) : __builtin_fmaf(w - 1.0f, gi - mi, gi);
      const float vn = __builtin_fmaf(omb2 * gi, gi, v[i] * b2);
      const float denom = __builtin_sqrtf(vn) / bc2 + eps;
      const float pn = pi + (neg_step * mn) / denom;
      m[i] = mn;
      v[i] = vn;
      p[i] = pn;
      if (OUT == 1) o16[i] = to_bf16(pn);
      if (OUT == 2) o16[i] = to_fp16(pn);
      if (OUT == 3) o32[i] = pn;
    }
    return;
  }
  alignas(64) float tp[BLOCK];
  alignas(64) float ts[BLOCK];
  for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
    const int64_t len = n - b0 < BLOCK ? n - b0 : BLOCK;
    float* __restrict pb = p + b0;
    const float* __restrict gb = g + b0;
    float* __restrict mb = m + b0;
    float* __restrict vb = v + b0;
#pragma GCC ivdep
    for (int64_t i = 0; i < len; ++i) {
      float gi = gb[i] * gs;
      float pi = pb[i];
      if (DECAY == 1) pi = pi * decay_mul;
      if (DECAY == 2) gi = __builtin_fmaf(pi, decay_add, gi);
      const float mi = mb[i];
      mb[i] = SMALL ? __builtin_fmaf(w, gi - mi, mi) : __builtin_fmaf(w - 1.0f, gi - mi, gi);
      vb[i] = __builtin_fmaf(omb2 * gi, gi, vb[i] * b2);
      tp[i] = pi;
    }
    vmsSqrt(int(len), vb, ts, VML_MODE);
#pragma GCC ivdep
    for (int64_t i = 0; i < len; ++i) {
      const float denom = ts[i] / bc2 + eps;
      const float pn = tp[i] + (neg_step * mb[i]) / denom;
      pb[i] = pn;
      if (OUT == 1) o16[b0 + i] = to_bf16(pn);
      if (OUT == 2) o16[b0 + i] = to_fp16(pn);
      if (OUT == 3) o32[b0 + i] = pn;
    }
  }
}

using AdamFn = void (*)(float*, const float*, float*, float*, void*, int64_t, const AdamScalars&);

template <int OUT, int DECAY, bool SMALL, bool MKL>
void adam_base(float* p, const float* g, float* m, float* v, void* o, int64_t n, const AdamScalars& s) {
  adam_loop<OUT, DECAY, SMALL, MKL>(p, g, m, v, o, n, s);
}
#if UCP_X86
template <int OUT, int DECAY, bool SMALL, bool MKL>
__attribute__((target("avx2,fma,f16c"))) void adam_avx2(float* p, const float* g, float* m, float* v, void* o,
                                                        int64_t n, const AdamScalars& s) {
  adam_loop<OUT, DECAY, SMALL, MKL>(p, g, m, v, o, n, s);
}
template <int OUT, int DECAY, bool SMALL, bool MKL>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))) void adam_avx512(
    float* p, const float* g, float* m, float* v, void* o, int64_t n, const AdamScalars& s) {
  adam_loop<OUT, DECAY, SMALL, MKL>(p, g, m, v, o, n, s);
}
#endif

int isa_level() {
#if UCP_X86
  static const int level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
  }();
  return level;
#else
  return 0;
#endif
}

template <int OUT, int DECAY, bool SMALL, bool MKL>
AdamFn pick4() {
#if UCP_X86
  switch (isa_level()) {
    case 2:
      return &adam_avx512<OUT, DECAY, SMALL, MKL>;
    case 1:
      return &adam_avx2<OUT, DECAY, SMALL, MKL>;
    default:
      break;
  }
#endif
  return &adam_base<OUT, DECAY, SMALL, MKL>;
}
template <int OUT, int DECAY, bool SMALL>
AdamFn pick3(bool mkl) {
  return mkl ? pick4<OUT, DECAY, SMALL, true>() : pick4<OUT, DECAY, SMALL, false>();
}
template <int OUT, int DECAY>
AdamFn pick2(bool small, bool mkl) {
  return small ? pick3<OUT, DECAY, true>(mkl) : pick3<OUT, DECAY, false>(mkl);
}
template <int OUT>
AdamFn pick1(int decay, bool small, bool mkl) {
  return decay == 2 ? pick2<OUT, 2>(small, mkl) : pick2<OUT, 1>(small, mkl);
}
AdamFn pick(int out, int decay, bool small, bool mkl) {
  switch (out) {
    case 1:
      return pick1<1>(decay, small, mkl);
    case 2:
      return pick1<2>(decay, small, mkl);
    case 3:
      return pick1<3>(decay, small, mkl);
    default:
      return pick1<0>(decay, small, mkl);
  }
}

// param, grad, exp_avg, exp_avg_sq: contiguous fp32 CPU tensors of equal numel (checked in Python);
// out: an empty tensor (no copy-back) or a contiguous bf16/fp16/fp32 tensor of that numel.
void adam_step(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
               torch::Tensor out, int64_t decay, double decay_mul, double decay_add, double weight, double beta2,
               double one_minus_beta2, double bc2_sqrt, double eps, double neg_step, double grad_scale,
               bool torch_sqrt, int64_t grain) {
  const int64_t n = param.numel();
  int kind = 0;
  void* o = nullptr;
  if (out.numel() > 0) {
    o = out.data_ptr();
    switch (out.scalar_type()) {
      case at::kBFloat16:
        kind = 1;
        break;
      case at::kHalf:
        kind = 2;
        break;
      case at::kFloat:
        kind = 3;
        break;
      default:
        TORCH_CHECK(false, "copy-back dtype ", out.scalar_type(), " is not bf16, fp16 or fp32");
    }
  }
  // Each scalar is rounded to fp32 once, as torch rounds a Python-float scalar for a float tensor.
  const AdamScalars s{float(decay_mul), float(decay_add), float(weight),   float(beta2),     float(one_minus_beta2),
                      float(bc2_sqrt),  float(eps),       float(neg_step), float(grad_scale)};
  const bool small = __builtin_fabsf(s.weight) < 0.5f;
  // Without MKL, torch's own sqrt is the IEEE one: torch_sqrt then needs nothing else.
  const AdamFn fn = pick(kind, int(decay), small, torch_sqrt && vmsSqrt != nullptr);
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const int64_t esize = kind == 3 ? 4 : 2;
  char* ob = static_cast<char*>(o);
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    fn(p + b, g + b, m + b, v + b, ob ? ob + b * esize : nullptr, e - b, s);
  });
}

// ---- CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) ------------------------------------
constexpr uint32_t POLY = 0x82F63B78u;

// a*b mod P in the reflected representation (x^0 is bit 31), as zlib's multmodp.
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
  }
  return p;
}

// x^(8*len) mod P: the operator that appends len zero bytes to a raw CRC register.
uint32_t x8nmodp(uint64_t len) {
  static const std::vector<uint32_t> x2n = [] {
    std::vector<uint32_t> t(64);
    uint32_t p = 1u << 30;  // x^1
    t[0] = p;
    for (int k = 1; k < 64; ++k) t[k] = p = multmodp(p, p);
    return t;
  }();
  uint32_t p = 1u << 31;  // x^0
  unsigned k = 3;         // 8*len = len * 2^3
  while (len) {
    if (len & 1) p = multmodp(x2n[k & 63], p);
    len >>= 1;
    ++k;
  }
  return p;
}

// Raw register update (no pre/post inversion) over n bytes, copying them from src to dst.
uint32_t crc_copy_base(uint32_t crc, unsigned char* dst, const unsigned char* src, int64_t n) {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::memmove(dst, src, size_t(n));
  for (int64_t i = 0; i < n; ++i) crc = table[(crc ^ src[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if UCP_X86
constexpr int64_t LANE = 4096;  // bytes per interleaved stream: three crc32 chains hide its latency

__attribute__((target("sse4.2"))) uint32_t crc_copy_hw(uint32_t crc, unsigned char* dst, const unsigned char* src,
                                                      int64_t n) {
  static const uint32_t shift1 = x8nmodp(LANE), shift2 = x8nmodp(2 * LANE);
  while (n >= 3 * LANE) {
    uint64_t a = crc, b = 0, c = 0;
    for (int64_t i = 0; i < LANE; i += 8) {
      uint64_t x, y, z;
      std::memcpy(&x, src + i, 8);
      std::memcpy(&y, src + LANE + i, 8);
      std::memcpy(&z, src + 2 * LANE + i, 8);
      std::memcpy(dst + i, &x, 8);
      std::memcpy(dst + LANE + i, &y, 8);
      std::memcpy(dst + 2 * LANE + i, &z, 8);
      a = _mm_crc32_u64(a, x);
      b = _mm_crc32_u64(b, y);
      c = _mm_crc32_u64(c, z);
    }
    crc = multmodp(shift2, uint32_t(a)) ^ multmodp(shift1, uint32_t(b)) ^ uint32_t(c);
    src += 3 * LANE;
    dst += 3 * LANE;
    n -= 3 * LANE;
  }
  uint64_t a = crc;
  for (; n >= 8; n -= 8, src += 8, dst += 8) {
    uint64_t x;
    std::memcpy(&x, src, 8);
    std::memcpy(dst, &x, 8);
    a = _mm_crc32_u64(a, x);
  }
  uint32_t r = uint32_t(a);
  for (; n > 0; --n, ++src, ++dst) {
    *dst = *src;
    r = _mm_crc32_u8(r, *src);
  }
  return r;
}
#endif

uint32_t crc_copy_raw(uint32_t crc, unsigned char* dst, const unsigned char* src, int64_t n) {
#if UCP_X86
  static const bool hw = [] {
    __builtin_cpu_init();
    return bool(__builtin_cpu_supports("sse4.2"));
  }();
  if (hw) return crc_copy_hw(crc, dst, src, n);
#endif
  return crc_copy_base(crc, dst, src, n);
}

// Copies n bytes src -> dst (non-overlapping) and returns crc32c(src, value), value being the
// CRC of what came before (0 to start), as crc32c.crc32c(data, value). Chunks run in parallel
// and their CRCs are combined; the GIL is released by the caller's binding.
int64_t copy_crc32c(int64_t dst_addr, int64_t src_addr, int64_t n, int64_t value, int64_t grain) {
  auto* dst = reinterpret_cast<unsigned char*>(dst_addr);
  const auto* src = reinterpret_cast<const unsigned char*>(src_addr);
  uint32_t start = ~uint32_t(value);
  if (n <= 0) return int64_t(~start);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain));
  if (chunks == 1) return int64_t(~crc_copy_raw(start, dst, src, n));
  const int64_t step = (n + chunks - 1) / chunks;
  std::vector<uint32_t> crcs(size_t(chunks), 0);
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t lo = c * step, hi = std::min(n, lo + step);
      if (lo < hi) crcs[size_t(c)] = crc_copy_raw(c == 0 ? start : 0u, dst + lo, src + lo, hi - lo);
    }
  });
  uint32_t crc = crcs[0];
  for (int64_t c = 1; c < chunks; ++c) {
    const int64_t lo = c * step, hi = std::min(n, lo + step);
    if (lo >= hi) break;
    crc = multmodp(x8nmodp(uint64_t(hi - lo)), crc) ^ crcs[size_t(c)];
  }
  return int64_t(~crc);
}

std::string isa() {
  switch (isa_level()) {
    case 2:
      return "avx512";
    case 1:
      return "avx2";
    default:
      return "baseline";
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("adam_step", &adam_step, "fused Adam(W) step over flat fp32 buffers",
          pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("copy_crc32c", &copy_crc32c, "copy bytes and return their CRC-32C",
          pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("isa", &isa, "the instruction set the kernels dispatch to on this CPU");
}
