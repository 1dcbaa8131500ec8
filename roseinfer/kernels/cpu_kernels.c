// CPU kernels for the hot loop: paged attention straight from the block tables (no gathered copies of
// K/V), and the elementwise chains around it fused into one pass each. float32 and bfloat16 (uint16_t).
// Built with -ffp-contract=off so float32 products and sums round exactly as PyTorch's separate ops do.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf2f(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) {  // round to nearest even, as torch does; branch-free so loops vectorize
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40 : rounded);  // NaN stays NaN
}

// Load n values (float32 or bfloat16) into a float buffer.
static inline void load_row(const void* src, int bf16, int64_t n, float* dst) {
    if (bf16) {
        const uint16_t* s = (const uint16_t*)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf2f(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static inline float round_to(float x, int bf16) { return bf16 ? bf2f(f2bf(x)) : x; }

// exp, branch-free so loops over it vectorize: 2^n * p(r) with |r| <= ln2/2 and a degree-6 polynomial
// (error about 2 ulp); exp(-inf) = 0. Clamped to [-87, 88] so 2^n stays a normal float.
static inline float softmax_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

// 8 floats in a vector register (GCC/Clang vector extensions; lowered to whatever the target has).
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f load8(const void* p, int bf16) {  // 8 consecutive float32 or bfloat16 values, as floats
    v8f f;
    if (bf16) {
        v8u16 h;
        memcpy(&h, p, sizeof(h));
        const v8u32 w = __builtin_convertvector(h, v8u32) << 16;
        memcpy(&f, &w, sizeof(f));
    } else {
        memcpy(&f, p, sizeof(f));
    }
    return f;
}

// The widest vector of floats the build's target has: 16 with AVX-512 (its full-width units halve the
// instructions of the loops below: 16% less attention time on a Zen 5 EPYC), else 8. The width is over keys
// (scores) or over dims (values), never over a sum, so these loops give the same results at either width. (The
// ``omp simd reduction(+)`` sums elsewhere, a softmax's and the sampler's weights, are ordered by the width the
// compiler picks: a machine of another width may round them an ulp apart.)
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));

static inline vf loadv(const void* p, int bf16) {  // VW consecutive float32 or bfloat16 values, as floats
    vf f;
    if (bf16) {
        vu16 h;
        memcpy(&h, p, sizeof(h));
        const vu32 w = __builtin_convertvector(h, vu32) << 16;
        memcpy(&f, &w, sizeof(f));
    } else {
        memcpy(&f, p, sizeof(f));
    }
    return f;
}

// Scores of G query heads (rows q_step apart) against one block of N keys stored [D][N], W keys a vector (T,
// loaded by LOAD). The G * N / W sums are vector variables, so they stay in registers as independent chains (an
// array in memory made every add wait for the previous store); each key row is loaded once for all G heads; each
// score is summed over d in order, as before. One function per (N, G) so every loop is unrolled at a fixed width.
#define BLOCK_SCORES(N, G, T, W, LOAD)                                                                    \
    static void block_scores_##N##_##G(const float* restrict q, int64_t q_step, const char* restrict kt,  \
                                       int bf16, int64_t head_dim, float* restrict out) {                \
        const int64_t esz = bf16 ? 2 : 4;                                                                 \
        T s[G][N / W];                                                                                    \
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)                                               \
            _Pragma("GCC unroll 2") for (int v = 0; v < N / W; v++) s[g][v] = (T){0};                     \
        for (int64_t d = 0; d < head_dim; d++) {                                                          \
            T k[N / W];                                                                                   \
            _Pragma("GCC unroll 2") for (int v = 0; v < N / W; v++) k[v] = LOAD(kt + (d * N + v * W) * esz, bf16); \
            _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {                                         \
                const float qd = q[g * q_step + d];                                                       \
                _Pragma("GCC unroll 2") for (int v = 0; v < N / W; v++) s[g][v] += qd * k[v];             \
            }                                                                                             \
        }                                                                                                 \
        memcpy(out, s, sizeof(s));                                                                        \
    }
BLOCK_SCORES(8, 1, v8f, 8, load8)
BLOCK_SCORES(8, 2, v8f, 8, load8)
BLOCK_SCORES(8, 3, v8f, 8, load8)
BLOCK_SCORES(8, 4, v8f, 8, load8)
BLOCK_SCORES(16, 1, vf, VW, loadv)
BLOCK_SCORES(16, 2, vf, VW, loadv)
BLOCK_SCORES(16, 3, vf, VW, loadv)
BLOCK_SCORES(16, 4, vf, VW, loadv)

typedef void (*block_scores_fn)(const float*, int64_t, const char*, int, int64_t, float*);

// The fixed-width scorer for a block size and a number of heads (1..4), or NULL: the generic loop then runs.
static block_scores_fn block_scorer(int64_t block_size, int64_t heads) {
    static const block_scores_fn by8[4] = {block_scores_8_1, block_scores_8_2, block_scores_8_3, block_scores_8_4};
    static const block_scores_fn by16[4] = {block_scores_16_1, block_scores_16_2, block_scores_16_3,
                                            block_scores_16_4};
    if (heads < 1 || heads > 4) return NULL;
    if (block_size == 8) return by8[heads - 1];
    if (block_size == 16) return by16[heads - 1];
    return NULL;
}

// acc[g] = sum over keys lo <= j < ctx of p[g][j] * V[j] for G query heads (probabilities p_step apart) of one KV head,
// 64 dims at a time: each V row is loaded once for the G heads, and the G * 8 vector sums stay in registers (each
// output still sums the keys in order). V cache [blocks, Hkv, block_size, D], D % 64 == 0. The next block's rows
// are prefetched while a block is summed: the rows of a sequence are scattered over blocks, and the loads waited
// on memory. One function per G so every loop is unrolled.
#define WEIGHTED_VALUES64(G)                                                                              \
    static void weighted_values64_##G(const float* restrict p, int64_t p_step, int64_t lo, int64_t ctx,          \
                                      const int64_t* table,                                               \
                                      const char* v_cache, int64_t num_kv_heads, int64_t kh, int64_t block_size, \
                                      int64_t head_dim, int bf16, float* restrict acc) {                   \
        const int64_t esz = bf16 ? 2 : 4;                                                                 \
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {                                                   \
            vf a[G][64 / VW];                                                                             \
            _Pragma("GCC unroll 3") for (int g = 0; g < G; g++)                                           \
                _Pragma("GCC unroll 8") for (int v = 0; v < 64 / VW; v++) a[g][v] = (vf){0};              \
            for (int64_t j0 = lo - lo % block_size; j0 < ctx; j0 += block_size) {                        \
                const int64_t blk = table[j0 / block_size];                                               \
                const char* base = v_cache + (((blk * num_kv_heads + kh) * block_size) * head_dim + d0) * esz; \
                const int64_t n = ctx - j0 < block_size ? ctx - j0 : block_size;                          \
                if (j0 + block_size < ctx) {                                                              \
                    const char* next = v_cache +                                                          \
                        (((table[j0 / block_size + 1] * num_kv_heads + kh) * block_size) * head_dim + d0) * esz; \
                    for (int64_t b = 0; b < block_size * head_dim * esz; b += 64) __builtin_prefetch(next + b); \
                }                                                                                         \
                for (int64_t jj = j0 < lo ? lo - j0 : 0; jj < n; jj++) {                                  \
                    const char* r = base + jj * head_dim * esz;                                           \
                    vf x[64 / VW];                                                                        \
                    _Pragma("GCC unroll 8") for (int v = 0; v < 64 / VW; v++) x[v] = loadv(r + v * VW * esz, bf16); \
                    _Pragma("GCC unroll 3") for (int g = 0; g < G; g++) {                                 \
                        const float pj = p[g * p_step + j0 + jj];                                         \
                        _Pragma("GCC unroll 8") for (int v = 0; v < 64 / VW; v++) a[g][v] += pj * x[v];   \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
            _Pragma("GCC unroll 3") for (int g = 0; g < G; g++) memcpy(acc + g * head_dim + d0, a[g], sizeof(a[g])); \
        }                                                                                                 \
    }
WEIGHTED_VALUES64(1)
WEIGHTED_VALUES64(2)
WEIGHTED_VALUES64(3)

// ---------------------------------------------------------------------------------------------------
// Writes each token's K and V into its cache slot, then lets every query token attend to all keys of its
// sequence up to its own position (within the last ``window`` keys, where window > 0: a sliding-window layer;
// scores capped at softcap * tanh(score / softcap) where softcap > 0, as Gemma 2 does).
// q, k, v are row views with token strides (they come out of one fused
// QKV projection); out is [T, H, D] contiguous. The caches are laid out per KV head (this kernel alone reads
// and writes them; the PyTorch path, chosen once per engine, has its own layout): K [blocks, Hkv, D, block_size],
// so the scores of a whole block come from vector products over its keys with no horizontal sums; V [blocks,
// Hkv, block_size, D], so one head's rows of a block are contiguous.
void paged_attention(const void* q, int64_t q_stride, const void* k, const void* v, int64_t kv_stride,
                     void* k_cache, void* v_cache, const int64_t* slot_mapping, const int64_t* positions,
                     const int64_t* seq_of_token, const int64_t* block_tables, int64_t table_width,
                     void* out, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, float scale, int64_t window, float softcap, int bf16) {
    const int64_t esz = bf16 ? 2 : 4;
    const int64_t row = num_kv_heads * head_dim;
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_ctx = 0;
    for (int64_t t = 0; t < num_tokens; t++)
        if (positions[t] + 1 > max_ctx) max_ctx = positions[t] + 1;

#pragma omp parallel
    {
        float* scores = (float*)malloc(sizeof(float) * group * max_ctx);
        float* qf = (float*)malloc(sizeof(float) * group * head_dim);
        float* acc = (float*)malloc(sizeof(float) * group * head_dim);
        float* kbuf = (float*)malloc(sizeof(float) * head_dim);
        float* sblk = (float*)malloc(sizeof(float) * 4 * block_size);
        // Every token's K and V into the cache first (the loop's end is a barrier): one parallel region, not two.
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; t++) {
            const int64_t blk = slot_mapping[t] / block_size, off = slot_mapping[t] % block_size;
            for (int64_t kh = 0; kh < num_kv_heads; kh++)  // V cache [blocks, Hkv, block_size, D]
                memcpy((char*)v_cache + ((blk * num_kv_heads + kh) * block_size + off) * head_dim * esz,
                       (const char*)v + (t * kv_stride + kh * head_dim) * esz, head_dim * esz);
            for (int64_t i = 0; i < row; i++) {  // i = kv head * D + d
                const int64_t dst = (blk * row + i) * block_size + off;
                if (bf16)
                    ((uint16_t*)k_cache)[dst] = ((const uint16_t*)k)[t * kv_stride + i];
                else
                    ((float*)k_cache)[dst] = ((const float*)k)[t * kv_stride + i];
            }
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t work = 0; work < num_tokens * num_kv_heads; work++) {
            const int64_t t = work / num_kv_heads, kh = work % num_kv_heads;
            const int64_t ctx = positions[t] + 1;
            const int64_t lo = window > 0 && ctx > window ? ctx - window : 0;  // the first key it sees
            const int64_t* table = block_tables + seq_of_token[t] * table_width;
            for (int64_t g = 0; g < group; g++)
                load_row((const char*)q + (t * q_stride + (kh * group + g) * head_dim) * esz, bf16, head_dim,
                         qf + g * head_dim);
            for (int64_t j0 = lo - lo % block_size; j0 < ctx; j0 += block_size) {  // (keys before lo: unread)
                const int64_t first = (table[j0 / block_size] * row + kh * head_dim) * block_size;
                const int64_t n = ctx - j0 < block_size ? ctx - j0 : block_size;
                if (j0 + block_size < ctx) {  // the next block's keys, while this one is scored
                    const char* next = (const char*)k_cache + (table[j0 / block_size + 1] * row + kh * head_dim) * block_size * esz;
                    for (int64_t b = 0; b < head_dim * block_size * esz; b += 64) __builtin_prefetch(next + b);
                }
                int64_t g0 = 0;
                for (; g0 < group; g0 += 4) {  // up to 4 heads of the group share each read of the block
                    const int64_t heads = group - g0 < 4 ? group - g0 : 4;
                    const block_scores_fn scorer = block_scorer(block_size, heads);
                    if (scorer == NULL) break;
                    scorer(qf + g0 * head_dim, head_dim, (const char*)k_cache + first * esz, bf16, head_dim, sblk);
                    for (int64_t g = 0; g < heads; g++)
                        for (int64_t jj = 0; jj < n; jj++)
                            scores[(g0 + g) * max_ctx + j0 + jj] = sblk[g * block_size + jj] * scale;
                }
                for (int64_t g = g0; g < group; g++) {  // block sizes without a fixed-width scorer
                    const float* qg = qf + g * head_dim;
                    for (int64_t jj = 0; jj < block_size; jj++) sblk[jj] = 0.f;
                    for (int64_t d = 0; d < head_dim; d++) {
                        const float qd = qg[d];
                        if (bf16) {
                            const uint16_t* kt = (const uint16_t*)k_cache + first + d * block_size;
#pragma omp simd
                            for (int64_t jj = 0; jj < block_size; jj++) sblk[jj] += qd * bf2f(kt[jj]);
                        } else {
                            const float* kt = (const float*)k_cache + first + d * block_size;
#pragma omp simd
                            for (int64_t jj = 0; jj < block_size; jj++) sblk[jj] += qd * kt[jj];
                        }
                    }
                    for (int64_t jj = 0; jj < n; jj++) scores[g * max_ctx + j0 + jj] = sblk[jj] * scale;
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float* sg = scores + g * max_ctx;
                float m = -INFINITY, sum = 0.f;
                if (softcap > 0.f)
                    for (int64_t j = lo; j < ctx; j++) sg[j] = tanhf(sg[j] / softcap) * softcap;
#pragma omp simd reduction(max : m)
                for (int64_t j = lo; j < ctx; j++) m = sg[j] > m ? sg[j] : m;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = lo; j < ctx; j++) {
                    sg[j] = softmax_exp(sg[j] - m);
                    sum += sg[j];
                }
                const float inv = 1.f / sum;
#pragma omp simd
                for (int64_t j = lo; j < ctx; j++) sg[j] *= inv;
            }
            if (head_dim % 64 == 0) {
                for (int64_t g0 = 0; g0 < group; g0 += 3) {  // up to 3 heads of the group share each V row
                    const int64_t heads = group - g0 < 3 ? group - g0 : 3;
                    const float* pg = scores + g0 * max_ctx;
                    float* ag = acc + g0 * head_dim;
                    if (heads == 3)
                        weighted_values64_3(pg, max_ctx, lo, ctx, table, (const char*)v_cache, num_kv_heads, kh,
                                            block_size, head_dim, bf16, ag);
                    else if (heads == 2)
                        weighted_values64_2(pg, max_ctx, lo, ctx, table, (const char*)v_cache, num_kv_heads, kh,
                                            block_size, head_dim, bf16, ag);
                    else
                        weighted_values64_1(pg, max_ctx, lo, ctx, table, (const char*)v_cache, num_kv_heads, kh,
                                            block_size, head_dim, bf16, ag);
                }
            } else {  // the generic loop, for head sizes that are not a multiple of 64
                memset(acc, 0, sizeof(float) * group * head_dim);
                for (int64_t j0 = lo - lo % block_size; j0 < ctx; j0 += block_size) {
                    const char* base = (const char*)v_cache + ((table[j0 / block_size] * num_kv_heads + kh) * block_size) * head_dim * esz;
                    const int64_t n = ctx - j0 < block_size ? ctx - j0 : block_size;
                    for (int64_t jj = j0 < lo ? lo - j0 : 0; jj < n; jj++) {
                        const float* vp = (const float*)(base + jj * head_dim * esz);
                        if (bf16) {
                            const uint16_t* vb = (const uint16_t*)(base + jj * head_dim * esz);
#pragma omp simd
                            for (int64_t d = 0; d < head_dim; d++) kbuf[d] = bf2f(vb[d]);
                            vp = kbuf;
                        }
                        for (int64_t g = 0; g < group; g++) {
                            const float p = scores[g * max_ctx + j0 + jj];
                            float* restrict ag = acc + g * head_dim;
                            const float* restrict vr = vp;
#pragma omp simd
                            for (int64_t d = 0; d < head_dim; d++) ag[d] += p * vr[d];
                        }
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                const int64_t off = (t * num_heads + kh * group + g) * head_dim;
                if (bf16) {
                    for (int64_t d = 0; d < head_dim; d++) ((uint16_t*)out)[off + d] = f2bf(acc[g * head_dim + d]);
                } else {
                    memcpy((float*)out + off, acc + g * head_dim, sizeof(float) * head_dim);
                }
            }
        }
        free(scores);
        free(qf);
        free(acc);
        free(kbuf);
        free(sblk);
    }
}

// ---------------------------------------------------------------------------------------------------
// Optionally h += delta (rounded to the dtype, as a PyTorch add is), then out = weight * rmsnorm(h), with
// the same steps and roundings as transformers' LlamaRMSNorm.
void add_rms_norm(void* h, const void* delta, const void* weight, void* out, int64_t rows, int64_t n,
                  float eps, int bf16) {
#pragma omp parallel
    {
        float* x = (float*)malloc(sizeof(float) * n);
        float* w = (float*)malloc(sizeof(float) * n);
        load_row(weight, bf16, n, w);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_row((char*)h + r * n * (bf16 ? 2 : 4), bf16, n, x);
            if (delta) {
                const void* dr = (const char*)delta + r * n * (bf16 ? 2 : 4);
                for (int64_t i = 0; i < n; i++)
                    x[i] = round_to(x[i] + (bf16 ? bf2f(((const uint16_t*)dr)[i]) : ((const float*)dr)[i]), bf16);
                if (bf16) {
                    for (int64_t i = 0; i < n; i++) ((uint16_t*)h)[r * n + i] = f2bf(x[i]);
                } else {
                    memcpy((float*)h + r * n, x, sizeof(float) * n);
                }
            }
            float ss = 0.f;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
            const float inv = 1.f / sqrtf(ss / (float)n + eps);
            for (int64_t i = 0; i < n; i++) {
                const float y = w[i] * round_to(x[i] * inv, bf16);
                if (bf16)
                    ((uint16_t*)out)[r * n + i] = f2bf(y);
                else
                    ((float*)out)[r * n + i] = y;
            }
        }
        free(x);
        free(w);
    }
}

// ---------------------------------------------------------------------------------------------------
// Rotary positions in place on the first num_heads heads of each token row (q and k heads together):
// x * cos + rotate_half(x) * sin, each product and the sum rounded as PyTorch's separate ops round them. Each
// half of a head is its own loop with the dtype fixed, so both vectorize (one loop with the rotation's branch
// and the dtype's did not: bfloat16 took three times float32's time).
static inline void rope_head_f32(float* restrict p, const float* restrict c, const float* restrict s, int64_t half) {
    float a[512];
    memcpy(a, p, sizeof(float) * 2 * half);
#pragma omp simd
    for (int64_t d = 0; d < half; d++) p[d] = a[d] * c[d] + (-a[d + half]) * s[d];
#pragma omp simd
    for (int64_t d = half; d < 2 * half; d++) p[d] = a[d] * c[d] + a[d - half] * s[d];
}

static inline float rbf(float x) { return bf2f(f2bf(x)); }

static inline void rope_head_bf16(uint16_t* restrict p, const float* restrict c, const float* restrict s,
                                  int64_t half) {
    float a[512];
#pragma omp simd
    for (int64_t d = 0; d < 2 * half; d++) a[d] = bf2f(p[d]);
#pragma omp simd
    for (int64_t d = 0; d < half; d++) p[d] = f2bf(rbf(a[d] * c[d]) + rbf((-a[d + half]) * s[d]));
#pragma omp simd
    for (int64_t d = half; d < 2 * half; d++) p[d] = f2bf(rbf(a[d] * c[d]) + rbf(a[d - half] * s[d]));
}

void rope(void* x, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
          const void* cos_table, const void* sin_table, const int64_t* positions, int bf16) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
        float c[512], s[512];
        load_row((const char*)cos_table + positions[t] * head_dim * (bf16 ? 2 : 4), bf16, head_dim, c);
        load_row((const char*)sin_table + positions[t] * head_dim * (bf16 ? 2 : 4), bf16, head_dim, s);
        for (int64_t h = 0; h < num_heads; h++) {
            const int64_t at = t * row_stride + h * head_dim;
            if (bf16)
                rope_head_bf16((uint16_t*)x + at, c, s, half);
            else
                rope_head_f32((float*)x + at, c, s, half);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Greedy sampling: the index of each row's largest value, the first of equal ones, a NaN counting as the largest
// (as torch.argmax has it), straight from float32 or bfloat16 logits (no float32 copy of the whole vocabulary).
// The maximum is one vectorized pass; its first index is found 256 values at a time.
static inline float logit_at(const void* row, int64_t i, int bf16) {
    return bf16 ? bf2f(((const uint16_t*)row)[i]) : ((const float*)row)[i];
}

static int64_t argmax_row(const char* row, int64_t n, int bf16) {
    float m = -INFINITY;
    int nan = 0;
    if (bf16) {
        const uint16_t* v = (const uint16_t*)row;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < n; i++) {
            const float f = bf2f(v[i]);
            m = f > m ? f : m;
            nan |= f != f;
        }
    } else {
        const float* v = (const float*)row;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < n; i++) {
            m = v[i] > m ? v[i] : m;
            nan |= v[i] != v[i];
        }
    }
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
        const int64_t end = i0 + 256 < n ? i0 + 256 : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = i0; i < end; i++) {
            const float f = logit_at(row, i, bf16);
            hit |= nan ? f != f : f == m;
        }
        if (hit) {
            for (int64_t i = i0; i < end; i++) {
                const float f = logit_at(row, i, bf16);
                if (nan ? f != f : f == m) return i;
            }
        }
    }
    return 0;
}

void argmax_rows(const void* x, int64_t rows, int64_t n, int64_t row_stride, int bf16, int64_t* out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row((const char*)x + r * row_stride * (bf16 ? 2 : 4), n, bf16);
}

// ---------------------------------------------------------------------------------------------------
// Random sampling, a row at a time: its logits over the temperature, the filters (top-k and min-p, then top-p over
// what they kept, as vLLM V1), and one draw where the kept weights' running sum passes u of their total. PyTorch
// made some ten passes over each row's vocabulary and a float64 copy of it; here the row is read once and its
// weights a few times while they sit in cache. The filters find where they stop by a radix select on the values'
// bits, not by sorting the vocabulary.

// A float's bits as an unsigned key ordered as the float is, -0 and +0 one key as they are one value (no NaN
// comes here).
static inline uint32_t order_key(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u << 1) == 0 ? 0 : u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

typedef struct {  // one thread's scratch for rows of n values
    float* x;         // the row over its temperature
    float* e;         // its weights exp(x - max), 0 where filtered out
    int32_t* cand;    // candidate token ids
    float* blocks;    // sums of DRAW_BLOCK weights
    int64_t* counts;  // per radix digit: values and weight
    double* masses;
    int32_t* seen;    // per token: times in the row's output (or 1: in its history), cleared after each row
} row_space;

#define DRAW_BLOCK 64
#define DIGITS 4096

static void row_space_init(row_space* ws, int64_t n) {
    ws->x = (float*)malloc(sizeof(float) * n);
    ws->e = (float*)malloc(sizeof(float) * n);
    ws->cand = (int32_t*)malloc(sizeof(int32_t) * n);
    ws->blocks = (float*)malloc(sizeof(float) * (n / DRAW_BLOCK + 1));
    ws->counts = (int64_t*)malloc(sizeof(int64_t) * DIGITS);
    ws->masses = (double*)malloc(sizeof(double) * DIGITS);
    ws->seen = (int32_t*)calloc((size_t)n, sizeof(int32_t));
}

static void row_space_free(row_space* ws) {
    free(ws->x);
    free(ws->e);
    free(ws->cand);
    free(ws->blocks);
    free(ws->counts);
    free(ws->masses);
    free(ws->seen);
}

// What a request's sampling parameters do to its row before the temperature, in vLLM's order: the logit bias
// added, the repetition penalty over the tokens of its prompt and output (a positive logit divided by it, a
// negative one multiplied), the frequency and presence penalties over its output, then min_tokens' banned tokens
// at -inf. Per row r, each list is the span [off[r], off[r + 1]) of its flat array; float32 ops, as PyTorch's.
typedef struct {
    const int64_t* bias_ids;
    const float* bias;
    const int64_t* bias_off;
    const int64_t* history;  // prompt and output tokens, for the repetition penalty (empty: none)
    const int64_t* history_off;
    const float* repetition;
    const int64_t* output;  // output tokens, for the frequency and presence penalties (empty: none)
    const int64_t* output_off;
    const float* frequency;
    const float* presence;
    const int64_t* banned;
    const int64_t* banned_off;
} processors;

static void apply_processors(float* x, int64_t n, const processors* pr, int64_t r, int32_t* seen) {
    for (int64_t j = pr->bias_off[r]; j < pr->bias_off[r + 1]; j++)
        if (pr->bias_ids[j] >= 0 && pr->bias_ids[j] < n) x[pr->bias_ids[j]] += pr->bias[j];
    const float rep = pr->repetition[r];
    for (int64_t j = pr->history_off[r]; j < pr->history_off[r + 1]; j++) {
        const int64_t t = pr->history[j];
        if (t < 0 || t >= n || seen[t]) continue;  // each token once
        seen[t] = 1;
        x[t] = x[t] > 0.f ? x[t] / rep : x[t] * rep;
    }
    for (int64_t j = pr->history_off[r]; j < pr->history_off[r + 1]; j++)
        if (pr->history[j] >= 0 && pr->history[j] < n) seen[pr->history[j]] = 0;
    for (int64_t j = pr->output_off[r]; j < pr->output_off[r + 1]; j++)
        if (pr->output[j] >= 0 && pr->output[j] < n) seen[pr->output[j]]++;
    const float freq = pr->frequency[r], presence = pr->presence[r];
    for (int64_t j = pr->output_off[r]; j < pr->output_off[r + 1]; j++) {
        const int64_t t = pr->output[j];
        if (t < 0 || t >= n || !seen[t]) continue;
        x[t] -= freq * (float)seen[t] + presence * 1.f;
        seen[t] = 0;
    }
    for (int64_t j = pr->banned_off[r]; j < pr->banned_off[r + 1]; j++)
        if (pr->banned[j] >= 0 && pr->banned[j] < n) x[pr->banned[j]] = -INFINITY;
}

// The ids of the values at least thr, in order (branch-free: which pass is anyone's guess).
static int64_t collect(const float* v, int64_t n, float thr, int32_t* ids) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        ids[m] = (int32_t)i;
        m += v[i] >= thr;
    }
    return m;
}

static int64_t count_at_least(const float* v, int64_t n, float thr) {
    int64_t m = 0;
#pragma omp simd reduction(+ : m)
    for (int64_t i = 0; i < n; i++) m += v[i] >= thr;
    return m;
}

// Where a walk down the candidates cand[0..n) in descending order (equal values in id order) stops, as the last
// element it keeps (*value, *id): by count (k > 0), the first k; by mass (k == 0), each element whose predecessors'
// weights sum below target. The candidates are narrowed to the digit that holds it, 12 bits of the key at a time,
// with the count and weight above that digit carried along; the few left are sorted. dense: the candidates are
// all of 0..n-1, read straight (cand only takes the narrowed ones).
static void walk_stop(const float* x, const float* e, int32_t* cand, int64_t n, int dense, int64_t k, double target,
                      row_space* ws, float* value, int32_t* id) {
    static const int shifts[3] = {20, 8, 0};
    static const uint32_t masks[3] = {0xfff, 0xfff, 0xff};
    int64_t count_above = 0;
    double mass_above = 0.0;
    for (int level = 0; level < 3 && n > 16; level++) {
        const int shift = shifts[level];
        const uint32_t mask = masks[level];
        memset(ws->counts, 0, sizeof(int64_t) * (mask + 1));
        memset(ws->masses, 0, sizeof(double) * (mask + 1));
        if (dense) {
            for (int64_t j = 0; j < n; j++) ws->counts[(order_key(x[j]) >> shift) & mask]++;
        } else {
            for (int64_t j = 0; j < n; j++) {
                const uint32_t d = (order_key(x[cand[j]]) >> shift) & mask;
                ws->counts[d]++;
                if (k == 0) ws->masses[d] += e[cand[j]];
            }
        }
        int64_t stop = -1, lowest = -1;
        for (int64_t d = mask; d >= 0; d--) {
            if (ws->counts[d] == 0) continue;
            lowest = d;
            if (k > 0 ? count_above + ws->counts[d] >= k : mass_above + ws->masses[d] >= target) {
                stop = d;
                break;
            }
            count_above += ws->counts[d];
            mass_above += ws->masses[d];
        }
        if (stop < 0) {  // the target never reached (rounding): the walk keeps all, to the lowest digit's last
            stop = lowest;
            count_above -= ws->counts[lowest];
            mass_above -= ws->masses[lowest];
        }
        int64_t m = 0;
        for (int64_t j = 0; j < n; j++) {
            const int32_t c = dense ? (int32_t)j : cand[j];
            cand[m] = c;
            m += ((order_key(x[c]) >> shift) & mask) == (uint32_t)stop;
        }
        n = m;
        dense = 0;
    }
    if (dense)
        for (int64_t j = 0; j < n; j++) cand[j] = (int32_t)j;
    // At most 16 left, or more of one value, already in id order (each narrowing keeps the order).
    if (n <= 16) {
        for (int64_t j = 1; j < n; j++) {
            const int32_t c = cand[j];
            int64_t i = j - 1;
            while (i >= 0 && (x[cand[i]] < x[c] || (x[cand[i]] == x[c] && cand[i] > c))) {
                cand[i + 1] = cand[i];
                i--;
            }
            cand[i + 1] = c;
        }
    }
    int64_t last = 0;
    if (k > 0) {
        last = k - count_above - 1;
        last = last < 0 ? 0 : (last >= n ? n - 1 : last);
    } else {
        double run = mass_above;
        for (int64_t j = 0; j < n && (j == 0 || run < target); j++) {
            last = j;
            run += e[cand[j]];
        }
    }
    *value = x[cand[last]];
    *id = cand[last];
}

typedef struct {  // what a row's filters keep: at least top-k's k-th value, within log(min_p) of the largest,
    float kth, log_min_p, top;  // and with top-p, no later than its last element (pv, pid) in descending order
    float pv;
    int32_t pid;
    int top_p;
} row_filter;

static inline int in_floor(const row_filter* f, float x) { return x >= f->kth && x - f->top >= f->log_min_p; }

static inline int filter_keeps(const row_filter* f, float x, int64_t i) {
    return in_floor(f, x) && (!f->top_p || x > f->pv || (x == f->pv && i <= f->pid));
}

// e = exp(x - top) where x is at least kth and x - top at least lmp, else 0 (and below e^-87: float32's softmax
// has nothing of those either); returns the sum of e, in float64 over blocks of DRAW_BLOCK.
static double kept_weights(const float* x, int64_t n, float top, float kth, float lmp, float* e) {
    double mass = 0.0;
    for (int64_t b = 0; b < n; b += DRAW_BLOCK) {
        const int64_t hi = b + DRAW_BLOCK < n ? b + DRAW_BLOCK : n;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = b; i < hi; i++) {
            const float d = x[i] - top;
            e[i] = (x[i] >= kth && d >= lmp && d > -87.f) ? softmax_exp(d) : 0.f;
            s += e[i];
        }
        mass += s;
    }
    return mass;
}

// The filters of row x[0..n) (its largest value top): fills f, and ws->e with the weights of what they keep
// (exp(x - top), 0 below e^-87: float32's softmax has nothing of them either).
static void filter_row(const float* x, int64_t n, float top, int64_t top_k, float top_p, float min_p, row_space* ws,
                       row_filter* f) {
    f->top = top;
    f->kth = -INFINITY;
    f->log_min_p = min_p > 0.f ? logf(min_p) : -INFINITY;
    f->top_p = 0;
    if (top_k > 0 && top_k < n) {
        // The k-th largest lies among the values within some width of the largest once k of them do (a count is
        // one vector pass): the walk then reads those, not the vocabulary.
        float width = 4.f;
        while (width <= 2048.f && count_at_least(x, n, top - width) < top_k) width *= 1.5f;
        int32_t id;
        if (width <= 2048.f)
            walk_stop(x, NULL, ws->cand, collect(x, n, top - width, ws->cand), 0, top_k, 0.0, ws, &f->kth, &id);
        else
            walk_stop(x, NULL, ws->cand, n, 1, top_k, 0.0, ws, &f->kth, &id);
    }
    float* e = ws->e;
    const double mass = kept_weights(x, n, top, f->kth, f->log_min_p, e);
    if (top_p < 1.f) {
        // What weighs under tau, at most n * tau, is under half of what top-p drops: the walk reads the rest only.
        float tau = (float)(0.5 * (1.0 - (double)top_p) * mass / (double)n);
        tau = tau > 1e-45f ? tau : 1e-45f;
        const int64_t m = collect(e, n, tau, ws->cand);
        walk_stop(x, e, ws->cand, m, 0, 0, (double)top_p * mass, ws, &f->pv, &f->pid);
        f->top_p = 1;
        const float pv = f->pv;
        const int32_t pid = f->pid;
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            if (!(x[i] > pv || (x[i] == pv && i <= pid))) e[i] = 0.f;
    }
}

// The token where the running sum of e passes u of its total (u in [0, 1)): blocks of DRAW_BLOCK weights are summed
// first, the block found, then the token in it. Never a token of weight 0.
static int64_t draw_row(const float* e, int64_t n, double u, float* blocks) {
    const int64_t nb = (n + DRAW_BLOCK - 1) / DRAW_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t lo = b * DRAW_BLOCK, hi = lo + DRAW_BLOCK < n ? lo + DRAW_BLOCK : n;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = lo; i < hi; i++) s += e[i];
        blocks[b] = s;
        total += s;
    }
    double target = u * total;
    if (target >= total) target = nextafter(total, 0.0);  // a draw that rounds up to the total
    double c = 0.0;
    int64_t b = 0;
    for (; b < nb - 1; b++) {
        const double next = c + blocks[b];
        if (next > target) break;
        c = next;
    }
    const int64_t lo = b * DRAW_BLOCK, hi = lo + DRAW_BLOCK < n ? lo + DRAW_BLOCK : n;
    int64_t last = -1;
    for (int64_t i = lo; i < hi; i++) {
        if (e[i] > 0.f) {
            last = i;
            c += e[i];
            if (c > target) return i;
        }
    }
    if (last >= 0) return last;  // the block's float sum passed the target, its float64 running sum did not
    for (int64_t i = n - 1; i >= 0; i--)
        if (e[i] > 0.f) return i;
    return 0;
}

static int64_t sample_row(const char* row, int64_t n, int bf16, float temperature, int64_t top_k, float top_p,
                          float min_p, double u, const processors* pr, int64_t r, row_space* ws) {
    if (pr != NULL) {  // processed first, then greedy or sampled from the processed row
        load_row(row, bf16, n, ws->x);
        apply_processors(ws->x, n, pr, r, ws->seen);
        if (!(temperature > 0.f)) return argmax_row((const char*)ws->x, n, 0);
        row = (const char*)ws->x;
        bf16 = 0;
    }
    if (!(temperature > 0.f)) return argmax_row(row, n, bf16);
    float* x = ws->x;
    float top = -INFINITY;
    int nan = 0;
    if (bf16) {
        const uint16_t* v = (const uint16_t*)row;
#pragma omp simd reduction(max : top) reduction(| : nan)
        for (int64_t i = 0; i < n; i++) {
            x[i] = bf2f(v[i]) / temperature;  // a division, as transformers' temperature warper
            top = x[i] > top ? x[i] : top;
            nan |= x[i] != x[i];
        }
    } else {
        const float* v = (const float*)row;
#pragma omp simd reduction(max : top) reduction(| : nan)
        for (int64_t i = 0; i < n; i++) {
            x[i] = v[i] / temperature;
            top = x[i] > top ? x[i] : top;
            nan |= x[i] != x[i];
        }
    }
    if (nan || top == -INFINITY || top == INFINITY) return argmax_row(row, n, bf16);  // no distribution to draw from
    row_filter f;
    filter_row(x, n, top, top_k, top_p, min_p, ws, &f);
    return draw_row(ws->e, n, u, ws->blocks);
}

// Each row's token: the argmax where its temperature is 0, else a draw at u[r] from its filtered distribution
// (top_k 0, top_p 1, min_p 0: off); with processors (else NULL), from the row they make.
void sample_rows(const void* logits, int64_t rows, int64_t n, int64_t row_stride, int bf16, const float* temperature,
                 const int64_t* top_k, const float* top_p, const float* min_p, const double* u, const processors* pr,
                 int64_t* out) {
#pragma omp parallel
    {
        row_space ws;
        row_space_init(&ws, n);
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++)
            out[r] = sample_row((const char*)logits + r * row_stride * (bf16 ? 2 : 4), n, bf16, temperature[r],
                                top_k[r], top_p[r], min_p[r], u[r], pr, r, &ws);
        row_space_free(&ws);
    }
}

// The filters alone, on float32 rows whose temperature is applied: out = x where they keep it, else -inf.
void filter_rows(const float* x, int64_t rows, int64_t n, int64_t row_stride, const int64_t* top_k,
                 const float* top_p, const float* min_p, float* out) {
#pragma omp parallel
    {
        row_space ws;
        row_space_init(&ws, n);
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            const float* v = x + r * row_stride;
            float top = -INFINITY;
            for (int64_t i = 0; i < n; i++) top = v[i] > top ? v[i] : top;
            row_filter f;
            if (top == -INFINITY || top == INFINITY) {
                memcpy(out + r * n, v, sizeof(float) * n);
                continue;
            }
            filter_row(v, n, top, top_k[r], top_p[r], min_p[r], &ws, &f);
            for (int64_t i = 0; i < n; i++) out[r * n + i] = filter_keeps(&f, v[i], i) ? v[i] : -INFINITY;
        }
        row_space_free(&ws);
    }
}

// ---------------------------------------------------------------------------------------------------
// Logprobs from the model's logits (no temperature, no processors, as vLLM gives them): each row's log-softmax at
// its token, and its num[r] largest entries (at most max_num; values descending, equal values in id order). The
// row's normalizer is one pass; the largest are found among the values within some width of the maximum.
void logprob_rows(const void* logits, int64_t rows, int64_t n, int64_t row_stride, int bf16, const int64_t* tokens,
                  const int64_t* num, int64_t max_num, float* chosen, float* top_vals, int64_t* top_ids) {
#pragma omp parallel
    {
        float* x = (float*)malloc(sizeof(float) * n);
        float* e = (float*)malloc(sizeof(float) * n);
        int32_t* cand = (int32_t*)malloc(sizeof(int32_t) * n);
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            load_row((const char*)logits + r * row_stride * (bf16 ? 2 : 4), bf16, n, x);
            float top = -INFINITY;
            int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
            for (int64_t i = 0; i < n; i++) {
                top = x[i] > top ? x[i] : top;
                nan |= x[i] != x[i];
            }
            const double sum = kept_weights(x, n, top, -INFINITY, -INFINITY, e);
            // A NaN logit makes every logprob NaN, as PyTorch's log_softmax: the maximum skips it, and the row's
            // others came out finite and plausible. (An infinite maximum gives NaN by itself.)
            const float log_sum = nan ? NAN : (float)log(sum);
            const int64_t t = tokens[r];
            chosen[r] = t >= 0 && t < n ? (x[t] - top) - log_sum : NAN;
            const int64_t k = num[r] < n ? num[r] : n;
            if (k <= 0) continue;
            int64_t m = n;
            for (float width = 4.f; width <= 4096.f; width *= 2.f) {
                if (count_at_least(x, n, top - width) >= k) {
                    m = collect(x, n, top - width, cand);
                    break;
                }
            }
            if (m == n)
                for (int64_t i = 0; i < n; i++) cand[i] = (int32_t)i;
            for (int64_t j = 0; j < k; j++) {  // the k largest by selection: k is at most a few dozen
                int64_t best = j;
                for (int64_t c = j + 1; c < m; c++) {
                    const float a = x[cand[c]], b = x[cand[best]];
                    if (a > b || (a == b && cand[c] < cand[best]) || (b != b && a == a)) best = c;
                }
                const int32_t id = cand[best];
                cand[best] = cand[j];
                cand[j] = id;
                top_vals[r * max_num + j] = (x[id] - top) - log_sum;
                top_ids[r * max_num + j] = id;
            }
        }
        free(x);
        free(e);
        free(cand);
    }
}

// ---------------------------------------------------------------------------------------------------
// An int8 layer's input (``Linear.quantize_int8``): each row of x, times smooth where given (SmoothQuant's
// 1 / factor per channel), scaled so its largest magnitude is 127 and rounded half to even, as torch.round;
// row_scale[r] = that magnitude / 127. The same float32 steps as the PyTorch twin, so both give the same bytes.
void quantize_rows(const void* x, int64_t rows, int64_t n, int64_t row_stride, int bf16, const float* smooth,
                   int8_t* out, float* row_scale) {
#pragma omp parallel
    {
        float* t = (float*)malloc(sizeof(float) * n);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_row((const char*)x + r * row_stride * (bf16 ? 2 : 4), bf16, n, t);
            if (smooth) {
#pragma omp simd
                for (int64_t i = 0; i < n; i++) t[i] *= smooth[i];
            }
            float m = 0.f;
#pragma omp simd reduction(max : m)
            for (int64_t i = 0; i < n; i++) m = m > fabsf(t[i]) ? m : fabsf(t[i]);
            m = m > 1e-12f ? m : 1e-12f;
            const float k = 127.f * (1.f / m);  // the twin's ops: a reciprocal, then a product
            int8_t* o = out + r * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                float v = t[i] * k;
                v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
                o[i] = (int8_t)(int32_t)((v + 12582912.f) - 12582912.f);  // 1.5 * 2^23: rounds half to even
            }
            row_scale[r] = m * (1.f / 127.f);
        }
        free(t);
    }
}

// The int32 sums of an int8 layer back to floats: out = acc * row_scale[r] * col_scale[c] (+ bias[c]), rounded
// to out's dtype, in the PyTorch twin's order.
void dequantize_rows(const int32_t* acc, int64_t rows, int64_t n, const float* row_scale, const float* col_scale,
                     const float* bias, void* out, int bf16) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int32_t* a = acc + r * n;
        const float rs = row_scale[r];
        if (bf16) {
            uint16_t* o = (uint16_t*)out + r * n;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) {
                float y = (float)a[c] * rs * col_scale[c];
                o[c] = f2bf(bias ? y + bias[c] : y);
            }
        } else {
            float* o = (float*)out + r * n;
#pragma omp simd
            for (int64_t c = 0; c < n; c++) {
                float y = (float)a[c] * rs * col_scale[c];
                o[c] = bias ? y + bias[c] : y;
            }
        }
    }
}
