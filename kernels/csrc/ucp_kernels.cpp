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

#include <algorithm>
#include <atomic>
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

// NaNs as torch's CPU .to() writes them: on x86 its vectorized conversion (every contiguous cast,
// tails included) writes bf16 NaN as 0xFFFF and fp16 NaN as F16C's vcvtps2ph does (sign, quiet bit,
// the payload's top 10 bits); elsewhere c10's scalar conversions (0x7FC0; sign | 0x7E00).
#if UCP_X86
constexpr bool TORCH_X86_NANS = true;
#else
constexpr bool TORCH_X86_NANS = false;
#endif

// Round to nearest even (c10::BFloat16's conversion); NaN as torch writes it (above).
__attribute__((always_inline)) inline uint16_t to_bf16(float f) {
  uint32_t u = f2u(f);
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(TORCH_X86_NANS ? 0xFFFF : 0x7FC0) : uint16_t(r);
}

// IEEE half, round to nearest even (c10's fp16_ieee_from_fp32_value, branch-free); NaN as torch
// writes it (above).
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
  const uint32_t nan = TORCH_X86_NANS ? 0x7E00u | ((w >> 13) & 0x3FFu) : 0x7E00u;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? nan : nonsign));
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

// Runs fn(lo, hi) over [0, n) in blocks of `block` items, handed out one at a time from a shared
// counter to min(torch.get_num_threads(), blocks) OpenMP threads (torch's own runtime: the extension
// links the libgomp torch loaded). Dynamic hand-out rather than at::parallel_for's one static range
// per thread: the step is memory-bound, and on a shared host a thread that loses its core for a
// while no longer holds the whole step back (the others take its remaining blocks). Serial inside
// another parallel region, or when one block covers everything.
template <typename F>
void parallel_blocks(int64_t n, int64_t block, const F& fn) {
  if (n <= 0) return;
  block = std::max<int64_t>(1, block);
  const int64_t blocks = (n + block - 1) / block;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), blocks);
  if (threads <= 1 || at::in_parallel_region()) {
    fn(int64_t(0), n);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(int(threads))
  {
    for (int64_t b = next.fetch_add(1, std::memory_order_relaxed); b < blocks;
         b = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t lo = b * block;
      fn(lo, std::min(n, lo + block));
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
  parallel_blocks(n, grain, [&](int64_t b, int64_t e) {
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

// Raw register update (no pre/post inversion) over n bytes; copies them to dst first when dst is set.
uint32_t crc_base(uint32_t crc, unsigned char* dst, const unsigned char* src, int64_t n) {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  if (dst != nullptr) std::memmove(dst, src, size_t(n));
  for (int64_t i = 0; i < n; ++i) crc = table[(crc ^ src[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if UCP_X86
// One chain of SSE4.2's crc32 instruction (latency 3, one per cycle): for short runs and remainders.
__attribute__((target("sse4.2"))) uint32_t crc_serial_hw(uint32_t crc, unsigned char* dst, const unsigned char* src,
                                                        int64_t n) {
  if (dst != nullptr) std::memcpy(dst, src, size_t(n));
  uint64_t a = crc;
  for (; n >= 8; n -= 8, src += 8) {
    uint64_t x;
    std::memcpy(&x, src, 8);
    a = _mm_crc32_u64(a, x);
  }
  uint32_t r = uint32_t(a);
  for (; n > 0; --n, ++src) r = _mm_crc32_u8(r, *src);
  return r;
}

// x^(8·lane) and x^(16·lane) mod P, remembered per thread for the last lane length: blocks and
// tiles mostly repeat one length, and deriving the shifts costs more than a tile's CRC.
struct LaneShifts {
  int64_t lane = -1;
  uint32_t one = 0, two = 0;
};
const LaneShifts& lane_shifts(int64_t lane) {
  static thread_local LaneShifts cached;
  if (cached.lane != lane) cached = LaneShifts{lane, x8nmodp(uint64_t(lane)), x8nmodp(uint64_t(2 * lane))};
  return cached;
}

// Three crc32 chains over three contiguous lanes of `lane` bytes (a multiple of 64) hide the
// instruction's latency; each 64-byte line is loaded once as a vector for the copy (a streaming,
// cache-bypassing store when NT: dst must then be 64-byte aligned) and read again as eight words for
// the CRC from L1. The lanes' registers are joined with x^(8·lane) shifts in GF(2).
#define UCP_CRC3_BODY(LOAD, STORE, STREAM, VEC, STEP)                                            \
  uint64_t a = crc, b = 0, c = 0;                                                                \
  const unsigned char *s1 = src + lane, *s2 = src + 2 * lane;                                    \
  unsigned char *d1 = dst + lane, *d2 = dst + 2 * lane;                                          \
  for (int64_t i = 0; i < lane; i += 64) {                                                       \
    if (COPY) {                                                                                  \
      for (int k = 0; k < 64; k += STEP) {                                                       \
        const VEC x = LOAD(src + i + k), y = LOAD(s1 + i + k), z = LOAD(s2 + i + k);             \
        if (NT) {                                                                                \
          STREAM(dst + i + k, x);                                                                \
          STREAM(d1 + i + k, y);                                                                 \
          STREAM(d2 + i + k, z);                                                                 \
        } else {                                                                                 \
          STORE(dst + i + k, x);                                                                 \
          STORE(d1 + i + k, y);                                                                  \
          STORE(d2 + i + k, z);                                                                  \
        }                                                                                        \
      }                                                                                          \
    }                                                                                            \
    _Pragma("GCC unroll 8") for (int k = 0; k < 64; k += 8) {                                    \
      uint64_t u, v, w;                                                                          \
      std::memcpy(&u, src + i + k, 8);                                                           \
      std::memcpy(&v, s1 + i + k, 8);                                                            \
      std::memcpy(&w, s2 + i + k, 8);                                                            \
      a = _mm_crc32_u64(a, u);                                                                   \
      b = _mm_crc32_u64(b, v);                                                                   \
      c = _mm_crc32_u64(c, w);                                                                   \
    }                                                                                            \
  }                                                                                              \
  if (NT) _mm_sfence(); /* streaming stores are weakly ordered: publish them before returning */ \
  const LaneShifts& sh = lane_shifts(lane);                                                      \
  return multmodp(sh.two, uint32_t(a)) ^ multmodp(sh.one, uint32_t(b)) ^ uint32_t(c);

inline __m128i ld128(const unsigned char* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline void st128(unsigned char* p, __m128i x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x); }
inline void nt128(unsigned char* p, __m128i x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), x); }

template <bool COPY, bool NT>
__attribute__((target("sse4.2"))) uint32_t crc3_sse(uint32_t crc, unsigned char* dst, const unsigned char* src,
                                                   int64_t lane) {
  UCP_CRC3_BODY(ld128, st128, nt128, __m128i, 16)
}

__attribute__((target("avx512f"))) inline __m512i ld512(const unsigned char* p) { return _mm512_loadu_si512(p); }
__attribute__((target("avx512f"))) inline void st512(unsigned char* p, __m512i x) { _mm512_storeu_si512(p, x); }
__attribute__((target("avx512f"))) inline void nt512(unsigned char* p, __m512i x) {
  _mm512_stream_si512(reinterpret_cast<__m512i*>(p), x);
}

template <bool COPY, bool NT>
__attribute__((target("sse4.2,avx512f"))) uint32_t crc3_avx512(uint32_t crc, unsigned char* dst,
                                                              const unsigned char* src, int64_t lane) {
  UCP_CRC3_BODY(ld512, st512, nt512, __m512i, 64)
}
#undef UCP_CRC3_BODY

bool has_sse42() {
  static const bool hw = [] {
    __builtin_cpu_init();
    return bool(__builtin_cpu_supports("sse4.2"));
  }();
  return hw;
}
#endif

constexpr int64_t MIN_LANE = 256;  // below 3 lanes of this, one chain

// Raw register update over one block of n bytes, copying it to dst when dst is set (streaming
// stores when nt). Any alignment, any length.
uint32_t crc_block(uint32_t crc, unsigned char* dst, const unsigned char* src, int64_t n, bool nt) {
#if UCP_X86
  if (has_sse42()) {
    if (dst != nullptr && nt) {  // streaming stores need 64-byte-aligned destinations: do the head first
      const int64_t head = std::min<int64_t>(n, int64_t((64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63));
      crc = crc_serial_hw(crc, dst, src, head);
      dst += head;
      src += head;
      n -= head;
    }
    const int64_t lane = (n / 3) & ~int64_t(63);
    if (lane >= MIN_LANE) {
      const bool wide = isa_level() == 2;
      if (dst == nullptr)
        crc = wide ? crc3_avx512<false, false>(crc, dst, src, lane) : crc3_sse<false, false>(crc, dst, src, lane);
      else if (nt)
        crc = wide ? crc3_avx512<true, true>(crc, dst, src, lane) : crc3_sse<true, true>(crc, dst, src, lane);
      else
        crc = wide ? crc3_avx512<true, false>(crc, dst, src, lane) : crc3_sse<true, false>(crc, dst, src, lane);
      src += 3 * lane;
      if (dst != nullptr) dst += 3 * lane;
      n -= 3 * lane;
    }
    return crc_serial_hw(crc, dst, src, n);
  }
#endif
  return crc_base(crc, dst, src, n);
}

// Copies past this many bytes use streaming stores: the copy is then far larger than the caches, the
// destination is not read back soon (it goes to storage), and skipping the read-for-ownership of each
// destination line is what brings copy + CRC to plain-copy speed.
constexpr int64_t NT_MIN = int64_t(4) << 20;
constexpr int64_t MIN_SPLIT = int64_t(1) << 20;  // bytes: smaller copies run on the calling thread

// Copies n bytes src -> dst (non-overlapping; dst may be 0 for a CRC alone) and returns
// crc32c(src, value), value being the CRC of what came before (0 to start), as
// crc32c.crc32c(data, value). Blocks of `grain` bytes (fewer when that leaves a thread idle) run in
// parallel and their CRCs are joined; the GIL is released by the caller's binding.
int64_t copy_crc32c(int64_t dst_addr, int64_t src_addr, int64_t n, int64_t value, int64_t grain) {
  auto* dst = reinterpret_cast<unsigned char*>(dst_addr);
  const auto* src = reinterpret_cast<const unsigned char*>(src_addr);
  const uint32_t start = ~uint32_t(value);
  if (n <= 0) return int64_t(~start);
  const bool nt = dst != nullptr && n >= NT_MIN;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // One block per thread when grain would leave one idle, but never under MIN_SPLIT bytes: a
  // thread team costs microseconds, a small copy less.
  const int64_t even = std::max<int64_t>(MIN_SPLIT, ((n + threads - 1) / threads + 63) & ~int64_t(63));
  const int64_t block = std::max<int64_t>(1, std::min(grain, even));
  const int64_t blocks = (n + block - 1) / block;
  std::vector<uint32_t> crcs(size_t(blocks), 0);
  parallel_blocks(blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t lo = i * block;
      crcs[size_t(i)] = crc_block(i == 0 ? start : 0u, dst ? dst + lo : nullptr, src + lo, std::min(block, n - lo), nt);
    }
  });
  uint32_t crc = crcs[0];
  const uint32_t shift = x8nmodp(uint64_t(block));
  for (int64_t i = 1; i < blocks; ++i) {
    const int64_t len = std::min(block, n - i * block);
    crc = multmodp(len == block ? shift : x8nmodp(uint64_t(len)), crc) ^ crcs[size_t(i)];
  }
  return int64_t(~crc);
}

// ---- cast + flatten ------------------------------------------------------------------------------
// bf16 -> fp32 is exact; fp16 -> fp32 is c10's fp16_ieee_to_fp32_value (exact; NaN stays NaN, made
// quiet on x86 as torch's vectorized conversion there does).
inline float from_bf16(uint16_t h) { return u2f(uint32_t(h) << 16); }
inline float from_fp16(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = u2f((two_w >> 4) + (0xE0u << 23)) * u2f(0x7800000u);  // * 2^-112
  const float denormalized = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
  // A NaN comes out quiet on x86, as F16C's vcvtph2ps (torch's conversion there) makes it.
  const uint32_t quiet = TORCH_X86_NANS && two_w > 0xF8000000u ? 0x00400000u : 0u;
  return u2f(sign | quiet | (two_w < (1u << 27) ? f2u(denormalized) : f2u(normalized)));
}

// Element kinds: 0 fp32, 1 bf16, 2 fp16. Each element goes through fp32 (exact for every source
// kind here), then rounds once to the destination as torch's .to() does (RNE; NaNs as in to_bf16
// and to_fp16).
template <int SK, int DK>
__attribute__((always_inline)) inline void cast_loop(const void* __restrict s, void* __restrict d, int64_t n) {
  const float* __restrict s32 = static_cast<const float*>(s);
  const uint16_t* __restrict s16 = static_cast<const uint16_t*>(s);
  float* __restrict d32 = static_cast<float*>(d);
  uint16_t* __restrict d16 = static_cast<uint16_t*>(d);
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    const float x = SK == 0 ? s32[i] : SK == 1 ? from_bf16(s16[i]) : from_fp16(s16[i]);
    if (DK == 0) d32[i] = x;
    // fp16 -> bf16 NaNs: torch converts that pair with c10's scalar conversion (0x7FC0), not vectorized.
    if (DK == 1) d16[i] = SK == 2 && x != x ? uint16_t(0x7FC0) : to_bf16(x);
    if (DK == 2) d16[i] = to_fp16(x);
  }
}

using CastFn = void (*)(const void*, void*, int64_t);
template <int SK, int DK>
void cast_base(const void* s, void* d, int64_t n) {
  cast_loop<SK, DK>(s, d, n);
}
#if UCP_X86
template <int SK, int DK>
__attribute__((target("avx2,fma,f16c"))) void cast_avx2(const void* s, void* d, int64_t n) {
  cast_loop<SK, DK>(s, d, n);
}
template <int SK, int DK>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))) void cast_avx512(const void* s, void* d,
                                                                                            int64_t n) {
  cast_loop<SK, DK>(s, d, n);
}
#endif
template <int SK, int DK>
CastFn cast_pick2() {
#if UCP_X86
  switch (isa_level()) {
    case 2:
      return &cast_avx512<SK, DK>;
    case 1:
      return &cast_avx2<SK, DK>;
    default:
      break;
  }
#endif
  return &cast_base<SK, DK>;
}
template <int SK>
CastFn cast_pick1(int dk) {
  return dk == 0 ? cast_pick2<SK, 0>() : dk == 1 ? cast_pick2<SK, 1>() : cast_pick2<SK, 2>();
}
CastFn cast_pick(int sk, int dk) {
  return sk == 0 ? cast_pick1<0>(dk) : sk == 1 ? cast_pick1<1>(dk) : cast_pick1<2>(dk);
}

int kind_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return 0;
    case at::kBFloat16:
      return 1;
    case at::kHalf:
      return 2;
    default:
      TORCH_CHECK(false, "cast_flatten: dtype ", t, " is not float32, bfloat16 or float16");
  }
  return -1;
}

constexpr int64_t CAST_TILE = 16384;  // elements converted, then CRC'd while still in L2

// Writes each contiguous CPU tensor srcs[i] (fp32/bf16/fp16), cast to out's dtype (same set), at
// element offset offsets[i] of out. Work is cut into pieces of at most `grain` elements run in
// parallel; with want_crc it returns the CRC-32C of each tensor's written bytes (pieces' CRCs are
// computed tile by tile from cache right after the tile is written, then joined), else an empty list.
std::vector<int64_t> cast_flatten(const std::vector<torch::Tensor>& srcs, const std::vector<int64_t>& offsets,
                                  torch::Tensor out, bool want_crc, int64_t grain) {
  TORCH_CHECK(srcs.size() == offsets.size(), "cast_flatten: ", srcs.size(), " tensors, ", offsets.size(), " offsets");
  const int dk = kind_of(out.scalar_type());
  const int64_t dsize = out.element_size();
  auto* obase = static_cast<unsigned char*>(out.data_ptr());
  grain = std::max<int64_t>(1, grain);
  struct Piece {
    size_t t;
    int64_t lo, hi;
  };
  std::vector<Piece> pieces;
  std::vector<CastFn> fns(srcs.size());
  std::vector<size_t> first(srcs.size() + 1, 0);
  for (size_t t = 0; t < srcs.size(); ++t) {
    const int64_t n = srcs[t].numel();
    TORCH_CHECK(offsets[t] >= 0 && offsets[t] + n <= out.numel(), "cast_flatten: tensor ", t, " does not fit");
    fns[t] = cast_pick(kind_of(srcs[t].scalar_type()), dk);
    first[t] = pieces.size();
    for (int64_t lo = 0; lo < n; lo += grain) pieces.push_back({t, lo, std::min(n, lo + grain)});
    first[t + 1] = pieces.size();
  }
  std::vector<uint32_t> crcs(pieces.size(), 0);
  parallel_blocks(int64_t(pieces.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Piece& pc = pieces[size_t(k)];
      const auto* s = static_cast<const unsigned char*>(srcs[pc.t].data_ptr());
      const int64_t ssize = srcs[pc.t].element_size();
      unsigned char* d = obase + (offsets[pc.t] + pc.lo) * dsize;
      uint32_t crc = pc.lo == 0 ? ~0u : 0u;
      for (int64_t lo = pc.lo; lo < pc.hi; lo += CAST_TILE) {
        const int64_t len = std::min(CAST_TILE, pc.hi - lo);
        unsigned char* dt = d + (lo - pc.lo) * dsize;
        fns[pc.t](s + lo * ssize, dt, len);
        if (want_crc) crc = crc_block(crc, nullptr, dt, len * dsize, false);
      }
      crcs[size_t(k)] = crc;
    }
  });
  std::vector<int64_t> result;
  if (!want_crc) return result;
  result.reserve(srcs.size());
  for (size_t t = 0; t < srcs.size(); ++t) {
    uint32_t crc = ~0u;  // an empty tensor: crc32c(b"") == 0
    for (size_t k = first[t]; k < first[t + 1]; ++k) {
      const Piece& pc = pieces[k];
      crc = k == first[t] ? crcs[k] : multmodp(x8nmodp(uint64_t((pc.hi - pc.lo) * dsize)), crc) ^ crcs[k];
    }
    result.push_back(int64_t(~crc));
  }
  return result;
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
  mod.def("cast_flatten", &cast_flatten, "cast tensors into one flat buffer (and CRC each)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("isa", &isa, "the instruction set the kernels dispatch to on this CPU");
}
