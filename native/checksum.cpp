// CRC-32 and CRC-32C (see checksum.h). The folding algorithm is the one of Intel's "Fast CRC
// Computation for Generic Polynomials Using PCLMULQDQ Instruction" (reflected variant): the data
// is folded 64 (or 256) bytes at a time into 128-bit (or 512-bit) accumulators by carry-less
// multiplication with x^(D+-32) mod P, then reduced to 32 bits with a Barrett step. Every
// constant is derived below from the polynomial (the CRC-32 ones equal the published ones), so
// both polynomials share one implementation.
#include "checksum.h"

#include <array>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define ASYNCSIDE_CRC_X86 1
#endif
#if defined(__aarch64__)
#include <arm_acle.h>
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#endif
#define ASYNCSIDE_CRC_ARM 1
#endif

namespace asyncside::io {

namespace {

// ---- constants, derived from the polynomial ---------------------------------------------------

constexpr uint64_t kPolyCrc32 = 0x104C11DB7ull;   // x^32 + ... (normal form, 33 bits)
constexpr uint64_t kPolyCrc32c = 0x11EDC6F41ull;  // Castagnoli

constexpr uint64_t reflect(uint64_t v, int bits) {
  uint64_t out = 0;
  for (int i = 0; i < bits; ++i) {
    if ((v >> i) & 1) out |= 1ull << (bits - 1 - i);
  }
  return out;
}

// x^n mod P (32-bit remainder, normal form).
constexpr uint64_t xpow_mod(unsigned n, uint64_t poly) {
  uint64_t r = 1;
  for (unsigned i = 0; i < n; ++i) {
    r <<= 1;
    if (r & (1ull << 32)) r ^= poly;
  }
  return r;
}

// The folding multiplier for distance n bits, in the reflected domain (33 bits).
constexpr uint64_t fold_k(unsigned n, uint64_t poly) { return reflect(xpow_mod(n, poly), 32) << 1; }

// floor(x^64 / P), reflected (33 bits): the Barrett constant.
constexpr uint64_t barrett_mu(uint64_t poly) {
  uint64_t q = 0;
  unsigned __int128 r = static_cast<unsigned __int128>(1) << 64;
  for (int i = 64; i >= 32; --i) {
    if ((r >> i) & 1) {
      q |= 1ull << (i - 32);
      r ^= static_cast<unsigned __int128>(poly) << (i - 32);
    }
  }
  return reflect(q, 33);
}

struct FoldConstants {
  uint64_t k2048[2];  // fold 4 x 512 bits by 2048 bits
  uint64_t k512[2];   // fold by 512 bits (4 x 128)
  uint64_t k384[2];
  uint64_t k256[2];
  uint64_t k128[2];
  uint64_t k64;
  uint64_t poly;  // reflected P, shifted: P' = (reflect(P) << 1) | 1
  uint64_t mu;
};

constexpr FoldConstants make_constants(uint64_t poly) {
  FoldConstants c{};
  c.k2048[0] = fold_k(2048 + 32, poly);
  c.k2048[1] = fold_k(2048 - 32, poly);
  c.k512[0] = fold_k(512 + 32, poly);
  c.k512[1] = fold_k(512 - 32, poly);
  c.k384[0] = fold_k(384 + 32, poly);
  c.k384[1] = fold_k(384 - 32, poly);
  c.k256[0] = fold_k(256 + 32, poly);
  c.k256[1] = fold_k(256 - 32, poly);
  c.k128[0] = fold_k(128 + 32, poly);
  c.k128[1] = fold_k(128 - 32, poly);
  c.k64 = fold_k(64, poly);
  c.poly = (reflect(poly & 0xFFFFFFFFull, 32) << 1) | 1;
  c.mu = barrett_mu(poly);
  return c;
}

constexpr FoldConstants kFoldCrc32 = make_constants(kPolyCrc32);
constexpr FoldConstants kFoldCrc32c = make_constants(kPolyCrc32c);
// The published CRC-32 constants (Intel's paper, zlib): the derivation above is the same.
static_assert(kFoldCrc32.k512[0] == 0x154442bd4ull && kFoldCrc32.k512[1] == 0x1c6e41596ull);
static_assert(kFoldCrc32.k128[0] == 0x1751997d0ull && kFoldCrc32.k128[1] == 0x0ccaa009eull);
static_assert(kFoldCrc32.k64 == 0x163cd6124ull && kFoldCrc32.poly == 0x1db710641ull && kFoldCrc32.mu == 0x1f7011641ull);

// ---- portable: slicing-by-8 tables ---------------------------------------------------------------

struct Tables {
  uint32_t t[8][256];
};

Tables make_tables(uint32_t reflected_poly) {
  Tables tb{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ reflected_poly : c >> 1;
    tb.t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (int s = 1; s < 8; ++s) tb.t[s][i] = (tb.t[s - 1][i] >> 8) ^ tb.t[0][tb.t[s - 1][i] & 0xFF];
  }
  return tb;
}

const Tables& tables(ChecksumKind kind) {
  static const Tables crc32 = make_tables(0xEDB88320u);
  static const Tables crc32c = make_tables(0x82F63B78u);
  return kind == ChecksumKind::Crc32 ? crc32 : crc32c;
}

// Internal state is the inverted CRC (zlib's ~crc), as every path below expects.
uint32_t table_update(const Tables& tb, uint32_t c, const uint8_t* p, size_t n) {
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= c;  // little-endian: the state covers the first four bytes
    c = tb.t[7][v & 0xFF] ^ tb.t[6][(v >> 8) & 0xFF] ^ tb.t[5][(v >> 16) & 0xFF] ^ tb.t[4][(v >> 24) & 0xFF] ^
        tb.t[3][(v >> 32) & 0xFF] ^ tb.t[2][(v >> 40) & 0xFF] ^ tb.t[1][(v >> 48) & 0xFF] ^ tb.t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ tb.t[0][(c ^ *p++) & 0xFF];
  return c;
}

#if ASYNCSIDE_CRC_X86

// ---- x86-64: SSE4.2 crc32 (CRC-32C only) ---------------------------------------------------------

__attribute__((target("sse4.2"))) uint32_t sse42_crc32c(uint32_t c, const uint8_t* p, size_t n) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}

// ---- x86-64: PCLMULQDQ folding, 4 x 128 bits ---------------------------------------------------------

#define ASYNCSIDE_CLMUL_TARGET __attribute__((target("pclmul,sse4.1")))

ASYNCSIDE_CLMUL_TARGET inline __m128i fold128(__m128i x, __m128i k, __m128i data) {
  const __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  const __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), data);
}

// Folds 16-byte blocks into x while n >= 16, then reduces x to the 32-bit state. *pp / *pn are
// advanced past the blocks consumed (fewer than 16 bytes remain).
ASYNCSIDE_CLMUL_TARGET uint32_t finish128(__m128i x, const uint8_t** pp, size_t* pn, const FoldConstants& k) {
  const uint8_t* p = *pp;
  size_t n = *pn;
  const __m128i k128 = _mm_set_epi64x(static_cast<int64_t>(k.k128[1]), static_cast<int64_t>(k.k128[0]));
  while (n >= 16) {
    x = fold128(x, k128, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    p += 16;
    n -= 16;
  }
  // 128 -> 64 bits.
  const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
  __m128i t = _mm_clmulepi64_si128(x, k128, 0x10);
  x = _mm_xor_si128(_mm_srli_si128(x, 8), t);
  const __m128i k64 = _mm_set_epi64x(0, static_cast<int64_t>(k.k64));
  t = _mm_srli_si128(x, 4);
  x = _mm_and_si128(x, mask32);
  x = _mm_clmulepi64_si128(x, k64, 0x00);
  x = _mm_xor_si128(x, t);
  // Barrett reduction to 32 bits.
  const __m128i pm = _mm_set_epi64x(static_cast<int64_t>(k.mu), static_cast<int64_t>(k.poly));
  t = _mm_and_si128(x, mask32);
  t = _mm_clmulepi64_si128(t, pm, 0x10);
  t = _mm_and_si128(t, mask32);
  t = _mm_clmulepi64_si128(t, pm, 0x00);
  x = _mm_xor_si128(x, t);
  *pp = p;
  *pn = n;
  return static_cast<uint32_t>(_mm_extract_epi32(x, 1));
}

// n >= 64.
ASYNCSIDE_CLMUL_TARGET uint32_t pclmul_fold(uint32_t c, const uint8_t** pp, size_t* pn, const FoldConstants& k) {
  const uint8_t* p = *pp;
  size_t n = *pn;
  __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 0));
  __m128i x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  __m128i x3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32));
  __m128i x4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 48));
  x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128(static_cast<int>(c)));
  p += 64;
  n -= 64;
  const __m128i k512 = _mm_set_epi64x(static_cast<int64_t>(k.k512[1]), static_cast<int64_t>(k.k512[0]));
  while (n >= 64) {
    x1 = fold128(x1, k512, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 0)));
    x2 = fold128(x2, k512, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    x3 = fold128(x3, k512, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32)));
    x4 = fold128(x4, k512, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 48)));
    p += 64;
    n -= 64;
  }
  const __m128i k128 = _mm_set_epi64x(static_cast<int64_t>(k.k128[1]), static_cast<int64_t>(k.k128[0]));
  x1 = fold128(x1, k128, x2);
  x1 = fold128(x1, k128, x3);
  x1 = fold128(x1, k128, x4);
  *pp = p;
  *pn = n;
  return finish128(x1, pp, pn, k);
}

// ---- x86-64: VPCLMULQDQ folding, 4 x 512 bits (AVX-512) ----------------------------------------------

#define ASYNCSIDE_VPCLMUL_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.1")))

ASYNCSIDE_VPCLMUL_TARGET inline __m512i fold512(__m512i x, __m512i k, __m512i data) {
  const __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00);
  const __m512i hi = _mm512_clmulepi64_epi128(x, k, 0x11);
  return _mm512_ternarylogic_epi64(lo, hi, data, 0x96);  // lo ^ hi ^ data
}

ASYNCSIDE_VPCLMUL_TARGET inline __m512i broadcast_pair(const uint64_t pair[2]) {
  return _mm512_broadcast_i32x4(_mm_set_epi64x(static_cast<int64_t>(pair[1]), static_cast<int64_t>(pair[0])));
}

// The four 512-bit accumulators folded into one 128-bit value, after the 64-byte blocks left in
// [p, p + n) (n < 256 on entry; p and n advance past them): what both folds below end with.
ASYNCSIDE_VPCLMUL_TARGET inline __m128i fold_down(__m512i x0, __m512i x1, __m512i x2, __m512i x3, const uint8_t*& p,
                                                  size_t& n, const FoldConstants& k) {
  const __m512i k512 = broadcast_pair(k.k512);
  x1 = fold512(x0, k512, x1);
  x2 = fold512(x1, k512, x2);
  x3 = fold512(x2, k512, x3);
  while (n >= 64) {
    x3 = fold512(x3, k512, _mm512_loadu_si512(p));
    p += 64;
    n -= 64;
  }
  // Four 128-bit lanes -> one: lane j is folded forward by (3 - j) x 128 bits onto lane 3.
  const __m512i lanes = _mm512_set_epi64(0, 0,  // lane 3: itself
                                         static_cast<int64_t>(k.k128[1]), static_cast<int64_t>(k.k128[0]),
                                         static_cast<int64_t>(k.k256[1]), static_cast<int64_t>(k.k256[0]),
                                         static_cast<int64_t>(k.k384[1]), static_cast<int64_t>(k.k384[0]));
  const __m512i t = _mm512_xor_si512(_mm512_clmulepi64_epi128(x3, lanes, 0x00), _mm512_clmulepi64_epi128(x3, lanes, 0x11));
  __m128i x = _mm512_extracti32x4_epi32(x3, 3);
  x = _mm_xor_si128(x, _mm512_extracti32x4_epi32(t, 0));
  x = _mm_xor_si128(x, _mm512_extracti32x4_epi32(t, 1));
  x = _mm_xor_si128(x, _mm512_extracti32x4_epi32(t, 2));
  return x;
}

// n >= 256. Not inlined, and ends with vzeroupper: this runs on whatever thread verifies (MLX's
// stream thread for a fault in a queued step), and leaving the upper halves of the vector
// registers dirty makes the legacy-SSE code that thread runs next (MLX's CPU kernels) pay a
// transition penalty on every instruction: measured, the quantized matmuls of a decode step ran
// several times slower after a single verified fault (BENCHMARKS.md, "Measurements behind code choices").
__attribute__((noinline)) ASYNCSIDE_VPCLMUL_TARGET uint32_t vpclmul_fold(uint32_t c, const uint8_t** pp, size_t* pn, const FoldConstants& k) {
  const uint8_t* p = *pp;
  size_t n = *pn;
  __m512i x0 = _mm512_loadu_si512(p + 0);
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(c))));
  p += 256;
  n -= 256;
  const __m512i k2048 = broadcast_pair(k.k2048);
  while (n >= 256) {
    x0 = fold512(x0, k2048, _mm512_loadu_si512(p + 0));
    x1 = fold512(x1, k2048, _mm512_loadu_si512(p + 64));
    x2 = fold512(x2, k2048, _mm512_loadu_si512(p + 128));
    x3 = fold512(x3, k2048, _mm512_loadu_si512(p + 192));
    p += 256;
    n -= 256;
  }
  __m128i x = fold_down(x0, x1, x2, x3, p, n, k);
  *pp = p;
  *pn = n;
  const uint32_t crc = finish128(x, pp, pn, k);
  _mm256_zeroupper();
  return crc;
}

// The fused copy: the same folding as vpclmul_fold, and each 256-byte block is stored to dst
// (streaming stores when `stream` and dst is 64-byte aligned: a large destination is not read for
// ownership and does not evict the cache) right after it was loaded, so the source is read once.
// n >= 256. Leaves < 256 bytes for the caller's tail; ends with sfence (streaming stores are
// weakly ordered) and vzeroupper (see vpclmul_fold).
__attribute__((noinline)) ASYNCSIDE_VPCLMUL_TARGET uint32_t vpclmul_fold_copy(uint32_t c, uint8_t** dp, const uint8_t** pp,
                                                                              size_t* pn, bool stream,
                                                                              const FoldConstants& k) {
  const uint8_t* p = *pp;
  uint8_t* d = *dp;
  size_t n = *pn;
  const bool nt = stream && (reinterpret_cast<uintptr_t>(d) % 64) == 0;
  __m512i x0 = _mm512_loadu_si512(p + 0);
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  if (nt) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 0), x0);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 64), x1);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 128), x2);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 192), x3);
  } else {
    _mm512_storeu_si512(d + 0, x0);
    _mm512_storeu_si512(d + 64, x1);
    _mm512_storeu_si512(d + 128, x2);
    _mm512_storeu_si512(d + 192, x3);
  }
  x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(c))));
  p += 256;
  d += 256;
  n -= 256;
  const __m512i k2048 = broadcast_pair(k.k2048);
  if (nt) {
    while (n >= 256) {
      const __m512i a = _mm512_loadu_si512(p + 0), b = _mm512_loadu_si512(p + 64);
      const __m512i e = _mm512_loadu_si512(p + 128), f = _mm512_loadu_si512(p + 192);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 0), a);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 64), b);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 128), e);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 192), f);
      x0 = fold512(x0, k2048, a);
      x1 = fold512(x1, k2048, b);
      x2 = fold512(x2, k2048, e);
      x3 = fold512(x3, k2048, f);
      p += 256;
      d += 256;
      n -= 256;
    }
    _mm_sfence();
  } else {
    while (n >= 256) {
      const __m512i a = _mm512_loadu_si512(p + 0), b = _mm512_loadu_si512(p + 64);
      const __m512i e = _mm512_loadu_si512(p + 128), f = _mm512_loadu_si512(p + 192);
      _mm512_storeu_si512(d + 0, a);
      _mm512_storeu_si512(d + 64, b);
      _mm512_storeu_si512(d + 128, e);
      _mm512_storeu_si512(d + 192, f);
      x0 = fold512(x0, k2048, a);
      x1 = fold512(x1, k2048, b);
      x2 = fold512(x2, k2048, e);
      x3 = fold512(x3, k2048, f);
      p += 256;
      d += 256;
      n -= 256;
    }
  }
  // The tail (< 256 bytes) is copied here and folded from the copy by the plain code below, so
  // the checksum covers exactly the bytes stored even if the source changes meanwhile.
  std::memcpy(d, p, n);
  p = d;
  __m128i x = fold_down(x0, x1, x2, x3, p, n, k);
  const uint32_t crc = finish128(x, &p, &n, k);
  *pp = p;  // inside dst: the last < 16 bytes, already copied
  *dp = d;
  *pn = n;
  _mm256_zeroupper();
  return crc;
}

// A plain copy with streaming stores (64-byte aligned destinations; others use memcpy).
__attribute__((noinline, target("avx512f"))) void stream_copy(uint8_t* d, const uint8_t* p, size_t n) {
  if (reinterpret_cast<uintptr_t>(d) % 64 != 0) {
    std::memcpy(d, p, n);
    return;
  }
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    const __m512i a = _mm512_loadu_si512(p + i), b = _mm512_loadu_si512(p + i + 64);
    const __m512i c = _mm512_loadu_si512(p + i + 128), e = _mm512_loadu_si512(p + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 192), e);
  }
  _mm_sfence();
  _mm256_zeroupper();
  std::memcpy(d + i, p + i, n - i);
}

struct X86Features {
  bool sse42 = false, pclmul = false, vpclmul = false;
};

X86Features x86_features() {
  X86Features f;
  __builtin_cpu_init();
  f.sse42 = __builtin_cpu_supports("sse4.2");
  f.pclmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  f.vpclmul = f.pclmul && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
              __builtin_cpu_supports("vpclmulqdq");
#if defined(ASYNCSIDE_CRC_TEST_NO_VPCLMUL)  // builds that check the 128-bit path on an AVX-512 CPU
  f.vpclmul = false;
#endif
  return f;
}

const X86Features& features() {
  static const X86Features f = x86_features();
  return f;
}

#endif  // ASYNCSIDE_CRC_X86

#if ASYNCSIDE_CRC_ARM

bool arm_has_crc() {
#if defined(__APPLE__)
  return true;  // every Apple arm64 CPU has the CRC extension
#elif defined(__linux__)
  static const bool has = (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
  return has;
#else
  return false;
#endif
}

__attribute__((target("+crc"))) uint32_t arm_crc(ChecksumKind kind, uint32_t c, const uint8_t* p, size_t n) {
  if (kind == ChecksumKind::Crc32c) {
    while (n >= 8) {
      uint64_t v;
      std::memcpy(&v, p, 8);
      c = __crc32cd(c, v);
      p += 8;
      n -= 8;
    }
    while (n--) c = __crc32cb(c, *p++);
  } else {
    while (n >= 8) {
      uint64_t v;
      std::memcpy(&v, p, 8);
      c = __crc32d(c, v);
      p += 8;
      n -= 8;
    }
    while (n--) c = __crc32b(c, *p++);
  }
  return c;
}

#endif  // ASYNCSIDE_CRC_ARM

// ---- combining: GF(2) polynomial arithmetic modulo P, reflected ----------------------------------

// a * b mod P (both reflected: bit 31 is x^0).
uint32_t multmodp(uint32_t a, uint32_t b, uint32_t reflected_poly) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ reflected_poly : b >> 1;
  }
  return p;
}

// x^(8 * nbytes) mod P, by squaring: x^(2^k) for k = 3, 4, ...
uint32_t x8nmodp(uint64_t nbytes, uint32_t reflected_poly) {
  uint32_t p = 1u << 31;  // x^0
  uint32_t sq = 1u << 30;  // x^1
  for (int k = 0; k < 3; ++k) sq = multmodp(sq, sq, reflected_poly);  // x^8
  while (nbytes) {
    if (nbytes & 1) p = multmodp(sq, p, reflected_poly);
    nbytes >>= 1;
    sq = multmodp(sq, sq, reflected_poly);
  }
  return p;
}

}  // namespace

uint32_t checksum_combine(ChecksumKind kind, uint32_t crc1, uint32_t crc2, uint64_t len2) noexcept {
  if (kind == ChecksumKind::None) return crc1;
  const uint32_t poly = kind == ChecksumKind::Crc32 ? 0xEDB88320u : 0x82F63B78u;
  return multmodp(x8nmodp(len2, poly), crc1, poly) ^ crc2;
}

uint32_t checksum_update_portable(ChecksumKind kind, uint32_t state, const void* data, size_t n) noexcept {
  if (kind == ChecksumKind::None) return state;
  return ~table_update(tables(kind), ~state, static_cast<const uint8_t*>(data), n);
}

uint32_t checksum_update(ChecksumKind kind, uint32_t state, const void* data, size_t n) noexcept {
  if (kind == ChecksumKind::None) return state;
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~state;
#if ASYNCSIDE_CRC_X86
  const X86Features& f = features();
  const FoldConstants& k = kind == ChecksumKind::Crc32 ? kFoldCrc32 : kFoldCrc32c;
  if (f.vpclmul && n >= 256) {
    c = vpclmul_fold(c, &p, &n, k);
  } else if (f.pclmul && n >= 64) {
    c = pclmul_fold(c, &p, &n, k);
  }
  if (kind == ChecksumKind::Crc32c && f.sse42) return ~sse42_crc32c(c, p, n);
#elif ASYNCSIDE_CRC_ARM
  if (arm_has_crc()) return ~arm_crc(kind, c, p, n);
#endif
  return ~table_update(tables(kind), c, p, n);
}

uint32_t checksum_copy(ChecksumKind kind, uint32_t state, void* dst, const void* src, size_t n, bool stream) noexcept {
  const auto* p = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
#if ASYNCSIDE_CRC_X86
  if (kind == ChecksumKind::None) {
    if (stream && features().vpclmul && n >= 256) {
      stream_copy(d, p, n);
    } else {
      std::memcpy(d, p, n);
    }
    return state;
  }
  if (kind != ChecksumKind::None && features().vpclmul && n >= 256) {
    const FoldConstants& k = kind == ChecksumKind::Crc32 ? kFoldCrc32 : kFoldCrc32c;
    const uint32_t c = vpclmul_fold_copy(~state, &d, &p, &n, stream, k);
    // Fewer than 16 bytes left, already copied by vpclmul_fold_copy (p points at the copy).
    if (kind == ChecksumKind::Crc32c && features().sse42) return ~sse42_crc32c(c, p, n);
    return ~table_update(tables(kind), c, p, n);
  }
#endif
  (void)stream;
  // Elsewhere (and for short pieces): copy, then checksum the copy while it is in L1/L2, in
  // blocks small enough to stay there.
  constexpr size_t kBlock = 32 << 10;
  for (size_t o = 0; o < n; o += kBlock) {
    const size_t b = n - o < kBlock ? n - o : kBlock;
    std::memcpy(d + o, p + o, b);
    state = checksum_update(kind, state, d + o, b);
  }
  return state;
}

const char* checksum_name(ChecksumKind kind) noexcept {
  switch (kind) {
    case ChecksumKind::None:
      return "none";
    case ChecksumKind::Crc32:
      return "crc32";
    case ChecksumKind::Crc32c:
      return "crc32c";
  }
  return "?";
}

int checksum_leaves_upper_state(ChecksumKind kind, size_t n) {
#if ASYNCSIDE_CRC_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return -1;
  const bool avx = (c & bit_AVX) != 0;
  if (!__get_cpuid_count(0xd, 1, &a, &b, &c, &d) || !(a & (1u << 2))) return -1;  // XGETBV ECX=1
  std::vector<uint8_t> data(n, 0x5a);
  if (avx) __asm__ volatile("vzeroupper");  // start clean: report this call's state only
  volatile uint32_t sink = checksum_update(kind, 0, data.data(), data.size());
  (void)sink;
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
  // Bit 2: upper 128 bits of ymm0-15; bit 6: upper 256 bits of zmm0-15 (zmm16-31, bit 7,
  // are out of reach of SSE code and cost nothing).
  return (lo & ((1u << 2) | (1u << 6))) != 0 ? 1 : 0;
#else
  (void)kind;
  (void)n;
  return -1;
#endif
}

const char* checksum_implementation(ChecksumKind kind) noexcept {
  if (kind == ChecksumKind::None) return "none";
#if ASYNCSIDE_CRC_X86
  const X86Features& f = features();
  if (f.vpclmul) return "vpclmulqdq";
  if (f.pclmul) return "pclmulqdq";
  if (kind == ChecksumKind::Crc32c && f.sse42) return "sse4.2";
#elif ASYNCSIDE_CRC_ARM
  if (arm_has_crc()) return "armv8-crc";
#endif
  return "table";
}

}  // namespace asyncside::io
