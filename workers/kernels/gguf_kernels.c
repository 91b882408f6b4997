/* Products of GGUF quantised weights, read in their own blocks (workers/backends/gguf_linear.py).
 *
 * The weights stay as the file stores them (ggml's block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
 * Q5_K, Q6_K; one row of N is K / block values of block bytes each). A call computes
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for rows m of x, in one of four modes:
 *
 * - mode 0 (integer): x is quantised per 32 values to int8 with one fp32 scale (llama.cpp's Q8_0
 *   activations, ``gguf_quantize``), and each weight row is unpacked a tile at a time into unsigned
 *   bytes q (0..255) with one (a, b) pair per 16 values, w = a * q + b (every type fits this form:
 *   Q8_0 as q + 128, b = -128 d; Q6_K as its 6-bit q, b = -32 d sc). The products are integer
 *   dot products per 16 values (AVX-512 VNNI ``vpdpbusd``, AVX2 ``vpmaddubsw`` + ``vpmaddwd``, or
 *   the scalar loop), scaled by a * dx, plus b times the activation's sum over those 16 values;
 * - mode 1 (float): the weight tile dequantised to fp32 in cache, against fp32 activations (the
 *   compiler's vectorised FMA loop), the comparison the measurements chose against;
 * - mode 2 (integer, batch-invariant): mode 0's decode-row products at every row count, so a row's
 *   result never depends on how many rows the call has (AVX2 and AVX-512 builds; the scalar build
 *   computes mode 0's tiles at any count, whose per-row order does not depend on it either);
 * - mode 3 (tiles, below): the activations as they are against weight tiles dequantised in cache;
 *   each sum runs in one order whatever the row count too (every row its own accumulators, the
 *   same horizontal sum; tests/test_gguf_kernels.py checks every type at 1-40, 64, 65, 600 rows),
 *   so batch-invariant mode takes it at every row count for bf16 rows on the avx512_bf16 build.
 *
 * The instruction set is the build's (``-march=native``; tests build with ``-mno-avx512f`` and
 * ``-mno-avx`` to run the AVX2 and scalar paths on an AVX-512 host): ``gguf_isa()`` says which.
 * Parallel over tiles of output rows with OpenMP (torch's libgomp, as cpu_kernels.c).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GG_ISA 2
#elif defined(__AVX2__)
#define GG_ISA 1
#else
#define GG_ISA 0
#endif

/* ggml's type ids (gguf.GGMLQuantizationType) */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

#define NT 8   /* weight rows unpacked per tile */
#define MT 64  /* activation rows per pass over a tile (they stay in cache) */
#define DIRECT_ROWS 64  /* up to this many activation rows, each weight row is read from its blocks */

int gguf_isa(void) { return GG_ISA; }

/* The row counts where the dequantised tiles (mode 3) beat both the integer products and a
 * transient dequantised matrix on oneDNN, for activations of type dt (0 fp32, 1 bf16) on this
 * build: from gguf_tile_from(type, dt) rows (0: never) up to gguf_tile_to(dt) (0: no limit).
 * Measured one thread, x[M, 576] @ W[1536, 576]^T (K-quants K 768), CPU us per call
 * (mindie-bench gguf-blocks --what kernels [--variant V --dtype D], 12-07, Zen 4):
 * - avx512_bf16 build, bf16 rows, Q4_1 int / tile: M=1 59 / 71, 4 97 / 93, 8 174 / 127, 64 1601 /
 *   623, 128 4599 / 1172 (bf16 F.linear over a dequantised copy: 81, 102, 157, 665, 1233; over a
 *   transient one 684 to 1791), 512 18235 / 4474 (dense 4185, transient 4831); Q4_K M=4 137 / 142,
 *   8 222 / 189; Q8_0 8 167 / 125; Q6_K (no table decode: 6 bits, a scale per 16 values) 8 225 /
 *   239, 16 463 / 327;
 * - AVX-512 without avx512_bf16, fp32 rows (the FMA tiles): VNNI's integer products win up to 64
 *   rows (Q4_1 M=8 153 / 244, 64 1531 / 1501) and the transient matrix above (128: 2741 / 2947);
 * - AVX2, fp32 rows: M=4 152 / 160, 8 298 / 246, 64 2505 / 1429, 128 7334 / 2897 / 2833 (Q4_K
 *   6959 / 3957 / 3755), 256 15001 / 5641 / 5192: tiles from 8 to 128 rows. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TILE_BF16 1          /* the tiles in bf16 for bf16 rows (vdpbf16ps) */
#define TILE_FROM_BF16 8     /* Q6_K: 16 */
#define TILE_FROM_F32 0
#define TILE_TO 0
#elif defined(__AVX512F__)
#define TILE_BF16 0
#define TILE_FROM_BF16 0
#define TILE_FROM_F32 0
#define TILE_TO 0
#else
#define TILE_BF16 0
#define TILE_FROM_BF16 8
#define TILE_FROM_F32 8
#define TILE_TO 128
#endif
int64_t gguf_tile_from(int type, int dt) {
#if GG_ISA >= 1
    const int64_t from = dt == 1 ? TILE_FROM_BF16 : TILE_FROM_F32;
    return type == T_Q6_K && TILE_BF16 && dt == 1 ? 16 : from;
#else
    (void)type;
    (void)dt;
    return 0;
#endif
}

int64_t gguf_tile_to(int dt) {
    (void)dt;
    return TILE_TO;
}

/* 1 where this build's tiles for bf16 rows are bf16 (vdpbf16ps: the avx512_bf16 build), whose mode 3
 * batch-invariant mode takes at every row count (gguf_linear.GgufLinear.tile_range) */
int gguf_tile_bf16(void) { return TILE_BF16; }

static void init_tables(void);
__attribute__((constructor)) static void gguf_init(void) { init_tables(); }

/* values per block and bytes per block of a type; 0 for a type not covered */
int64_t gguf_block_values(int type) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
    default: return 0;
    }
}

int64_t gguf_block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, f;
    if (e == 0) {
        float v = ldexpf((float)m, -24);  /* zero or subnormal */
        return s ? -v : v;
    }
    f = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112) << 23) | (m << 13));
    float r;
    memcpy(&r, &f, 4);
    return r;
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v = { (uint32_t)x << 16 };
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);  /* round to nearest even, as torch does */
    return (uint16_t)(v.u >> 16);
}

/* Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4) */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* 8 bytes at a time in a 64-bit word (SWAR): byte-wise work the compiler otherwise does one byte at
 * a time through the stack (a tenth of the speed) */
#define LO4 0x0F0F0F0F0F0F0F0Full
#define LO1 0x0101010101010101ull
#define LO2 0x0303030303030303ull
static inline uint64_t ld8(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void st8(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
/* bit i of b -> 0x10 in byte i (Q5_0 / Q5_1's fifth bits) */
static uint64_t bit4_of[256];
static void init_tables(void) {
    for (int b = 0; b < 256; b++) {
        uint64_t v = 0;
        for (int i = 0; i < 8; i++) if (b >> i & 1) v |= 0x10ull << (8 * i);
        bit4_of[b] = v;
    }
}

/* One row of K values: q[K] unsigned, a[K/16], b[K/16] with w = a * q + b per 16 values. */
static void unpack_row(int type, const uint8_t *src, int64_t K, uint8_t *q, float *a, float *b) {
    const int64_t nb = K / gguf_block_values(type), bb = gguf_block_bytes(type);
    switch (type) {
    case T_Q4_0: case T_Q4_1:
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *x = src + i * bb, *qs = x + (type == T_Q4_0 ? 2 : 4);
            const float d = f16_to_f32(rd16(x));
            const float off = type == T_Q4_0 ? -8.0f * d : f16_to_f32(rd16(x + 2));
            uint8_t *o = q + i * 32;
            for (int j = 0; j < 16; j += 8) {
                const uint64_t v = ld8(qs + j);
                st8(o + j, v & LO4);
                st8(o + 16 + j, (v >> 4) & LO4);
            }
            a[2 * i] = a[2 * i + 1] = d;
            b[2 * i] = b[2 * i + 1] = off;
        }
        break;
    case T_Q5_0: case T_Q5_1:
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *x = src + i * bb, *p = x + (type == T_Q5_0 ? 2 : 4), *qs = p + 4;
            const float d = f16_to_f32(rd16(x));
            const float off = type == T_Q5_0 ? -16.0f * d : f16_to_f32(rd16(x + 2));
            uint8_t *o = q + i * 32;
            for (int j = 0; j < 16; j += 8) {  /* qh bit j: value j, bit j + 16: value j + 16 */
                const uint64_t v = ld8(qs + j);
                st8(o + j, (v & LO4) | bit4_of[p[j / 8]]);
                st8(o + 16 + j, ((v >> 4) & LO4) | bit4_of[p[2 + j / 8]]);
            }
            a[2 * i] = a[2 * i + 1] = d;
            b[2 * i] = b[2 * i + 1] = off;
        }
        break;
    case T_Q8_0:
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *x = src + i * bb;
            const float d = f16_to_f32(rd16(x));
            for (int j = 0; j < 32; j += 8) st8(q + i * 32 + j, ld8(x + 2 + j) ^ 0x8080808080808080ull);  /* q + 128 */
            a[2 * i] = a[2 * i + 1] = d;
            b[2 * i] = b[2 * i + 1] = -128.0f * d;
        }
        break;
    case T_Q4_K: case T_Q5_K:
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *x = src + i * bb;
            const float d = f16_to_f32(rd16(x)), dmin = f16_to_f32(rd16(x + 2));
            const uint8_t *scales = x + 4, *qh = x + 16, *qs = x + (type == T_Q4_K ? 16 : 48);
            uint8_t *o = q + i * 256;
            for (int j = 0; j < 4; j++) {
                const uint8_t *ql = qs + 32 * j;
                for (int l = 0; l < 32; l += 8) {
                    uint64_t lo = ld8(ql + l) & LO4, hi = (ld8(ql + l) >> 4) & LO4;
                    if (type == T_Q5_K) {  /* the fifth bits: bit 2j of qh[l] (low half), 2j + 1 (high) */
                        const uint64_t h = ld8(qh + l);
                        lo |= ((h >> (2 * j)) & LO1) << 4;
                        hi |= ((h >> (2 * j + 1)) & LO1) << 4;
                    }
                    st8(o + 64 * j + l, lo);
                    st8(o + 64 * j + 32 + l, hi);
                }
                for (int h = 0; h < 2; h++) {
                    uint8_t sc, m;
                    scale_min_k4(2 * j + h, scales, &sc, &m);
                    const int64_t g = i * 16 + 4 * j + 2 * h;
                    a[g] = a[g + 1] = d * sc;
                    b[g] = b[g + 1] = -dmin * m;
                }
            }
        }
        break;
    case T_Q6_K:
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *x = src + i * bb, *ql = x, *qh = x + 128;
            const int8_t *sc = (const int8_t *)(x + 192);
            const float d = f16_to_f32(rd16(x + 208));
            for (int n = 0; n < 2; n++) {
                const uint8_t *l0 = ql + 64 * n, *h0 = qh + 32 * n;
                uint8_t *y = q + i * 256 + 128 * n;
                for (int l = 0; l < 32; l += 8) {
                    const uint64_t a0 = ld8(l0 + l), a1 = ld8(l0 + l + 32), h = ld8(h0 + l);
                    st8(y + l, (a0 & LO4) | ((h & LO2) << 4));
                    st8(y + l + 32, (a1 & LO4) | (((h >> 2) & LO2) << 4));
                    st8(y + l + 64, ((a0 >> 4) & LO4) | (((h >> 4) & LO2) << 4));
                    st8(y + l + 96, ((a1 >> 4) & LO4) | (((h >> 6) & LO2) << 4));
                }
            }
            for (int g = 0; g < 16; g++) {
                a[i * 16 + g] = d * sc[g];
                b[i * 16 + g] = -32.0f * d * sc[g];
            }
        }
        break;
    }
}

/* Activations: per row, int8 q[K], the scale per 4 values d4[K/4] (one per 32, written 8 times:
 * the lanes of a vpdpbusd result load it directly) and s16[K/16] = d * (sum of q over those 16
 * values). dt: 0 fp32, 1 bf16. One row here (the fused
 * decode step in cpu_kernels.c calls it through a pointer), many in gguf_quantize. */
void gguf_quantize_row(int dt, const void *x, int64_t K, int8_t *xq, float *d4, float *s16) {
#if GG_ISA == 2
    /* the loop below, 32 values a step (the same values: an exact maximum, the same division and
     * rounding to nearest even, exact integer sums); a prompt's rows are quantised per linear */
    for (int64_t blk = 0; blk < K / 32; blk++) {
        const int64_t k0 = blk * 32;
        __m512 v0, v1;
        if (dt == 1) {
            const uint16_t *p = (const uint16_t *)x + k0;
            v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
            v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 16))), 16));
        } else {
            v0 = _mm512_loadu_ps((const float *)x + k0);
            v1 = _mm512_loadu_ps((const float *)x + k0 + 16);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
        const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(xq + k0), _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(xq + k0 + 16), _mm512_cvtepi32_epi8(i1));
        _mm256_storeu_ps(d4 + 8 * blk, _mm256_set1_ps(d));
        s16[2 * blk] = d * (float)_mm512_reduce_add_epi32(i0);
        s16[2 * blk + 1] = d * (float)_mm512_reduce_add_epi32(i1);
    }
    return;
#endif
    float v[32];
    for (int64_t blk = 0; blk < K / 32; blk++) {
        const int64_t k0 = blk * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            v[j] = dt == 1 ? bf16_to_f32(((const uint16_t *)x)[k0 + j]) : ((const float *)x)[k0 + j];
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int8_t *o = xq + k0;
        int s0 = 0, s1 = 0;
        for (int j = 0; j < 32; j++) {
            o[j] = (int8_t)nearbyintf(v[j] * id);
            if (j < 16) s0 += o[j]; else s1 += o[j];
        }
        for (int j = 0; j < 8; j++) d4[8 * blk + j] = d;
        s16[2 * blk] = d * (float)s0;
        s16[2 * blk + 1] = d * (float)s1;
    }
}

int gguf_quantize(int dt, const void *x, int64_t M, int64_t K, int8_t *xq, float *d4, float *s16) {
    if (K % 32) return -1;
    const int64_t es = dt == 1 ? 2 : 4;
    _Pragma("omp parallel for schedule(static) if (M * K > 65536)")
    for (int64_t m = 0; m < M; m++)
        gguf_quantize_row(dt, (const char *)x + m * K * es, K, xq + m * K, d4 + m * (K / 4), s16 + m * (K / 16));
    return 0;
}

/* sum over 16-value groups of a[g] * dx[4 g] * (q . xq over g) (dx: d4) */
static inline float idot(const uint8_t *q, const float *a, const int8_t *xq, const float *dx, int64_t K) {
#if GG_ISA == 2
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(q + k),
                                              _mm512_loadu_si512(xq + k));
        const __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(a + k / 16))),
                                       _mm512_loadu_ps(dx + k / 4));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc);
    }
    if (k < K) {  /* 32 values left (K is a multiple of 32) */
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_maskz_loadu_epi8(0xffffffffull, q + k),
                                              _mm512_maskz_loadu_epi8(0xffffffffull, xq + k));
        const __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(3, a + k / 16))),
                                       _mm512_maskz_loadu_ps(0xff, dx + k / 4));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc);
    }
    return _mm512_reduce_add_ps(acc);
#elif GG_ISA == 1
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + k)), x = _mm256_loadu_si256((const __m256i *)(xq + k));
        /* vpmaddubsw saturates pairs at 32767: exact for q <= 127 (every type but Q8_0's shifted
         * bytes); above it the halves are widened to 16 bits and multiplied exactly */
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
        const float s0 = a[k / 16] * dx[k / 4], s1 = a[k / 16 + 1] * dx[k / 4 + 4];
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0)), acc);
    }
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#else
    float acc = 0.0f;
    for (int64_t g = 0; g < K / 16; g++) {
        int32_t s = 0;
        for (int j = 0; j < 16; j++) s += (int32_t)q[g * 16 + j] * xq[g * 16 + j];
        acc += a[g] * dx[4 * g] * (float)s;
    }
    return acc;
#endif
}

#if GG_ISA == 1
/* AVX2 for bytes above 127 (Q8_0): both sides widened to 16 bits, vpmaddwd is exact */
static inline float idot_wide(const uint8_t *q, const float *a, const int8_t *xq, const float *dx, int64_t K) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + k)));
        const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xq + k)));
        const __m256i p = _mm256_madd_epi16(w, x);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(a[k / 16] * dx[k / 4]), acc);
    }
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}
#endif

#if GG_ISA >= 1
/* ---- Decode rows: each weight row read straight from its blocks (no unpacked copy) ----
 * A 32-value chunk of the row becomes 32 unsigned bytes in a ymm register, multiplied with the
 * activation's 32 int8 values into 8 int32 lanes (lanes 0-3: values 0-15, 4-7: 16-31), scaled per
 * 16 values. */
static inline __m256i dot32(__m256i w, __m256i x) {
#if GG_ISA == 2
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

static inline __m256i nib32(const uint8_t *qs) {  /* 16 bytes: low nibbles, then high nibbles */
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0xF);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

static inline __m256i fifth_bits(uint32_t x) {  /* bit i of x -> 0x10 in byte i */
#if GG_ISA == 2
    return _mm256_maskz_mov_epi8(x, _mm256_set1_epi8(0x10));
#else
    const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll, 0x0303030303030303ll);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfell));
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
#endif
}

static inline float hsum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}

/* for each of the mr (<= 4) activation rows r: acc[r] += dot(w, x_r of chunk c) * (a0 | a1 per 16)
 * * dx_r, accb[r] += b0 / b1 times the activation's sums: the chunk is decoded once for them all */
#define CHUNK(W, A0, A1, B0, B1, C) do { \
        const int64_t c_ = (C); \
        const __m256i w_ = (W); \
        const float a0_ = (A0), a1_ = (A1), b0_ = (B0), b1_ = (B1); \
        for (int r = 0; r < 4; r++) { \
            if (r >= mr) break; \
            const int8_t *xr_ = xq + r * K; \
            const float *dr_ = d4 + r * G4, *sr_ = s16 + r * G; \
            const __m256i p_ = dot32(w_, _mm256_loadu_si256((const __m256i *)(xr_ + 32 * c_))); \
            const float dx_ = dr_[8 * c_]; \
            acc[r + 4 * (c_ & 1)] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_), \
                _mm256_set_m128(_mm_set1_ps(a1_ * dx_), _mm_set1_ps(a0_ * dx_)), acc[r + 4 * (c_ & 1)]); \
            /* explicit fmaf, not a * b + c * d + e: the compiler contracts that expression \
             * differently in its copies of this loop (row 0 peeled), and a row's sum then \
             * depends on its place in the block: batch-invariant mode needs one order */ \
            accb[r] = fmaf(b1_, sr_[2 * c_ + 1], fmaf(b0_, sr_[2 * c_], accb[r])); \
        } \
    } while (0)

/* Q4_K / Q5_K block x, values 64j .. 64j + 63: sub-block 2j's 32 values in lo, 2j + 1's in hi (each
 * w = a * q + b with its own 6-bit scale and minimum) */
static inline void k45_pair(int type, const uint8_t *x, int j, __m256i *lo, __m256i *hi, float *a0, float *a1,
                            float *b0, float *b1) {
    const uint8_t *scales = x + 4, *qs = x + (type == T_Q4_K ? 16 : 48);
    const float d = f16_to_f32(rd16(x)), dmin = f16_to_f32(rd16(x + 2));
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j)), m4 = _mm256_set1_epi8(0xF);
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (type == T_Q5_K) {  /* the fifth bits: bit 2j of qh[l] (low half), 2j + 1 (high) */
        const __m256i h = _mm256_loadu_si256((const __m256i *)(x + 16)), one = _mm256_set1_epi8(1);
        *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j), one), 4));
        *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j + 1), one), 4));
    }
    uint8_t sc0, m0, sc1, m1;
    scale_min_k4(2 * j, scales, &sc0, &m0);
    scale_min_k4(2 * j + 1, scales, &sc1, &m1);
    *a0 = d * sc0;
    *a1 = d * sc1;
    *b0 = -dmin * m0;
    *b1 = -dmin * m1;
}

/* Q6_K block x, half n: its 128 values as four 32-byte runs of 6-bit q (low 4 bits from ql, high
 * 2 from qh): values 32k .. 32k + 31 of the half in q[k] */
static inline void q6k_quads(const uint8_t *x, int n, __m256i *q) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(x + 64 * n));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(x + 64 * n + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(x + 128 + 32 * n));
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
}

/* a Q5_0 / Q5_1 block: its 32 values (0-31) and the scale d and offset b of value = d * q + b */
static inline __m256i q5_block(int type, const uint8_t *x, float *d, float *b) {
    const uint8_t *p = x + (type == T_Q5_0 ? 2 : 4);
    uint32_t qh;
    memcpy(&qh, p, 4);
    *d = f16_to_f32(rd16(x));
    *b = type == T_Q5_0 ? -16.0f * *d : f16_to_f32(rd16(x + 2));
    return _mm256_or_si256(nib32(p + 4), fifth_bits(qh));
}

/* half n (0, 1) of a Q6_K block: its 4 chunks of 32 values (0-63) and each chunk's two 16-value
 * scales a[2k], a[2k + 1] (value = a * (q - 32)); a half at a time keeps AVX2's 16 registers enough */
static inline void q6k_half(const uint8_t *x, int n, __m256i q[4], float a[8]) {
    const int8_t *sc = (const int8_t *)(x + 192) + 8 * n;
    const float d = f16_to_f32(rd16(x + 208));
    q6k_quads(x, n, q);
    for (int c = 0; c < 8; c++) a[c] = d * sc[c];
}

/* res[r] = row w . activation row r, for mr (1-4) rows from xq, d4, s16 (K, K / 4 and K / 16 apart) */
__attribute__((unused)) static void row_dot256(int type, const uint8_t *w, int64_t K, const int8_t *xq, const float *d4, const float *s16,
                    int mr, float *res) {
    const int64_t G = K / 16, G4 = K / 4;
    /* two accumulators per row, even and odd chunks: two FMA chains instead of one */
    __m256 acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
    float accb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t nb = K / gguf_block_values(type), bb = gguf_block_bytes(type);
    switch (type) {
    case T_Q4_0: case T_Q4_1:
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *x = w + i * bb;
            const float d = f16_to_f32(rd16(x)), b = type == T_Q4_0 ? -8.0f * d : f16_to_f32(rd16(x + 2));
            CHUNK(nib32(x + (type == T_Q4_0 ? 2 : 4)), d, d, b, b, i);
        }
        break;
    case T_Q5_0: case T_Q5_1:
        for (int64_t i = 0; i < nb; i++) {
            float d, b;
            const __m256i q = q5_block(type, w + i * bb, &d, &b);
            CHUNK(q, d, d, b, b, i);
        }
        break;
    case T_Q8_0:
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *x = w + i * bb;
            const float d = f16_to_f32(rd16(x));
            const __m256i v = _mm256_loadu_si256((const __m256i *)(x + 2));
#if GG_ISA == 2
            CHUNK(_mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)), d, d, -128.0f * d, -128.0f * d, i);
#else       /* vpmaddubsw saturates q + 128: |q| times x with q's sign instead */
            const __m256i av = _mm256_abs_epi8(v);
            for (int r = 0; r < mr; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + 32 * i));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(xv, v)),
                                                    _mm256_set1_epi16(1));
                acc[r + 4 * (i & 1)] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * d4[r * G4 + 8 * i]),
                                                       acc[r + 4 * (i & 1)]);
            }
#endif
        }
        break;
    case T_Q4_K: case T_Q5_K:
        for (int64_t i = 0; i < nb; i++) {
            for (int j = 0; j < 4; j++) {
                __m256i lo, hi;
                float a0, a1, b0, b1;
                k45_pair(type, w + i * bb, j, &lo, &hi, &a0, &a1, &b0, &b1);
                CHUNK(lo, a0, a0, b0, b0, 8 * i + 2 * j);
                CHUNK(hi, a1, a1, b1, b1, 8 * i + 2 * j + 1);
            }
        }
        break;
    case T_Q6_K:
        for (int64_t i = 0; i < nb; i++) {
            for (int n = 0; n < 2; n++) {
                __m256i q[4];
                float a[8];
                q6k_half(w + i * bb, n, q, a);
                for (int k = 0; k < 4; k++)
                    CHUNK(q[k], a[2 * k], a[2 * k + 1], -32.0f * a[2 * k], -32.0f * a[2 * k + 1], 8 * i + 4 * n + k);
            }
        }
        break;
    }
    for (int r = 0; r < mr; r++) res[r] = hsum8(_mm256_add_ps(acc[r], acc[r + 4])) + accb[r];
}

#if GG_ISA == 2
/* ---- The same rows 64 values at a time (AVX-512 VNNI) ----
 * A 64-value chunk of the row becomes 64 unsigned bytes in natural order in a zmm register, with
 * its four 16-value groups' (a, b) in two xmm; for each activation row, one vpdpbusd gives 16 int32
 * lanes (lane j: values 4j .. 4j + 3, group j / 4), scaled by a * dx per group and accumulated;
 * b times the activation's group sums goes to a second, 4-lane accumulator. A chunk is decoded
 * once for up to 8 activation rows. About a third of row_dot256's instructions per product. */
#define ROW64(r, ACC, ACCB) do { \
            if (MR > (r)) { \
                const int8_t *x_ = xq + (r) * K + k0_; \
                const float *d_ = d4 + (r) * G4 + k0_ / 4, *s_ = s16 + (r) * G + g0_; \
                const __m512i p_ = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w_, \
                    tail_ ? _mm512_maskz_loadu_epi8(0xffffffffull, x_) : _mm512_loadu_si512(x_)); \
                ACC = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p_), _mm512_mul_ps(av_, \
                    tail_ ? _mm512_maskz_loadu_ps(0xff, d_) : _mm512_loadu_ps(d_)), ACC); \
                ACCB = _mm_fmadd_ps(b4_, tail_ ? _mm_maskz_loadu_ps(3, s_) : _mm_loadu_ps(s_), ACCB); \
            } \
        } while (0)
/* accumulators as named variables (an array of them stays in memory); TAIL (a constant): the
 * chunk is the last 32 values of the row, the loads past them masked off */
#define CONSUME64(W, A4, B4, K0, TAIL) do { \
        const __m512i w_ = (W); \
        const __m128 a4_ = (A4), b4_ = (B4); \
        const int64_t k0_ = (K0), g0_ = k0_ / 16; \
        const int tail_ = (TAIL); \
        const __m512 av_ = _mm512_permutexvar_ps(grp, _mm512_castps128_ps512(a4_)); \
        ROW64(0, acc0, accb0); \
        ROW64(1, acc1, accb1); \
        ROW64(2, acc2, accb2); \
        ROW64(3, acc3, accb3); \
        ROW64(4, acc4, accb4); \
        ROW64(5, acc5, accb5); \
        ROW64(6, acc6, accb6); \
        ROW64(7, acc7, accb7); \
    } while (0)

/* two 32-value blocks' 16 bytes of nibbles -> 64 values in order (low nibbles first per block) */
static inline __m512i nib64(const uint8_t *q0, const uint8_t *q1) {
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q0)),
                                              _mm_loadu_si128((const __m128i *)q1), 1);
    const __m256i m = _mm256_set1_epi8(0xF);
    const __m512i lo = _mm512_castsi256_si512(_mm256_and_si256(v, m));
    const __m512i hi = _mm512_castsi256_si512(_mm256_and_si256(_mm256_srli_epi16(v, 4), m));
    return _mm512_permutex2var_epi64(lo, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi);
}

static inline __m512i two32(__m256i a, __m256i b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

/* two 32-value blocks x0, x1 of a 32-block type -> 64 unsigned bytes in order, with each block's
 * (a, b): w = a * q + b */
static inline __attribute__((always_inline)) __m512i pair32(const int type, const uint8_t *x0, const uint8_t *x1,
                                                           float *a0, float *a1, float *b0, float *b1) {
    const float d0 = f16_to_f32(rd16(x0)), d1 = f16_to_f32(rd16(x1));
    *a0 = d0;
    *a1 = d1;
    if (type == T_Q8_0) {
        *b0 = -128.0f * d0;
        *b1 = -128.0f * d1;
        return _mm512_xor_si512(two32(_mm256_loadu_si256((const __m256i *)(x0 + 2)),
                                      _mm256_loadu_si256((const __m256i *)(x1 + 2))), _mm512_set1_epi8((char)0x80));
    }
    const int q5 = type == T_Q5_0 || type == T_Q5_1, hd = type == T_Q4_1 || type == T_Q5_1 ? 4 : 2;
    __m512i v = nib64(x0 + hd + (q5 ? 4 : 0), x1 + hd + (q5 ? 4 : 0));
    if (q5) {  /* the fifth bits: bit j of qh -> 0x10 in value j */
        uint32_t h0, h1;
        memcpy(&h0, x0 + hd, 4);
        memcpy(&h1, x1 + hd, 4);
        v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(((__mmask64)h1 << 32) | h0, _mm512_set1_epi8(0x10)));
    }
    *b0 = type == T_Q4_0 ? -8.0f * d0 : type == T_Q5_0 ? -16.0f * d0 : f16_to_f32(rd16(x0 + 2));
    *b1 = type == T_Q4_0 ? -8.0f * d1 : type == T_Q5_0 ? -16.0f * d1 : f16_to_f32(rd16(x1 + 2));
    return v;
}

/* type and MR (the activation rows, 1-8) are constants in each of row_dot512's calls: the
 * accumulators stay in registers and the type's branches fold away */
static inline __attribute__((always_inline)) void rows512(const int type, const int MR, const uint8_t *w, int64_t K,
                                                          const int8_t *xq, const float *d4, const float *s16,
                                                          float *res) {
    const int64_t G = K / 16, G4 = K / 4;
    const __m512i grp = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0, acc6 = acc0,
           acc7 = acc0;
    __m128 accb0 = _mm_setzero_ps(), accb1 = accb0, accb2 = accb0, accb3 = accb0, accb4 = accb0, accb5 = accb0,
           accb6 = accb0, accb7 = accb0;
    const int64_t nb = K / gguf_block_values(type), bb = gguf_block_bytes(type);
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: {
        int64_t i = 0;
        for (; i + 1 < nb; i += 2) {
            float a0, a1, b0, b1;
            const __m512i v = pair32(type, w + i * bb, w + (i + 1) * bb, &a0, &a1, &b0, &b1);
            CONSUME64(v, _mm_set_ps(a1, a1, a0, a0), _mm_set_ps(b1, b1, b0, b0), i * 32, 0);
        }
        if (i < nb) {  /* an odd block at the end: paired with itself, its second half's activations masked off */
            float a0, a1, b0, b1;
            const __m512i v = pair32(type, w + i * bb, w + i * bb, &a0, &a1, &b0, &b1);
            CONSUME64(v, _mm_set_ps(0.0f, 0.0f, a0, a0), _mm_set_ps(0.0f, 0.0f, b0, b0), i * 32, 1);
        }
        break;
    }
    case T_Q4_K: case T_Q5_K:
        for (int64_t i = 0; i < nb; i++) {
            for (int j = 0; j < 4; j++) {
                __m256i lo, hi;
                float a0, a1, b0, b1;
                k45_pair(type, w + i * bb, j, &lo, &hi, &a0, &a1, &b0, &b1);
                CONSUME64(two32(lo, hi), _mm_set_ps(a1, a1, a0, a0), _mm_set_ps(b1, b1, b0, b0), i * 256 + 64 * j, 0);
            }
        }
        break;
    case T_Q6_K:
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *x = w + i * bb;
            const int8_t *sc = (const int8_t *)(x + 192);
            const float d = f16_to_f32(rd16(x + 208));
            for (int n = 0; n < 2; n++) {
                __m256i q[4];
                q6k_quads(x, n, q);
                for (int k = 0; k < 4; k += 2) {  /* q[k], q[k + 1]: values 32k .. 32k + 63 of this half */
                    const int8_t *s4 = sc + 8 * n + 2 * k;
                    const __m128 a4 = _mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(_mm_cvtepi8_epi32(
                        _mm_cvtsi32_si128(*(const int *)s4))));
                    CONSUME64(two32(q[k], q[k + 1]), a4, _mm_mul_ps(_mm_set1_ps(-32.0f), a4),
                              i * 256 + 128 * n + 32 * k, 0);
                }
            }
        }
        break;
    }
    const __m512 acc[8] = {acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7};
    const __m128 accb[8] = {accb0, accb1, accb2, accb3, accb4, accb5, accb6, accb7};
    for (int r = 0; r < MR; r++) {
        const __m128 b = accb[r], b2 = _mm_add_ps(b, _mm_movehl_ps(b, b));
        res[r] = _mm512_reduce_add_ps(acc[r]) + _mm_cvtss_f32(_mm_add_ss(b2, _mm_shuffle_ps(b2, b2, 1)));
    }
}

#endif

/* A kernel instantiated per block type and per count of activation rows (1-8), both constants in
 * each call so that its accumulators stay in registers and its type branches fold away: CALL(T, MR)
 * for the call's ``type`` and ``mr`` (row_dot512 and, below, the interleaved kernel's x16_group) */
#define EACH_MR(CALL, T) do { switch (mr) {                                        \
    case 8: CALL(T, 8); break; case 7: CALL(T, 7); break; case 6: CALL(T, 6); break; \
    case 5: CALL(T, 5); break; case 4: CALL(T, 4); break; case 3: CALL(T, 3); break; \
    case 2: CALL(T, 2); break; default: CALL(T, 1); break; } } while (0)
#define EACH_TYPE_MR(CALL) do { switch (type) {                                                     \
    case T_Q4_0: EACH_MR(CALL, T_Q4_0); break; case T_Q4_1: EACH_MR(CALL, T_Q4_1); break;             \
    case T_Q5_0: EACH_MR(CALL, T_Q5_0); break; case T_Q5_1: EACH_MR(CALL, T_Q5_1); break;             \
    case T_Q8_0: EACH_MR(CALL, T_Q8_0); break; case T_Q4_K: EACH_MR(CALL, T_Q4_K); break;             \
    case T_Q5_K: EACH_MR(CALL, T_Q5_K); break; case T_Q6_K: EACH_MR(CALL, T_Q6_K); break; } } while (0)

#if GG_ISA == 2
#define ROWS512(T, MR_) rows512(T, MR_, w, K, xq, d4, s16, res)
static void row_dot512(int type, const uint8_t *w, int64_t K, const int8_t *xq, const float *d4, const float *s16,
                       int mr, float *res) {
    EACH_TYPE_MR(ROWS512);
}
#endif

/* activation rows per row_dot call: a weight chunk is decoded once for them all */
#if GG_ISA == 2
#define ROW_BLOCK 8
#else
#define ROW_BLOCK 4
#endif

/* res[r] = row w . activation row r, for mr (1-ROW_BLOCK) rows from xq, d4, s16 (K, K / 4 and K / 16 apart) */
static inline void row_dot(int type, const uint8_t *w, int64_t K, const int8_t *xq, const float *d4,
                           const float *s16, int mr, float *res) {
#if GG_ISA == 2
    row_dot512(type, w, K, xq, d4, s16, mr, res);
#else
    row_dot256(type, w, K, xq, d4, s16, mr, res);
#endif
}
#endif

#if GG_ISA >= 1
/* ---- Mid and large row counts: dequantised tiles against every activation row (mode 3) ----
 * The integer products scale every 16 values of every (weight row, activation row) pair, which
 * makes them compute-bound from a few rows (they lose to bf16 oneDNN from ~4-8 rows on a bf16
 * CPU). Here TILE_BYTES of weight rows are dequantised at a time into a buffer that stays in L1
 * (bf16 where the build has avx512_bf16 and the activations are bf16, else fp32), then every
 * activation row goes against the tile, TM activation rows x TN weight rows per register block
 * (vdpbf16ps on bf16, FMAs on fp32; fp32 sums), with no transient copy of the whole matrix. */
#define TN 4                /* weight rows per register block */
#define TILE_BYTES 24576    /* dequantised weight rows per tile: within a 32 KiB L1 with the activations' block */
#define TILE_TASK_ROWS 64   /* weight rows dequantised at a time (a parallel task of gguf_matmul's mode 3) */
#define TILE_PREFETCH 4096  /* bytes ahead of the row being decoded: the weights stream from memory */
#define TILE_TASK_M 512     /* activation rows per task of mode 3: its sums, 128 KiB, stay in L2 */
#define TILE_X_BYTES 262144 /* activation rows per pass over them: within L2 (Zen 4: 1 MiB) */
#if defined(__AVX512F__)
#define TM 4                /* activation rows per register block: 16 zmm accumulators */
#define VW 16
typedef __m512 vf_t;
#define VZERO() _mm512_setzero_ps()
#define VLOADF(p) _mm512_loadu_ps(p)
#define VLOADB(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32( \
    _mm256_loadu_si256((const __m256i *)(p))), 16))
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline __m256 to8(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
#define TM 2                /* 8 ymm accumulators, 4 weight registers: within AVX2's 16 */
#define VW 8
typedef __m256 vf_t;
#define VZERO() _mm256_setzero_ps()
#define VLOADF(p) _mm256_loadu_ps(p)
#define VLOADB(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32( \
    _mm_loadu_si128((const __m128i *)(p))), 16))
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline __m256 to8(__m256 v) { return v; }
#endif

/* the four sums of a, b, c, d in one xmm */
static inline __m128 hsum4(vf_t a, vf_t b, vf_t c, vf_t d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(to8(a), to8(b)), _mm256_hadd_ps(to8(c), to8(d)));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

static inline void store4(__m128 v, float *p, int nr) {
    if (nr == 4) {
        _mm_storeu_ps(p, v);
        return;
    }
    float t[4];
    _mm_storeu_ps(t, v);
    for (int j = 0; j < nr; j++) p[j] = t[j];
}

/* 16 unsigned bytes q -> a * q + b into dst at value k0 (bf16, rounded to nearest even as
 * gguf_dequantize rounds, or fp32) */
static inline void emit16(__m128i q, float a, float b, void *dst, int64_t k0, int bf) {
#if defined(__AVX512F__)
    const __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(a), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), _mm512_set1_ps(b));
#if TILE_BF16
    if (bf) {
        _mm256_storeu_si256((__m256i *)((uint16_t *)dst + k0), (__m256i)_mm512_cvtneps_pbh(v));
        return;
    }
#endif
    _mm512_storeu_ps((float *)dst + k0, v);
#else
    (void)bf;
    const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
    _mm256_storeu_ps((float *)dst + k0, _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), bv));
    _mm256_storeu_ps((float *)dst + k0 + 8,
                     _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), bv));
#endif
}

/* 32 unsigned bytes of at most 5 bits (Q4/Q5 types, one scale per 32 values): into bf16 through a
 * table of the 32 possible values (one FMA and one conversion per 32 values instead of per 16
 * each, then vpermw); else each 16 through emit16 */
static inline void emit32(__m256i q, float a0, float a1, float b0, float b1, void *dst, int64_t k0, int bf, int lut) {
#if TILE_BF16
    if (bf && lut) {
        const __m512 i0 = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512 av = _mm512_set1_ps(a0), bv = _mm512_set1_ps(b0);
        const __m512i tab = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(av, _mm512_add_ps(i0, _mm512_set1_ps(16.0f)), bv),
                                                         _mm512_fmadd_ps(av, i0, bv));
        _mm512_storeu_si512((uint16_t *)dst + k0, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), tab));
        return;
    }
#endif
    (void)lut;
    emit16(_mm256_castsi256_si128(q), a0, b0, dst, k0, bf);
    emit16(_mm256_extracti128_si256(q, 1), a1, b1, dst, k0 + 16, bf);
}

/* two runs of 32 4-bit values (lo: scale a0, b0; hi: a1, b1) into bf16 through one table of both
 * (entries 0-15 lo's, 16-31 hi's): half emit32's FMAs and conversions */
static inline void emit64_4(__m256i lo, __m256i hi, float a0, float a1, float b0, float b1, void *dst, int64_t k0,
                            int bf) {
#if TILE_BF16
    if (bf) {
        const __m512 i0 = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i tab = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(_mm512_set1_ps(a1), i0, _mm512_set1_ps(b1)),
                                                         _mm512_fmadd_ps(_mm512_set1_ps(a0), i0, _mm512_set1_ps(b0)));
        uint16_t *o = (uint16_t *)dst + k0;
        _mm512_storeu_si512(o, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(lo), tab));
        _mm512_storeu_si512(o + 32, _mm512_permutexvar_epi16(
            _mm512_cvtepu8_epi16(_mm256_or_si256(hi, _mm256_set1_epi8(16))), tab));
        return;
    }
#endif
    emit32(lo, a0, a0, b0, b0, dst, k0, bf, 0);
    emit32(hi, a1, a1, b1, b1, dst, k0 + 32, bf, 0);
}

/* one weight row dequantised into the tile (bf: bf16, else fp32), decoded in registers as
 * row_dot256 decodes it */
static void tile_row(int type, const uint8_t *w, int64_t K, int bf, void *dst) {
    const int64_t nb = K / gguf_block_values(type), bb = gguf_block_bytes(type);
    for (int64_t o = 0; o < nb * bb; o += 64) _mm_prefetch((const char *)w + TILE_PREFETCH + o, _MM_HINT_T0);
    switch (type) {
    case T_Q4_0: case T_Q4_1: {
        const int hd = type == T_Q4_0 ? 2 : 4;
        int64_t i = 0;
        for (; i + 1 < nb; i += 2) {
            const uint8_t *x = w + i * bb, *y = x + bb;
            const float d0 = f16_to_f32(rd16(x)), b0 = type == T_Q4_0 ? -8.0f * d0 : f16_to_f32(rd16(x + 2));
            const float d1 = f16_to_f32(rd16(y)), b1 = type == T_Q4_0 ? -8.0f * d1 : f16_to_f32(rd16(y + 2));
            emit64_4(nib32(x + hd), nib32(y + hd), d0, d1, b0, b1, dst, 32 * i, bf);
        }
        if (i < nb) {
            const uint8_t *x = w + i * bb;
            const float d = f16_to_f32(rd16(x)), b = type == T_Q4_0 ? -8.0f * d : f16_to_f32(rd16(x + 2));
            emit32(nib32(x + hd), d, d, b, b, dst, 32 * i, bf, 1);
        }
        break;
    }
    case T_Q5_0: case T_Q5_1:
        for (int64_t i = 0; i < nb; i++) {
            float d, b;
            const __m256i q = q5_block(type, w + i * bb, &d, &b);
            emit32(q, d, d, b, b, dst, 32 * i, bf, 1);
        }
        break;
    case T_Q8_0:
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *x = w + i * bb;
            const float d = f16_to_f32(rd16(x));
#if TILE_BF16
            if (bf) {  /* d * q rounded once, as unpack_row's a * (q + 128) + b with one FMA */
                const __m128i q0 = _mm_loadu_si128((const __m128i *)(x + 2)), q1 = _mm_loadu_si128((const __m128i *)(x + 18));
                const __m512 dv = _mm512_set1_ps(d);
                _mm512_storeu_si512((uint16_t *)dst + 32 * i, (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1))),
                    _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)))));
                continue;
            }
#endif
            const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(x + 2)), _mm256_set1_epi8((char)0x80));
            emit32(v, d, d, -128.0f * d, -128.0f * d, dst, 32 * i, bf, 0);  /* q + 128, as unpack_row */
        }
        break;
    case T_Q4_K: case T_Q5_K:
        for (int64_t i = 0; i < nb; i++)
            for (int j = 0; j < 4; j++) {
                __m256i lo, hi;
                float a0, a1, b0, b1;
                k45_pair(type, w + i * bb, j, &lo, &hi, &a0, &a1, &b0, &b1);
                if (type == T_Q4_K) {
                    emit64_4(lo, hi, a0, a1, b0, b1, dst, 256 * i + 64 * j, bf);
                } else {
                    emit32(lo, a0, a0, b0, b0, dst, 256 * i + 64 * j, bf, 1);
                    emit32(hi, a1, a1, b1, b1, dst, 256 * i + 64 * j + 32, bf, 1);
                }
            }
        break;
    case T_Q6_K:
        for (int64_t i = 0; i < nb; i++) {
            for (int n = 0; n < 2; n++) {
                __m256i q[4];
                float a[8];
                q6k_half(w + i * bb, n, q, a);
                for (int k = 0; k < 4; k++)
                    emit32(q[k], a[2 * k], a[2 * k + 1], -32.0f * a[2 * k], -32.0f * a[2 * k + 1], dst,
                           256 * i + 128 * n + 32 * k, bf, 0);
            }
        }
        break;
    }
}

/* accumulators as named variables (an array of them stays in memory); MR and XDT are constants in
 * each call, so the unused rows and the other activation type fold away */
#define TL_ACC vf_t c00 = VZERO(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00, \
    c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00
#define TL_OUT(r) do { if (MR > (r)) store4(hsum4(c##r##0, c##r##1, c##r##2, c##r##3), res + (r) * ldr, nr); } while (0)
#define TL_OUTS do { TL_OUT(0); TL_OUT(1); TL_OUT(2); TL_OUT(3); } while (0)
#define TL_ROW(r) do { if (MR > (r)) { \
        const vf_t x_ = XDT ? VLOADB((const uint16_t *)x + (r) * ldx + k) : VLOADF((const float *)x + (r) * ldx + k); \
        c##r##0 = VFMA(x_, w0, c##r##0); c##r##1 = VFMA(x_, w1, c##r##1); \
        c##r##2 = VFMA(x_, w2, c##r##2); c##r##3 = VFMA(x_, w3, c##r##3); } } while (0)

/* res[r * ldr + j] = x row r . w row j (fp32 weights, K apart), r < MR, j < nr */
static inline __attribute__((always_inline)) void tile_f32(const int MR, const int XDT, const void *x, int64_t ldx,
                                                           const float *w, int64_t K, float *res, int64_t ldr, int nr) {
    TL_ACC;
    for (int64_t k = 0; k < K; k += VW) {
        const vf_t w0 = VLOADF(w + k), w1 = VLOADF(w + K + k), w2 = VLOADF(w + 2 * K + k), w3 = VLOADF(w + 3 * K + k);
        TL_ROW(0); TL_ROW(1); TL_ROW(2); TL_ROW(3);
    }
    TL_OUTS;
}

#if TILE_BF16
#define TB_ROW(r) do { if (MR > (r)) { \
        const __m512bh x_ = (__m512bh)_mm512_loadu_si512(x + (r) * ldx + k); \
        c##r##0 = _mm512_dpbf16_ps(c##r##0, x_, w0); c##r##1 = _mm512_dpbf16_ps(c##r##1, x_, w1); \
        c##r##2 = _mm512_dpbf16_ps(c##r##2, x_, w2); c##r##3 = _mm512_dpbf16_ps(c##r##3, x_, w3); } } while (0)

/* the same over bf16 rows and weights, 32 values per vdpbf16ps */
static inline __attribute__((always_inline)) void tile_bf16(const int MR, const uint16_t *x, int64_t ldx,
                                                            const uint16_t *w, int64_t K, float *res, int64_t ldr,
                                                            int nr) {
    TL_ACC;
    for (int64_t k = 0; k < K; k += 32) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + K + k),
                       w2 = (__m512bh)_mm512_loadu_si512(w + 2 * K + k),
                       w3 = (__m512bh)_mm512_loadu_si512(w + 3 * K + k);
        TB_ROW(0); TB_ROW(1); TB_ROW(2); TB_ROW(3);
    }
    TL_OUTS;
}
#endif

#if TM == 4
#define TL_SWITCH(CALL) do { switch (mr) { case 4: CALL(4); break; case 3: CALL(3); break; \
    case 2: CALL(2); break; default: CALL(1); } } while (0)
#else
#define TL_SWITCH(CALL) do { if (mr == 2) CALL(2); else CALL(1); } while (0)
#endif
#define TL_F32_0(M_) tile_f32(M_, 0, x, K, (const float *)w, K, res, ldr, nr)
#define TL_F32_1(M_) tile_f32(M_, 1, x, K, (const float *)w, K, res, ldr, nr)
#define TL_B16(M_) tile_bf16(M_, (const uint16_t *)x, K, (const uint16_t *)w, K, res, ldr, nr)

/* one register block: mr (1-TM) activation rows of type xdt against TN tile rows (nr of them kept) */
static void tile_block(int bf, int xdt, int mr, const void *x, const void *w, int64_t K, float *res, int64_t ldr,
                       int nr) {
#if TILE_BF16
    if (bf) {
        TL_SWITCH(TL_B16);
        return;
    }
#endif
    (void)bf;
    if (xdt) TL_SWITCH(TL_F32_1);
    else TL_SWITCH(TL_F32_0);
}

/* This thread's tile buffer of at least n bytes, kept between calls: a fresh one per call is an
 * mmap above glibc's threshold (128 KiB: 64 rows of 1536 bf16), whose page faults cost the fused
 * decode step a third of its time at 8 rows */
static void *tile_buffer(size_t n) {
    static __thread void *buf;
    static __thread size_t have;
    if (n > have) {
        free(buf);
        buf = aligned_alloc(64, n);
        have = buf ? n : 0;
    }
    return buf;
}

/* res[m * ldr + n - n0] = weight row n . activation row m, for n0 <= n < n1 and the M rows of x
 * (dt 0 fp32, 1 bf16, K apart); one thread. Up to TILE_TASK_ROWS weight rows are dequantised at
 * a time (once, whatever M is), then taken TILE_BYTES at a time (in L1) against blocks of
 * activation rows that stay in L2 (TILE_X_BYTES): a prompt's rows are not streamed from memory
 * once per tile. Each sum is the same whatever the blocking (one order per (m, n)). -1 where a
 * buffer cannot be had. */
static int tile_rows(int type, const uint8_t *w, int64_t K, int dt, const void *x, int64_t M, int64_t n0, int64_t n1,
                     float *res, int64_t ldr) {
    const int bf = TILE_BF16 && dt == 1;
    const int64_t es = bf ? 2 : 4, xes = dt == 1 ? 2 : 4;
    const int64_t rb = K / gguf_block_values(type) * gguf_block_bytes(type);
    int64_t nt = TILE_BYTES / (K * es) / TN * TN, mb = TILE_X_BYTES / (K * xes) / TM * TM;
    if (nt < TN) nt = TN;
    if (mb < TM) mb = TM;
    /* one pass over the activations (decode steps, short prompts): nt rows at a time, written and
     * read in L1; more: a task's rows at once, dequantised once for every pass */
    const int64_t cap = M <= mb ? nt : (TILE_TASK_ROWS + TN - 1) / TN * TN;
    void *wt = tile_buffer((size_t)((cap * K * es + 63) / 64 * 64));
    if (!wt) return -1;
    for (int64_t c0 = n0; c0 < n1; c0 += cap) {
        const int64_t rows = n1 - c0 < cap ? n1 - c0 : cap;
        for (int64_t r = 0; r < rows; r++) tile_row(type, w + (c0 + r) * rb, K, bf, (char *)wt + r * K * es);
        if (rows % TN) memset((char *)wt + rows * K * es, 0, (size_t)((TN - rows % TN) * K * es));
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
            const int64_t m1 = M - m0 < mb ? M : m0 + mb;
            for (int64_t t0 = 0; t0 < rows; t0 += nt) {
                const int64_t t1 = rows - t0 < nt ? rows : t0 + nt;
                for (int64_t m = m0; m < m1; m += TM) {
                    const int mr = m1 - m < TM ? (int)(m1 - m) : TM;
                    for (int64_t j = t0; j < t1; j += TN)
                        tile_block(bf, dt, mr, (const char *)x + m * K * xes, (const char *)wt + j * K * es, K,
                                   res + m * ldr + (c0 - n0) + j, ldr, t1 - j < TN ? (int)(t1 - j) : TN);
                }
            }
        }
    }
    return 0;
}
#endif

static inline float fdot(const float *u, const float *v, int64_t n) {
    float s = 0.0f;
    _Pragma("omp simd reduction(+:s)")
    for (int64_t i = 0; i < n; i++) s += u[i] * v[i];
    return s;
}

/* ---- 16-row interleaved blocks: integer products fast at every row count (AVX-512 VNNI; AVX2) ----
 * Mode 2 computes a row's products with the weight row's values along the vector lanes: every
 * vpdpbusd lane sums 4 products that then need their own conversion, scale and FMA (the scales
 * change every 16-32 values), about 8 instructions per 64 products, which makes it compute-bound
 * from one row and 4-5x slower than the dequantised tiles on prompts. Here the weights of 16
 * output rows are interleaved at load (gguf_x16_pack): a zmm holds 4 consecutive values of each of
 * the 16 rows, so 8 vpdpbusd (the activation's 4 bytes broadcast) sum a whole 32-value block of 16
 * rows in int32 exactly, and the block then costs one conversion, one scale and two FMAs for all
 * 16 outputs: out[m, n] = sum over blocks (in order) of fma(isum, a[n] * dx[m], acc) then
 * fma(b[n], sx[m], acc), with w = a * q + b as in mode 0 (Q6_K: per 16-value half). Each (row,
 * output) sum runs in that one order whatever the row count, the register block or the rows beside
 * it (integer sums are exact, and no horizontal sum is taken), so batch-invariant mode takes it at
 * every row count. The layout of one group of 16 rows, for each 32 values (K-quants: after each
 * super-block's d[16], dmin[16] (Q4_K, Q5_K) or d[16] (Q6_K) as the file's fp16):
 * - scales: d[16] fp16 (+ m[16] fp16: Q4_1, Q5_1); K-quants sc[16], m[16] bytes; Q6_K sc[16] x 2 int8;
 * - Q5 types: 8 masks of 64 bits (bit 4 o + i of mask t: the fifth bit of value 4 t + i of row o);
 * - 4-bit values: 4 x 64 bytes, byte 4 o + i of vector u: value 8 u + i (low nibble) and 8 u + 4 + i;
 *   Q8_0 instead 8 x 64 bytes of q + 128 (vector t: values 4 t .. 4 t + 3 of each row);
 * - Q6_K's high 2 bits: 2 x 64 bytes, bits 2 s of byte 4 o + i of vector h: value 4 (4 h + s) + i.
 * Rows past N in the last group are zero (their outputs are never stored). The layout takes the
 * file's bytes (K-quants 64 bytes more per 16 rows and 256 values: their 6-bit scales as bytes). */
#define X16 0x100

int gguf_x16_supported(void) { return GG_ISA >= 1; }

/* bytes of one group of 16 rows of K values in the interleaved layout; 0 for a type or K not covered */
int64_t gguf_x16_bytes(int type, int64_t K) {
    const int64_t bv = gguf_block_values(type);
    if (!bv || K % bv) return 0;
    const int64_t n32 = K / 32, n256 = K / 256;
    switch (type) {
    case T_Q4_0: return n32 * (32 + 256);
    case T_Q4_1: return n32 * (64 + 256);
    case T_Q5_0: return n32 * (32 + 64 + 256);
    case T_Q5_1: return n32 * (64 + 64 + 256);
    case T_Q8_0: return n32 * (32 + 512);
    case T_Q4_K: return n256 * 64 + n32 * (32 + 256);
    case T_Q5_K: return n256 * 64 + n32 * (32 + 64 + 256);
    case T_Q6_K: return n256 * 32 + n32 * (32 + 384);
    default: return 0;
    }
}

static inline void wr16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

/* the 5-bit types: their values' fifth bits go in 8 masks of 64 bits before the nibbles */
static inline int x16_fifth(int type) { return type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K; }

/* the interleaved values of one 32-value block of row o (q: its 32 unsigned values, unpack_row's)
 * into the block's value section p (after its scales) */
static void x16_put_values(int type, const uint8_t *q, int o, uint8_t *p) {
    if (type == T_Q8_0) {
        for (int t = 0; t < 8; t++)
            for (int i = 0; i < 4; i++) p[64 * t + 4 * o + i] = q[4 * t + i];
        return;
    }
    if (x16_fifth(type)) {
        for (int t = 0; t < 8; t++) {
            uint64_t m;
            memcpy(&m, p + 8 * t, 8);
            for (int i = 0; i < 4; i++) m |= (uint64_t)((q[4 * t + i] >> 4) & 1) << (4 * o + i);
            memcpy(p + 8 * t, &m, 8);
        }
        p += 64;
    }
    for (int u = 0; u < 4; u++)
        for (int i = 0; i < 4; i++)
            p[64 * u + 4 * o + i] = (uint8_t)((q[8 * u + i] & 0xF) | (q[8 * u + 4 + i] & 0xF) << 4);
    if (type == T_Q6_K)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 4; i++) {
                uint8_t v = 0;
                for (int s = 0; s < 4; s++) v |= (uint8_t)(((q[4 * (4 * h + s) + i] >> 4) & 3) << (2 * s));
                p[256 + 64 * h + 4 * o + i] = v;
            }
}

/* The value section of one 32-value block of row o back into q (x16_put_values' inverse) */
static void x16_get_values(int type, const uint8_t *p, int o, uint8_t *q) {
    if (type == T_Q8_0) {
        for (int t = 0; t < 8; t++)
            for (int i = 0; i < 4; i++) q[4 * t + i] = p[64 * t + 4 * o + i];
        return;
    }
    const uint8_t *masks = NULL;
    if (x16_fifth(type)) {
        masks = p;
        p += 64;
    }
    for (int u = 0; u < 4; u++)
        for (int i = 0; i < 4; i++) {
            q[8 * u + i] = p[64 * u + 4 * o + i] & 0xF;
            q[8 * u + 4 + i] = p[64 * u + 4 * o + i] >> 4;
        }
    if (masks)
        for (int t = 0; t < 8; t++) {
            uint64_t m;
            memcpy(&m, masks + 8 * t, 8);
            for (int i = 0; i < 4; i++) q[4 * t + i] |= (uint8_t)(((m >> (4 * o + i)) & 1) << 4);
        }
    if (type == T_Q6_K)
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int i = 0; i < 4; i++)
                    q[4 * (4 * h + s) + i] |= (uint8_t)(((p[256 + 64 * h + 4 * o + i] >> (2 * s)) & 3) << 4);
}

static inline int64_t x16_value_bytes(int type) {
    return type == T_Q8_0 ? 512 : type == T_Q6_K ? 384 :
           x16_fifth(type) ? 320 : 256;
}

/* scale bytes before each 32-value block's values (d, m; K-quants sc, m; Q6_K two sc), and each
 * K-quant super-block's header (d, dmin; Q6_K d) */
static inline int64_t x16_scale_bytes(int type) {
    return type == T_Q4_1 || type == T_Q5_1 ? 64 : 32;
}
static inline int64_t x16_head_bytes(int type) {
    return type == T_Q4_K || type == T_Q5_K ? 64 : type == T_Q6_K ? 32 : 0;
}

/* w [N rows of the file's blocks] -> dst [ceil(N / 16) groups of gguf_x16_bytes]. -1: not covered
 * (or the scalar build: the kernels below are AVX-512 VNNI's and AVX2's) */
int gguf_x16_pack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *dst) {
    const int64_t gb = gguf_x16_bytes(type, K);
    if (!gb || GG_ISA < 1 || N < 0) return -1;
    const int64_t rb = K / gguf_block_values(type) * gguf_block_bytes(type), groups = (N + 15) / 16;
    const int64_t G = K / 16, sb = x16_scale_bytes(type), vb = x16_value_bytes(type), hb = x16_head_bytes(type);
    int failed = 0;
    _Pragma("omp parallel if (groups > 1 && N * K > 65536)")
    {
        uint8_t *q = malloc((size_t)(K + 64));
        float *a = malloc((size_t)(G * 4 + 64)), *b = malloc((size_t)(G * 4 + 64));
        if (!q || !a || !b) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t g = 0; g < groups; g++) {
            if (failed) continue;
            uint8_t *out = dst + g * gb;
            memset(out, 0, (size_t)gb);
            for (int o = 0; o < 16 && g * 16 + o < N; o++) {
                const uint8_t *row = w + (g * 16 + o) * rb;
                unpack_row(type, row, K, q, a, b);
                uint8_t *p = out;
                for (int64_t j = 0; j < K / 32; j++) {
                    if (hb && j % 8 == 0) {  /* a K-quant super-block's header: the file's d (and dmin) */
                        const uint8_t *x = row + j / 8 * gguf_block_bytes(type);
                        if (type == T_Q6_K) {
                            wr16(p + 2 * o, rd16(x + 208));
                        } else {
                            wr16(p + 2 * o, rd16(x));
                            wr16(p + 32 + 2 * o, rd16(x + 2));
                        }
                        p += hb;
                    }
                    if (type == T_Q4_K || type == T_Q5_K) {
                        uint8_t sc, m;
                        scale_min_k4((int)(j % 8), row + j / 8 * gguf_block_bytes(type) + 4, &sc, &m);
                        p[o] = sc;
                        p[16 + o] = m;
                    } else if (type == T_Q6_K) {
                        const int8_t *sc = (const int8_t *)(row + j / 8 * gguf_block_bytes(type) + 192);
                        p[o] = (uint8_t)sc[2 * (j % 8)];
                        p[16 + o] = (uint8_t)sc[2 * (j % 8) + 1];
                    } else {
                        const uint8_t *x = row + j * gguf_block_bytes(type);
                        wr16(p + 2 * o, rd16(x));
                        if (type == T_Q4_1 || type == T_Q5_1) wr16(p + 32 + 2 * o, rd16(x + 2));
                    }
                    p += sb;
                    x16_put_values(type, q + 32 * j, o, p);
                    p += vb;
                }
            }
        }
        free(q);
        free(a);
        free(b);
    }
    return failed ? -1 : 0;
}

/* row o of group gp as unpack_row gives it: q[K], a[K / 16], b[K / 16], the same values */
static void x16_unpack_row(int type, const uint8_t *gp, int o, int64_t K, uint8_t *q, float *a, float *b) {
    const int64_t sb = x16_scale_bytes(type), vb = x16_value_bytes(type), hb = x16_head_bytes(type);
    const uint8_t *p = gp;
    float d = 0.0f, dmin = 0.0f;
    for (int64_t j = 0; j < K / 32; j++) {
        if (hb && j % 8 == 0) {
            d = f16_to_f32(rd16(p + 2 * o));
            if (type != T_Q6_K) dmin = f16_to_f32(rd16(p + 32 + 2 * o));
            p += hb;
        }
        float a0, a1, b0, b1;
        if (type == T_Q4_K || type == T_Q5_K) {
            const uint8_t sc = p[o], m = p[16 + o];
            a0 = a1 = d * sc;
            b0 = b1 = -dmin * m;
        } else if (type == T_Q6_K) {
            const int8_t s0 = (int8_t)p[o], s1 = (int8_t)p[16 + o];
            a0 = d * s0;
            a1 = d * s1;
            b0 = -32.0f * d * s0;
            b1 = -32.0f * d * s1;
        } else {
            const float dd = f16_to_f32(rd16(p + 2 * o));
            a0 = a1 = dd;
            b0 = b1 = type == T_Q4_0 ? -8.0f * dd : type == T_Q5_0 ? -16.0f * dd : type == T_Q8_0 ? -128.0f * dd
                    : f16_to_f32(rd16(p + 32 + 2 * o));
        }
        a[2 * j] = a0;
        a[2 * j + 1] = a1;
        b[2 * j] = b0;
        b[2 * j + 1] = b1;
        p += sb;
        x16_get_values(type, p, o, q + 32 * j);
        p += vb;
    }
}

/* One activation row r's step of a block j into its accumulator ACC, in x16_rows (its w, a0, b0, a1,
 * b1, xq, d4, s16, K, G, G4, j, type and MR): the integer sums of the block (X16_DOT, the build's),
 * then one conversion, one scale and FMAs, in the same order on every build (X16_FMA and the rest are
 * the build's vector width), which is why the AVX2 and AVX-512 builds give the same bits */
#define X16_ROW(r, ACC) do { \
        if (MR > (r)) { \
            const int8_t *x_ = xq + (r) * K + 32 * j; \
            const float dx_ = d4[(r) * G4 + 8 * j]; \
            const float *s_ = s16 + (r) * G + 2 * j; \
            x16_vi t0_ = X16_ZERO(); \
            X16_DOT(t0_, x_, 0); \
            if (type == T_Q6_K) { \
                x16_vi t1_ = X16_ZERO(); \
                X16_DOT(t1_, x_, 4); \
                ACC = X16_FMA(X16_CVT(t0_), X16_MUL(a0, X16_SET1(dx_)), ACC); \
                ACC = X16_FMA(b0, X16_SET1(s_[0]), ACC); \
                ACC = X16_FMA(X16_CVT(t1_), X16_MUL(a1, X16_SET1(dx_)), ACC); \
                ACC = X16_FMA(b1, X16_SET1(s_[1]), ACC); \
            } else { \
                X16_DOT(t0_, x_, 4); \
                ACC = X16_FMA(X16_CVT(t0_), X16_MUL(a0, X16_SET1(dx_)), ACC); \
                ACC = X16_FMA(b0, X16_SET1(s_[0] + s_[1]), ACC); \
            } \
        } \
    } while (0)

/* Q6_K's two 16-value halves: w = d sc (q - 32), so a = d sc and b = -32 d sc per half */
#define X16_Q6K_SCALES(DV, S0, S1) do { \
        const __typeof__(DV) d32_ = X16_MUL(X16_SET1(-32.0f), DV); \
        a0 = X16_MUL(DV, S0); \
        a1 = X16_MUL(DV, S1); \
        b0 = X16_MUL(d32_, S0); \
        b1 = X16_MUL(d32_, S1); \
    } while (0)

#if GG_ISA >= 1
#define X16_PREFETCH 2048  /* bytes ahead of the block being read */
static inline int32_t ld32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
#endif

#if GG_ISA == 2
/* activation rows per register block: 8, Q6_K 4 (its two halves' scales and sums spill 8 rows'
 * accumulators out of the 32 registers: 2.7x slower at 8 rows) */
#define X16_ROWS(type) ((type) == T_Q6_K ? 4 : 8)

/* one row's 8 x 4-value sums into s (int32 per output), the activation's 4 bytes broadcast */
#define X16_DOT(S, X, T0) do { \
        S = _mm512_dpbusd_epi32(S, w[(T0) + 0], _mm512_set1_epi32(ld32((X) + 4 * ((T0) + 0)))); \
        S = _mm512_dpbusd_epi32(S, w[(T0) + 1], _mm512_set1_epi32(ld32((X) + 4 * ((T0) + 1)))); \
        S = _mm512_dpbusd_epi32(S, w[(T0) + 2], _mm512_set1_epi32(ld32((X) + 4 * ((T0) + 2)))); \
        S = _mm512_dpbusd_epi32(S, w[(T0) + 3], _mm512_set1_epi32(ld32((X) + 4 * ((T0) + 3)))); \
    } while (0)
/* the vector types and float steps X16_ROW (above) takes on this build */
typedef __m512i x16_vi;
#define X16_ZERO _mm512_setzero_si512
#define X16_FMA _mm512_fmadd_ps
#define X16_CVT _mm512_cvtepi32_ps
#define X16_MUL _mm512_mul_ps
#define X16_SET1 _mm512_set1_ps

/* the 16 outputs of group gp for MR (1-8) activation rows: res[r * 16 + o]. type and MR are
 * constants in each call (x16_group's switch): the accumulators stay in registers */
static inline __attribute__((always_inline)) void x16_rows(const int type, const int MR, const uint8_t *gp, int64_t K,
                                                           const int8_t *xq, const float *d4, const float *s16,
                                                           float *res) {
    const int64_t G = K / 16, G4 = K / 4, sb = x16_scale_bytes(type), vb = x16_value_bytes(type);
    const int64_t hb = x16_head_bytes(type);
    const __m512i m4 = _mm512_set1_epi8(0xF), sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0,
           acc6 = acc0, acc7 = acc0;
    __m512 dv = acc0, dm = acc0;
    const uint8_t *p = gp;
    for (int64_t j = 0; j < K / 32; j++) {
        /* decode steps read each group once, from memory: ask for the bytes X16_PREFETCH ahead
         * (past the group's end they are the next group's, which this thread takes next) */
        for (int64_t c = 0; c < sb + vb; c += 64) _mm_prefetch((const char *)p + X16_PREFETCH + c, _MM_HINT_T0);
        if (hb && j % 8 == 0) {
            dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
            if (type != T_Q6_K) dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
            p += hb;
        }
        __m512 a0, a1 = acc0, b0, b1 = acc0;
        if (type == T_Q4_K || type == T_Q5_K) {
            a0 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))));
            b0 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), sign)),
                               _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))));
        } else if (type == T_Q6_K) {
            const __m512 s0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
            const __m512 s1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
            X16_Q6K_SCALES(dv, s0, s1);
        } else {
            a0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
            b0 = type == T_Q4_1 || type == T_Q5_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)))
               : _mm512_mul_ps(_mm512_set1_ps(type == T_Q4_0 ? -8.0f : type == T_Q5_0 ? -16.0f : -128.0f), a0);
        }
        p += sb;
        __m512i w[8];
        if (type == T_Q8_0) {
            for (int t = 0; t < 8; t++) w[t] = _mm512_loadu_si512(p + 64 * t);
        } else {
            const uint8_t *v = p + (x16_fifth(type) ? 64 : 0);
            for (int u = 0; u < 4; u++) {
                const __m512i n = _mm512_loadu_si512(v + 64 * u);
                w[2 * u] = _mm512_and_si512(n, m4);
                w[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(n, 4), m4);
            }
            if (x16_fifth(type)) {
                const __m512i five = _mm512_set1_epi8(0x10);
                for (int t = 0; t < 8; t++) {
                    uint64_t mk;
                    memcpy(&mk, p + 8 * t, 8);
                    w[t] = _mm512_or_si512(w[t], _mm512_maskz_mov_epi8((__mmask64)mk, five));
                }
            }
            if (type == T_Q6_K)  /* field s (bits 2s, 2s + 1) moved to bits 4-5, then w | (x & 0x30) in one vpternlogd */
                for (int h = 0; h < 2; h++) {
                    const __m512i hv = _mm512_loadu_si512(p + 256 + 64 * h), m30 = _mm512_set1_epi8(0x30);
                    w[4 * h] = _mm512_ternarylogic_epi32(w[4 * h], _mm512_slli_epi16(hv, 4), m30, 0xF8);
                    w[4 * h + 1] = _mm512_ternarylogic_epi32(w[4 * h + 1], _mm512_slli_epi16(hv, 2), m30, 0xF8);
                    w[4 * h + 2] = _mm512_ternarylogic_epi32(w[4 * h + 2], hv, m30, 0xF8);
                    w[4 * h + 3] = _mm512_ternarylogic_epi32(w[4 * h + 3], _mm512_srli_epi16(hv, 2), m30, 0xF8);
                }
        }
        p += vb;
        X16_ROW(0, acc0);
        X16_ROW(1, acc1);
        X16_ROW(2, acc2);
        X16_ROW(3, acc3);
        X16_ROW(4, acc4);
        X16_ROW(5, acc5);
        X16_ROW(6, acc6);
        X16_ROW(7, acc7);
    }
    const __m512 acc[8] = {acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7};
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(res + 16 * r, acc[r]);
}

#elif GG_ISA == 1
/* The AVX2 build's interleaved products: the same layout, each group read as two halves of 8 rows
 * (the second half from cache), a ymm holding 4 values of each of 8 rows. The integer sums are the
 * VNNI build's (vpmaddubsw pairs, exact: no saturation at these weights' ranges; Q8_0's 8-bit
 * weights as two nibbles), and the float steps are the same operations in the same order, so the
 * two builds give the same bits. AVX-VNNI (Alder Lake, Zen 4 and 5) sums 4 products in one vpdpbusd. */
/* activation rows per register block: 4 accumulators beside 8 weight vectors and the scales (Q6_K
 * too: 1.2x faster at 4 than at 2 rows, whatever spills) */
#define X16_ROWS(type) 4

/* s + the 4-product sums (per int32 lane: 4 values of one row) of w[0..3] (unsigned weight bytes)
 * with the activation's 16 bytes x, each 4 of them broadcast. AVX2 alone: vpmaddubsw's int16 pair
 * sums added in int16 before one vpmaddwd, as many as cannot overflow (4-5-bit weights 4, 6-bit 2:
 * a pair is at most 2 x 63 x 128); Q8_0's weights (q + 128, to 255) as two nibbles. */
static inline __attribute__((always_inline)) __m256i x16_sum4(const int type, __m256i s, const __m256i *w,
                                                              const int8_t *x) {
    const __m256i x0 = _mm256_set1_epi32(ld32(x)), x1 = _mm256_set1_epi32(ld32(x + 4));
    const __m256i x2 = _mm256_set1_epi32(ld32(x + 8)), x3 = _mm256_set1_epi32(ld32(x + 12));
#if defined(__AVXVNNI__)
    (void)type;
    s = _mm256_dpbusd_avx_epi32(s, w[0], x0);
    s = _mm256_dpbusd_avx_epi32(s, w[1], x1);
    s = _mm256_dpbusd_avx_epi32(s, w[2], x2);
    return _mm256_dpbusd_avx_epi32(s, w[3], x3);
#else
    const __m256i one = _mm256_set1_epi16(1);
#define MUB(W, X) _mm256_maddubs_epi16(W, X)
    if (type == T_Q8_0) {
        const __m256i m4 = _mm256_set1_epi8(0xF);
#define LO(i) _mm256_and_si256(w[i], m4)
#define HI(i) _mm256_and_si256(_mm256_srli_epi16(w[i], 4), m4)
        const __m256i lo = _mm256_add_epi16(_mm256_add_epi16(MUB(LO(0), x0), MUB(LO(1), x1)),
                                            _mm256_add_epi16(MUB(LO(2), x2), MUB(LO(3), x3)));
        const __m256i hi = _mm256_add_epi16(_mm256_add_epi16(MUB(HI(0), x0), MUB(HI(1), x1)),
                                            _mm256_add_epi16(MUB(HI(2), x2), MUB(HI(3), x3)));
#undef LO
#undef HI
        return _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(lo, one),
                                                    _mm256_slli_epi32(_mm256_madd_epi16(hi, one), 4)));
    }
    const __m256i p01 = _mm256_add_epi16(MUB(w[0], x0), MUB(w[1], x1));
    const __m256i p23 = _mm256_add_epi16(MUB(w[2], x2), MUB(w[3], x3));
#undef MUB
    if (type == T_Q6_K)
        return _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(p01, one), _mm256_madd_epi16(p23, one)));
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_add_epi16(p01, p23), one));
#endif
}

#define X16_DOT(S, X, T0) S = x16_sum4(type, S, w + (T0), (X) + 4 * (T0))
typedef __m256i x16_vi;
#define X16_ZERO _mm256_setzero_si256
#define X16_FMA _mm256_fmadd_ps
#define X16_CVT _mm256_cvtepi32_ps
#define X16_MUL _mm256_mul_ps
#define X16_SET1 _mm256_set1_ps

static inline __m256 u8x8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline __m256 i8x8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* x16_rows' contract (res[r * 16 + o]) for MR (1-4) activation rows, one half of the group at a time */
static inline __attribute__((always_inline)) void x16_rows(const int type, const int MR, const uint8_t *gp, int64_t K,
                                                           const int8_t *xq, const float *d4, const float *s16,
                                                           float *res) {
    const int64_t G = K / 16, G4 = K / 4, sb = x16_scale_bytes(type), vb = x16_value_bytes(type);
    const int64_t hb = x16_head_bytes(type);
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {  /* rows 8 h .. 8 h + 7: bytes 32 h .. 32 h + 31 of each 64 */
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, dv = acc0, dm = acc0;
        const uint8_t *p = gp;
        for (int64_t j = 0; j < K / 32; j++) {
            if (!h)  /* the second half reads what the first brought in */
                for (int64_t c = 0; c < sb + vb; c += 64) _mm_prefetch((const char *)p + X16_PREFETCH + c, _MM_HINT_T0);
            if (hb && j % 8 == 0) {
                dv = f16x8(p + 16 * h);
                if (type != T_Q6_K) dm = f16x8(p + 32 + 16 * h);
                p += hb;
            }
            __m256 a0, a1 = acc0, b0, b1 = acc0;
            if (type == T_Q4_K || type == T_Q5_K) {
                a0 = _mm256_mul_ps(dv, u8x8(p + 8 * h));
                b0 = _mm256_mul_ps(_mm256_xor_ps(dm, _mm256_set1_ps(-0.0f)), u8x8(p + 16 + 8 * h));
            } else if (type == T_Q6_K) {
                const __m256 s0 = i8x8(p + 8 * h), s1 = i8x8(p + 16 + 8 * h);
                X16_Q6K_SCALES(dv, s0, s1);
            } else {
                a0 = f16x8(p + 16 * h);
                b0 = type == T_Q4_1 || type == T_Q5_1 ? f16x8(p + 32 + 16 * h)
                   : _mm256_mul_ps(_mm256_set1_ps(type == T_Q4_0 ? -8.0f : type == T_Q5_0 ? -16.0f : -128.0f), a0);
            }
            p += sb;
            __m256i w[8];
            if (type == T_Q8_0) {
                for (int t = 0; t < 8; t++) w[t] = _mm256_loadu_si256((const __m256i *)(p + 64 * t + 32 * h));
            } else {
                const uint8_t *v = p + (x16_fifth(type) ? 64 : 0);
                for (int u = 0; u < 4; u++) {
                    const __m256i n = _mm256_loadu_si256((const __m256i *)(v + 64 * u + 32 * h));
                    w[2 * u] = _mm256_and_si256(n, m4);
                    w[2 * u + 1] = _mm256_and_si256(_mm256_srli_epi16(n, 4), m4);
                }
                if (x16_fifth(type))
                    for (int t = 0; t < 8; t++) {
                        uint64_t mk;
                        memcpy(&mk, p + 8 * t, 8);
                        w[t] = _mm256_or_si256(w[t], fifth_bits((uint32_t)(mk >> (32 * h))));
                    }
                if (type == T_Q6_K)  /* field s (bits 2s, 2s + 1) moved to bits 4-5 */
                    for (int hh = 0; hh < 2; hh++) {
                        const __m256i hv = _mm256_loadu_si256((const __m256i *)(p + 256 + 64 * hh + 32 * h));
                        w[4 * hh] = _mm256_or_si256(w[4 * hh], _mm256_and_si256(_mm256_slli_epi16(hv, 4), m30));
                        w[4 * hh + 1] = _mm256_or_si256(w[4 * hh + 1], _mm256_and_si256(_mm256_slli_epi16(hv, 2), m30));
                        w[4 * hh + 2] = _mm256_or_si256(w[4 * hh + 2], _mm256_and_si256(hv, m30));
                        w[4 * hh + 3] = _mm256_or_si256(w[4 * hh + 3], _mm256_and_si256(_mm256_srli_epi16(hv, 2), m30));
                    }
            }
            p += vb;
            X16_ROW(0, acc0);
            X16_ROW(1, acc1);
            X16_ROW(2, acc2);
            X16_ROW(3, acc3);
        }
        const __m256 acc[4] = {acc0, acc1, acc2, acc3};
        for (int r = 0; r < MR && r < 4; r++) _mm256_storeu_ps(res + 16 * r + 8 * h, acc[r]);
    }
}
#endif

#if GG_ISA >= 1
#define X16_ROWS_OF(T, MR_) x16_rows(T, MR_, gp, K, xq, d4, s16, res)
static void x16_group(int type, const uint8_t *gp, int64_t K, const int8_t *xq, const float *d4, const float *s16,
                      int mr, float *res) {
    EACH_TYPE_MR(X16_ROWS_OF);
}

/* rows n0 .. n1 of interleaved weights w against M quantised activation rows: res[m * ldr + n - n0]
 * (gguf_rows' contract; the fused decode step splits the rows over its team) */
static void x16_range(int type, const uint8_t *w, int64_t K, const int8_t *xq, const float *d4, const float *s16,
                      int64_t M, int64_t n0, int64_t n1, float *res, int64_t ldr) {
    const int64_t gb = gguf_x16_bytes(type, K), G = K / 16;
    const int rmax = X16_ROWS(type);
    for (int64_t g = n0 / 16; g * 16 < n1; g++) {
        const int64_t lo = g * 16 > n0 ? g * 16 : n0, hi = g * 16 + 16 < n1 ? g * 16 + 16 : n1;
        for (int64_t m0 = 0; m0 < M; m0 += rmax) {
            const int mr = M - m0 < rmax ? (int)(M - m0) : rmax;
            float r16[8 * 16];
            x16_group(type, w + g * gb, K, xq + m0 * K, d4 + m0 * (K / 4), s16 + m0 * G, mr, r16);
            for (int r = 0; r < mr; r++)
                for (int64_t n = lo; n < hi; n++) res[(m0 + r) * ldr + n - n0] = r16[16 * r + n - g * 16];
        }
    }
}
#endif

/* Weight rows n0 .. n1 of w (raw blocks) against M activation rows quantised by gguf_quantize_row:
 * res[m * ldr + n - n0] = the sum, no bias, one thread (the caller splits rows over its team: the
 * fused decode step in cpu_kernels.c, through a pointer). Each row as gguf_matmul's decode path
 * computes it, so a step's rows come out the same in either; with x (the same rows unquantised, dt 0
 * fp32, 1 bf16: the caller's choice, at the row counts gguf_tile_from and gguf_tile_to give, or
 * at every count in batch-invariant mode on the avx512_bf16 build) mode 3's tiles instead, each
 * sum as gguf_matmul's mode 3 computes it. */
void gguf_rows(int type, const uint8_t *w, int64_t K, const int8_t *xq, const float *d4, const float *s16,
               int64_t M, int64_t n0, int64_t n1, float *res, int64_t ldr, int dt, const void *x) {
#if GG_ISA >= 1
    if (type & X16) {  /* interleaved 16-row groups (gguf_x16_pack): the integer products, one order */
        x16_range(type & 0xFF, w, K, xq, d4, s16, M, n0, n1, res, ldr);
        return;
    }
#endif
    const int64_t rb = K / gguf_block_values(type) * gguf_block_bytes(type), G = K / 16;
#if GG_ISA >= 1
    if (x && !tile_rows(type, w, K, dt, x, M, n0, n1, res, ldr)) return;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int mr = M - m0 < ROW_BLOCK ? (int)(M - m0) : ROW_BLOCK;
            float r4[ROW_BLOCK];
            row_dot(type, w + n * rb, K, xq + m0 * K, d4 + m0 * (K / 4), s16 + m0 * G, mr, r4);
            for (int r = 0; r < mr; r++) res[(m0 + r) * ldr + n - n0] = r4[r];
        }
#else  /* the scalar build: gguf_matmul's integer mode, a row unpacked at a time */
    uint8_t q[K];
    float a[G], b[G];
    for (int64_t n = n0; n < n1; n++) {
        unpack_row(type, w + n * rb, K, q, a, b);
        for (int64_t m = 0; m < M; m++)
            res[m * ldr + n - n0] = idot(q, a, xq + m * K, d4 + m * (K / 4), K) + fdot(b, s16 + m * G, G);
    }
#endif
}

static inline void store(int dt, void *out, int64_t i, float v) {
    if (dt == 1) ((uint16_t *)out)[i] = f32_to_bf16(v);
    else ((float *)out)[i] = v;
}

static inline float load(int dt, const void *p, int64_t i) {
    return dt == 1 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if GG_ISA >= 1
/* gguf_matmul of interleaved weights (type | X16): the integer products at every row count, 64
 * activation rows at a time (they stay in cache while the groups stream past), parallel over groups */
static int x16_matmul(int type, int dt, int64_t M, int64_t K, const int8_t *xq, const float *d4, const float *s16,
                      const uint8_t *w, int64_t N, const void *bias, void *out, int64_t ldo) {
    const int64_t gb = gguf_x16_bytes(type, K), groups = (N + 15) / 16, G = K / 16;
    const int rmax = X16_ROWS(type);
    if (!gb) return -1;
    for (int64_t t0 = 0; t0 < M; t0 += DIRECT_ROWS) {
        const int64_t t1 = M - t0 < DIRECT_ROWS ? M : t0 + DIRECT_ROWS;
        _Pragma("omp parallel for schedule(static) if (groups > 1 && N * K > 65536)")
        for (int64_t g = 0; g < groups; g++)
            for (int64_t m0 = t0; m0 < t1; m0 += rmax) {
                const int mr = t1 - m0 < rmax ? (int)(t1 - m0) : rmax;
                float res[8 * 16];
                x16_group(type, w + g * gb, K, xq + m0 * K, d4 + m0 * (K / 4), s16 + m0 * G, mr, res);
                for (int r = 0; r < mr; r++)
                    for (int64_t n = g * 16; n < N && n < g * 16 + 16; n++) {
                        const float v = res[16 * r + n - g * 16];
                        store(dt, out, (m0 + r) * ldo + n, bias ? v + load(dt, bias, n) : v);
                    }
            }
    }
    return 0;
}
#endif

/* out[m * ldo + n] (dt: 0 fp32, 1 bf16; bias of that type or NULL) for the N rows of w (raw
 * blocks, row after row). mode 0 and 2: xq, d4, s16 from gguf_quantize (x unused); mode 1: x fp32
 * [M, K]; mode 3 (AVX2 and AVX-512 builds): x [M, K] of type dt, the dequantised tiles.
 * Returns -1 for a type or shape it does not cover. */
int gguf_matmul(int type, int mode, int dt, int64_t M, int64_t K, const float *x, const int8_t *xq,
                const float *d4, const float *s16, const uint8_t *w, int64_t N, const void *bias, void *out,
                int64_t ldo) {
    if (type & X16) {  /* interleaved 16-row groups: the integer products (modes 0 and 2 alike) */
#if GG_ISA >= 1
        return (mode == 0 || mode == 2) && M >= 0 && N >= 0 ? x16_matmul(type & 0xFF, dt, M, K, xq, d4, s16, w, N,
                                                                         bias, out, ldo) : -1;
#else
        return -1;
#endif
    }
    const int64_t bv = gguf_block_values(type);
    if (!bv || K % bv || M < 0 || N < 0) return -1;
    const int64_t rb = K / bv * gguf_block_bytes(type), G = K / 16;
    const int64_t tiles = (N + NT - 1) / NT;
    int failed = 0;
    if (mode == 3) {
#if GG_ISA >= 1
        /* tasks: TILE_TASK_ROWS weight rows against TILE_TASK_M activation rows (a prompt's sums
         * stay in L2 before their store; the weights are dequantised once per TILE_TASK_M rows) */
        const int64_t nt = (N + TILE_TASK_ROWS - 1) / TILE_TASK_ROWS, mt = (M + TILE_TASK_M - 1) / TILE_TASK_M;
        const int64_t xes = dt == 1 ? 2 : 4, mc = M < TILE_TASK_M ? M : TILE_TASK_M;
        _Pragma("omp parallel if (nt * mt > 1 && M * N * K > 65536)")
        {
            float *res = malloc((size_t)(mc * TILE_TASK_ROWS * 4 + 64));
            _Pragma("omp for schedule(static)")
            for (int64_t t = 0; t < nt * mt; t++) {
                const int64_t m0 = t / nt * TILE_TASK_M, m1 = M - m0 < TILE_TASK_M ? M : m0 + TILE_TASK_M;
                const int64_t n0 = t % nt * TILE_TASK_ROWS, n1 = N - n0 < TILE_TASK_ROWS ? N : n0 + TILE_TASK_ROWS;
                if (failed || !res ||
                    tile_rows(type, w, K, dt, (const char *)x + m0 * K * xes, m1 - m0, n0, n1, res, TILE_TASK_ROWS)) {
                    _Pragma("omp atomic write")
                    failed = 1;
                    continue;
                }
                for (int64_t m = m0; m < m1; m++)
                    for (int64_t n = n0; n < n1; n++) {
                        const float v = res[(m - m0) * TILE_TASK_ROWS + n - n0];
                        store(dt, out, m * ldo + n, bias ? v + load(dt, bias, n) : v);
                    }
            }
            free(res);
        }
        return failed ? -1 : 0;
#else
        return -1;  /* the scalar build has mode 1 instead */
#endif
    }
#if GG_ISA >= 1
    /* decode steps (and mode 2 at any row count): each row from its blocks, no unpacked copy, one
     * summation order per row whatever M is; 64 activation rows at a time stay in cache while
     * the weights stream past them */
    if ((mode == 0 && M <= DIRECT_ROWS) || mode == 2) {
        for (int64_t t0 = 0; t0 < M; t0 += DIRECT_ROWS) {
            const int64_t t1 = M - t0 < DIRECT_ROWS ? M : t0 + DIRECT_ROWS;
            _Pragma("omp parallel for schedule(static) if (N * K > 65536)")
            for (int64_t n = 0; n < N; n++)
                for (int64_t m0 = t0; m0 < t1; m0 += ROW_BLOCK) {
                    const int mr = t1 - m0 < ROW_BLOCK ? (int)(t1 - m0) : ROW_BLOCK;
                    float res[ROW_BLOCK];
                    row_dot(type, w + n * rb, K, xq + m0 * K, d4 + m0 * (K / 4), s16 + m0 * G, mr, res);
                    for (int r = 0; r < mr; r++)
                        store(dt, out, (m0 + r) * ldo + n, bias ? res[r] + load(dt, bias, n) : res[r]);
                }
        }
        return 0;
    }
#endif
    _Pragma("omp parallel if (tiles > 1 && M * N * K > 32768)")
    {
        uint8_t *q = aligned_alloc(64, (size_t)(NT * K + 64));
        float *a = aligned_alloc(64, (size_t)(NT * G * 4 + 64)), *b = aligned_alloc(64, (size_t)(NT * G * 4 + 64));
        float *wf = mode == 1 ? aligned_alloc(64, (size_t)(NT * K * 4 + 64)) : NULL;
        if (!q || !a || !b || (mode == 1 && !wf)) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t t = 0; t < tiles; t++) {
            if (failed) continue;
            const int64_t n0 = t * NT, nt = N - n0 < NT ? N - n0 : NT;
            for (int64_t r = 0; r < nt; r++) {
                unpack_row(type, w + (n0 + r) * rb, K, q + r * K, a + r * G, b + r * G);
                if (mode == 1)
                    for (int64_t k = 0; k < K; k++)
                        wf[r * K + k] = a[r * G + k / 16] * (float)q[r * K + k] + b[r * G + k / 16];
            }
            for (int64_t m0 = 0; m0 < M; m0 += MT) {
                const int64_t m1 = M - m0 < MT ? M : m0 + MT;
                for (int64_t m = m0; m < m1; m++) {
                    for (int64_t r = 0; r < nt; r++) {
                        float v;
                        if (mode == 1) {
                            v = fdot(wf + r * K, x + m * K, K);
                        } else {
#if GG_ISA == 1
                            v = type == T_Q8_0 ? idot_wide(q + r * K, a + r * G, xq + m * K, d4 + m * (K / 4), K)
                                               : idot(q + r * K, a + r * G, xq + m * K, d4 + m * (K / 4), K);
#else
                            v = idot(q + r * K, a + r * G, xq + m * K, d4 + m * (K / 4), K);
#endif
                            v += fdot(b + r * G, s16 + m * G, G);
                        }
                        if (bias) v += load(dt, bias, n0 + r);
                        store(dt, out, m * ldo + n0 + r, v);
                    }
                }
            }
        }
        free(q);
        free(a);
        free(b);
        free(wf);
    }
    return failed ? -1 : 0;
}

int gguf_dequantize_rows(int type, const uint8_t *w, const int64_t *ids, int64_t N, int64_t K, int dt, void *out);

/* The N rows of w dequantised to out [N, K] (dt: 0 fp32, 1 bf16): large steps' products go to
 * oneDNN over this transient copy (gguf_linear.py measures where that wins). */
int gguf_dequantize(int type, const uint8_t *w, int64_t N, int64_t K, int dt, void *out) {
    return gguf_dequantize_rows(type, w, NULL, N, K, dt, out);
}

/* gguf_dequantize of rows ids[0 .. N - 1] of w (NULL: rows 0 .. N - 1) into out [N, K]: an
 * embedding's lookup from the blocks (a tied LM head's, interleaved or not) */
int gguf_dequantize_rows(int type, const uint8_t *w, const int64_t *ids, int64_t N, int64_t K, int dt, void *out) {
    const int x16 = (type & X16) != 0;  /* interleaved 16-row groups: each row back as unpack_row gives it */
    type &= 0xFF;
    const int64_t bv = gguf_block_values(type), gb = x16 ? gguf_x16_bytes(type, K) : 0;
    if (!bv || K % bv || (x16 && !gb)) return -1;
    const int64_t rb = K / bv * gguf_block_bytes(type), G = K / 16;
    int failed = 0;
    _Pragma("omp parallel if (N * K > 65536)")
    {
        uint8_t *q = aligned_alloc(64, (size_t)(K + 64));
        float *a = aligned_alloc(64, (size_t)(G * 4 + 64)), *b = aligned_alloc(64, (size_t)(G * 4 + 64));
        if (!q || !a || !b) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t n = 0; n < N; n++) {
            if (failed) continue;
            const int64_t r = ids ? ids[n] : n;  /* the source row; n the output row */
            if (x16) x16_unpack_row(type, w + r / 16 * gb, (int)(r % 16), K, q, a, b);
            else unpack_row(type, w + r * rb, K, q, a, b);
            for (int64_t g = 0; g < G; g++) {  /* 16 values of one scale: the compiler's vector loop */
                const float ag = a[g], bg = b[g];
                const uint8_t *qg = q + g * 16;
                if (dt == 1) {
                    uint16_t *o = (uint16_t *)out + n * K + g * 16;
                    for (int j = 0; j < 16; j++) {
                        union { float f; uint32_t u; } v = { ag * (float)qg[j] + bg };
                        o[j] = (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);  /* finite: no NaN case */
                    }
                } else {
                    float *o = (float *)out + n * K + g * 16;
                    for (int j = 0; j < 16; j++) o[j] = ag * (float)qg[j] + bg;
                }
            }
        }
        free(q);
        free(a);
        free(b);
    }
    return failed ? -1 : 0;
}

/* ---- A mixture-of-experts layer's routed experts over their blocks (gguf_moe) ----------------------- */

/* One linear's rows in blocks, as a GgufLinear holds them: n_parts parts, part p rows first[p] ..
 * first[p] + rows[p] - 1 of the output, of ggml type type[p] (| X16: interleaved) at data[p]. The
 * layout of cpu_kernels.c's dec_gguf_t (one ctypes structure describes both: gguf_linear.CParts);
 * gguf_moe takes the integer products and leaves the tile ranges, which the fused step reads. */
#define MOE_PARTS 4
typedef struct {
    int64_t n_parts;
    int64_t first[MOE_PARTS], rows[MOE_PARTS], type[MOE_PARTS];
    const uint8_t *data[MOE_PARTS];
    int64_t tile_from[MOE_PARTS], tile_to;
} gg_linear_t;

#define MOE_TOKENS 128 /* tokens per pass: their routed rows wait in fp32 for the per-token sums */
#define MOE_ROWS 16    /* an expert's routed rows per task */

static inline float round_dt(int dt, float v) { return dt == 1 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* Output rows n0 .. n1 of lin (K columns) against M quantised rows: res[m * ldr + n] for those n,
 * from the parts that hold them (gguf_rows on each part's share of the range). */
static void moe_rows(const gg_linear_t *lin, int64_t K, const int8_t *xq, const float *d4, const float *s16,
                     int64_t M, int64_t n0, int64_t n1, float *res, int64_t ldr, int dt) {
    for (int64_t p = 0; p < lin->n_parts; p++) {
        const int64_t a = n0 > lin->first[p] ? n0 : lin->first[p];
        const int64_t b = n1 < lin->first[p] + lin->rows[p] ? n1 : lin->first[p] + lin->rows[p];
        if (a < b)
            gguf_rows((int)lin->type[p], lin->data[p], K, xq, d4, s16, M, a - lin->first[p], b - lin->first[p],
                      res + a, ldr, dt, NULL);
    }
}

/* The tasks of one phase: (expert, first routed row, first output row) for each MOE_ROWS rows of
 * each expert and each *cols output rows of its N: all N at once where those row chunks give every
 * thread 4 tasks already, else the N split (whole 16-row groups) until they do (one token's 8
 * experts on 16 cores). Returns their count. */
static int64_t moe_tasks(const int64_t *cnt, int64_t E, int64_t N, int64_t threads, int64_t *task, int64_t *cols) {
    int64_t chunks = 0, n = 0;
    for (int64_t e = 0; e < E; e++) chunks += (cnt[e + 1] - cnt[e] + MOE_ROWS - 1) / MOE_ROWS;
    const int64_t want = 4 * threads, split = chunks >= want || !chunks ? 1 : (want + chunks - 1) / chunks;
    int64_t c0 = (N + split - 1) / split;
    c0 = (c0 + 15) / 16 * 16;
    *cols = c0 < N ? c0 : N;
    for (int64_t e = 0; e < E; e++)
        for (int64_t a = cnt[e]; a < cnt[e + 1]; a += MOE_ROWS)
            for (int64_t c = 0; c < N; c += *cols) { task[3 * n] = e; task[3 * n + 1] = a; task[3 * n + 2] = c; n++; }
    return n;
}

/* The routed experts of T tokens: x [T, H] (dt 0 fp32, 1 bf16), token t's k experts ids[t * k + j]
 * (outside 0 .. E - 1: not this layer's, skipped) with weights wts[t * k + j] (fp32); expert e's
 * w13[e] [2 I, H] (its gate rows, then its up rows) and w2[e] [H, I]. out[t] = the sum over its
 * experts in ascending id of round(y * round(w)), y = down(act) rounded to dt, act = silu(gate) *
 * up of the products rounded to dt (bf16: silu from silu_bf16, torch's bits, as the C SwiGLU pass),
 * each sum rounded to dt: what SparseMoE.experts_forward computes over GgufLinear experts, in one
 * call, a token's result whatever else is in the call (the integer products take a row alone).
 * Phases of one parallel region: gate and up, the SwiGLU (its rows quantised again), down, each
 * task MOE_ROWS routed rows of one expert against its output rows, split where that leaves cores
 * idle (moe_tasks: one token's 8 experts on 16 cores); then each token's sum. Returns 0, or -1 (nothing written) for a shape
 * it does not cover or memory it cannot get. */
int gguf_moe(int dt, int64_t T, int64_t H, int64_t I, int64_t k, const void *x, const int64_t *ids, const float *wts,
             int64_t E, const gg_linear_t *w13, const gg_linear_t *w2, const uint16_t *silu_bf16, void *out) {
    if (T < 0 || k <= 0 || k > 64 || H % 32 || I % 32 || (dt != 0 && dt != 1) || (dt == 1 && !silu_bf16)) return -1;
    for (int64_t e = 0; e < E; e++)
        if (w13[e].n_parts < 1 || w13[e].n_parts > MOE_PARTS || w2[e].n_parts < 1 || w2[e].n_parts > MOE_PARTS)
            return -1;
    const int64_t es = dt == 1 ? 2 : 4, TB = T < MOE_TOKENS ? T : MOE_TOKENS, P = TB * k;
    int8_t *xq = malloc((size_t)(TB * H + 64)), *gq = malloc((size_t)(P * H + 64)), *aq = malloc((size_t)(P * I + 64));
    float *d4 = malloc((size_t)(TB * (H / 4) * 4 + 64)), *s16 = malloc((size_t)(TB * (H / 16) * 4 + 64));
    float *gd4 = malloc((size_t)(P * (H / 4) * 4 + 64)), *gs16 = malloc((size_t)(P * (H / 16) * 4 + 64));
    float *ad4 = malloc((size_t)(P * (I / 4) * 4 + 64)), *as16 = malloc((size_t)(P * (I / 16) * 4 + 64));
    float *r13 = malloc((size_t)(P * 2 * I * 4 + 64)), *y = malloc((size_t)(P * H * 4 + 64));
    char *act = malloc((size_t)(P * I * es + 64));
    int64_t *cnt = calloc((size_t)(E + 1), sizeof *cnt), *fill = malloc((size_t)(E + 1) * sizeof *fill);
    int64_t *pair = malloc((size_t)(P + 1) * sizeof *pair);
    const int64_t threads = omp_get_max_threads();
    const int64_t most = (P / MOE_ROWS + E + 1) * (4 * threads + 1);  /* tasks of a phase, at most */
    int64_t *task = malloc((size_t)(most + 1) * 3 * sizeof *task), *task2 = malloc((size_t)(most + 1) * 3 * sizeof *task2);
    int failed = !xq || !gq || !aq || !d4 || !s16 || !gd4 || !gs16 || !ad4 || !as16 || !r13 || !y || !act || !cnt
                 || !fill || !pair || !task || !task2;
    for (int64_t t0 = 0; !failed && t0 < T; t0 += TB) {
        const int64_t nb = T - t0 < TB ? T - t0 : TB;
        gguf_quantize(dt, (const char *)x + t0 * H * es, nb, H, xq, d4, s16);
        /* the (token, slot) pairs grouped by expert: a counting sort, tokens in order within one;
         * pair i of expert e's group is routed row cnt[e] + i, its data at that row of gq, r13, y */
        memset(cnt, 0, (size_t)(E + 1) * sizeof *cnt);
        for (int64_t i = 0; i < nb * k; i++) {
            const int64_t e = ids[t0 * k + i];
            if (e >= 0 && e < E) cnt[e + 1]++;
        }
        for (int64_t e = 0; e < E; e++) cnt[e + 1] += cnt[e];
        memcpy(fill, cnt, (size_t)(E + 1) * sizeof *fill);
        for (int64_t i = 0; i < nb * k; i++) {
            const int64_t e = ids[t0 * k + i];
            if (e >= 0 && e < E) pair[fill[e]++] = i;
        }
        const int64_t routed = cnt[E];
        int64_t cols13, cols2;
        const int64_t n13 = moe_tasks(cnt, E, 2 * I, threads, task, &cols13);
        const int64_t n2 = moe_tasks(cnt, E, H, threads, task2, &cols2);
        _Pragma("omp parallel if (routed * H > 4096)")
        {
            _Pragma("omp for schedule(static)")
            for (int64_t r = 0; r < routed; r++) {  /* each routed row's quantised input, grouped by expert */
                const int64_t t = pair[r] / k;
                memcpy(gq + r * H, xq + t * H, (size_t)H);
                memcpy(gd4 + r * (H / 4), d4 + t * (H / 4), (size_t)(H / 4) * 4);
                memcpy(gs16 + r * (H / 16), s16 + t * (H / 16), (size_t)(H / 16) * 4);
            }
            _Pragma("omp for schedule(dynamic, 1)")  /* gate and up */
            for (int64_t w = 0; w < n13; w++) {
                const int64_t e = task[3 * w], a = task[3 * w + 1], c = task[3 * w + 2];
                const int64_t n = cnt[e + 1] - a < MOE_ROWS ? cnt[e + 1] - a : MOE_ROWS;
                moe_rows(&w13[e], H, gq + a * H, gd4 + a * (H / 4), gs16 + a * (H / 16), n, c,
                         c + cols13 < 2 * I ? c + cols13 : 2 * I, r13 + a * 2 * I, 2 * I, dt);
            }
            _Pragma("omp for schedule(static)")  /* SwiGLU, each row quantised for the down product */
            for (int64_t r = 0; r < routed; r++) {
                for (int64_t i = 0; i < I; i++) {
                    const float g = round_dt(dt, r13[r * 2 * I + i]), u = round_dt(dt, r13[r * 2 * I + I + i]);
                    if (dt == 1)
                        ((uint16_t *)act)[r * I + i] = f32_to_bf16(bf16_to_f32(silu_bf16[f32_to_bf16(g)]) * u);
                    else
                        ((float *)act)[r * I + i] = g / (1.0f + expf(-g)) * u;
                }
                gguf_quantize_row(dt, act + r * I * es, I, aq + r * I, ad4 + r * (I / 4), as16 + r * (I / 16));
            }
            _Pragma("omp for schedule(dynamic, 1)")  /* down */
            for (int64_t w = 0; w < n2; w++) {
                const int64_t e = task2[3 * w], a = task2[3 * w + 1], c = task2[3 * w + 2];
                const int64_t n = cnt[e + 1] - a < MOE_ROWS ? cnt[e + 1] - a : MOE_ROWS;
                const int64_t c1 = c + cols2 < H ? c + cols2 : H;
                moe_rows(&w2[e], I, aq + a * I, ad4 + a * (I / 4), as16 + a * (I / 16), n, c, c1, y + a * H, H, dt);
                for (int64_t r = 0; r < n; r++)
                    for (int64_t h = c; h < c1; h++) y[(a + r) * H + h] = round_dt(dt, y[(a + r) * H + h]);
            }
            /* per token: its experts' outputs weighted and summed in ascending expert id, rounded
             * as index_add_ into a zero output of type dt rounds */
            _Pragma("omp for schedule(static)")
            for (int64_t t = 0; t < nb; t++) {
                int64_t order[64], row[64];
                int64_t m = 0;
                for (int64_t j = 0; j < k; j++) {
                    const int64_t e = ids[(t0 + t) * k + j];
                    if (e < 0 || e >= E) continue;
                    /* this slot's routed row: its place among expert e's pairs (tokens in order) */
                    int64_t lo = cnt[e], hi = cnt[e + 1];
                    const int64_t want = t * k + j;
                    while (lo < hi) {
                        const int64_t mid = (lo + hi) / 2;
                        if (pair[mid] < want) lo = mid + 1; else hi = mid;
                    }
                    int64_t at = m++;
                    while (at > 0 && ids[(t0 + t) * k + order[at - 1]] > e) {
                        order[at] = order[at - 1];
                        row[at] = row[at - 1];
                        at--;
                    }
                    order[at] = j;
                    row[at] = lo;
                }
                for (int64_t h = 0; h < H; h++) {
                    float acc = 0.0f;
                    for (int64_t i = 0; i < m; i++) {
                        const float wv = round_dt(dt, wts[(t0 + t) * k + order[i]]);
                        acc = round_dt(dt, acc + round_dt(dt, y[row[i] * H + h] * wv));
                    }
                    store(dt, out, (t0 + t) * H + h, acc);
                }
            }
        }
    }
    free(xq); free(gq); free(aq); free(d4); free(s16); free(gd4); free(gs16); free(ad4); free(as16);
    free(r13); free(y); free(act); free(cnt); free(fill); free(pair); free(task); free(task2);
    return failed ? -1 : 0;
}
