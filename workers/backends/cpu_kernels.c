/* C kernels for the CPU backend (built at first use by cpu_kernels.py): paged attention, RMSNorm, rope.
 *
 * The portable torch path must copy every decoding sequence's KV blocks into a scratch tensor
 * (twice per layer) before its batched matmuls can run, and pays ~15 op dispatches per layer;
 * at small batches that is most of the attention time. These kernels read the cache in place
 * through the block tables, one pass with an online softmax (flash-decoding style), in fp32.
 *
 * Layouts (as workers/engine/attention.py):
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
#include <stdint.h>
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

#define MAX_D 256
#define MAX_G 16
#define CHUNK 128

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

/* One (sequence, kv head) work item, over chunks of up to CHUNK cached positions of one block:
 * scores of the chunk for the G query heads, one rescale of the running sums per chunk, then the
 * value rows. Cached rows are read in place and converted to fp32 inside the loops. */
INLINE void decode_item(int dt, const void *q, const void *kc, const void *vc, const int64_t *table, int64_t p,
                        int64_t H, int64_t Hkv, int64_t bs, int64_t D, int64_t window, float scale, int64_t kvh,
                        void *out) {
    const int64_t G = H / Hkv;
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G], sc[MAX_G][CHUNK];
    for (int64_t g = 0; g < G; g++) {
        for (int64_t d = 0; d < D; d++) {
            qf[g][d] = load_one(dt, q, (kvh * G + g) * D + d) * scale;
            acc[g][d] = 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
    for (int64_t t0 = lo; t0 <= p;) {
        const int64_t in_blk = t0 % bs;
        int64_t n = bs - in_blk;
        if (n > p + 1 - t0) n = p + 1 - t0;
        if (n > CHUNK) n = CHUNK;
        const int64_t base = ((table[t0 / bs] * Hkv + kvh) * bs + in_blk) * D;
        for (int64_t j = 0; j < n; j++) {
            const int64_t r = base + j * D;
            for (int64_t g = 0; g < G; g++) {
                float dot = 0.0f;
                for (int64_t d = 0; d < D; d++) dot += qf[g][d] * load_one(dt, kc, r + d);
                sc[g][j] = dot;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float mb = m[g];
            for (int64_t j = 0; j < n; j++) mb = sc[g][j] > mb ? sc[g][j] : mb;
            if (mb > m[g]) {
                const float corr = expf(m[g] - mb);  /* 0 on the first chunk: m = -inf */
                l[g] *= corr;
                for (int64_t d = 0; d < D; d++) acc[g][d] *= corr;
                m[g] = mb;
            }
            float sum = 0.0f;
            _Pragma("omp simd reduction(+:sum)")
            for (int64_t j = 0; j < n; j++) { sc[g][j] = expf(sc[g][j] - mb); sum += sc[g][j]; }
            l[g] += sum;
        }
        for (int64_t j = 0; j < n; j++) {
            const int64_t r = base + j * D;
            for (int64_t g = 0; g < G; g++) {
                const float e = sc[g][j];
                for (int64_t d = 0; d < D; d++) acc[g][d] += e * load_one(dt, vc, r + d);
            }
        }
        t0 += n;
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = 1.0f / l[g];
        for (int64_t d = 0; d < D; d++) store_one(dt, out, (kvh * G + g) * D + d, acc[g][d] * inv);
    }
}

/* dtype: 0 fp32, 1 bf16, 2 fp16. Returns 0, or -1 when a dimension exceeds the static buffers. */
int paged_decode(int dtype, const void *q, const void *kc, const void *vc, const int64_t *tables,
                 int64_t max_blocks, const int64_t *pos, int64_t B, int64_t H, int64_t Hkv, int64_t bs,
                 int64_t D, int64_t window, float scale, void *out) {
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
        case 0: decode_item(0, qb, kc, vc, table, pos[b], H, Hkv, bs, D, window, scale, kvh, ob); break;
        case 1: decode_item(1, qb, kc, vc, table, pos[b], H, Hkv, bs, D, window, scale, kvh, ob); break;
        default: decode_item(2, qb, kc, vc, table, pos[b], H, Hkv, bs, D, window, scale, kvh, ob); break;
        }
    }
    return 0;
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

/* ---- Fused elementwise kernels of the decoder layer (cpu_fused.py) ----------------------------
 * Both round like transformers' eager code, op by op, so outputs match it on the same weights:
 * no contraction of a*b+c into one fused multiply-add here (it rounds once where torch rounds twice). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma clang fp contract(off)
#endif

INLINE void rms_row(int dtype, const void *x, int64_t off, const void *w, void *out, int64_t out_off, int64_t C,
                    float eps, float *buf) {
    float ss = 0.0f;
    for (int64_t c = 0; c < C; c++) {
        buf[c] = load_one(dtype, x, off + c);
        ss += buf[c] * buf[c];
    }
    const float inv = 1.0f / sqrtf(ss / (float)C + eps);
    for (int64_t c = 0; c < C; c++)
        store_one(dtype, out, out_off + c, load_one(dtype, w, c) * round_to(dtype, buf[c] * inv));
}

/* RMSNorm of N rows of C elements (row r at x + r * row_stride): out[r] = w * to_dtype(x * rsqrt(mean(x^2) + eps)),
 * statistics in fp32, as transformers' LlamaRMSNorm. out is contiguous [N, C]. C <= 65536. */
int rms_norm(int dtype, const void *x, int64_t row_stride, const void *w, void *out, int64_t N, int64_t C,
             float eps) {
    if (C > 65536 || dtype < 0 || dtype > 2 || (dtype == 2 && !HAVE_F16)) return -1;
    _Pragma("omp parallel for schedule(static) if (N * C > 262144)")
    for (int64_t r = 0; r < N; r++) {
        float buf[C];
        switch (dtype) {
        case 0: rms_row(0, x, r * row_stride, w, out, r * C, C, eps, buf); break;
        case 1: rms_row(1, x, r * row_stride, w, out, r * C, C, eps, buf); break;
        default: rms_row(2, x, r * row_stride, w, out, r * C, C, eps, buf); break;
        }
    }
    return 0;
}

INLINE void rope_token(int dtype, void *x, int64_t base0, int64_t H, int64_t D, const float *cr, const float *sr) {
    const int64_t half = D / 2;
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
        case 0: rope_token(0, x, t * t_stride, H, D, cr, sr); break;
        case 1: rope_token(1, x, t * t_stride, H, D, cr, sr); break;
        default: rope_token(2, x, t * t_stride, H, D, cr, sr); break;
        }
    }
    return 0;
}

#pragma GCC pop_options
