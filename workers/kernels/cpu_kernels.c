/* C kernels for the CPU backend (built at first use by cpu_kernels.py). Six families:
 *   1. paged attention: paged_write (the cache write), paged_decode (decodes), paged_prefill
 *      (prompt chunks, AVX-512 builds): workers/attention/cpu.py;
 *   2. RMSNorm (rms_norm) and 3. rotary embedding (rope_inplace, in place): workers/backends/cpu_fused.py;
 *   4. linear products over weights in the 16-channel layout (linear_rows; int8_unpack_t, the
 *      int8 weight dequantised for oneDNN): workers/backends/int8.py, layout in workers/kernels/cpu_layout.py;
 *   5. the fused decode step (decode_layers: embedding, every layer, the final norm in one
 *      OpenMP region, built from the four above): workers/backends/cpu_decode.py;
 *   6. the gated delta rule's recurrent step (gdn_recurrent, Qwen3-Next / Qwen3.5 decodes):
 *      workers/backends/cpu_deltanet.py.
 *
 * The portable torch path must copy every decoding sequence's KV blocks into a scratch tensor
 * (twice per layer) before its batched matmuls can run, and pays ~15 op dispatches per layer;
 * at small batches that is most of the attention time. These kernels read the cache in place
 * through the block tables, one pass with an online softmax (flash-decoding style), in fp32.
 *
 * Layouts (as workers/attention/paged.py):
 *   cache  [num_blocks, n_kv_heads, block_size, head_dim]   element type T (fp32, bf16 or fp16)
 *   q      [B, n_heads, head_dim] T;  out [B, n_heads, head_dim] T
 *   tables [B, max_blocks] int64;     pos [B] int64 (position of the query = context length - 1)
 * A query at position p sees keys lo..p with lo = max(0, p - window + 1) (window <= 0: no window).
 * The G = n_heads / n_kv_heads query heads of a KV head share each key/value row load.
 *
 * OpenMP: the library is linked against the libgomp that torch loaded, so it shares torch's
 * thread pool and thread count (torch.set_num_threads).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* fp16 needs the compiler's _Float16 (GCC >= 12 / clang on x86-64, aarch64); without it the
 * fp16 entry points return -1 and the Python side keeps torch for fp16 models. */
#ifdef __FLT16_MAX__
#define HAVE_F16 1
typedef _Float16 f16_t;
#else
#define HAVE_F16 0
typedef uint16_t f16_t; /* placeholder, never read as a number */
#endif

int kernels_have_f16(void) { return HAVE_F16; }

/* Whether the decode attention uses its items specialised by shape, and the vector chunk maximum,
 * where they apply (AVX-512 builds). Off, it computes as before them (the generic item, a scalar
 * maximum), so tests can compare the two bit for bit. Returns the previous setting; on < 0 only
 * asks. Atomic: a step may be running on other threads. */
static int decode16c_on = 1;
int kernels_decode_specialised(int on) {
    return on >= 0 ? __atomic_exchange_n(&decode16c_on, on ? 1 : 0, __ATOMIC_RELAXED)
                   : __atomic_load_n(&decode16c_on, __ATOMIC_RELAXED);
}

static inline int decode16c_enabled(void) { return __atomic_load_n(&decode16c_on, __ATOMIC_RELAXED); }

/* Instruction sets this build may use (MINDIE_CPU_ISA=avx2 takes AVX-512 out). */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
/* masked 16-bit loads and stores (every AVX-512 CPU but Xeon Phi) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512BW 1
#else
#define HAVE_AVX512BW 0
#endif
/* AVX2 + FMA without AVX-512 (AMD Zen 1-3, Intel Haswell to Comet Lake; cpuTuning.isa avx2 on
 * any CPU): 8-lane versions of the decode and prefill attention and of the decode step's
 * products. AVX-512 builds take their 16-lane code instead; other CPUs the portable loops. */
#if !HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
/* bf16 weights widened in registers for fp32 FMAs (the 8-lane bf16_rows8 and register tiles), on
 * CPUs without a native bf16 dot product: AVX2 builds, and AVX-512 builds without avx512_bf16
 * (Skylake-SP to Ice Lake, cpuTuning.isa avx512 on any AVX-512 CPU), whose bf16 products would
 * otherwise take the portable loops and whose fp32 models would otherwise read fp32 copies */
#if HAVE_AVX2 || (HAVE_AVX512 && !HAVE_DPBF16 && defined(__AVX2__) && defined(__FMA__))
#define HAVE_W16 1
#else
#define HAVE_W16 0
#endif
/* AMX-BF16 tiles (Intel Sapphire Rapids and later, -march=native on such a CPU): the decode
 * step's bf16 products from AMX_ROWS rows, where the AVX512-BF16 dot products are compute bound */
#if HAVE_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define MAX_D 256
#define MAX_G 16
#define CHUNK 128
#define PF_ROWS 32 /* how far ahead the decode items prefetch cached rows (they come from memory) */

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v = { (uint32_t)x << 16 };
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* quiet NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(v.u >> 16);
}

/* Element access by type code (0 fp32, 1 bf16, 2 fp16). The kernels pass the code as a
 * compile-time constant (always_inline + a switch at the call), so every element type gets its
 * own branch-free, vectorised loops. */
#define INLINE static inline __attribute__((always_inline))

INLINE float load_one(int dtype, const void *p, int64_t i) {
    if (dtype == 1) return bf16_to_f32(((const uint16_t *)p)[i]);
#if HAVE_F16
    if (dtype == 2) return (float)((const f16_t *)p)[i];
#endif
    return ((const float *)p)[i];
}

INLINE void store_one(int dtype, void *p, int64_t i, float v) {
    if (dtype == 1) ((uint16_t *)p)[i] = f32_to_bf16(v);
#if HAVE_F16
    else if (dtype == 2) ((f16_t *)p)[i] = (f16_t)v;
#endif
    else ((float *)p)[i] = v;
}

INLINE float round_to(int dtype, float x) {
    if (dtype == 1) return bf16_to_f32(f32_to_bf16(x));
#if HAVE_F16
    if (dtype == 2) return (float)(f16_t)x;
#endif
    return x;
}

/* ---- Soft-capped scores (Gemma 2's attn_logit_softcapping): s becomes cap * tanh(s / cap) ----
 * tanh as a rational function of degree 13/6 on x clamped to +-7.905 (Eigen's fast float tanh:
 * within 4e-7 of tanh everywhere, x itself below 4e-4), the same terms in every instruction set.
 * cap <= 0: no capping. Callers cap only the scores of keys a query sees (a masked -inf stays so). */
#define TANH_CLAMP 7.90531110763549805f
#define TANH_A13 -2.76076847742355e-16f
#define TANH_A11 2.00018790482477e-13f
#define TANH_A9 -8.60467152213735e-11f
#define TANH_A7 5.12229709037114e-08f
#define TANH_A5 1.48572235717979e-05f
#define TANH_A3 6.37261928875436e-04f
#define TANH_A1 4.89352455891786e-03f
#define TANH_B6 1.19825839466702e-06f
#define TANH_B4 1.18534705686654e-04f
#define TANH_B2 2.26843463243900e-03f
#define TANH_B0 4.89352518554385e-03f

/* tanh's numerator (times x) and denominator in x2 = x * x, with the type's fma and set1: the
 * scalar, 16- and 8-lane tanh share the terms */
#define TANH_TERMS(fma, set1, x2, p, q) do { \
        p = fma(set1(TANH_A13), x2, set1(TANH_A11)); \
        p = fma(p, x2, set1(TANH_A9)); \
        p = fma(p, x2, set1(TANH_A7)); \
        p = fma(p, x2, set1(TANH_A5)); \
        p = fma(p, x2, set1(TANH_A3)); \
        p = fma(p, x2, set1(TANH_A1)); \
        q = fma(set1(TANH_B6), x2, set1(TANH_B4)); \
        q = fma(q, x2, set1(TANH_B2)); \
        q = fma(q, x2, set1(TANH_B0)); \
    } while (0)

INLINE float fma_one(float a, float b, float c) { return a * b + c; }
INLINE float set1_one(float a) { return a; }

INLINE float tanh_one(float x) {
    if (fabsf(x) < 4e-4f) return x;
    const float c = x > TANH_CLAMP ? TANH_CLAMP : (x < -TANH_CLAMP ? -TANH_CLAMP : x), x2 = c * c;
    float p, q;
    TANH_TERMS(fma_one, set1_one, x2, p, q);
    return c * p / q;
}

INLINE float cap_one(float s, float cap) { return cap > 0.0f ? cap * tanh_one(s / cap) : s; }

/* ---- Parts shared by the two decode items (decode_item16, decode_item) ---- */

/* The query heads of KV head kvh in fp32, pre-scaled; running sums and maxima reset. */
INLINE void item_start(int dt, const void *q, int64_t G, int64_t D, float scale, int64_t kvh, float (*qf)[MAX_D],
                       float (*acc)[MAX_D], float *m, float *l) {
    for (int64_t g = 0; g < G; g++) {
        for (int64_t d = 0; d < D; d++) {
            qf[g][d] = load_one(dt, q, (kvh * G + g) * D + d) * scale;
            acc[g][d] = 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
}

/* Ask for the cached rows [from, to) of a chunk (they come from memory: a step reads every layer's
 * cache once), es bytes per element. */
INLINE void prefetch_rows(const void *c, int64_t base, int64_t from, int64_t to, int64_t D, int64_t es) {
    for (int64_t j = from; j < to; j++)
        for (int64_t o = 0; o < D * es; o += 64) __builtin_prefetch((const char *)c + (base + j * D) * es + o);
}

/* The chunk of cached positions from t0 to at most p: within one block, at most CHUNK long. Returns
 * its length; *base is the element offset of its first row in the cache. Its first PF_ROWS K and
 * V rows are prefetched (the items prefetch the rest as they go). */
INLINE int64_t item_chunk(int64_t t0, int64_t p, const int64_t *table, int64_t Hkv, int64_t kvh, int64_t bs,
                          int64_t D, int64_t es, const void *kc, const void *vc, int64_t *base) {
    const int64_t in_blk = t0 % bs;
    int64_t n = bs - in_blk;
    if (n > p + 1 - t0) n = p + 1 - t0;
    if (n > CHUNK) n = CHUNK;
    *base = ((table[t0 / bs] * Hkv + kvh) * bs + in_blk) * D;
    prefetch_rows(kc, *base, 0, n < PF_ROWS ? n : PF_ROWS, D, es);
    prefetch_rows(vc, *base, 0, n < PF_ROWS ? n : PF_ROWS, D, es);
    return n;
}

/* The first position a query at p sees: max(0, p - window + 1), window <= 0 meaning none. */
INLINE int64_t item_first(int64_t p, int64_t window) {
    return window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* Online softmax for one head: the running max after this chunk's scores, rescaling the running
 * sum and accumulator when it grows. */
INLINE float item_rescale(const float *sc, int64_t n, float *m, float *l, float *acc, int64_t D) {
    float mb = *m;
    for (int64_t j = 0; j < n; j++) mb = sc[j] > mb ? sc[j] : mb;
    if (mb > *m) {
        const float corr = expf(*m - mb);  /* 0 on the first chunk: m = -inf */
        *l *= corr;
        for (int64_t d = 0; d < D; d++) acc[d] *= corr;
        *m = mb;
    }
    return mb;
}

/* GPT-OSS's sinks: one logit per query head in the softmax's denominator (it has no value row):
 * the running maximum and sums rescaled as for a chunk of that one score */
INLINE void item_sink(float sink, float *m, float *l, float *acc, int64_t D) {
    if (sink > *m) {
        const float corr = expf(*m - sink);
        *l *= corr;
        for (int64_t d = 0; d < D; d++) acc[d] *= corr;
        *m = sink;
    }
    *l += expf(sink - *m);
}

/* The G heads of KV head kvh: their sinks (when given) joined, their outputs written */
INLINE void item_finish(int dt, void *out, int64_t G, int64_t D, int64_t kvh, float (*acc)[MAX_D], float *m, float *l,
                        const float *sinks) {
    if (sinks != NULL)
        for (int64_t g = 0; g < G; g++) item_sink(sinks[kvh * G + g], &m[g], &l[g], acc[g], D);
    for (int64_t g = 0; g < G; g++) {
        const float inv = 1.0f / l[g];
        for (int64_t d = 0; d < D; d++) store_one(dt, out, (kvh * G + g) * D + d, acc[g][d] * inv);
    }
}

#if HAVE_AVX512
/* The first min(left, 16) lanes */
INLINE __mmask16 lanes16(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

/* 16 elements of type dt (fp32 or bf16) at p + i, as fp32 */
INLINE __m512 load16(int dt, const void *p, int64_t i) {
    if (dt == 1)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

/* lane j = the sum of the 16 lanes of v[j]: 16 horizontal sums in 45 instructions, not 16 x 8 */
INLINE __m512 sum16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

/* e^x for x <= 0 (softmax terms): Cephes' expf polynomial (within 2 ulp of expf), scaled by 2^n
 * with scalef, so very negative x give 0 as expf does. */
INLINE __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* tanh_one in 16 lanes */
INLINE __m512 tanh16(__m512 x) {
    const __m512 c = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-TANH_CLAMP)), _mm512_set1_ps(TANH_CLAMP));
    const __m512 x2 = _mm512_mul_ps(c, c);
    __m512 p, q;
    TANH_TERMS(_mm512_fmadd_ps, _mm512_set1_ps, x2, p, q);
    const __m512 t = _mm512_div_ps(_mm512_mul_ps(c, p), q);
    const __mmask16 small = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(4e-4f), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(small, t, x);
}

/* cap_one in 16 lanes */
INLINE __m512 cap16(__m512 s, float cap) {
    if (cap <= 0.0f) return s;
    const __m512 c = _mm512_set1_ps(cap);
    return _mm512_mul_ps(c, tanh16(_mm512_div_ps(s, c)));
}

/* item_rescale with the maximum taken 16 scores at a time (the same value: a maximum has no
 * rounding, and a NaN score is skipped as the scalar compare skips it) */
INLINE float item_rescale16(const float *sc, int64_t n, float *m, float *l, float *acc, int64_t D) {
    __m512 mx = _mm512_set1_ps(*m);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = lanes16(n - j);
        /* max_ps returns its second operand when either is NaN: a NaN score leaves mx as it was */
        mx = _mm512_mask_max_ps(mx, k, _mm512_maskz_loadu_ps(k, sc + j), mx);
    }
    const float mb = _mm512_reduce_max_ps(mx);
    if (mb > *m) {
        const float corr = expf(*m - mb);  /* 0 on the first chunk: m = -inf */
        *l *= corr;
        for (int64_t d = 0; d < D; d++) acc[d] *= corr;
        *m = mb;
    }
    return mb;
}

/* One chunk's online-softmax step for one head: the running maximum and sums updated
 * (item_rescale16), the scores replaced by their exponentials, whose sum joins the running one */
INLINE void chunk_softmax16(float *sc, int64_t n, float cap, float *m, float *l, float *acc, int64_t D) {
    if (cap > 0.0f)
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = lanes16(n - j);
            _mm512_mask_storeu_ps(sc + j, k, cap16(_mm512_maskz_loadu_ps(k, sc + j), cap));
        }
    const float mb = decode16c_enabled() ? item_rescale16(sc, n, m, l, acc, D) : item_rescale(sc, n, m, l, acc, D);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = lanes16(n - j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + j), _mm512_set1_ps(mb)));
        _mm512_mask_storeu_ps(sc + j, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    *l += _mm512_reduce_add_ps(sum);
}

/* decode_item for fp32/bf16 caches and D a multiple of 16 with AVX-512: each group of 16 cached
 * rows is converted to fp32 once for all G query heads, its 16 scores per head are summed
 * together (sum16), and the softmax terms take a vector exp. Values accumulate in the same order
 * as decode_item. */
INLINE void decode_item16(int dt, const void *q, const void *kc, const void *vc, const int64_t *table, int64_t p,
                          int64_t H, int64_t Hkv, int64_t bs, int64_t D, int64_t window, float scale, float cap, const float *sinks, int64_t kvh,
                          void *out) {
    const int64_t G = H / Hkv, DV = D / 16, es = dt == 0 ? 4 : 2;
    float qf[MAX_G][MAX_D] __attribute__((aligned(64))), acc[MAX_G][MAX_D] __attribute__((aligned(64)));
    float rows[16][MAX_D] __attribute__((aligned(64))), m[MAX_G], l[MAX_G], sc[MAX_G][CHUNK];
    item_start(dt, q, G, D, scale, kvh, qf, acc, m, l);
    for (int64_t t0 = item_first(p, window), base, n; t0 <= p; t0 += n) {
        n = item_chunk(t0, p, table, Hkv, kvh, bs, D, es, kc, vc, &base);
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t jn = n - j0 < 16 ? n - j0 : 16;
            prefetch_rows(kc, base, j0 + PF_ROWS, n < j0 + PF_ROWS + 16 ? n : j0 + PF_ROWS + 16, D, es);
            for (int64_t j = 0; j < jn; j++)
                for (int64_t v = 0; v < DV; v++) _mm512_store_ps(rows[j] + v * 16, load16(dt, kc, base + (j0 + j) * D + v * 16));
            for (int64_t g = 0; g < G; g++) {
                __m512 s[16];
                for (int64_t j = 0; j < 16; j++) {
                    __m512 a = _mm512_setzero_ps();
                    if (j < jn)
                        for (int64_t v = 0; v < DV; v++)
                            a = _mm512_fmadd_ps(_mm512_load_ps(qf[g] + v * 16), _mm512_load_ps(rows[j] + v * 16), a);
                    s[j] = a;
                }
                _mm512_storeu_ps(sc[g] + j0, sum16(s)); /* CHUNK is a multiple of 16: in bounds */
            }
        }
        for (int64_t g = 0; g < G; g++) chunk_softmax16(sc[g], n, cap, &m[g], &l[g], acc[g], D);
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t jn = n - j0 < 16 ? n - j0 : 16;
            prefetch_rows(vc, base, j0 + PF_ROWS, n < j0 + PF_ROWS + 16 ? n : j0 + PF_ROWS + 16, D, es);
            for (int64_t j = 0; j < jn; j++)
                for (int64_t v = 0; v < DV; v++) _mm512_store_ps(rows[j] + v * 16, load16(dt, vc, base + (j0 + j) * D + v * 16));
            for (int64_t g = 0; g < G; g++)
                for (int64_t v = 0; v < DV; v++) {
                    __m512 a = _mm512_load_ps(acc[g] + v * 16);
                    for (int64_t j = 0; j < jn; j++)
                        a = _mm512_fmadd_ps(_mm512_set1_ps(sc[g][j0 + j]), _mm512_load_ps(rows[j] + v * 16), a);
                    _mm512_store_ps(acc[g] + v * 16, a);
                }
        }
    }
    item_finish(dt, out, G, D, kvh, acc, m, l, sinks);
}


/* decode_item16 with G query heads per KV head and DV vectors per head known at compile time
 * (the common shapes, through decode_item16_by): the pre-scaled queries and the value sums are
 * held in local vectors (registers for the small shapes, G x DV <= 16), each cached row is
 * converted once and used from there (decode_item16 stores it to the stack and loads it back per
 * head). Every sum is formed in the same order as in decode_item16, so the results are the same
 * bits. The vectors are sized for the largest shape compiled (C16_G heads, C16_D head size). */
#define C16_G 8
#define C16_D 128
INLINE void decode_item16c(int dt, const void *q, const void *kc, const void *vc, const int64_t *table, int64_t p,
                           int64_t Hkv, int64_t bs, int64_t window, float scale, float cap, const float *sinks, int64_t kvh, void *out,
                           const int G, const int DV) {
    const int64_t D = DV * 16, es = dt == 0 ? 4 : 2;
    float acc[C16_G][MAX_D] __attribute__((aligned(64)));  /* rows as item_finish takes them */
    float m[C16_G], l[C16_G], sc[C16_G][CHUNK];
    __m512 qv[C16_G][C16_D / 16];  /* item_start's pre-scaled queries */
    for (int g = 0; g < G; g++) {
        for (int v = 0; v < DV; v++) {
            qv[g][v] = _mm512_mul_ps(load16(dt, q, (kvh * G + g) * D + v * 16), _mm512_set1_ps(scale));
            _mm512_store_ps(acc[g] + v * 16, _mm512_setzero_ps());
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int64_t t0 = item_first(p, window), base, n; t0 <= p; t0 += n) {
        n = item_chunk(t0, p, table, Hkv, kvh, bs, D, es, kc, vc, &base);
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t jn = n - j0 < 16 ? n - j0 : 16;
            prefetch_rows(kc, base, j0 + PF_ROWS, n < j0 + PF_ROWS + 16 ? n : j0 + PF_ROWS + 16, D, es);
            __m512 s[C16_G][16];
            for (int j = 0; j < 16; j++) {
                if (j < jn) {
                    __m512 kr[C16_D / 16];
                    for (int v = 0; v < DV; v++) kr[v] = load16(dt, kc, base + (j0 + j) * D + v * 16);
                    for (int g = 0; g < G; g++) {
                        __m512 a = _mm512_setzero_ps();
                        for (int v = 0; v < DV; v++) a = _mm512_fmadd_ps(qv[g][v], kr[v], a);
                        s[g][j] = a;
                    }
                } else {
                    for (int g = 0; g < G; g++) s[g][j] = _mm512_setzero_ps();
                }
            }
            for (int g = 0; g < G; g++) _mm512_storeu_ps(sc[g] + j0, sum16(s[g]));
        }
        for (int g = 0; g < G; g++) chunk_softmax16(sc[g], n, cap, &m[g], &l[g], acc[g], D);
        __m512 av[C16_G][C16_D / 16];
        for (int g = 0; g < G; g++)
            for (int v = 0; v < DV; v++) av[g][v] = _mm512_load_ps(acc[g] + v * 16);
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t jn = n - j0 < 16 ? n - j0 : 16;
            prefetch_rows(vc, base, j0 + PF_ROWS, n < j0 + PF_ROWS + 16 ? n : j0 + PF_ROWS + 16, D, es);
            for (int64_t j = 0; j < jn; j++) {
                __m512 pg[C16_G];
                for (int g = 0; g < G; g++) pg[g] = _mm512_set1_ps(sc[g][j0 + j]);
                for (int v = 0; v < DV; v++) {
                    const __m512 vr = load16(dt, vc, base + (j0 + j) * D + v * 16);
                    for (int g = 0; g < G; g++) av[g][v] = _mm512_fmadd_ps(pg[g], vr, av[g][v]);
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int v = 0; v < DV; v++) _mm512_store_ps(acc[g] + v * 16, av[g][v]);
    }
    item_finish(dt, out, G, D, kvh, acc, m, l, sinks);
}

/* The shapes decode_item16c is compiled for: (query heads per KV head, head size) */
#define DEC16C_SHAPES(X) X(1, 4) X(2, 4) X(4, 4) X(8, 4) X(1, 8) X(2, 8) X(4, 8)

/* One function per shape, not inlined: each has its own stack frame, and only one is live */
#define DEC16C_FN(g_, dv_) \
    static __attribute__((noinline)) void decode16c_##g_##_##dv_(int dt, const void *q, const void *kc, \
            const void *vc, const int64_t *table, int64_t p, int64_t Hkv, int64_t bs, int64_t window, float scale, float cap, const float *sinks, \
            int64_t kvh, void *out) { \
        if (dt == 0) decode_item16c(0, q, kc, vc, table, p, Hkv, bs, window, scale, cap, sinks, kvh, out, g_, dv_); \
        else decode_item16c(1, q, kc, vc, table, p, Hkv, bs, window, scale, cap, sinks, kvh, out, g_, dv_); \
    }
DEC16C_SHAPES(DEC16C_FN)
#undef DEC16C_FN

/* decode_item16c for the shapes it is compiled for (when switched on); 0 for any other */
INLINE int decode_item16_by(int dt, const void *q, const void *kc, const void *vc, const int64_t *table, int64_t p,
                            int64_t H, int64_t Hkv, int64_t bs, int64_t D, int64_t window, float scale, float cap, const float *sinks, int64_t kvh,
                            void *out) {
    const int64_t G = H / Hkv;
    if (!decode16c_enabled()) return 0;
#define DEC16C_CALL(g_, dv_) \
    if (G == g_ && D == dv_ * 16) { \
        decode16c_##g_##_##dv_(dt, q, kc, vc, table, p, Hkv, bs, window, scale, cap, sinks, kvh, out); \
        return 1; \
    }
    DEC16C_SHAPES(DEC16C_CALL)
#undef DEC16C_CALL
    return 0;
}
#endif

#if HAVE_AVX2
/* ---- AVX2 + FMA attention (8 lanes): decode_item8 and prefill_tile8 follow decode_item16 and
 * prefill_tile16 step for step (same chunks, same online softmax in fp32) ---- */

/* 8 elements of type dt (fp32 or bf16) at p + i, as fp32 */
INLINE __m256 load8(int dt, const void *p, int64_t i) {
    if (dt == 1)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

/* lane j = the sum of the 8 lanes of v[j] */
INLINE __m256 sum8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

INLINE float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* e^x for x <= 0: exp16's polynomial; 2^n built in the exponent bits, so x is clamped at -87
 * (e^-87 ~ 1.6e-38 where expf gives a denormal or 0: nothing beside the chunk maximum's e^0 = 1) */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* tanh_one in 8 lanes */
INLINE __m256 tanh8(__m256 x) {
    const __m256 c = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-TANH_CLAMP)), _mm256_set1_ps(TANH_CLAMP));
    const __m256 x2 = _mm256_mul_ps(c, c);
    __m256 p, q;
    TANH_TERMS(_mm256_fmadd_ps, _mm256_set1_ps, x2, p, q);
    const __m256 t = _mm256_div_ps(_mm256_mul_ps(c, p), q);
    const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    return _mm256_blendv_ps(t, x, _mm256_cmp_ps(ax, _mm256_set1_ps(4e-4f), _CMP_LT_OQ));
}

/* cap_one in 8 lanes */
INLINE __m256 cap8(__m256 s, float cap) {
    if (cap <= 0.0f) return s;
    const __m256 c = _mm256_set1_ps(cap);
    return _mm256_mul_ps(c, tanh8(_mm256_div_ps(s, c)));
}

/* lanes ja <= lane < jb all ones */
INLINE __m256 lanes8(int64_t ja, int64_t jb) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32((int)ja - 1)),
                                                _mm256_cmpgt_epi32(_mm256_set1_epi32((int)jb), idx)));
}

/* chunk_softmax16 in 8 lanes: maximum (a NaN score skipped, as the scalar compare skips it),
 * rescale, exponentials in place and their sum. sc holds n scores, padded to a multiple of 8. */
INLINE void chunk_softmax8(float *sc, int64_t n, float cap, float *m, float *l, float *acc, int64_t D) {
    int64_t j = 0;
    if (cap > 0.0f) {
        for (; j + 8 <= n; j += 8) _mm256_storeu_ps(sc + j, cap8(_mm256_loadu_ps(sc + j), cap));
        for (; j < n; j++) sc[j] = cap_one(sc[j], cap);
        j = 0;
    }
    __m256 mx = _mm256_set1_ps(*m);
    for (; j + 8 <= n; j += 8) mx = _mm256_max_ps(_mm256_loadu_ps(sc + j), mx);
    float mb = hmax8(mx);
    for (; j < n; j++) mb = sc[j] > mb ? sc[j] : mb;
    if (mb > *m) {
        const float corr = expf(*m - mb);  /* 0 on the first chunk: m = -inf */
        *l *= corr;
        for (int64_t d = 0; d < D; d++) acc[d] *= corr;
        *m = mb;
    }
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j < n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), _mm256_set1_ps(mb)));
        if (n - j < 8) e = _mm256_and_ps(e, lanes8(0, n - j));
        _mm256_storeu_ps(sc + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    *l += hsum8(sum);
}

/* decode_item for fp32/bf16 caches and D a multiple of 8: each group of 8 cached rows is
 * converted to fp32 once for all G query heads, its 8 scores per head summed together (sum8),
 * the softmax terms take a vector exp. */
INLINE void decode_item8(int dt, const void *q, const void *kc, const void *vc, const int64_t *table, int64_t p,
                         int64_t H, int64_t Hkv, int64_t bs, int64_t D, int64_t window, float scale, float cap, const float *sinks, int64_t kvh,
                         void *out) {
    const int64_t G = H / Hkv, DV = D / 8, es = dt == 0 ? 4 : 2;
    float qf[MAX_G][MAX_D] __attribute__((aligned(32))), acc[MAX_G][MAX_D] __attribute__((aligned(32)));
    float rows[8][MAX_D] __attribute__((aligned(32))), m[MAX_G], l[MAX_G];
    float sc[MAX_G][CHUNK] __attribute__((aligned(32)));
    item_start(dt, q, G, D, scale, kvh, qf, acc, m, l);
    for (int64_t t0 = item_first(p, window), base, n; t0 <= p; t0 += n) {
        n = item_chunk(t0, p, table, Hkv, kvh, bs, D, es, kc, vc, &base);
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            const int64_t jn = n - j0 < 8 ? n - j0 : 8;
            prefetch_rows(kc, base, j0 + PF_ROWS, n < j0 + PF_ROWS + 8 ? n : j0 + PF_ROWS + 8, D, es);
            for (int64_t j = 0; j < jn; j++)
                for (int64_t v = 0; v < DV; v++) _mm256_store_ps(rows[j] + v * 8, load8(dt, kc, base + (j0 + j) * D + v * 8));
            for (int64_t g = 0; g < G; g++) {
                __m256 s[8];
                for (int64_t j = 0; j < 8; j++) {
                    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                    if (j < jn) {
                        int64_t v = 0;
                        for (; v + 2 <= DV; v += 2) {
                            a0 = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + v * 8), _mm256_load_ps(rows[j] + v * 8), a0);
                            a1 = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + v * 8 + 8), _mm256_load_ps(rows[j] + v * 8 + 8), a1);
                        }
                        if (v < DV) a0 = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + v * 8), _mm256_load_ps(rows[j] + v * 8), a0);
                    }
                    s[j] = _mm256_add_ps(a0, a1);
                }
                _mm256_store_ps(sc[g] + j0, sum8(s)); /* CHUNK is a multiple of 8: in bounds */
            }
        }
        for (int64_t g = 0; g < G; g++) chunk_softmax8(sc[g], n, cap, &m[g], &l[g], acc[g], D);
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            const int64_t jn = n - j0 < 8 ? n - j0 : 8;
            prefetch_rows(vc, base, j0 + PF_ROWS, n < j0 + PF_ROWS + 8 ? n : j0 + PF_ROWS + 8, D, es);
            for (int64_t j = 0; j < jn; j++)
                for (int64_t v = 0; v < DV; v++) _mm256_store_ps(rows[j] + v * 8, load8(dt, vc, base + (j0 + j) * D + v * 8));
            for (int64_t g = 0; g < G; g++)
                for (int64_t v = 0; v < DV; v++) {
                    __m256 a = _mm256_load_ps(acc[g] + v * 8);
                    for (int64_t j = 0; j < jn; j++)
                        a = _mm256_fmadd_ps(_mm256_set1_ps(sc[g][j0 + j]), _mm256_load_ps(rows[j] + v * 8), a);
                    _mm256_store_ps(acc[g] + v * 8, a);
                }
        }
    }
    item_finish(dt, out, G, D, kvh, acc, m, l, sinks);
}
#endif

/* One (sequence, kv head) work item, over chunks of up to CHUNK cached positions of one block:
 * scores of the chunk for the G query heads, one rescale of the running sums per chunk, then the
 * value rows. Cached rows are read in place and converted to fp32 inside the loops. */
INLINE void decode_item(int dt, const void *q, const void *kc, const void *vc, const int64_t *table, int64_t p,
                        int64_t H, int64_t Hkv, int64_t bs, int64_t D, int64_t window, float scale, float cap, const float *sinks, int64_t kvh,
                        void *out) {
#if HAVE_AVX512
    if ((dt == 0 || dt == 1) && D % 16 == 0) {
        if (!decode_item16_by(dt, q, kc, vc, table, p, H, Hkv, bs, D, window, scale, cap, sinks, kvh, out))
            decode_item16(dt, q, kc, vc, table, p, H, Hkv, bs, D, window, scale, cap, sinks, kvh, out);
        return;
    }
#endif
#if HAVE_AVX2
    if ((dt == 0 || dt == 1) && D % 8 == 0) {
        decode_item8(dt, q, kc, vc, table, p, H, Hkv, bs, D, window, scale, cap, sinks, kvh, out);
        return;
    }
#endif
    const int64_t G = H / Hkv, es = dt == 0 ? 4 : 2;
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G], sc[MAX_G][CHUNK];
    item_start(dt, q, G, D, scale, kvh, qf, acc, m, l);
    for (int64_t t0 = item_first(p, window), base, n; t0 <= p; t0 += n) {
        n = item_chunk(t0, p, table, Hkv, kvh, bs, D, es, kc, vc, &base);
        for (int64_t j = 0; j < n; j++) {
            const int64_t r = base + j * D;
            if (j + PF_ROWS < n) prefetch_rows(kc, base, j + PF_ROWS, j + PF_ROWS + 1, D, es);
            for (int64_t g = 0; g < G; g++) {
                float dot = 0.0f;
                for (int64_t d = 0; d < D; d++) dot += qf[g][d] * load_one(dt, kc, r + d);
                sc[g][j] = dot;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            if (cap > 0.0f)
                for (int64_t j = 0; j < n; j++) sc[g][j] = cap_one(sc[g][j], cap);
            const float mb = item_rescale(sc[g], n, &m[g], &l[g], acc[g], D);
            float sum = 0.0f;
            _Pragma("omp simd reduction(+:sum)")
            for (int64_t j = 0; j < n; j++) { sc[g][j] = expf(sc[g][j] - mb); sum += sc[g][j]; }
            l[g] += sum;
        }
        for (int64_t j = 0; j < n; j++) {
            const int64_t r = base + j * D;
            if (j + PF_ROWS < n) prefetch_rows(vc, base, j + PF_ROWS, j + PF_ROWS + 1, D, es);
            for (int64_t g = 0; g < G; g++) {
                const float e = sc[g][j];
                for (int64_t d = 0; d < D; d++) acc[g][d] += e * load_one(dt, vc, r + d);
            }
        }
    }
    item_finish(dt, out, G, D, kvh, acc, m, l, sinks);
}

/* 1 when decode items of this dtype and shape take decode_item16c (AVX-512 builds, switched on) */
int kernels_decode_specialised_for(int dtype, int64_t H, int64_t Hkv, int64_t D) {
#if HAVE_AVX512
    if (dtype < 0 || dtype > 1 || Hkv <= 0 || H % Hkv || !decode16c_enabled()) return 0;
    const int64_t G = H / Hkv;
#define DEC16C_HAS(g_, dv_) if (G == g_ && D == dv_ * 16) return 1;
    DEC16C_SHAPES(DEC16C_HAS)
#undef DEC16C_HAS
#endif
    return 0;
}

/* dtype: 0 fp32, 1 bf16, 2 fp16; scale: the softmax scale; cap: scores soft-capped (cap_one; 0:
 * none); sinks: [H] fp32 logits in the softmax's denominators (item_sink), or NULL. Returns 0, or -1
 * when a dimension exceeds the static buffers. */
int paged_decode(int dtype, const void *q, const void *kc, const void *vc, const int64_t *tables,
                 int64_t max_blocks, const int64_t *pos, int64_t B, int64_t H, int64_t Hkv, int64_t bs,
                 int64_t D, int64_t window, float scale, float cap, const float *sinks, void *out) {
    if (D > MAX_D || Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_G || dtype < 0 || dtype > 2
        || (dtype == 2 && !HAVE_F16))
        return -1;
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += pos[b] + 1;
    _Pragma("omp parallel for schedule(dynamic, 1) if (work * Hkv * D > 65536)")
    for (int64_t i = 0; i < B * Hkv; i++) {
        const int64_t b = i / Hkv, kvh = i % Hkv;
        const void *qb = (const char *)q + b * H * D * (dtype == 0 ? 4 : 2);
        void *ob = (char *)out + b * H * D * (dtype == 0 ? 4 : 2);
        const int64_t *table = tables + b * max_blocks;
        switch (dtype) {
        case 0: decode_item(0, qb, kc, vc, table, pos[b], H, Hkv, bs, D, window, scale, cap, sinks, kvh, ob); break;
        case 1: decode_item(1, qb, kc, vc, table, pos[b], H, Hkv, bs, D, window, scale, cap, sinks, kvh, ob); break;
        default: decode_item(2, qb, kc, vc, table, pos[b], H, Hkv, bs, D, window, scale, cap, sinks, kvh, ob); break;
        }
    }
    return 0;
}

/* ---- Prefill attention: several queries per sequence, read from the cache in place ---- */

#if HAVE_AVX512
#define PRE_ROWS 32 /* (query position, head) rows of one tile: its fp32 queries and sums stay on the stack */

/* The visible keys of a 16-key group starting at cached position t for a query that sees [lo, hi]. */
INLINE __mmask16 visible16(int64_t t, int64_t jn, int64_t lo, int64_t hi) {
    __mmask16 k = lanes16(jn);
    if (hi < t + jn - 1) k &= lanes16(hi - t + 1 < 0 ? 0 : hi - t + 1);
    if (lo > t) k &= (__mmask16)~lanes16(lo - t > 16 ? 16 : lo - t);
    return k;
}

/* One tile: the nq query positions p0 .. p0 + nq - 1 of one sequence, the G heads of KV head kvh.
 * Row r is (position p0 + r / G, head kvh * G + r % G). Each 16-key group is converted to fp32
 * once for all rows; a row skips the groups it cannot see (the causal half, the window); online
 * softmax per row, in fp32, as decode_item16 does for one position. q and out rows are
 * q_stride elements apart. */
INLINE void prefill_tile16(int dt, const void *q, int64_t q_stride, const void *kc, const void *vc,
                           const int64_t *table, int64_t p0, int64_t nq, int64_t H, int64_t Hkv, int64_t bs,
                           int64_t D, int64_t window, float scale, float cap, const float *sinks, int64_t kvh, void *out) {
    const int64_t G = H / Hkv, DV = D / 16, es = dt == 0 ? 4 : 2, R = nq * G;
    float qf[PRE_ROWS][MAX_D] __attribute__((aligned(64))), acc[PRE_ROWS][MAX_D] __attribute__((aligned(64)));
    float rows[16][MAX_D] __attribute__((aligned(64))), sc[PRE_ROWS][CHUNK] __attribute__((aligned(64)));
    float m[PRE_ROWS], l[PRE_ROWS];
    int64_t lo[PRE_ROWS], hi[PRE_ROWS];
    const int scores_dp = HAVE_DPBF16 && dt == 1; /* bf16 scores from the raw queries (qw below), not qf */
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / G, h = kvh * G + r % G;
        hi[r] = p0 + i;
        lo[r] = item_first(hi[r], window);
        for (int64_t d = 0; d < D; d++) {
            if (!scores_dp) qf[r][d] = load_one(dt, q, i * q_stride + h * D + d) * scale;
            acc[r][d] = 0.0f;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
#if HAVE_DPBF16
    /* bf16: the scores as bf16 pair products (vdpbf16ps) of the unscaled queries against the
     * group's keys transposed to [D / 2][16 keys] pairs; scaled after the sum. */
    uint32_t qw[PRE_ROWS][MAX_D / 2] __attribute__((aligned(64))), kt[MAX_D / 2][16] __attribute__((aligned(64)));
    if (scores_dp)
        for (int64_t r = 0; r < R; r++)
            memcpy(qw[r], (const uint16_t *)q + (r / G) * q_stride + (kvh * G + r % G) * D, (size_t)D * 2);
#endif
    const int64_t last = hi[R - 1];
    for (int64_t t0 = lo[0], base, n; t0 <= last; t0 += n) {
        n = item_chunk(t0, last, table, Hkv, kvh, bs, D, es, kc, vc, &base);
        int64_t r0 = 0, r1 = R; /* the rows that see some key of this chunk (positions rise with r) */
        while (r0 < R && hi[r0] < t0) r0++;
        while (r1 > r0 && lo[r1 - 1] > t0 + n - 1) r1--;
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t jn = n - j0 < 16 ? n - j0 : 16, t = t0 + j0;
#if HAVE_DPBF16
            if (scores_dp) {
                const uint32_t *kr = (const uint32_t *)((const uint16_t *)kc + base + j0 * D);
                for (int64_t j = 0; j < 16; j++)
                    for (int64_t w = 0; w < D / 2; w++) kt[w][j] = j < jn ? kr[j * (D / 2) + w] : 0;
                for (int64_t r = r0; r < r1; r++) {
                    const __mmask16 k = visible16(t, jn, lo[r], hi[r]);
                    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
                    if (k)
                        for (int64_t w = 0; w < D / 2; w += 2) {
                            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32((int)qw[r][w]),
                                                  (__m512bh)_mm512_load_si512(kt[w]));
                            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32((int)qw[r][w + 1]),
                                                  (__m512bh)_mm512_load_si512(kt[w + 1]));
                        }
                    _mm512_storeu_ps(sc[r] + j0, _mm512_mask_blend_ps(k, _mm512_set1_ps(-INFINITY),
                                                                      cap16(_mm512_mul_ps(_mm512_add_ps(a0, a1),
                                                                                          _mm512_set1_ps(scale)), cap)));
                }
                continue;
            }
#endif
            for (int64_t j = 0; j < jn; j++)
                for (int64_t v = 0; v < DV; v++) _mm512_store_ps(rows[j] + v * 16, load16(dt, kc, base + (j0 + j) * D + v * 16));
            for (int64_t r = r0; r < r1; r++) {
                const __mmask16 k = visible16(t, jn, lo[r], hi[r]);
                if (!k) {
                    _mm512_storeu_ps(sc[r] + j0, _mm512_set1_ps(-INFINITY));
                    continue;
                }
                __m512 s[16];
                for (int64_t j = 0; j < 16; j++) {
                    __m512 a = _mm512_setzero_ps();
                    if ((k >> j) & 1)
                        for (int64_t v = 0; v < DV; v++)
                            a = _mm512_fmadd_ps(_mm512_load_ps(qf[r] + v * 16), _mm512_load_ps(rows[j] + v * 16), a);
                    s[j] = a;
                }
                _mm512_storeu_ps(sc[r] + j0, _mm512_mask_blend_ps(k, _mm512_set1_ps(-INFINITY), cap16(sum16(s), cap)));
            }
        }
        for (int64_t r = r0; r < r1; r++) {
            const float mb = item_rescale(sc[r], n, &m[r], &l[r], acc[r], D);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; j += 16) {
                const __mmask16 k = visible16(t0 + j, n - j < 16 ? n - j : 16, lo[r], hi[r]);
                const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_loadu_ps(sc[r] + j), _mm512_set1_ps(mb))));
                _mm512_storeu_ps(sc[r] + j, e);
                sum = _mm512_add_ps(sum, e);
            }
            l[r] += _mm512_reduce_add_ps(sum);
        }
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t jn = n - j0 < 16 ? n - j0 : 16, t = t0 + j0;
            for (int64_t j = 0; j < jn; j++)
                for (int64_t v = 0; v < DV; v++) _mm512_store_ps(rows[j] + v * 16, load16(dt, vc, base + (j0 + j) * D + v * 16));
            for (int64_t r = r0; r < r1; r++) {
                int64_t ja = lo[r] - t, jb = hi[r] - t + 1; /* the visible keys of this group */
                if (ja < 0) ja = 0;
                if (jb > jn) jb = jn;
                if (ja >= jb) continue;
                for (int64_t v = 0; v < DV; v++) {
                    __m512 a = _mm512_load_ps(acc[r] + v * 16);
                    for (int64_t j = ja; j < jb; j++)
                        a = _mm512_fmadd_ps(_mm512_set1_ps(sc[r][j0 + j]), _mm512_load_ps(rows[j] + v * 16), a);
                    _mm512_store_ps(acc[r] + v * 16, a);
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / G, h = kvh * G + r % G;
        if (sinks != NULL) item_sink(sinks[h], &m[r], &l[r], acc[r], D);
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) store_one(dt, out, i * q_stride + h * D + d, acc[r][d] * inv);
    }
}
#endif

#if HAVE_AVX2
#define PRE_ROWS 32 /* as in AVX-512 builds */

/* prefill_tile16 in 8 lanes, fp32 FMAs for both element types (AVX2 has no bf16 dot product):
 * each 8-key group converted to fp32 once for all rows; a row skips the groups it cannot see. */
INLINE void prefill_tile8(int dt, const void *q, int64_t q_stride, const void *kc, const void *vc,
                          const int64_t *table, int64_t p0, int64_t nq, int64_t H, int64_t Hkv, int64_t bs,
                          int64_t D, int64_t window, float scale, float cap, const float *sinks, int64_t kvh, void *out) {
    const int64_t G = H / Hkv, DV = D / 8, es = dt == 0 ? 4 : 2, R = nq * G;
    float qf[PRE_ROWS][MAX_D] __attribute__((aligned(32))), acc[PRE_ROWS][MAX_D] __attribute__((aligned(32)));
    float rows[8][MAX_D] __attribute__((aligned(32))), sc[PRE_ROWS][CHUNK] __attribute__((aligned(32)));
    float m[PRE_ROWS], l[PRE_ROWS];
    int64_t lo[PRE_ROWS], hi[PRE_ROWS];
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / G, h = kvh * G + r % G;
        hi[r] = p0 + i;
        lo[r] = item_first(hi[r], window);
        for (int64_t d = 0; d < D; d++) {
            qf[r][d] = load_one(dt, q, i * q_stride + h * D + d) * scale;
            acc[r][d] = 0.0f;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t last = hi[R - 1];
    for (int64_t t0 = lo[0], base, n; t0 <= last; t0 += n) {
        n = item_chunk(t0, last, table, Hkv, kvh, bs, D, es, kc, vc, &base);
        int64_t r0 = 0, r1 = R; /* the rows that see some key of this chunk (positions rise with r) */
        while (r0 < R && hi[r0] < t0) r0++;
        while (r1 > r0 && lo[r1 - 1] > t0 + n - 1) r1--;
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            const int64_t jn = n - j0 < 8 ? n - j0 : 8, t = t0 + j0;
            for (int64_t j = 0; j < jn; j++)
                for (int64_t v = 0; v < DV; v++) _mm256_store_ps(rows[j] + v * 8, load8(dt, kc, base + (j0 + j) * D + v * 8));
            /* two rows at a time against four keys at a time: 8 accumulators, 6 loads per 8 FMAs */
            for (int64_t r = r0; r < r1; r += 2) {
                const int64_t rb = r + 1 < r1 ? r + 1 : r; /* an odd last row pairs with itself */
                int64_t ja[2], jb[2];
                for (int i = 0; i < 2; i++) {
                    const int64_t rr = i ? rb : r;
                    ja[i] = lo[rr] - t < 0 ? 0 : lo[rr] - t;
                    jb[i] = hi[rr] - t + 1 > jn ? jn : hi[rr] - t + 1;
                }
                __m256 s[2][8];
                for (int64_t h = 0; h < 8; h += 4) {
                    __m256 a[2][4];
                    for (int i = 0; i < 2; i++)
                        for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
                    if (h < jb[0] || h < jb[1])
                        for (int64_t v = 0; v < DV; v++) {
                            const __m256 q0 = _mm256_load_ps(qf[r] + v * 8), q1 = _mm256_load_ps(qf[rb] + v * 8);
                            for (int j = 0; j < 4; j++) {
                                const __m256 kv = _mm256_load_ps(rows[h + j] + v * 8);
                                a[0][j] = _mm256_fmadd_ps(q0, kv, a[0][j]);
                                a[1][j] = _mm256_fmadd_ps(q1, kv, a[1][j]);
                            }
                        }
                    for (int i = 0; i < 2; i++)
                        for (int j = 0; j < 4; j++) s[i][h + j] = a[i][j];
                }
                for (int i = 0; i < 2 && r + i < r1; i++) {
                    /* lanes past jn hold stale keys' scores (or NaN from stale rows): masked here */
                    const __m256 vis = ja[i] < jb[i] ? lanes8(ja[i], jb[i]) : _mm256_setzero_ps();
                    _mm256_store_ps(sc[r + i] + j0, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), cap8(sum8(s[i]), cap), vis));
                }
            }
        }
        for (int64_t r = r0; r < r1; r++) {
            const float mb = item_rescale(sc[r], n, &m[r], &l[r], acc[r], D);
            __m256 sum = _mm256_setzero_ps();
            for (int64_t j = 0; j < n; j += 8) {
                const int64_t jn = n - j < 8 ? n - j : 8, t = t0 + j;
                int64_t ja = lo[r] - t, jb = hi[r] - t + 1;
                if (ja < 0) ja = 0;
                if (jb > jn) jb = jn;
                const __m256 e = _mm256_and_ps(lanes8(ja, jb),
                                               exp8(_mm256_sub_ps(_mm256_load_ps(sc[r] + j), _mm256_set1_ps(mb))));
                _mm256_store_ps(sc[r] + j, e);
                sum = _mm256_add_ps(sum, e);
            }
            l[r] += hsum8(sum);
        }
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            const int64_t jn = n - j0 < 8 ? n - j0 : 8, t = t0 + j0;
            for (int64_t j = 0; j < jn; j++)
                for (int64_t v = 0; v < DV; v++) _mm256_store_ps(rows[j] + v * 8, load8(dt, vc, base + (j0 + j) * D + v * 8));
            for (int64_t r = r0; r < r1; r++) {
                int64_t ja = lo[r] - t, jb = hi[r] - t + 1;
                if (ja < 0) ja = 0;
                if (jb > jn) jb = jn;
                if (ja >= jb) continue;
                for (int64_t v = 0; v < DV; v++) {
                    __m256 a = _mm256_load_ps(acc[r] + v * 8);
                    for (int64_t j = ja; j < jb; j++)
                        a = _mm256_fmadd_ps(_mm256_set1_ps(sc[r][j0 + j]), _mm256_load_ps(rows[j] + v * 8), a);
                    _mm256_store_ps(acc[r] + v * 8, a);
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / G, h = kvh * G + r % G;
        if (sinks != NULL) item_sink(sinks[h], &m[r], &l[r], acc[r], D);
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) store_one(dt, out, i * q_stride + h * D + d, acc[r][d] * inv);
    }
}
#define prefill_tile prefill_tile8
#elif HAVE_AVX512
#define prefill_tile prefill_tile16
#endif

/* Attention of prompt chunks: sequence b's nq[b] queries are rows row0[b] .. row0[b] + nq[b] - 1 of
 * q and out ([T, H, D], type dtype), at positions start[b] .. start[b] + nq[b] - 1, and see the
 * cached keys of their sequence up to their own position (this step's keys written first); scale,
 * cap and sinks as paged_decode's. fp32 and bf16 caches with D a multiple of 16, AVX-512 and AVX2
 * builds: returns -1 otherwise (the caller keeps torch's SDPA), before touching anything. */
#if HAVE_AVX512 || HAVE_AVX2
/* paged_prefill's tiles: each sequence's nq[b] queries QT at a time */
static int64_t tile_count(const int64_t *nq, int64_t B, int64_t QT) {
    int64_t tiles = 0;
    for (int64_t b = 0; b < B; b++) tiles += (nq[b] + QT - 1) / QT;
    return tiles;
}

/* The flat list of those tiles: tile i's sequence at [2 i], its first query at [2 i + 1]; NULL when
 * out of memory */
static int64_t *tile_list(const int64_t *nq, int64_t B, int64_t QT, int64_t tiles) {
    int64_t *tile = (int64_t *)malloc((size_t)(tiles > 0 ? tiles : 1) * 2 * sizeof *tile);
    if (tile != NULL)
        for (int64_t b = 0, i = 0; b < B; b++)
            for (int64_t a = 0; a < nq[b]; a += QT, i++) { tile[2 * i] = b; tile[2 * i + 1] = a; }
    return tile;
}
#endif

#if HAVE_AMX
static int prefill_amx(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int64_t *tables,
                       int64_t max_blocks, const int64_t *row0, const int64_t *start, const int64_t *nq, int64_t B,
                       int64_t H, int64_t Hkv, int64_t bs, int64_t D, int64_t window, float scale, uint16_t *out);
#endif

int paged_prefill(int dtype, const void *q, const void *kc, const void *vc, const int64_t *tables,
                  int64_t max_blocks, const int64_t *row0, const int64_t *start, const int64_t *nq, int64_t B,
                  int64_t H, int64_t Hkv, int64_t bs, int64_t D, int64_t window, float scale, float cap,
                  const float *sinks, void *out) {
#if HAVE_AVX512 || HAVE_AVX2
    if (D > MAX_D || D % 16 != 0 || Hkv <= 0 || H % Hkv != 0 || H / Hkv > PRE_ROWS || (dtype != 0 && dtype != 1))
        return -1;
#if HAVE_AMX
    /* the AMX tiles take no soft-capping and no sinks: such chunks take the tiles below */
    if (dtype == 1 && cap <= 0.0f && sinks == NULL
        && prefill_amx((const uint16_t *)q, (const uint16_t *)kc, (const uint16_t *)vc, tables, max_blocks,
                       row0, start, nq, B, H, Hkv, bs, D, window, scale, (uint16_t *)out) == 0)
        return 0;
#endif
    const int64_t G = H / Hkv, QT = PRE_ROWS / G, es = dtype == 0 ? 4 : 2, tiles = tile_count(nq, B, QT);
    int64_t *tile = tile_list(nq, B, QT, tiles);
    if (tile == NULL) return -1;
    _Pragma("omp parallel for schedule(dynamic, 1) if (tiles * Hkv > 1)")
    for (int64_t w = 0; w < tiles * Hkv; w++) {
        const int64_t b = tile[2 * (w / Hkv)], a = tile[2 * (w / Hkv) + 1], kvh = w % Hkv;
        const int64_t n = nq[b] - a < QT ? nq[b] - a : QT;
        const int64_t off = (row0[b] + a) * H * D * es;
        if (dtype == 0)
            prefill_tile(0, (const char *)q + off, H * D, kc, vc, tables + b * max_blocks, start[b] + a, n, H, Hkv,
                           bs, D, window, scale, cap, sinks, kvh, (char *)out + off);
        else
            prefill_tile(1, (const char *)q + off, H * D, kc, vc, tables + b * max_blocks, start[b] + a, n, H, Hkv,
                           bs, D, window, scale, cap, sinks, kvh, (char *)out + off);
    }
    free(tile);
    return 0;
#else
    (void)dtype; (void)q; (void)kc; (void)vc; (void)tables; (void)max_blocks; (void)row0; (void)start; (void)nq;
    (void)B; (void)H; (void)Hkv; (void)bs; (void)D; (void)window; (void)scale; (void)cap; (void)sinks; (void)out;
    return -1;
#endif
}

/* One decode_item for the fused decode step, compiled here (contraction allowed) so that its
 * products round exactly as paged_decode's do. */
static __attribute__((noinline)) void attend_item(int dtype, const void *q, const void *kc, const void *vc,
                                                  const int64_t *table, int64_t p, int64_t H, int64_t Hkv, int64_t bs,
                                                  int64_t D, int64_t window, float scale, float cap, const float *sinks, int64_t kvh, void *out) {
    if (dtype == 0) decode_item(0, q, kc, vc, table, p, H, Hkv, bs, D, window, scale, cap, sinks, kvh, out);
    else decode_item(1, q, kc, vc, table, p, H, Hkv, bs, D, window, scale, cap, sinks, kvh, out);
}

/* Write T new rows into cache[blocks[t], :, offsets[t], :]: token t's [Hkv, D] rows start at
 * k + t * t_stride elements (same element type as the cache). */
void paged_write(int64_t elem_size, const void *k, void *cache, const int64_t *blocks, const int64_t *offsets,
                 int64_t T, int64_t t_stride, int64_t Hkv, int64_t bs, int64_t D) {
    const int64_t row = D * elem_size;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hkv; h++)
            memcpy((char *)cache + ((blocks[t] * Hkv + h) * bs + offsets[t]) * row,
                   (const char *)k + t * t_stride * elem_size + h * row, row);
}

/* ---- Small-batch matrix-vector products for the fused decode step (decode_layers) ------------
 * Weights are repacked once (cpu_decode.py) so that 16 output channels lie in one vector's lanes:
 *   fp32 [N/16][K][16],  bf16 [N/16][K/2][16][2] (pairs of K, as AVX512-BF16's dot product reads),
 * N padded to 16 and K to even with zeros. Each lane then sums its output's products in K order,
 * in chunks of 512 K whose sums are added at the end: the order oneDNN's packed inner product
 * uses on these CPUs for one row, so the small models' products come out bit-identical to the eager path's
 * (tests/test_cpu_decode.py; larger shapes can differ in the last bit where oneDNN blocks K
 * differently). A call computes up to GROUP blocks of 16 outputs for all M rows, four rows at a
 * time (the weight group is read from memory once; the next four rows find it in cache). */
#define DEC_MAX_ROWS 64
#define GROUP 4
#define K_CHUNK 512

int kernels_have_dpbf16(void) { return HAVE_DPBF16; }
int kernels_have_avx512(void) { return HAVE_AVX512; }
int kernels_have_avx2(void) { return HAVE_AVX2; }
/* linear_rows' dt 2: fp32 rows and outputs over bf16 weights (HAVE_W16 builds) */
int kernels_have_w16a32(void) { return HAVE_W16; }
/* whether paged_prefill computes prompt chunks in this build (else it returns -1) */
int kernels_have_prefill(void) { return HAVE_AVX512 || HAVE_AVX2; }

/* f(args..., MM) with the row count MM (1-4) a compile-time constant in each call */
#define BY_ROWS(mm, f, ...) do { switch (mm) {                      \
    case 4: f(__VA_ARGS__, 4); break;                                 \
    case 3: f(__VA_ARGS__, 3); break;                                 \
    case 2: f(__VA_ARGS__, 2); break;                                 \
    default: f(__VA_ARGS__, 1); break; } } while (0)
/* the same for row counts 1-6 (the register tiles of dp_group, bf16_tiles8 and bf16_group_tiles8) */
#define BY_ROWS6(mm, f, ...) do { switch (mm) {                     \
    case 6: f(__VA_ARGS__, 6); break;                                 \
    case 5: f(__VA_ARGS__, 5); break;                                 \
    default: BY_ROWS(mm, f, __VA_ARGS__); break; } } while (0)

/* The *_rows products below compute rows m0 .. m0 + MM of a group into res, MM a constant after
 * inlining (the accumulators stay in registers, the loop has no branches). A group's blocks past
 * nb repeat its last one (block_of), and their results are not read. */
INLINE int64_t block_of(int64_t g0, int b, int64_t nb) { return g0 + (b < nb ? b : nb - 1); }

#if HAVE_AVX512
/* A K chunk's sums into res: added to the earlier chunks' in K order, as oneDNN does. */
INLINE void chunk_out(float *res, __m512 (*acc)[GROUP], int64_t m0, const int MM, int first) {
    for (int m = 0; m < MM; m++)
        for (int b = 0; b < GROUP; b++) {
            float *o = res + (m0 + m) * GROUP * 16 + b * 16;
            _mm512_storeu_ps(o, first ? acc[m][b] : _mm512_add_ps(_mm512_loadu_ps(o), acc[m][b]));
        }
}

/* fp32: broadcast of x[m, k] times 16 output channels, FMA */
INLINE void fma_rows(const float *xf, int64_t K, const float *wf, int64_t g0, int64_t nb, int64_t m0, float *res,
                     const int MM) {
    const float *w[GROUP];
    for (int b = 0; b < GROUP; b++) w[b] = wf + block_of(g0, b, nb) * K * 16;
    for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
        const int64_t k1 = K - k0 < K_CHUNK ? K : k0 + K_CHUNK;
        __m512 acc[4][GROUP];
        for (int m = 0; m < MM; m++) for (int b = 0; b < GROUP; b++) acc[m][b] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k++) {
            __m512 xv[4];
            for (int m = 0; m < MM; m++) xv[m] = _mm512_set1_ps(xf[(m0 + m) * K + k]);
            for (int b = 0; b < GROUP; b++) {
                const __m512 wv = _mm512_loadu_ps(w[b] + k * 16);
                for (int m = 0; m < MM; m++) acc[m][b] = _mm512_fmadd_ps(xv[m], wv, acc[m][b]);
            }
        }
        chunk_out(res, acc, m0, MM, k0 == 0);
    }
}
#endif

#if HAVE_DPBF16
/* bf16: per pair of K, one broadcast load of each row's pair (a shuffle from a general register
 * would take a vector slot the products need) and one vdpbf16ps per (row, block); an odd K's last
 * pair is padded with zero. Up to DP_MR rows at once: 6 rows x GROUP blocks keep 24 accumulators,
 * the 6 rows' pairs and one block of weights in the 32 vector registers, so each weight load
 * serves 6 products (4 rows: 1.5x the loads per product, 0.94x oneDNN's rate at 512 rows on a Zen 4). */
#define DP_MR 6
INLINE void dp_rows(const uint16_t *xb, int64_t K, const uint16_t *wb, int64_t g0, int64_t nb, int64_t m0,
                    float *res, const int MM) {
    const int64_t KP = (K + 1) / 2, full = K / 2;
    const uint16_t *w[GROUP];
    for (int b = 0; b < GROUP; b++) w[b] = wb + block_of(g0, b, nb) * KP * 32;
    for (int64_t p0 = 0; p0 < KP; p0 += K_CHUNK / 2) {
        const int64_t p1 = KP - p0 < K_CHUNK / 2 ? KP : p0 + K_CHUNK / 2;
        __m512 acc[DP_MR][GROUP];
        for (int m = 0; m < MM; m++) for (int b = 0; b < GROUP; b++) acc[m][b] = _mm512_setzero_ps();
        for (int64_t kp = p0; kp < p1; kp++) {
            __m512i xv[DP_MR];
            for (int m = 0; m < MM; m++) {
                const uint16_t *r = xb + (m0 + m) * K + 2 * kp;
                int32_t pair = r[0];
                if (kp < full) memcpy(&pair, r, sizeof pair);
                xv[m] = _mm512_set1_epi32(pair);
            }
            for (int b = 0; b < GROUP; b++) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w[b] + kp * 32));
                for (int m = 0; m < MM; m++) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], (__m512bh)xv[m], wv);
            }
        }
        chunk_out(res, acc, m0, MM, p0 == 0);
    }
}

/* rows [0, M) through dp_rows in passes of near-equal height (8 rows: 4 + 4, not 6 + 2) */
static void dp_group(const uint16_t *xb, int64_t M, int64_t K, const uint16_t *wb, int64_t g0, int64_t nb,
                     float *res) {
    const int64_t passes = (M + DP_MR - 1) / DP_MR;
    for (int64_t i = 0; i < passes; i++) {
        const int64_t m0 = M * i / passes, mm = M * (i + 1) / passes - m0;
        BY_ROWS6(mm, dp_rows, xb, K, wb, g0, nb, m0, res);
    }
}
#endif

#if HAVE_AVX512
/* int8 weights: each block's 16 channels widened to fp32 once per k for the MM rows, the sum
 * over all of K in one accumulator, then the channels' scales */
INLINE void q8_rows(int dt, const void *x, int64_t K, const int8_t *q, const float *scale, int64_t g0, int64_t nb,
                    int64_t m0, float *res, const int MM) {
    const int8_t *w[GROUP];
    for (int b = 0; b < GROUP; b++) w[b] = q + block_of(g0, b, nb) * K * 16;
    __m512 acc[4][GROUP];
    for (int m = 0; m < MM; m++) for (int b = 0; b < GROUP; b++) acc[m][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 xv[4];
        for (int m = 0; m < MM; m++) xv[m] = _mm512_set1_ps(load_one(dt, x, (m0 + m) * K + k));
        for (int b = 0; b < GROUP; b++) {
            const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w[b] + k * 16))));
            for (int m = 0; m < MM; m++) acc[m][b] = _mm512_fmadd_ps(xv[m], wv, acc[m][b]);
        }
    }
    for (int m = 0; m < MM; m++)
        for (int b = 0; b < GROUP; b++)
            _mm512_storeu_ps(res + (m0 + m) * GROUP * 16 + b * 16,
                             _mm512_mul_ps(acc[m][b], _mm512_loadu_ps(scale + block_of(g0, b, nb) * 16)));
}
#endif

#if HAVE_W16
/* AVX2 products over the same packed layout, each block's 16 channels as two 8-lane halves. Up
 * to two rows take two blocks per pass, more rows one (accumulators: rows x blocks x 2 <= 8 of the
 * 16 vector registers, enough to keep both FMA units busy). Each lane sums in K order within a
 * chunk of K_CHUNK, as fma_rows does. */
INLINE void fma_rows8(const float *xf, int64_t K, const float *wf, int64_t g0, int64_t nb, int64_t m0, float *res,
                      const int MM) {
    const int BP = MM <= 2 ? 2 : 1;
    for (int b0 = 0; b0 < nb; b0 += BP) {
        const float *w[2];
        for (int b = 0; b < BP; b++) w[b] = wf + block_of(g0, b0 + b, nb) * K * 16;
        for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
            const int64_t k1 = K - k0 < K_CHUNK ? K : k0 + K_CHUNK;
            __m256 acc[4][2][2];
            for (int m = 0; m < MM; m++)
                for (int b = 0; b < BP; b++) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
            for (int64_t k = k0; k < k1; k++) {
                __m256 wv[2][2];
                for (int b = 0; b < BP; b++) {
                    wv[b][0] = _mm256_loadu_ps(w[b] + k * 16);
                    wv[b][1] = _mm256_loadu_ps(w[b] + k * 16 + 8);
                }
                for (int m = 0; m < MM; m++) {
                    const __m256 xv = _mm256_broadcast_ss(xf + (m0 + m) * K + k);
                    for (int b = 0; b < BP; b++) {
                        acc[m][b][0] = _mm256_fmadd_ps(xv, wv[b][0], acc[m][b][0]);
                        acc[m][b][1] = _mm256_fmadd_ps(xv, wv[b][1], acc[m][b][1]);
                    }
                }
            }
            for (int m = 0; m < MM; m++)
                for (int b = 0; b < BP && b0 + b < GROUP; b++)
                    for (int h = 0; h < 2; h++) {
                        float *o = res + (m0 + m) * GROUP * 16 + (b0 + b) * 16 + h * 8;
                        _mm256_storeu_ps(o, k0 == 0 ? acc[m][b][h] : _mm256_add_ps(_mm256_loadu_ps(o), acc[m][b][h]));
                    }
        }
    }
}

/* bf16 weights [N/16][K/2][16][2] widened to fp32 (a pair's even element is the low half of its
 * 32 bits, the odd one the high half), x's pair broadcast; an odd K's last pair has x1 = 0. A lane's
 * two FMAs per pair depend on each other, so one block's two accumulators would leave the FMA units
 * waiting on their latency (~18 GB/s of weights a Zen 3 core at one row): few rows take BP blocks
 * at once (independent sums, each still in K order, so the bits do not change). */
INLINE void bf16_rows8(const void *x, int64_t K, const uint16_t *wb, int64_t g0, int64_t nb, int64_t m0,
                       float *res, const int XF, const int MM) {
    const uint16_t *xb = (const uint16_t *)x; /* XF: x is fp32 (linear_rows' dt 2), else bf16 */
    const float *xf = (const float *)x;
    const int64_t KP = (K + 1) / 2, full = K / 2;
    const int BP = MM == 1 ? 4 : MM == 2 ? 2 : 1;
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int b0 = 0; b0 < nb; b0 += BP) {
        const uint16_t *w[4];
        for (int b = 0; b < BP; b++) w[b] = wb + block_of(g0, b0 + b, nb) * KP * 32;
        for (int64_t p0 = 0; p0 < KP; p0 += K_CHUNK / 2) {
            const int64_t p1 = KP - p0 < K_CHUNK / 2 ? KP : p0 + K_CHUNK / 2;
            __m256 acc[4][4][2];
            for (int m = 0; m < MM; m++)
                for (int b = 0; b < BP; b++) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
            for (int64_t kp = p0; kp < p1; kp++) {
                __m256 x0[4], x1[4];
                for (int m = 0; m < MM; m++) {
                    const int64_t r = (m0 + m) * K + 2 * kp;
                    x0[m] = _mm256_set1_ps(XF ? xf[r] : bf16_to_f32(xb[r]));
                    x1[m] = _mm256_set1_ps(kp < full ? (XF ? xf[r + 1] : bf16_to_f32(xb[r + 1])) : 0.0f);
                }
                for (int b = 0; b < BP; b++)
                    for (int h = 0; h < 2; h++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(w[b] + kp * 32 + h * 16));
                        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
                        for (int m = 0; m < MM; m++)
                            acc[m][b][h] = _mm256_fmadd_ps(x1[m], wo, _mm256_fmadd_ps(x0[m], we, acc[m][b][h]));
                    }
            }
            for (int m = 0; m < MM; m++)
                for (int b = 0; b < BP && b0 + b < GROUP; b++)
                    for (int h = 0; h < 2; h++) {
                        float *o = res + (m0 + m) * GROUP * 16 + (b0 + b) * 16 + h * 8;
                        _mm256_storeu_ps(o, p0 == 0 ? acc[m][b][h] : _mm256_add_ps(_mm256_loadu_ps(o), acc[m][b][h]));
                    }
        }
    }
}
#endif

#if HAVE_W16
/* ---- bf16 products for many rows (prompt chunks) on AVX2, linear_rows from TILE_ROWS rows ----
 * bf16_rows8 reads the weights once per four rows and widens each x element in a general register
 * (shift, move, broadcast): 32-35 GFLOP/s a core on a Zen 3, below oneDNN's fp32. Here rows are
 * register-blocked GotoBLAS style: a tile of up to 6 rows x one 16-channel block keeps 12 fp32
 * accumulators; each weight pair of K is widened once (a shift, an and) and serves the 6 rows; x
 * is widened once per K chunk into an fp32 panel (MC_ROWS rows, L2) whose elements the FMAs take
 * as memory broadcasts; a block's chunk of weights (16 KiB) stays in L1 for every tile of the panel.
 * Each lane sums in the order of bf16_rows8 (K order within chunks of K_CHUNK, chunks added), so
 * both paths give the same bits and the dispatch by row count changes no result. */
#define TILE_MR 6
#define MC_ROWS 96    /* panel rows: 96 x 512 x 4 B = 192 KiB of fp32 x */
#define NC_BLOCKS 16  /* blocks per pass: their sums 96 x 256 x 4 B = 96 KiB */

static int64_t tile_rows_from = 4; /* linear_rows' bf16 products take the tiles from this many rows */

/* Sets the row count from which bf16 linear_rows takes the tiled path (tests and benchmarks force
 * either path: 1 = always, a huge value = never); returns the previous one, on < 1 only asks. */
int64_t kernels_tile_rows(int64_t rows) {
    return rows >= 1 ? __atomic_exchange_n(&tile_rows_from, rows, __ATOMIC_RELAXED)
                     : __atomic_load_n(&tile_rows_from, __ATOMIC_RELAXED);
}

/* rows [0, MR) of the panel (row stride K_CHUNK, fp32) times one block's np pairs of K (w at the
 * chunk's first pair), into sums s (row stride ss): s = acc on a chunk's first pass, else s + acc */
INLINE void bf16_tile8(const float *a, const uint16_t *w, int64_t np, float *s, int64_t ss, int first,
                       const int MR) {
    __m256 acc[TILE_MR][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t kp = 0; kp < np; kp++) {
        const __m256i *wv = (const __m256i *)(w + kp * 32);
        const __m256 we0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wv), 16));
        const __m256 we1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wv + 1), 16));
        for (int m = 0; m < MR; m++) {
            const __m256 x0 = _mm256_broadcast_ss(a + m * K_CHUNK + 2 * kp);
            acc[m][0] = _mm256_fmadd_ps(x0, we0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(x0, we1, acc[m][1]);
        }
        const __m256 wo0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(_mm256_loadu_si256(wv), 16), 16));
        const __m256 wo1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(_mm256_loadu_si256(wv + 1), 16), 16));
        for (int m = 0; m < MR; m++) {
            const __m256 x1 = _mm256_broadcast_ss(a + m * K_CHUNK + 2 * kp + 1);
            acc[m][0] = _mm256_fmadd_ps(x1, wo0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(x1, wo1, acc[m][1]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int h = 0; h < 2; h++) {
            float *o = s + m * ss + h * 8;
            _mm256_storeu_ps(o, first ? acc[m][h] : _mm256_add_ps(_mm256_loadu_ps(o), acc[m][h]));
        }
}

/* x rows [m0, m0 + mc), K elements [k0, k1) widened to fp32 at a[m * K_CHUNK + k - k0]; k1 may be
 * K + 1 (an odd K's pad, 0 as bf16_rows8's x1) */
static void stage_rows8(const void *x, int xf, int64_t K, int64_t m0, int64_t mc, int64_t k0, int64_t k1, float *a) {
    for (int64_t m = 0; m < mc; m++) {
        float *d = a + m * K_CHUNK - k0;
        int64_t k = k0;
        if (xf) { /* fp32 rows (linear_rows' dt 2): copied as they are */
            const float *r = (const float *)x + (m0 + m) * K;
            for (; k < k1; k++) d[k] = k < K ? r[k] : 0.0f;
            continue;
        }
        const uint16_t *r = (const uint16_t *)x + (m0 + m) * K;
        for (; k + 8 <= k1 && k + 8 <= K; k += 8)
            _mm256_storeu_ps(d + k, _mm256_castsi256_ps(_mm256_slli_epi32(
                                        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + k))), 16)));
        for (; k < k1; k++) d[k] = k < K ? bf16_to_f32(r[k]) : 0.0f;
    }
}

/* out rows [0, M) x blocks [b0, b1) (this thread's share), bf16, with bias: see above */
static void bf16_tiles8(int dt, const void *x, int64_t M, int64_t K, const uint16_t *wb, int64_t b0, int64_t b1,
                        int64_t N, const void *bias, void *out, float *a, float *sums) {
    const int64_t KP = (K + 1) / 2, SS = NC_BLOCKS * 16;
    for (int64_t m0 = 0; m0 < M; m0 += MC_ROWS) {
        const int64_t mc = M - m0 < MC_ROWS ? M - m0 : MC_ROWS;
        for (int64_t g0 = b0; g0 < b1; g0 += NC_BLOCKS) {
            const int64_t gn = b1 - g0 < NC_BLOCKS ? b1 - g0 : NC_BLOCKS;
            for (int64_t p0 = 0; p0 < KP; p0 += K_CHUNK / 2) {
                const int64_t p1 = KP - p0 < K_CHUNK / 2 ? KP : p0 + K_CHUNK / 2;
                stage_rows8(x, dt == 2, K, m0, mc, 2 * p0, 2 * p1, a);
                for (int64_t b = g0; b < g0 + gn; b++) {
                    const uint16_t *w = wb + b * KP * 32 + p0 * 32;
                    /* the panel's rows in tiles of near-equal height (8 rows: 4 + 4, not 6 + 2) */
                    const int64_t tiles = (mc + TILE_MR - 1) / TILE_MR;
                    for (int64_t i = 0; i < tiles; i++) {
                        const int64_t r0 = mc * i / tiles, mr = mc * (i + 1) / tiles - r0;
                        const float *ar = a + r0 * K_CHUNK;
                        float *s = sums + r0 * SS + (b - g0) * 16;
                        BY_ROWS6(mr, bf16_tile8, ar, w, p1 - p0, s, SS, p0 == 0);
                    }
                }
            }
            /* dt 1: bf16 x, bias and out; dt 2: fp32 (the element type store_one's 0) */
            const int et = dt == 2 ? 0 : 1;
            for (int64_t m = 0; m < mc; m++)
                for (int64_t n = g0 * 16; n < N && n < (g0 + gn) * 16; n++)
                    store_one(et, out, (m0 + m) * N + n, sums[m * SS + n - g0 * 16] + (bias ? load_one(et, bias, n) : 0.0f));
        }
    }
}

/* The same tiles for gemv_group (the fused decode step's products, up to DEC_MAX_ROWS rows): blocks
 * g0 .. g0 + nb into res [M][GROUP * 16], x panels of GROUP_PANEL rows on the stack (48 KiB). */
#define GROUP_PANEL 24
static void bf16_group_tiles8(const void *x, int xf, int64_t M, int64_t K, const uint16_t *wb, int64_t g0, int64_t nb,
                              float *res) {
    const int64_t KP = (K + 1) / 2;
    float a[GROUP_PANEL * K_CHUNK] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += GROUP_PANEL) {
        const int64_t mc = M - m0 < GROUP_PANEL ? M - m0 : GROUP_PANEL, tiles = (mc + TILE_MR - 1) / TILE_MR;
        for (int64_t p0 = 0; p0 < KP; p0 += K_CHUNK / 2) {
            const int64_t p1 = KP - p0 < K_CHUNK / 2 ? KP : p0 + K_CHUNK / 2;
            stage_rows8(x, xf, K, m0, mc, 2 * p0, 2 * p1, a);
            for (int64_t b = 0; b < nb; b++) {
                const uint16_t *w = wb + (g0 + b) * KP * 32 + p0 * 32;
                for (int64_t i = 0; i < tiles; i++) {
                    const int64_t r0 = mc * i / tiles, mr = mc * (i + 1) / tiles - r0;
                    const float *ar = a + r0 * K_CHUNK;
                    float *s = res + (m0 + r0) * GROUP * 16 + b * 16;
                    BY_ROWS6(mr, bf16_tile8, ar, w, p1 - p0, s, GROUP * 16, p0 == 0);
                }
            }
        }
    }
}
#else
int64_t kernels_tile_rows(int64_t rows) { (void)rows; return 0; } /* no tiled path in this build */
#endif

/* Weight-only int8 (w8a16): q int8 [N/16][K][16], fp32 scales [N/16 * 16] (padding rows 0);
 * res = scale * sum over k of x * q, summed in fp32. */
static void gemv_group_int8(int dt, const void *x, int64_t M, int64_t K, const int8_t *q, const float *scale,
                            int64_t g0, int64_t nb, float *res) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mm = M - m0 < 4 ? M - m0 : 4;
#if HAVE_AVX512
        if (dt == 1) BY_ROWS(mm, q8_rows, 1, x, K, q, scale, g0, nb, m0, res);
        else BY_ROWS(mm, q8_rows, 0, x, K, q, scale, g0, nb, m0, res);
#else
        int64_t r[4];
        for (int m = 0; m < 4; m++) r[m] = (m0 + m < M ? m0 + m : M - 1) * K;
        for (int b = 0; b < nb; b++) {
            float acc[4][16] = {{0}}, wv[16];
            const int8_t *wq = q + (g0 + b) * K * 16;
            for (int64_t k = 0; k < K; k++) {
                for (int l = 0; l < 16; l++) wv[l] = (float)wq[k * 16 + l];
                for (int m = 0; m < 4; m++) {
                    const float xk = load_one(dt, x, r[m] + k);
                    for (int l = 0; l < 16; l++) acc[m][l] += xk * wv[l];
                }
            }
            for (int m = 0; m < mm; m++)
                for (int l = 0; l < 16; l++)
                    res[(m0 + m) * GROUP * 16 + b * 16 + l] = acc[m][l] * scale[(g0 + b) * 16 + l];
        }
#endif
    }
}

#if HAVE_AMX
/* The kernel's bf16 layout [NB][K/2][16][2] is AMX's B operand as it stands: per block, each pair
 * of K is one 64-byte tile row of 16 channels x 2 values. A = 16 rows of x x 32 values of K,
 * C = 16 rows x 16 channels in fp32, accumulated over the whole of K (another order than the dot
 * products' K_CHUNK partial sums: results agree to rounding, not to the bit). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_cfg_t;

#define AMX_PANEL 512  /* linear_rows' rows per pass over the weights on AMX tiles */
static int amx_state = -1;         /* -1: not asked yet, 0: the kernel refused, 1: granted */
static int64_t amx_rows_from = 1;  /* gemv_group's bf16 products take the tiles from this many rows */

/* Linux lends the AMX tile state to a process that asks (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
 * oneDNN asks too. Once per process, in any thread: the grant is the process's. */
static int amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s;
}

static void amx_config(int rows, int tail_pairs) {
    tile_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) { c.rows[t] = (uint8_t)rows; c.colsb[t] = 64; }  /* C: the 4 blocks of a group */
    c.rows[4] = (uint8_t)rows; c.colsb[4] = 64;                                   /* A: 32 values of K */
    c.rows[5] = 16; c.colsb[5] = 64;                                              /* B: 16 pairs */
    if (tail_pairs) {                                                             /* the last K < 32 */
        c.rows[6] = (uint8_t)rows; c.colsb[6] = (uint16_t)(tail_pairs * 4);
        c.rows[7] = (uint8_t)tail_pairs; c.colsb[7] = 64;
    }
    _tile_loadconfig(&c);
}

#define AMX_BLOCK(t, b) do { _tile_loadd(5, w[b] + p * 32, 64); _tile_dpbf16ps(t, 4, 5); } while (0)
#define AMX_TAIL(t, b) do { _tile_loadd(7, w[b] + full * 32, 64); _tile_dpbf16ps(t, 6, 7); } while (0)

/* 32 rows (two row tiles, the second of rows1 rows) x 2 blocks per pass, K a multiple of 32: each
 * step of K loads 2 A and 2 B tiles for 4 products (the 16-row loop loads 5 for 4), so prompt
 * chunks are less bound by L2 */
static void amx_config2(int rows1) {
    tile_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    c.rows[2] = c.rows[3] = c.rows[5] = (uint8_t)rows1;  /* C and A of the second row tile */
    _tile_loadconfig(&c);
}

/* Two row tiles (xa: 16 rows, xb: the configured rows1) by two blocks (w0, w1) over all of K (a
 * multiple of 32): each step of K loads 2 A and 2 B tiles for 4 products; the sums go to o (rows
 * GROUP * 16 floats apart, the second block at o + 16). The tile configuration is amx_config2's. */
INLINE void amx_pair2(const uint16_t *xa, const uint16_t *xb, int64_t K, const uint16_t *w0, const uint16_t *w1,
                      float *o) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t p = 0; p < K / 2; p += 16) {
        _tile_loadd(4, xa + 2 * p, K * 2);
        _tile_loadd(6, w0 + p * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w1 + p * 32, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, xb + 2 * p, K * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, o, GROUP * 16 * 4); _tile_stored(1, o + 16, GROUP * 16 * 4);
    _tile_stored(2, o + 16 * GROUP * 16, GROUP * 16 * 4); _tile_stored(3, o + 16 * GROUP * 16 + 16, GROUP * 16 * 4);
}

static void bf16_group_amx2(const uint16_t *x, int64_t M, int64_t K, const uint16_t *const *w, float *res) {
    int configured = -1;
    for (int64_t r0 = 0; r0 + 16 < M; r0 += 32) {
        const int rows1 = M - r0 - 16 < 16 ? (int)(M - r0 - 16) : 16;
        if (rows1 != configured) { amx_config2(rows1); configured = rows1; }
        const uint16_t *xa = x + r0 * K, *xb = xa + 16 * K;
        for (int bp = 0; bp < GROUP; bp += 2)
            amx_pair2(xa, xb, K, w[bp], w[bp + 1], res + r0 * GROUP * 16 + bp * 16);
    }
}

/* gemv_group's bf16 products on AMX tiles, K even: 16 rows at a time through the group's blocks
 * (blocks past nb repeat the last, as block_of; their sums land in res unread); from 32 rows with
 * K a multiple of 32, row pairs by bf16_group_amx2. Every path sums a row's products in the same
 * order (16 pairs of K per product, K ascending), so a row's bits do not depend on its neighbours. */
static void bf16_group_amx(const uint16_t *x, int64_t M, int64_t K, const uint16_t *wb, int64_t g0, int64_t nb,
                           float *res) {
    const int64_t KP = K / 2, full = KP / 16 * 16, tail = KP - full;
    const uint16_t *w[GROUP];
    for (int b = 0; b < GROUP; b++) w[b] = wb + block_of(g0, b, nb) * KP * 32;
    int configured = -1;
    int64_t start = 0;
    if (!tail && M >= 32) {
        bf16_group_amx2(x, M, K, w, res);
        start = M % 32 > 16 || M % 32 == 0 ? M : M - M % 32;  /* a last lone row tile of <= 16 rows below */
    }
    for (int64_t r0 = start; r0 < M; r0 += 16) {
        const int rows = M - r0 < 16 ? (int)(M - r0) : 16;
        if (rows != configured) { amx_config(rows, (int)tail); configured = rows; }
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const uint16_t *xa = x + r0 * K;
        for (int64_t p = 0; p < full; p += 16) {
            _tile_loadd(4, xa + 2 * p, K * 2);
            AMX_BLOCK(0, 0); AMX_BLOCK(1, 1); AMX_BLOCK(2, 2); AMX_BLOCK(3, 3);
        }
        if (tail) {
            _tile_loadd(6, xa + 2 * full, K * 2);
            AMX_TAIL(0, 0); AMX_TAIL(1, 1); AMX_TAIL(2, 2); AMX_TAIL(3, 3);
        }
        float *o = res + r0 * GROUP * 16;
        _tile_stored(0, o, GROUP * 16 * 4); _tile_stored(1, o + 16, GROUP * 16 * 4);
        _tile_stored(2, o + 32, GROUP * 16 * 4); _tile_stored(3, o + 48, GROUP * 16 * 4);
    }
    _tile_release();  /* an unused tile state costs nothing at context switches */
}

/* linear_rows' products of one group over a whole panel of rows on AMX tiles, K a multiple of 32
 * up to AMX_PANEL_K: res [M][GROUP * 16] as bf16_group_amx gives it, bit for bit (the same 32-value
 * steps of K in the same order), with the loops turned so that a block pair's weights (2 x 16 x K:
 * up to 64 KiB) stay near while every row pair of the panel passes over them: each step then loads
 * two tiles from L2 instead of four (bf16_group_amx2 takes its 64 rows at a time through all 4
 * blocks). A larger K would need its sums stored and loaded back between chunks of K, which costs
 * more than it saves (measured on the 1B shape, K 2048). */
#define AMX_PANEL_K 1024
static void bf16_panel_amx(const uint16_t *x, int64_t M, int64_t K, const uint16_t *wb, int64_t g0, int64_t nb,
                           float *res) {
    const int64_t KP = K / 2, full = M / 32 * 32;
    const uint16_t *w[GROUP];
    for (int b = 0; b < GROUP; b++) w[b] = wb + block_of(g0, b, nb) * KP * 32;
    if (full) amx_config2(16);
    for (int bp = 0; bp < GROUP; bp += 2) {
        const uint16_t *w0 = w[bp], *w1 = w[bp + 1];
        for (int64_t r0 = 0; r0 < full; r0 += 32)
            amx_pair2(x + r0 * K, x + (r0 + 16) * K, K, w0, w1, res + r0 * GROUP * 16 + bp * 16);
    }
    if (full < M)  /* the last rows (< 32) as gemv_group takes them; it releases the tiles */
        bf16_group_amx(x + full * K, M - full, K, wb, g0, nb, res + full * GROUP * 16);
    else
        _tile_release();
}
#endif

/* ---- Prefill attention on AMX tiles (bf16 caches) ---- */

#if HAVE_AMX
/* paged_prefill's bf16 tiles on AMX: up to AMX_PRE_ROWS (query position, head) rows per tile, the
 * scores S = Q Kᵀ and the values P V as tile products, the online softmax in AVX-512 between them.
 *
 * Each row's result depends on its own query and keys only, never on which other rows share its
 * tile (a prompt fresh, the same prompt after a prefix-cache hit and chunked otherwise give the
 * same bits):
 * - tile products compute each row of C from that row of A alone;
 * - the keys are cut into chunks at absolute positions (multiples of CHUNK, the first one starting
 *   at a multiple of 32 below the tile's first visible key), so a row sees the same chunks, with
 *   the same keys in the same lanes and 32-key steps, in any tile; keys a row cannot see weigh
 *   exactly 0 and add nothing.
 * The probabilities enter the value product as two bf16 terms (hi + lo: ~16 bits of the fp32
 * value, where one bf16 would keep 8); their sum, the maxima and the rescaling stay in fp32. */
#define AMX_PRE_ROWS 128 /* rows per tile at most: longer prompts reread their keys less often */
#define AMX_PRE_D 128  /* the largest head size on this path (tile budget, workspace) */

typedef struct {
    uint16_t q[AMX_PRE_ROWS][AMX_PRE_D];   /* the tile's queries, rows past R zero */
    uint32_t kt[AMX_PRE_D / 2][CHUNK];     /* the chunk's keys as B of the scores: [pair of D][key] */
    uint32_t vp[CHUNK / 2][AMX_PRE_D];     /* the chunk's values as B of P V: [pair of keys][d] */
    float sc[AMX_PRE_ROWS][CHUNK];         /* scores, then their exponentials */
    uint16_t ph[AMX_PRE_ROWS][CHUNK], pl[AMX_PRE_ROWS][CHUNK]; /* exponentials as bf16 hi + lo */
    float pv[AMX_PRE_ROWS][AMX_PRE_D];     /* this chunk's P V */
    float acc[AMX_PRE_ROWS][AMX_PRE_D];
    float m[AMX_PRE_ROWS], l[AMX_PRE_ROWS];
    int64_t lo[AMX_PRE_ROWS], hi[AMX_PRE_ROWS];
} amx_pre_ws;

static int prefill_amx_on = 1;
static int64_t prefill_amx_calls = 0; /* calls this path computed (tests read it) */

/* 16 x 16 32-bit transpose: r[i] lane j -> r[j] lane i */
INLINE void transpose16(__m512i *r) {
    __m512i a[16], b[16];
    for (int k = 0; k < 8; k++) {
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) {
        b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
    for (int c = 0; c < 4; c++) { /* b[4k + c] lane L holds rows 4k..4k+3 of column 4L + c */
        const __m512i p = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), q = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
        const __m512i p2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88),
                      q2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(p, p2, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(p, p2, 0xDD);
        r[4 + c] = _mm512_shuffle_i32x4(q, q2, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(q, q2, 0xDD);
    }
}

/* The cached row of position t (KV head kvh), as bf16 */
INLINE const uint16_t *cached_row(const uint16_t *c, const int64_t *table, int64_t t, int64_t Hkv, int64_t kvh,
                                  int64_t bs, int64_t D) {
    return c + ((table[t / bs] * Hkv + kvh) * bs + t % bs) * D;
}

/* Stage keys c0 .. c0 + n - 1 as kt (word w of key j at kt[w][j]) and values as vp (keys 2k and
 * 2k + 1 interleaved per d); keys past n up to the next multiple of 32 are zero. */
static void amx_pre_stage(amx_pre_ws *ws, const uint16_t *kc, const uint16_t *vc, const int64_t *table, int64_t c0,
                          int64_t n, int64_t Hkv, int64_t kvh, int64_t bs, int64_t D) {
    const int64_t W = D / 2, n32 = (n + 31) / 32 * 32;
    for (int64_t j0 = 0; j0 < n32; j0 += 16) {
        const uint32_t *row[16];
        for (int j = 0; j < 16; j++)
            row[j] = j0 + j < n ? (const uint32_t *)cached_row(kc, table, c0 + j0 + j, Hkv, kvh, bs, D) : NULL;
        for (int64_t w0 = 0; w0 < W; w0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) r[j] = row[j] ? _mm512_loadu_si512(row[j] + w0) : _mm512_setzero_si512();
            transpose16(r);
            for (int w = 0; w < 16; w++) _mm512_store_si512(&ws->kt[w0 + w][j0], r[w]);
        }
    }
    /* pair k of d: (V[2k][d], V[2k+1][d]) */
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t k = 0; k < n32 / 2; k++) {
        const int64_t t = 2 * k;
        const uint16_t *a = t < n ? cached_row(vc, table, c0 + t, Hkv, kvh, bs, D) : NULL;
        const uint16_t *b = t + 1 < n ? cached_row(vc, table, c0 + t + 1, Hkv, kvh, bs, D) : NULL;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const __m512i x = a ? _mm512_loadu_si512(a + d0) : _mm512_setzero_si512();
            const __m512i y = b ? _mm512_loadu_si512(b + d0) : _mm512_setzero_si512();
            _mm512_store_si512(&ws->vp[k][d0], _mm512_permutex2var_epi16(x, lo_idx, y));
            _mm512_store_si512(&ws->vp[k][d0 + 16], _mm512_permutex2var_epi16(x, hi_idx, y));
        }
    }
}

/* C tile i (of up to 4) += A(4) B and A(5) B, B the 16 d from 16 d * i of the pair rows at bp */
#define PV_STEP(i) do { if (nd > i) { _tile_loadd(6, bp + 16 * i, AMX_PRE_D * 4); _tile_dpbf16ps(i, 4, 6); \
                                      _tile_dpbf16ps(i, 5, 6); } } while (0)
#define PV_STORE(i) do { if (nd > i) _tile_stored(i, &ws->pv[rt * 16][d0 + 16 * i], AMX_PRE_D * 4); } while (0)

/* One tile as prefill_tile16 (same arguments, bf16), R = nq * G <= AMX_PRE_ROWS, D a multiple of
 * 32 up to AMX_PRE_D; the tile configuration is loaded by the caller. */
static void prefill_tile_amx(amx_pre_ws *ws, const uint16_t *q, int64_t q_stride, const uint16_t *kc,
                             const uint16_t *vc, const int64_t *table, int64_t p0, int64_t nq, int64_t H, int64_t Hkv,
                             int64_t bs, int64_t D, int64_t window, float scale, int64_t kvh, uint16_t *out) {
    const int64_t G = H / Hkv, R = nq * G, RT = (R + 15) / 16;
    for (int64_t r = 0; r < RT * 16; r++) {
        if (r < R) {
            memcpy(ws->q[r], q + (r / G) * q_stride + (kvh * G + r % G) * D, (size_t)D * 2);
            ws->hi[r] = p0 + r / G;
            ws->lo[r] = item_first(ws->hi[r], window);
            memset(ws->acc[r], 0, (size_t)D * 4);
            ws->m[r] = -INFINITY;
            ws->l[r] = 0.0f;
        } else {
            memset(ws->q[r], 0, (size_t)D * 2);
            memset(ws->ph[r], 0, sizeof ws->ph[r]);
            memset(ws->pl[r], 0, sizeof ws->pl[r]);
        }
    }
    const int64_t last = ws->hi[R - 1];
    for (int64_t c0 = ws->lo[0] / 32 * 32, n; c0 <= last; c0 += n) {
        const int64_t cend = (c0 / CHUNK + 1) * CHUNK < last + 1 ? (c0 / CHUNK + 1) * CHUNK : last + 1;
        n = cend - c0;
        const int64_t n16 = (n + 15) / 16 * 16, n32 = (n + 31) / 32 * 32;
        int64_t r0 = 0, r1 = R; /* the rows that see some key of this chunk (positions rise with r) */
        while (r0 < R && ws->hi[r0] < c0) r0++;
        while (r1 > r0 && ws->lo[r1 - 1] > cend - 1) r1--;
        if (r0 >= r1) continue;
        const int64_t rt0 = r0 / 16, rt1 = (r1 + 15) / 16, ra = rt0 * 16, rb = rt1 * 16 < R ? rt1 * 16 : R;
        amx_pre_stage(ws, kc, vc, table, c0, n, Hkv, kvh, bs, D);
        /* scores of the key groups some row of the row tile sees */
        for (int64_t rt = rt0; rt < rt1; rt++) {
            const int64_t top = rt * 16 + 15 < R ? rt * 16 + 15 : R - 1;
            for (int64_t j0 = 0; j0 < n16; j0 += 16) {
                if (c0 + j0 > ws->hi[top] || c0 + j0 + 15 < ws->lo[rt * 16]) continue;
                _tile_zero(0);
                for (int64_t w0 = 0; w0 < D / 2; w0 += 16) {
                    _tile_loadd(1, &ws->q[rt * 16][2 * w0], AMX_PRE_D * 2);
                    _tile_loadd(2, &ws->kt[w0][j0], CHUNK * 4);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, &ws->sc[rt * 16][j0], CHUNK * 4);
            }
        }
        /* online softmax per row: scaled, masked, the running maximum and sum; bf16 hi + lo terms */
        for (int64_t r = ra; r < rb; r++) {
            const int64_t lo = ws->lo[r], hi = ws->hi[r];
            __m512 mx = _mm512_set1_ps(ws->m[r]);
            for (int64_t j = 0; j < n32; j += 16) {
                const int64_t t = c0 + j, left = n - j;
                const __mmask16 k = left > 0 && t <= hi && t + 15 >= lo ? visible16(t, left < 16 ? left : 16, lo, hi) : 0;
                const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), k, _mm512_loadu_ps(ws->sc[r] + j),
                                                    _mm512_set1_ps(scale));
                _mm512_store_ps(ws->sc[r] + j, s);
                mx = _mm512_mask_max_ps(mx, k, s, mx);
            }
            const float mb = _mm512_reduce_max_ps(mx);
            if (mb > ws->m[r]) {
                const float corr = expf(ws->m[r] - mb); /* 0 on the first chunk: m = -inf */
                ws->l[r] *= corr;
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_store_ps(ws->acc[r] + d, _mm512_mul_ps(_mm512_load_ps(ws->acc[r] + d), _mm512_set1_ps(corr)));
                ws->m[r] = mb;
            }
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < n32; j += 32) {
                __m512 e[2];
                for (int h = 0; h < 2; h++) {
                    const __m512 s = _mm512_load_ps(ws->sc[r] + j + 16 * h);
                    /* -inf - mb = -inf: exp16 gives 0; a row with no visible key yet (mb = -inf) gets NaN, masked */
                    e[h] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                               exp16(_mm512_sub_ps(s, _mm512_set1_ps(mb))));
                    sum = _mm512_add_ps(sum, e[h]);
                }
                const __m512bh hb = _mm512_cvtne2ps_pbh(e[1], e[0]);
                const __m512i hw = (__m512i)hb;
                /* the bf16 value back in fp32: the low half words shifted up */
                const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hw)), 16));
                const __m512 h1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hw, 1)), 16));
                _mm512_store_si512(ws->ph[r] + j, hw);
                _mm512_store_si512(ws->pl[r] + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(e[1], h1),
                                                                               _mm512_sub_ps(e[0], h0)));
            }
            ws->l[r] += _mm512_reduce_add_ps(sum);
        }
        /* P V for the active row tiles, 64 columns of d per pass */
        for (int64_t rt = rt0; rt < rt1; rt++)
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
                const int nd = D - d0 >= 64 ? 4 : (int)((D - d0) / 16);
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t kk = 0; kk < n32; kk += 32) {
                    _tile_loadd(4, ws->ph[rt * 16] + kk, CHUNK * 2);
                    _tile_loadd(5, ws->pl[rt * 16] + kk, CHUNK * 2);
                    const uint32_t *bp = &ws->vp[kk / 2][d0];
                    PV_STEP(0); PV_STEP(1); PV_STEP(2); PV_STEP(3);
                }
                PV_STORE(0); PV_STORE(1); PV_STORE(2); PV_STORE(3);
            }
        for (int64_t r = r0; r < r1; r++)
            for (int64_t d = 0; d < D; d += 16)
                _mm512_store_ps(ws->acc[r] + d, _mm512_add_ps(_mm512_load_ps(ws->acc[r] + d), _mm512_load_ps(ws->pv[r] + d)));
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / G, h = kvh * G + r % G;
        const float inv = 1.0f / ws->l[r];
        for (int64_t d = 0; d < D; d++) out[i * q_stride + h * D + d] = f32_to_bf16(ws->acc[r][d] * inv);
    }
}
#undef PV_STEP
#undef PV_STORE

/* paged_prefill's bf16 chunks on AMX tiles; -1 where this path does not cover the call */
static int prefill_amx(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int64_t *tables,
                       int64_t max_blocks, const int64_t *row0, const int64_t *start, const int64_t *nq, int64_t B,
                       int64_t H, int64_t Hkv, int64_t bs, int64_t D, int64_t window, float scale, uint16_t *out) {
    if (!__atomic_load_n(&prefill_amx_on, __ATOMIC_RELAXED) || D % 32 != 0 || D > AMX_PRE_D || !amx_ready())
        return -1;
    const int64_t G = H / Hkv;
    /* the most rows per tile that still leave two (tile, KV head) items per thread (a row's
     * result does not depend on the tile's size) */
    int64_t QT = AMX_PRE_ROWS / G, tiles;
    for (;; QT = (QT + 1) / 2) {
        tiles = tile_count(nq, B, QT);
        if (QT * G <= 16 || tiles * Hkv >= 2 * omp_get_max_threads()) break;
    }
    int64_t *tile = tile_list(nq, B, QT, tiles);
    if (tile == NULL) return -1;
    int failed = 0;
    _Pragma("omp parallel if (tiles * Hkv > 1)")
    {
        /* every thread takes part in the loop (a work-sharing construct): one without a workspace
         * skips its tiles and the call fails (the caller recomputes them all) */
        amx_pre_ws *ws = (amx_pre_ws *)aligned_alloc(64, sizeof(amx_pre_ws));
        if (ws != NULL) amx_config2(16); /* every operand: 16 rows of 64 bytes */
        else __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t w = 0; w < tiles * Hkv; w++) {
            if (ws == NULL) continue;
            const int64_t b = tile[2 * (w / Hkv)], a = tile[2 * (w / Hkv) + 1], kvh = w % Hkv;
            const int64_t n = nq[b] - a < QT ? nq[b] - a : QT, off = (row0[b] + a) * H * D;
            prefill_tile_amx(ws, q + off, H * D, kc, vc, tables + b * max_blocks, start[b] + a, n, H, Hkv, bs, D,
                             window, scale, kvh, out + off);
        }
        if (ws != NULL) {
            _tile_release();
            free(ws);
        }
    }
    free(tile);
    if (failed) return -2;
    __atomic_add_fetch(&prefill_amx_calls, 1, __ATOMIC_RELAXED);
    return 0;
}
#endif

/* Whether bf16 prompt chunks take AMX tiles (paged_prefill): on >= 0 sets it (tests and benchmarks
 * compare both paths); returns the previous setting, 0 where this build or the OS has no AMX. */
int kernels_prefill_amx(int on) {
#if HAVE_AMX
    if (!amx_ready()) return 0;
    return on >= 0 ? __atomic_exchange_n(&prefill_amx_on, on ? 1 : 0, __ATOMIC_RELAXED)
                   : __atomic_load_n(&prefill_amx_on, __ATOMIC_RELAXED);
#else
    (void)on;
    return 0;
#endif
}

/* How many paged_prefill calls the AMX path has computed in this process */
int64_t kernels_prefill_amx_calls(void) {
#if HAVE_AMX
    return __atomic_load_n(&prefill_amx_calls, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

/* Sets the row count from which gemv_group's bf16 products (the fused decode step, linear_rows)
 * take AMX tiles (tests and benchmarks force either path: 1 = always, a huge value = never);
 * returns the previous one, on < 1 only asks. 0: no AMX in this build, or the OS refused it. */
int64_t kernels_amx_rows(int64_t rows) {
#if HAVE_AMX
    if (!amx_ready()) return 0;
    return rows >= 1 ? __atomic_exchange_n(&amx_rows_from, rows, __ATOMIC_RELAXED)
                     : __atomic_load_n(&amx_rows_from, __ATOMIC_RELAXED);
#else
    (void)rows;
    return 0;
#endif
}

/* res[m][b * 16 + l] = sum over k of x[m, k] * w[(g0 + b) * 16 + l, k], for b < nb <= GROUP
 * (scale != NULL: w is int8, see gemv_group_int8) */
static void gemv_group(int dt, const void *x, int64_t M, int64_t K, const void *pw, const float *scale, int64_t g0,
                       int64_t nb, float *res /* [M][GROUP * 16] */) {
    if (scale) {
        gemv_group_int8(dt, x, M, K, (const int8_t *)pw, scale, g0, nb, res);
        return;
    }
    const int64_t KP = (K + 1) / 2;
#if HAVE_AMX
    if (dt == 1 && K % 2 == 0 && M >= __atomic_load_n(&amx_rows_from, __ATOMIC_RELAXED) && amx_ready()) {
        bf16_group_amx((const uint16_t *)x, M, K, (const uint16_t *)pw, g0, nb, res);
        return;
    }
#endif
#if HAVE_W16
    if ((dt == 1 || dt == 2) && M >= __atomic_load_n(&tile_rows_from, __ATOMIC_RELAXED)) {
        bf16_group_tiles8(x, dt == 2, M, K, (const uint16_t *)pw, g0, nb, res);
        return;
    }
#endif
#if HAVE_DPBF16
    if (dt == 1) {
        dp_group((const uint16_t *)x, M, K, (const uint16_t *)pw, g0, nb, res);
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mm = M - m0 < 4 ? M - m0 : 4;
#if HAVE_AVX512
        if (dt == 0) {
            BY_ROWS(mm, fma_rows, (const float *)x, K, (const float *)pw, g0, nb, m0, res);
            continue;
        }
#endif
#if HAVE_AVX2
        if (dt == 0) {
            BY_ROWS(mm, fma_rows8, (const float *)x, K, (const float *)pw, g0, nb, m0, res);
            continue;
        }
#endif
#if HAVE_W16  /* bf16 weights widened in registers (AVX2, AVX-512 without avx512_bf16) */
        if (dt == 2)
            BY_ROWS(mm, bf16_rows8, x, K, (const uint16_t *)pw, g0, nb, m0, res, 1);
        else
            BY_ROWS(mm, bf16_rows8, x, K, (const uint16_t *)pw, g0, nb, m0, res, 0);
        continue;
#endif
        /* Portable path (no AVX2): the same layout and order, 16 lanes the compiler vectorises,
         * four rows per pass over the weight block (rows past M repeat the last one, discarded). */
        int64_t r[4];
        for (int m = 0; m < 4; m++) r[m] = (m0 + m < M ? m0 + m : M - 1) * K;
        for (int b = 0; b < nb; b++) {
            float tot[4][16] = {{0}}, acc[4][16], w0[16], w1[16];
            if (dt == 0) {
                const float *xf = (const float *)x, *wf = (const float *)pw + (g0 + b) * K * 16;
                for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
                    const int64_t k1 = K - k0 < K_CHUNK ? K : k0 + K_CHUNK;
                    memset(acc, 0, sizeof acc);
                    for (int64_t k = k0; k < k1; k++)
                        for (int m = 0; m < 4; m++) {
                            const float xk = xf[r[m] + k];
                            for (int l = 0; l < 16; l++) acc[m][l] += xk * wf[k * 16 + l];
                        }
                    for (int m = 0; m < 4; m++)
                        for (int l = 0; l < 16; l++) tot[m][l] = k0 ? tot[m][l] + acc[m][l] : acc[m][l];
                }
            } else {
                const uint16_t *xb = (const uint16_t *)x, *wb = (const uint16_t *)pw + (g0 + b) * KP * 32;
                for (int64_t p0 = 0; p0 < KP; p0 += K_CHUNK / 2) {
                    const int64_t p1 = KP - p0 < K_CHUNK / 2 ? KP : p0 + K_CHUNK / 2;
                    memset(acc, 0, sizeof acc);
                    for (int64_t kp = p0; kp < p1; kp++) {
                        for (int l = 0; l < 16; l++) {
                            w0[l] = bf16_to_f32(wb[(kp * 16 + l) * 2]);
                            w1[l] = bf16_to_f32(wb[(kp * 16 + l) * 2 + 1]);
                        }
                        for (int m = 0; m < 4; m++) {
                            const float x0 = bf16_to_f32(xb[r[m] + 2 * kp]);
                            const float x1 = 2 * kp + 1 < K ? bf16_to_f32(xb[r[m] + 2 * kp + 1]) : 0.0f;
                            for (int l = 0; l < 16; l++) acc[m][l] += x1 * w1[l] + x0 * w0[l];
                        }
                    }
                    for (int m = 0; m < 4; m++)
                        for (int l = 0; l < 16; l++) tot[m][l] = p0 ? tot[m][l] + acc[m][l] : acc[m][l];
                }
            }
            for (int m = 0; m < mm; m++)
                for (int l = 0; l < 16; l++) res[(m0 + m) * GROUP * 16 + b * 16 + l] = tot[m][l];
        }
    }
}

#if HAVE_AVX512BW
/* The vector forms of f32_to_bf16 / load_one / store_one for the step's outputs, bit for bit. */

/* each lane's bf16 (round to nearest even, NaN made quiet) in its low 16 bits */
INLINE __m512i bf16_bits16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f), hi = _mm512_srli_epi32(u, 16);
    const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}

INLINE __m512 round16(int dt, __m512 f) {
    return dt == 1 ? _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(f), 16)) : f;
}

INLINE __m512 load16m(int dt, const void *p, int64_t i, __mmask16 k) {
    if (dt == 1)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(k, (const float *)p + i);
}

INLINE void store16m(int dt, void *p, int64_t i, __m512 v, __mmask16 k) {
    if (dt == 1) _mm256_mask_storeu_epi16((uint16_t *)p + i, k, _mm512_cvtepi32_epi16(bf16_bits16(v)));
    else _mm512_mask_storeu_ps((float *)p + i, k, v);
}
#endif

/* out rows m0 .. m0 + mm of the group's channels from res [mm][GROUP * 16], bias added, rounded
 * to the element type */
INLINE void store_group(int dt, const float *res, int64_t mm, int64_t m0, int64_t g0, int64_t nb, int64_t N,
                        const void *bias, void *out) {
    const int64_t n0 = g0 * 16, n1 = N < (g0 + nb) * 16 ? N : (g0 + nb) * 16;
    for (int64_t m = 0; m < mm; m++) {
#if HAVE_AVX512BW
        /* 16 outputs at a time, rounded as store_one rounds them (a scalar loop took a sixth
         * of a 512-row bf16 product on AMX) */
        for (int64_t n = n0; n < n1; n += 16) {
            const __mmask16 k = lanes16(n1 - n);
            __m512 v = _mm512_maskz_loadu_ps(k, res + m * GROUP * 16 + n - n0);
            if (bias) v = _mm512_add_ps(v, load16m(dt, bias, n, k));
            store16m(dt, out, (m0 + m) * N + n, v, k);
        }
#else
        for (int64_t n = n0; n < n1; n++)
            store_one(dt, out, (m0 + m) * N + n, res[m * GROUP * 16 + n - n0] + (bias ? load_one(dt, bias, n) : 0.0f));
#endif
    }
}

/* out[M, N] = x[M, K] @ w^T (+ bias), rounded to the element type, w packed as above (int8 with
 * scales when scale != NULL): the decode step's products on their own, and the CPU's int8 linears
 * at small row counts (workers/backends/int8.py). Rows go DEC_MAX_ROWS at a time through each group,
 * whose weights stay in cache meanwhile. dt 2 (HAVE_W16 builds): x, bias and out fp32 over bf16 weights
 * (a model computed in fp32 that reads half the bytes; each lane sums as for dt 1). */
int linear_rows(int dt, const void *x, int64_t M, int64_t K, const void *pw, const float *scale, int64_t N,
                const void *bias, void *out) {
    if (dt < 0 || dt > 2 || M < 1 || (dt == 2 && (scale || !HAVE_W16))) return -1;
    const int64_t NB = (N + 15) / 16, es = dt == 1 ? 2 : 4;
#if HAVE_W16
    if ((dt == 1 || dt == 2) && !scale && M >= __atomic_load_n(&tile_rows_from, __ATOMIC_RELAXED)) {
        int failed = 0;
        _Pragma("omp parallel reduction(|: failed)")
        {
            /* each thread an even share of the blocks (as my_blocks) and its own x panel */
            const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t b0 = NB * t / T, b1 = NB * (t + 1) / T;
            float *a = aligned_alloc(64, (size_t)MC_ROWS * K_CHUNK * sizeof(float));
            float *sums = aligned_alloc(64, (size_t)MC_ROWS * NC_BLOCKS * 16 * sizeof(float));
            if (a && sums) {
                if (b1 > b0) bf16_tiles8(dt, x, M, K, (const uint16_t *)pw, b0, b1, N, bias, out, a, sums);
            } else {
                failed = 1;
            }
            free(a);
            free(sums);
        }
        if (!failed) return 0;
        /* out of memory for a panel: the row path below computes every output again */
    }
#endif
    /* AMX tiles (gemv_group's rule): rows in panels of AMX_PANEL, the weights read once per panel
     * (from memory for a large model) */
    int64_t panel = M;
#if HAVE_AMX
    const int amx = dt == 1 && !scale && K % 2 == 0 && M >= __atomic_load_n(&amx_rows_from, __ATOMIC_RELAXED) && amx_ready();
    /* K a multiple of 32 up to AMX_PANEL_K, more than DEC_MAX_ROWS rows: each block pair of the
     * weights kept near while the panel's rows pass (bf16_panel_amx) */
    if (amx && K % 32 == 0 && K <= AMX_PANEL_K && M > DEC_MAX_ROWS) {
        int failed = 0;
        _Pragma("omp parallel reduction(|: failed)")
        {
            float *res = aligned_alloc(64, (size_t)(M < AMX_PANEL ? M : AMX_PANEL) * GROUP * 16 * sizeof(float));
            failed = res == NULL;
            /* every thread takes part in the loops (work-sharing constructs); one without its
             * buffer skips its groups and the call falls back below */
            for (int64_t p0 = 0; p0 < M; p0 += AMX_PANEL) {
                const int64_t mm = M - p0 < AMX_PANEL ? M - p0 : AMX_PANEL;
                _Pragma("omp for schedule(static)")
                for (int64_t g0 = 0; g0 < NB; g0 += GROUP) {
                    if (res == NULL) continue;
                    const int64_t nb = NB - g0 < GROUP ? NB - g0 : GROUP;
                    bf16_panel_amx((const uint16_t *)x + p0 * K, mm, K, (const uint16_t *)pw, g0, nb, res);
                    store_group(dt, res, mm, p0, g0, nb, N, bias, out);
                }
            }
            free(res);
        }
        if (!failed) return 0;
    }
    if (amx) panel = AMX_PANEL;
#endif
    /* otherwise (and where a panel's buffer could not be had) rows DEC_MAX_ROWS at a time through
     * each group, on AMX in panels of AMX_PANEL rows, each panel's x kept near while every group
     * passes over it */
    for (int64_t p0 = 0; p0 < M; p0 += panel) {
    const int64_t p1 = M - p0 < panel ? M : p0 + panel;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t g0 = 0; g0 < NB; g0 += GROUP) {
        float res[DEC_MAX_ROWS * GROUP * 16];
        const int64_t nb = NB - g0 < GROUP ? NB - g0 : GROUP;
        for (int64_t m0 = p0; m0 < p1; m0 += DEC_MAX_ROWS) {
            const int64_t mm = p1 - m0 < DEC_MAX_ROWS ? p1 - m0 : DEC_MAX_ROWS;
            gemv_group(dt, (const char *)x + m0 * K * es, mm, K, pw, scale, g0, nb, res);
            store_group(dt == 2 ? 0 : dt, res, mm, m0, g0, nb, N, bias, out);
        }
    }
    }
    return 0;
}

/* out[K][NB * 16] (element type dt) = the transpose of an int8 weight packed as [NB][K][16]: row k
 * holds every output channel's weight at k, 16 contiguous bytes per block, so the int8 linears
 * dequantise for oneDNN (x @ out) reading their own layout (workers/backends/int8.py). */
int int8_unpack_t(int dt, const int8_t *q, int64_t NB, int64_t K, void *out) {
    if (dt < 0 || dt > 1 || NB < 1 || K < 1) return -1;
    /* 4 rows k at a time: the 64 bytes of a block they read are one cache line */
    _Pragma("omp parallel for schedule(static)")
    for (int64_t k0 = 0; k0 < K; k0 += 4)
        for (int64_t nb = 0; nb < NB; nb++)
        for (int64_t k = k0; k < k0 + 4 && k < K; k++) {
            const int8_t *src = q + (nb * K + k) * 16;
            const int64_t o = (k * NB + nb) * 16;
#if HAVE_AVX512
            const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
            if (dt == 1)  /* integers of at most 8 bits: the top half of their fp32 bits is the exact bf16 */
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + o),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
            else
                _mm512_storeu_ps((float *)out + o, v);
#else
            for (int l = 0; l < 16; l++) {
                const union { float f; uint32_t u; } v = {(float)src[l]};
                if (dt == 1) ((uint16_t *)out)[o + l] = (uint16_t)(v.u >> 16);
                else ((float *)out)[o + l] = v.f;
            }
#endif
        }
    return 0;
}

/* ---- Fused elementwise kernels of the decoder layer (cpu_fused.py) ----------------------------
 * Both round like transformers' eager code, op by op, so outputs match it on the same weights:
 * no contraction of a*b+c into one fused multiply-add here (it rounds once where torch rounds twice). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma clang fp contract(off)
#endif

/* One row's RMSNorm, statistics in fp32: out = w * to_dtype(x * rsqrt(mean(x^2) + eps)) (transformers'
 * LlamaRMSNorm), or with w1 (Gemma's 1 + w, fp32) out = to_dtype((x * rsqrt(...)) * w1), both products
 * in fp32 and one rounding (transformers' Gemma RMSNorm). */
INLINE void rms_row(int dtype, const void *x, int64_t off, const void *w, const float *w1, void *out,
                    int64_t out_off, int64_t C, float eps, float *buf) {
    float ss = 0.0f;
    for (int64_t c = 0; c < C; c++) {
        buf[c] = load_one(dtype, x, off + c);
        ss += buf[c] * buf[c];
    }
    const float inv = 1.0f / sqrtf(ss / (float)C + eps);
    if (w1 != NULL)
        for (int64_t c = 0; c < C; c++) store_one(dtype, out, out_off + c, (buf[c] * inv) * w1[c]);
    else
        for (int64_t c = 0; c < C; c++)
            store_one(dtype, out, out_off + c, load_one(dtype, w, c) * round_to(dtype, buf[c] * inv));
}

static int rms_rows(int dtype, const void *x, int64_t row_stride, const void *w, const float *w1, void *out,
                    int64_t N, int64_t C, float eps) {
    if (C > 65536 || dtype < 0 || dtype > 2 || (dtype == 2 && !HAVE_F16)) return -1;
    _Pragma("omp parallel for schedule(static) if (N * C > 262144)")
    for (int64_t r = 0; r < N; r++) {
        float buf[C];
        switch (dtype) {
        case 0: rms_row(0, x, r * row_stride, w, w1, out, r * C, C, eps, buf); break;
        case 1: rms_row(1, x, r * row_stride, w, w1, out, r * C, C, eps, buf); break;
        default: rms_row(2, x, r * row_stride, w, w1, out, r * C, C, eps, buf); break;
        }
    }
    return 0;
}

/* RMSNorm of N rows of C elements (row r at x + r * row_stride), as transformers' LlamaRMSNorm. out is
 * contiguous [N, C]. C <= 65536. */
int rms_norm(int dtype, const void *x, int64_t row_stride, const void *w, void *out, int64_t N, int64_t C,
             float eps) {
    return rms_rows(dtype, x, row_stride, w, NULL, out, N, C, eps);
}

/* Gemma's RMSNorm of N rows (w1 = 1 + w in fp32; cpu_fused.CpuGemmaRMSNorm). Else as rms_norm. */
int rms_norm_w1(int dtype, const void *x, int64_t row_stride, const float *w1, void *out, int64_t N, int64_t C,
                float eps) {
    return rms_rows(dtype, x, row_stride, NULL, w1, out, N, C, eps);
}

/* One token's H heads of D elements at x + base0: the first 2 * half of each head turned (half = D / 2:
 * all of it; less: a partial rotary, the rest left as it is), cos/sin the token's table rows [half]. */
INLINE void rope_token(int dtype, void *x, int64_t base0, int64_t H, int64_t D, int64_t half, const float *cr,
                       const float *sr) {
#if HAVE_AVX512BW
    if (dtype == 1 && half % 16 == 0 && half <= 128) {
        /* bf16, 16 lanes at a time: the same products, sums and roundings (bf16_bits16 is
         * f32_to_bf16), so the same bits; the scalar loop below took ~1 ns per element */
        __m512 c[8], s[8];
        for (int64_t v = 0; v < half / 16; v++) {
            c[v] = round16(1, _mm512_loadu_ps(cr + 16 * v));
            s[v] = round16(1, _mm512_loadu_ps(sr + 16 * v));
        }
        for (int64_t h = 0; h < H; h++) {
            const int64_t base = base0 + h * D;
            for (int64_t v = 0; v < half / 16; v++) {
                const int64_t i = base + 16 * v;
                const __m512 x1 = load16m(1, x, i, 0xFFFF), x2 = load16m(1, x, i + half, 0xFFFF);
                const __m512 a = _mm512_sub_ps(round16(1, _mm512_mul_ps(x1, c[v])), round16(1, _mm512_mul_ps(x2, s[v])));
                const __m512 b = _mm512_add_ps(round16(1, _mm512_mul_ps(x2, c[v])), round16(1, _mm512_mul_ps(x1, s[v])));
                store16m(1, x, i, a, 0xFFFF);
                store16m(1, x, i + half, b, 0xFFFF);
            }
        }
        return;
    }
#endif
    float c[half], s[half];
    for (int64_t i = 0; i < half; i++) { c[i] = round_to(dtype, cr[i]); s[i] = round_to(dtype, sr[i]); }
    for (int64_t h = 0; h < H; h++) {
        const int64_t base = base0 + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = load_one(dtype, x, base + i), x2 = load_one(dtype, x, base + half + i);
            const float a = round_to(dtype, round_to(dtype, x1 * c[i]) - round_to(dtype, x2 * s[i]));
            const float b = round_to(dtype, round_to(dtype, x2 * c[i]) + round_to(dtype, x1 * s[i]));
            store_one(dtype, x, base + i, a);
            store_one(dtype, x, base + half + i, b);
        }
    }
}

/* Rotary embedding in place, NeoX "rotate half" layout, on T tokens x H heads of D elements (token t
 * head h at x + t * t_stride + h * D). cos/sin: fp32 tables [max_pos, D/2] rounded to the activation
 * type first, then x1*c - x2*s and x2*c + x1*s with each product and sum rounded, as transformers
 * computes q * cos + rotate_half(q) * sin in that type. Returns -1 for a position out of the table. */
int rope_inplace(int dtype, void *x, int64_t T, int64_t t_stride, int64_t H, int64_t D, const int64_t *pos,
                 const float *cos_t, const float *sin_t, int64_t max_pos) {
    const int64_t half = D / 2;
    if (dtype < 0 || dtype > 2 || (dtype == 2 && !HAVE_F16)) return -1;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return -1;
    _Pragma("omp parallel for schedule(static) if (T * H * D > 262144)")
    for (int64_t t = 0; t < T; t++) {
        const float *cr = cos_t + pos[t] * half, *sr = sin_t + pos[t] * half;
        switch (dtype) {
        case 0: rope_token(0, x, t * t_stride, H, D, half, cr, sr); break;
        case 1: rope_token(1, x, t * t_stride, H, D, half, cr, sr); break;
        default: rope_token(2, x, t * t_stride, H, D, half, cr, sr); break;
        }
    }
    return 0;
}

/* ---- The whole decoder stack for a decode step of up to DEC_MAX_ROWS sequences ----------------
 * One call runs embedding, every layer (RMSNorm, fused q/k/v projection, rope, cache write,
 * paged attention, o projection + residual, RMSNorm, gate/up projection + SwiGLU, down projection +
 * residual) and the final norm inside one OpenMP parallel region, with a barrier between phases.
 * In eager torch the same step is ~12 op dispatches per layer, each several microseconds, which
 * at batch 1 costs as much as streaming the weights (docs/performance.md). Every intermediate is
 * rounded to the activation type where torch's eager ops round, so results follow the unfused path
 * (the products' sums can differ in order from oneDNN's, i.e. in the last bits of fp32). */
/* A linear layer kept in a GGUF file's quantised blocks (workers/backends/gguf_linear.py, whose
 * CParts is this layout, gguf_kernels.c's gg_linear_t too): up to 4 parts (one per GGUF tensor,
 * each its own ggml type), computed by gguf_kernels.c's gguf_rows through the step's pointer over
 * activations quantised by its gguf_quantize_row */
#define DEC_GGUF_PARTS 4
typedef struct {
    int64_t n_parts;
    int64_t first[DEC_GGUF_PARTS], rows[DEC_GGUF_PARTS], type[DEC_GGUF_PARTS];  /* output rows, ggml type */
    const void *data[DEC_GGUF_PARTS];  /* [rows][row bytes] */
    /* part p takes gguf_rows' dequantised tiles from tile_from[p] rows (0: never, the integer
     * products) to tile_to (0: no limit); batch-invariant mode: 1 or 0, one path at every count */
    int64_t tile_from[DEC_GGUF_PARTS], tile_to;
} dec_gguf_t;

INLINE int dec_gguf_tile(const dec_gguf_t *g, int64_t p, int64_t M) {
    return g->tile_from[p] && M >= g->tile_from[p] && (!g->tile_to || M <= g->tile_to);
}

/* whether every part of g takes the tiles at this step's rows (no quantised input needed) */
INLINE int dec_gguf_tiled(const dec_gguf_t *g, int64_t M) {
    if (!g) return 1;
    for (int64_t p = 0; p < g->n_parts; p++)
        if (!dec_gguf_tile(g, p, M)) return 0;
    return 1;
}

typedef void (*gguf_rows_fn)(int type, const void *w, int64_t K, const int8_t *xq, const float *d4,
                             const float *s16, int64_t M, int64_t n0, int64_t n1, float *res, int64_t ldr,
                             int dt, const void *x);
typedef void (*gguf_quantize_fn)(int dt, const void *x, int64_t K, int8_t *xq, float *d4, float *s16);

typedef struct {
    /* weights packed for gemv_group; gate and up as two matrices of I rows */
    const void *in_norm, *qkv_w, *qkv_b, *o_w, *o_b, *post_norm, *gate_w, *gate_b, *up_w, *up_b, *down_w, *down_b;
    const float *qkv_s, *o_s, *gate_s, *up_s, *down_s;  /* int8 weights: their scales; else NULL */
    void *k_cache, *v_cache;
    int64_t window;  /* <= 0: none */
    const dec_gguf_t *qkv_g, *o_g, *gate_g, *up_g, *down_g;  /* GGUF blocks instead of *_w; else NULL */
    /* optional (NULL: none): per-head q and k norms before rope (Qwen3, Gemma 3); Gemma's norms of
     * the attention's and the feed-forward's outputs before their residual adds */
    const void *q_norm, *k_norm, *attn_out_norm, *ff_out_norm;
    const float *cos_t, *sin_t;  /* this layer's rope tables (Gemma's local and global ropes differ) */
    int64_t moe;  /* a mixture-of-experts layer: the step stops after its feed-forward's norm (dec_step_t l0) */
    const float *sinks;  /* GPT-OSS: [H] fp32 sink logits of this layer's softmax (item_sink), or NULL */
    int64_t rot_half;  /* a partial rotary (GLM-4-MoE): the first 2 * rot_half dims of a head turn, its
                        * tables [max_pos, rot_half]; 0: all D (tables [max_pos, D / 2]) */
} dec_layer_t;

typedef struct {
    int64_t n_layers, C, H, Hkv, D, I, bs, max_blocks, max_pos, M;
    float eps, scale;
    const dec_layer_t *layers;
    const void *embed;         /* [V, C] */
    const int64_t *ids, *pos;  /* [M] */
    const int64_t *blocks, *offsets;  /* [M]: the cache slot of each new token */
    const int64_t *tables;     /* [M, max_blocks] */
    const void *final_norm;
    const uint16_t *act_bf16;  /* [65536 + 2]: the activation of every bf16 value as torch computes it, or NULL */
    void *x;       /* [M, C] residual stream (scratch) */
    void *xn;      /* [M, C] normed (scratch) */
    void *qkv;     /* [M, (H + 2 Hkv) D] */
    void *att;     /* [M, H D] */
    void *act;     /* [M, I] */
    void *out;     /* [M, C]: the final norm's output */
    gguf_rows_fn gg_rows;          /* GGUF layers: gguf_kernels.c's products, or NULL */
    gguf_quantize_fn gg_quantize;
    int8_t *gg_xq;                 /* [M, max K]: a GGUF layer's input quantised per 32 values */
    float *gg_d4, *gg_s16;         /* [M, max K / 4], [M, max K / 16] */
    /* Gemma: norms scale by 1 + w (the weights given as fp32 1 + w: rms_row's w1), the feed-forward
     * is GeGLU (gelu, tanh approximation), the embedding rows times embed_scale (0: none) */
    int64_t norm_w1, act_gelu;
    float embed_scale;
    float softcap;  /* Gemma 2: attention scores soft-capped (cap_one); 0: none */
    /* layers l0 .. on (0: from the embedding); decode_layers sets stopped: the first moe layer it met,
     * whose attention it added to x and whose feed-forward input it left normed in xn (the caller
     * adds that layer's mixture to x and calls again from stopped + 1), or -1: done, out written */
    int64_t l0, stopped;
} dec_step_t;

#if HAVE_AVX512BW
/* round(act(g)) * u for 16 lanes: g's bf16 bits (each lane's low 16) index torch's own silu (or
 * gelu) results (the tables hold 2 spare entries, so the 4-byte gather of the last one stays
 * inside); the product in fp32, rounded by the store as torch rounds it */
INLINE __m512 act_times16(const uint16_t *table, __m512i gbits, __m512 u) {
    const __m512i t = _mm512_i32gather_epi32(gbits, (const void *)table, 2);
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(t, 16)), u);
}
#endif

/* This thread's share of NB 16-channel blocks, split evenly over the team (dealing whole groups
 * of GROUP would give two threads 24 and 19 of 43 blocks, one idle at the phase's end) */
INLINE void my_blocks(int64_t NB, int64_t *b0, int64_t *b1) {
    const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
    *b0 = NB * t / T;
    *b1 = NB * (t + 1) / T;
}

/* one row's norm of C values in place or not, Llama's (w) or Gemma's (norm_w1: w is fp32 1 + w) */
INLINE void dec_rms_row(int dt, const dec_step_t *s, const void *src, int64_t off, const void *w, void *dst,
                        int64_t C, float *buf) {
    rms_row(dt, src, off, s->norm_w1 ? NULL : w, s->norm_w1 ? (const float *)w : NULL, dst, off, C, s->eps, buf);
}

INLINE void dec_norm_rows(int dt, const dec_step_t *s, const void *w, void *dst) {
    float buf[s->C];
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < s->M; m++) dec_rms_row(dt, s, s->x, m * s->C, w, dst, s->C, buf);
}

/* Gemma's sandwich: x += round(norm(xn)) (xn normed in place first, then the residual add rounded
 * as torch's x + h) */
INLINE void dec_norm_add_rows(int dt, const dec_step_t *s, const void *w) {
    float buf[s->C];
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < s->M; m++) {
        dec_rms_row(dt, s, s->xn, m * s->C, w, s->xn, s->C, buf);
        for (int64_t c = 0; c < s->C; c++) {
            const int64_t i = m * s->C + c;
            store_one(dt, s->x, i, load_one(dt, s->x, i) + load_one(dt, s->xn, i));
        }
    }
}

/* A GGUF layer's input rows quantised into the step's scratch (the team's rows split, then a barrier) */
INLINE void dec_gguf_quantize(int dt, const dec_step_t *s, const void *in, int64_t K) {
    const int64_t es = dt == 0 ? 4 : 2;
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < s->M; m++)
        s->gg_quantize(dt, (const char *)in + m * K * es, K, s->gg_xq + m * K, s->gg_d4 + m * (K / 4),
                       s->gg_s16 + m * (K / 16));
}

/* gemv_group's sums for the 16-channel blocks g0 .. g0 + nb of a GGUF layer, from its parts (in:
 * the layer's input rows of type dt, for gguf_rows' dequantised tiles) */
INLINE void gguf_group(int dt, const dec_step_t *s, const dec_gguf_t *g, const void *in, int64_t K, int64_t N,
                       int64_t g0, int64_t nb, float *res) {
    const int64_t lo = g0 * 16, hi = (g0 + nb) * 16 < N ? (g0 + nb) * 16 : N;
    for (int64_t p = 0; p < g->n_parts; p++) {
        const int64_t a = g->first[p] > lo ? g->first[p] : lo, e = g->first[p] + g->rows[p];
        const int64_t b = e < hi ? e : hi;
        if (a < b)
            s->gg_rows((int)g->type[p], g->data[p], K, s->gg_xq, s->gg_d4, s->gg_s16, s->M, a - g->first[p],
                       b - g->first[p], res + (a - lo), GROUP * 16, dt, dec_gguf_tile(g, p, s->M) ? in : NULL);
    }
}

/* x[M, K] @ w^T (+ b): out[m, n] = round(sum), or with residual x[m, n] = round(x + round(sum));
 * pt: the products' type code (dt, or 2: fp32 rows over bf16 weights, gemv_group's dt 2) */
INLINE void dec_linear(int dt, int pt, const dec_step_t *s, const void *in, int64_t K, const void *w,
                       const float *sc, const dec_gguf_t *gg, const void *bias, int64_t N, void *dst, int residual) {
    float res[DEC_MAX_ROWS * GROUP * 16];
    const int64_t NB = (N + 15) / 16;
    int64_t b0, b1;
    if (gg && !dec_gguf_tiled(gg, s->M)) dec_gguf_quantize(dt, s, in, K);
    my_blocks(NB, &b0, &b1);
    for (int64_t g0 = b0; g0 < b1; g0 += GROUP) {
        const int64_t nb = b1 - g0 < GROUP ? b1 - g0 : GROUP;
        if (gg) gguf_group(dt, s, gg, in, K, N, g0, nb, res);
        else gemv_group(sc ? dt : pt, in, s->M, K, w, sc, g0, nb, res);
#if HAVE_AVX512BW
        for (int64_t m = 0; m < s->M; m++)
            for (int64_t b = 0; b < nb; b++) {
                const int64_t n0 = (g0 + b) * 16, i = m * N + n0;
                const __mmask16 k = lanes16(N - n0);
                __m512 v = _mm512_loadu_ps(res + m * GROUP * 16 + b * 16);
                if (bias) v = _mm512_add_ps(v, load16m(dt, bias, n0, k));
                v = round16(dt, v);
                /* the sum as it stands: -fassociative-math would otherwise fold an fp32 residual
                 * add into (x + bias) + sum, where the eager path (and batch-invariant mode: a row
                 * the same in either) adds x + (sum + bias) */
                __asm__("" : "+v"(v));
                store16m(dt, dst, i, residual ? _mm512_add_ps(load16m(dt, dst, i, k), v) : v, k);
            }
        continue;
#endif
        for (int64_t m = 0; m < s->M; m++)
            for (int64_t n = g0 * 16; n < N && n < (g0 + nb) * 16; n++) {
                const float v = round_to(dt, res[m * GROUP * 16 + n - g0 * 16] + (bias ? load_one(dt, bias, n) : 0.0f));
                const int64_t i = m * N + n;
                store_one(dt, dst, i, residual ? load_one(dt, dst, i) + v : v);
            }
    }
    _Pragma("omp barrier")
}

/* A block's output projection into the residual stream: x += round(in @ w^T), or with Gemma's
 * norm of it (out_norm) x += round(norm(round(in @ w^T))), the product landing in xn first */
INLINE void dec_residual(int dt, int pt, const dec_step_t *s, const void *in, int64_t K, const void *w,
                         const float *sc, const dec_gguf_t *gg, const void *bias, const void *out_norm) {
    dec_linear(dt, pt, s, in, K, w, sc, gg, bias, s->C, out_norm ? s->xn : s->x, !out_norm);
    if (out_norm) dec_norm_add_rows(dt, s, out_norm);
}

/* torch's gelu with the tanh approximation, as its scalar code writes it */
INLINE float gelu_tanh(float x) {
    const float beta = (float)0.79788456080286535588, kappa = 0.044715f;  /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(beta * (x + kappa * (x * x * x))));
}

/* gate and up for the same outputs together: act = round(round(silu(g)) * u), or gelu's (GeGLU) */
INLINE void dec_glu(int dt, int pt, const dec_step_t *s, const dec_layer_t *L) {
    float rg[DEC_MAX_ROWS * GROUP * 16], ru[DEC_MAX_ROWS * GROUP * 16];
    const int64_t I = s->I, NB = (I + 15) / 16;
    int64_t b0, b1;
    if ((L->gate_g || L->up_g) && !(dec_gguf_tiled(L->gate_g, s->M) && dec_gguf_tiled(L->up_g, s->M)))
        dec_gguf_quantize(dt, s, s->xn, s->C);  /* one input for both */
    my_blocks(NB, &b0, &b1);
    for (int64_t g0 = b0; g0 < b1; g0 += GROUP) {
        const int64_t nb = b1 - g0 < GROUP ? b1 - g0 : GROUP;
        if (L->gate_g) gguf_group(dt, s, L->gate_g, s->xn, s->C, I, g0, nb, rg);
        else gemv_group(L->gate_s ? dt : pt, s->xn, s->M, s->C, L->gate_w, L->gate_s, g0, nb, rg);
        if (L->up_g) gguf_group(dt, s, L->up_g, s->xn, s->C, I, g0, nb, ru);
        else gemv_group(L->up_s ? dt : pt, s->xn, s->M, s->C, L->up_w, L->up_s, g0, nb, ru);
#if HAVE_AVX512BW
        if (dt == 1 && s->act_bf16) {
            for (int64_t m = 0; m < s->M; m++)
                for (int64_t b = 0; b < nb; b++) {
                    const int64_t n0 = (g0 + b) * 16, r = m * GROUP * 16 + b * 16;
                    const __mmask16 k = lanes16(I - n0);
                    __m512 g = _mm512_loadu_ps(rg + r), u = _mm512_loadu_ps(ru + r);
                    if (L->gate_b) g = _mm512_add_ps(g, load16m(1, L->gate_b, n0, k));
                    if (L->up_b) u = _mm512_add_ps(u, load16m(1, L->up_b, n0, k));
                    store16m(1, s->act, m * I + n0, act_times16(s->act_bf16, bf16_bits16(g), round16(1, u)), k);
                }
            continue;
        }
#endif
        for (int64_t m = 0; m < s->M; m++)
            for (int64_t n = g0 * 16; n < I && n < (g0 + nb) * 16; n++) {
                const int64_t r = m * GROUP * 16 + n - g0 * 16;
                const float g = round_to(dt, rg[r] + (L->gate_b ? load_one(dt, L->gate_b, n) : 0.0f));
                const float u = round_to(dt, ru[r] + (L->up_b ? load_one(dt, L->up_b, n) : 0.0f));
                /* bf16: torch's own results (its vectorised exp differs from expf in the last bit at times) */
                const float sg = dt == 1 && s->act_bf16 ? bf16_to_f32(s->act_bf16[f32_to_bf16(g)])
                               : round_to(dt, s->act_gelu ? gelu_tanh(g) : g / (1.0f + expf(-g)));
                store_one(dt, s->act, m * I + n, sg * u);
            }
    }
    _Pragma("omp barrier")
}

/* SwiGLU of bf16 rows for the eager path (GeGLU given a gelu table): out[t, i] =
 * round(round(silu(g)) * u), g = gu[t, i] and u = gu[t, I + i] (rows gu_stride elements apart,
 * out [T, I] contiguous), silu from torch's own results (table: 65536 + 2 entries, cpu_fused.py) and products rounded as torch rounds them, so
 * the output equals F.silu(gate) * up bit for bit; one pass instead of two ops each writing the
 * whole activation. Builds without AVX-512BW return -1 (the caller keeps torch). */
int silu_mul_bf16(const uint16_t *gu, int64_t T, int64_t I, int64_t gu_stride, const uint16_t *table,
                  uint16_t *out) {
#if HAVE_AVX512BW
    _Pragma("omp parallel for schedule(static) if (T * I > 65536)")
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gu + t * gu_stride, *u = g + I;
        for (int64_t i = 0; i < I; i += 16) {
            const __mmask16 k = lanes16(I - i);
            /* lanes past I load 0: a valid index, their products are not stored */
            const __m512i gi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, g + i));
            const __m512 uf = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, u + i)), 16));
            store16m(1, out, t * I + i, act_times16(table, gi, uf), k);
        }
    }
    return 0;
#else
    /* the fused step's scalar form (dec_glu): the same table and roundings */
    _Pragma("omp parallel for schedule(static) if (T * I > 65536)")
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < I; i++)
            store_one(1, out, t * I + i, bf16_to_f32(table[gu[t * gu_stride + i]]) * bf16_to_f32(gu[t * gu_stride + I + i]));
    return 0;
#endif
}

/* SwiGLU of fp32 rows for the eager path in batch-invariant mode (cpu_fused.py): out[t, i] =
 * (g / (1 + expf(-g))) * u, element by element as the fused decode step computes an fp32 step
 * (dec_glu), so a row's activation is the same in either. (torch's silu takes its vectorised
 * exp in the body of a loop and the scalar one in its tails, whose place moves with the row
 * count.) */
static int glu_mul_f32(const float *gu, int64_t T, int64_t I, int64_t gu_stride, int gelu, float *out) {
    _Pragma("omp parallel for schedule(static) if (T * I > 65536)")
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < I; i++) {
            const float g = gu[t * gu_stride + i], u = gu[t * gu_stride + I + i];
            out[t * I + i] = round_to(0, gelu ? gelu_tanh(g) : g / (1.0f + expf(-g))) * u;
        }
    return 0;
}

int silu_mul_f32(const float *gu, int64_t T, int64_t I, int64_t gu_stride, float *out) {
    return glu_mul_f32(gu, T, I, gu_stride, 0, out);
}

/* GeGLU of fp32 rows (Gemma's gelu with the tanh approximation), as silu_mul_f32 */
int gelu_mul_f32(const float *gu, int64_t T, int64_t I, int64_t gu_stride, float *out) {
    return glu_mul_f32(gu, T, I, gu_stride, 1, out);
}

INLINE void dec_step(int dt, int pt, const dec_step_t *s, int64_t stop) {
    const int64_t M = s->M, C = s->C, H = s->H, Hkv = s->Hkv, D = s->D, half = D / 2;
    const int64_t NQ = (H + 2 * Hkv) * D, es = dt == 0 ? 4 : 2;
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < (s->l0 == 0 ? M : 0); m++) {
        if (s->embed_scale == 0.0f) {
            memcpy((char *)s->x + m * C * es, (const char *)s->embed + s->ids[m] * C * es, C * es);
            continue;
        }
        for (int64_t c = 0; c < C; c++)  /* Gemma: x * round(sqrt(C)), rounded as torch's product */
            store_one(dt, s->x, m * C + c, load_one(dt, s->embed, s->ids[m] * C + c) * s->embed_scale);
    }
    for (int64_t l = s->l0; l < (stop < 0 ? s->n_layers : stop + 1); l++) {
        const dec_layer_t *L = &s->layers[l];
        dec_norm_rows(dt, s, L->in_norm, s->xn);
        dec_linear(dt, pt, s, s->xn, C, L->qkv_w, L->qkv_s, L->qkv_g, L->qkv_b, NQ, s->qkv, 0);
        _Pragma("omp for schedule(static)")
        for (int64_t m = 0; m < M; m++) {
            float hb[MAX_D];
            for (int64_t h = 0; L->q_norm && h < H + Hkv; h++)  /* per-head q / k norms, in place */
                dec_rms_row(dt, s, s->qkv, m * NQ + h * D, h < H ? L->q_norm : L->k_norm, s->qkv, D, hb);
            const int64_t hr = L->rot_half ? L->rot_half : half;
            rope_token(dt, s->qkv, m * NQ, H + Hkv, D, hr, L->cos_t + s->pos[m] * hr, L->sin_t + s->pos[m] * hr);
            const char *row = (const char *)s->qkv + m * NQ * es;
            paged_write(es, row + H * D * es, L->k_cache, s->blocks + m, s->offsets + m, 1, NQ, Hkv, s->bs, D);
            paged_write(es, row + (H + Hkv) * D * es, L->v_cache, s->blocks + m, s->offsets + m, 1, NQ, Hkv, s->bs, D);
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t i = 0; i < M * Hkv; i++) {
            const int64_t m = i / Hkv;
            attend_item(dt, (const char *)s->qkv + m * NQ * es, L->k_cache, L->v_cache, s->tables + m * s->max_blocks,
                        s->pos[m], H, Hkv, s->bs, D, L->window, s->scale, s->softcap, L->sinks, i % Hkv, (char *)s->att + m * H * D * es);
        }
        dec_residual(dt, pt, s, s->att, H * D, L->o_w, L->o_s, L->o_g, L->o_b, L->attn_out_norm);
        dec_norm_rows(dt, s, L->post_norm, s->xn);
        if (l == stop) return;  /* its mixture of experts: the caller's */
        dec_glu(dt, pt, s, L);
        dec_residual(dt, pt, s, s->act, s->I, L->down_w, L->down_s, L->down_g, L->down_b, L->ff_out_norm);
    }
    dec_norm_rows(dt, s, s->final_norm, s->out);
}

/* dtype 0 fp32, 1 bf16, 2 (HAVE_W16 builds): fp32 activations over bf16 layer weights (linear_rows' dt 2;
 * int8 layers keep their own products). Returns 0, or -1 (before touching anything) for shapes
 * beyond the static buffers or a position outside the rope table. */
int decode_layers(int dtype, dec_step_t *s) {
    if (dtype < 0 || dtype > 2 || (dtype == 2 && !HAVE_W16) || s->M < 1 || s->M > DEC_MAX_ROWS || s->D > MAX_D
        || s->D % 2 || s->Hkv <= 0 || s->H % s->Hkv || s->H / s->Hkv > MAX_G || s->C > 65536
        || s->l0 < 0 || s->l0 > s->n_layers)  /* l0 = n_layers: the final norm alone */
        return -1;
    for (int64_t m = 0; m < s->M; m++)
        if (s->pos[m] < 0 || s->pos[m] >= s->max_pos || s->offsets[m] < 0 || s->offsets[m] >= s->bs) return -1;
    for (int64_t l = 0; l < s->n_layers; l++)
        if (s->layers[l].rot_half < 0 || s->layers[l].rot_half > s->D / 2) return -1;
    int64_t stop = -1;
    for (int64_t l = s->l0; l < s->n_layers && stop < 0; l++)
        if (s->layers[l].moe) stop = l;
    s->stopped = stop;
    _Pragma("omp parallel")
    {
        if (dtype == 0) dec_step(0, 0, s, stop); else if (dtype == 1) dec_step(1, 1, s, stop); else dec_step(0, 2, s, stop);
    }
    return 0;
}

#pragma GCC pop_options

/* ---------------------------------------------------------------------------------------------
 * 6. The gated delta rule's recurrent step (Gated DeltaNet decodes of Qwen3-Next / Qwen3.5:
 *    workers/backends/cpu_deltanet.py, the torch reference workers/models/gated_deltanet.py
 *    recurrent_gated_delta_rule), fp32. For each sequence b and value head h, with its key head
 *    h / (Hv / Hk), q and k l2-normalised (eps 1e-6), q scaled by 1/sqrt(Dk), S = state[slots[b], h]
 *    [Dk, Dv]:
 *        S' = exp(g) S + k (beta (v - exp(g) S^T k))^T,   out = S'^T q
 *    computed as one read sweep (a = S^T k, c = S^T q, together) and one update sweep of S in
 *    place: out = exp(g) c + delta (k . q), delta = beta (v - exp(g) a).
 *    q, k [B, Hk, Dk]; v, out [B, Hv, Dv]; g, beta [B, Hv]; state [slots, Hv, Dk, Dv]. */
int gdn_recurrent(int64_t B, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, const float *q, const float *k,
                  const float *v, const float *g, const float *beta, float *state, const int64_t *slots,
                  float *out) {
    if (Dk > 1024 || Dv > 1024 || Hv % Hk) return -1;
    int64_t rep = Hv / Hk;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hv; h++) {
            const float *qh = q + (b * Hk + h / rep) * Dk, *kh = k + (b * Hk + h / rep) * Dk;
            const float *vh = v + (b * Hv + h) * Dv;
            float *S = state + (slots[b] * Hv + h) * Dk * Dv;
            float qn[1024], kn[1024], a[1024], c[1024];
            float sq = 0.f, sk = 0.f;
            for (int64_t i = 0; i < Dk; i++) { sq += qh[i] * qh[i]; sk += kh[i] * kh[i]; }
            float rq = 1.f / sqrtf(sq + 1e-6f), rk = 1.f / sqrtf(sk + 1e-6f), scale = 1.f / sqrtf((float)Dk);
            float kq = 0.f;
            for (int64_t i = 0; i < Dk; i++) {
                qn[i] = qh[i] * rq * scale;
                kn[i] = kh[i] * rk;
                kq += kn[i] * qn[i];
            }
            for (int64_t j = 0; j < Dv; j++) { a[j] = 0.f; c[j] = 0.f; }
            for (int64_t i = 0; i < Dk; i++) { /* the read sweep: S^T k and S^T q */
                const float *row = S + i * Dv;
                float ki = kn[i], qi = qn[i];
                for (int64_t j = 0; j < Dv; j++) { a[j] += row[j] * ki; c[j] += row[j] * qi; }
            }
            float decay = expf(g[b * Hv + h]), bt = beta[b * Hv + h];
            float *o = out + (b * Hv + h) * Dv;
            for (int64_t j = 0; j < Dv; j++) {
                float delta = (vh[j] - decay * a[j]) * bt;
                a[j] = delta; /* reused: the row update */
                o[j] = decay * c[j] + delta * kq;
            }
            for (int64_t i = 0; i < Dk; i++) { /* the update sweep, in place */
                float *row = S + i * Dv;
                float ki = kn[i];
                for (int64_t j = 0; j < Dv; j++) row[j] = decay * row[j] + ki * a[j];
            }
        }
    }
    return 0;
}
