/* Paged-attention kernels for the CPU backend (built at first use by cpu_kernels.py).
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

/* Load n elements of type T as fp32. */
#define DEFINE_LOAD(NAME, T, CONV)                                          \
    static inline void NAME(const T *src, float *dst, int64_t n) {          \
        for (int64_t i = 0; i < n; i++) dst[i] = CONV(src[i]);              \
    }
#define ID(x) ((float)(x))
DEFINE_LOAD(load_f32, float, ID)
DEFINE_LOAD(load_bf16, uint16_t, bf16_to_f32)
DEFINE_LOAD(load_f16, _Float16, ID)

static inline void store_f32(float *dst, const float *src, int64_t n) { memcpy(dst, src, n * sizeof(float)); }
static inline void store_bf16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}
static inline void store_f16(_Float16 *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = (_Float16)src[i];
}

/* One (sequence, kv head) work item, over chunks of up to CHUNK cached positions: scores of the
 * chunk for the G heads, one rescale of the running sums per chunk, then the value rows. */
#define DEFINE_DECODE(SUFFIX, T)                                                                        \
    static void decode_one_##SUFFIX(const T *q, const T *kc, const T *vc, const int64_t *table,        \
                                    int64_t p, int64_t H, int64_t Hkv, int64_t bs, int64_t D,           \
                                    int64_t window, float scale, int64_t kvh, T *out) {                \
        const int64_t G = H / Hkv;                                                                      \
        float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G], row[MAX_D];                     \
        float sc[MAX_G][CHUNK];                                                                         \
        for (int64_t g = 0; g < G; g++) {                                                               \
            load_##SUFFIX(q + (kvh * G + g) * D, qf[g], D);                                             \
            for (int64_t d = 0; d < D; d++) { qf[g][d] *= scale; acc[g][d] = 0.0f; }                    \
            m[g] = -INFINITY;                                                                           \
            l[g] = 0.0f;                                                                                \
        }                                                                                               \
        const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;                       \
        for (int64_t t0 = lo; t0 <= p;) {                                                               \
            const int64_t blk = t0 / bs, in_blk = t0 % bs;                                              \
            int64_t n = bs - in_blk;                                                                    \
            if (n > p + 1 - t0) n = p + 1 - t0;                                                         \
            if (n > CHUNK) n = CHUNK;                                                                   \
            const int64_t base = ((table[blk] * Hkv + kvh) * bs + in_blk) * D;                          \
            for (int64_t j = 0; j < n; j++) {                                                           \
                load_##SUFFIX(kc + base + j * D, row, D);                                               \
                for (int64_t g = 0; g < G; g++) {                                                       \
                    float dot = 0.0f;                                                                   \
                    for (int64_t d = 0; d < D; d++) dot += qf[g][d] * row[d];                           \
                    sc[g][j] = dot;                                                                     \
                }                                                                                       \
            }                                                                                           \
            for (int64_t g = 0; g < G; g++) {                                                           \
                float mb = m[g];                                                                        \
                for (int64_t j = 0; j < n; j++) mb = sc[g][j] > mb ? sc[g][j] : mb;                     \
                if (mb > m[g]) {                                                                        \
                    const float corr = expf(m[g] - mb);                                                 \
                    l[g] *= corr;                                                                       \
                    for (int64_t d = 0; d < D; d++) acc[g][d] *= corr;                                  \
                    m[g] = mb;                                                                          \
                }                                                                                       \
                float sum = 0.0f;                                                                       \
                _Pragma("omp simd reduction(+:sum)")                                                    \
                for (int64_t j = 0; j < n; j++) { sc[g][j] = expf(sc[g][j] - mb); sum += sc[g][j]; }    \
                l[g] += sum;                                                                            \
            }                                                                                           \
            for (int64_t j = 0; j < n; j++) {                                                           \
                load_##SUFFIX(vc + base + j * D, row, D);                                               \
                for (int64_t g = 0; g < G; g++) {                                                       \
                    const float e = sc[g][j];                                                           \
                    for (int64_t d = 0; d < D; d++) acc[g][d] += e * row[d];                            \
                }                                                                                       \
            }                                                                                           \
            t0 += n;                                                                                    \
        }                                                                                               \
        for (int64_t g = 0; g < G; g++) {                                                               \
            const float inv = 1.0f / l[g];                                                              \
            for (int64_t d = 0; d < D; d++) acc[g][d] *= inv;                                           \
            store_##SUFFIX(out + (kvh * G + g) * D, acc[g], D);                                         \
        }                                                                                               \
    }                                                                                                   \
    static void decode_##SUFFIX(const T *q, const T *kc, const T *vc, const int64_t *tables,           \
                                int64_t max_blocks, const int64_t *pos, int64_t B, int64_t H,          \
                                int64_t Hkv, int64_t bs, int64_t D, int64_t window, float scale,       \
                                T *out) {                                                               \
        int64_t work = 0;                                                                               \
        for (int64_t b = 0; b < B; b++) work += pos[b] + 1;                                             \
        _Pragma("omp parallel for schedule(dynamic, 1) if (work * Hkv * D > 65536)")                   \
        for (int64_t i = 0; i < B * Hkv; i++) {                                                         \
            const int64_t b = i / Hkv, kvh = i % Hkv;                                                   \
            decode_one_##SUFFIX(q + b * H * D, kc, vc, tables + b * max_blocks, pos[b], H, Hkv, bs, D,  \
                                window, scale, kvh, out + b * H * D);                                   \
        }                                                                                               \
    }

DEFINE_DECODE(f32, float)
DEFINE_DECODE(bf16, uint16_t)
DEFINE_DECODE(f16, _Float16)

/* dtype: 0 fp32, 1 bf16, 2 fp16. Returns 0, or -1 when a dimension exceeds the static buffers. */
int paged_decode(int dtype, const void *q, const void *kc, const void *vc, const int64_t *tables,
                 int64_t max_blocks, const int64_t *pos, int64_t B, int64_t H, int64_t Hkv, int64_t bs,
                 int64_t D, int64_t window, float scale, void *out) {
    if (D > MAX_D || Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_G) return -1;
    switch (dtype) {
    case 0: decode_f32(q, kc, vc, tables, max_blocks, pos, B, H, Hkv, bs, D, window, scale, out); return 0;
    case 1: decode_bf16(q, kc, vc, tables, max_blocks, pos, B, H, Hkv, bs, D, window, scale, out); return 0;
    case 2: decode_f16(q, kc, vc, tables, max_blocks, pos, B, H, Hkv, bs, D, window, scale, out); return 0;
    }
    return -1;
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
