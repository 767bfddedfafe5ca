/* Paged attention of small segments (decode rows, deferred and short prefill chunks) on the CPU.

   Built and loaded by raincheck_core/ops/native.py; the contract is that of `varlen_attention` in
   raincheck_core/ops/attention.py. Segment s has q_len[s] query rows at packed rows q_start[s]... of
   `q [R, heads, d]`, reads the k_len[s] cache slots keys[k_start[s]...] of `k_cache, v_cache
   [slots, kv, d]` (its own new slots last), and sees them bottom-right causally: row i sees the first
   k_len - q_len + i + 1. Query head h reads KV head h / (heads / kv). fp32, contiguous, one thread.

   Why native: the torch path gathers every segment's K/V into a padded copy and runs batched
   [rows x d] x [d x keys] matmuls of a few rows each; at 32 decode rows it moved each byte of K/V three
   times and ran the tiny matmuls at a fraction of the core's rate. Here each K/V row is read once, in
   place, through the slot list (the page table), and a slot's K/V for every head is consumed while it is
   in cache. A segment of more than DOT_ROWS rows (a deferred or prefill chunk) first copies each block of
   keys transposed, so that its rows' scores run along contiguous keys. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_math.h"

static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t t = 0; t < d; t++) acc += a[t] * b[t];
    return acc;
}

/* `dot` of one query against DOTS keys at once: the same sum per key, lane for lane (each has its own
   accumulator, reduced as `dot` reduces it), but DOTS independent FMA chains instead of one. A decode
   row's scores are otherwise bound by the latency of one chain (a few FMAs over d, then a horizontal
   sum) per key and head, not by the bytes of K. */
#define DOTS 4
static inline void dots(const float *restrict a, const float *restrict b0, const float *restrict b1,
                        const float *restrict b2, const float *restrict b3, int64_t d, float *restrict r) {
    float c0 = 0.0f, c1 = 0.0f, c2 = 0.0f, c3 = 0.0f;
#pragma omp simd reduction(+ : c0, c1, c2, c3)
    for (int64_t t = 0; t < d; t++) {
        c0 += a[t] * b0[t];
        c1 += a[t] * b1[t];
        c2 += a[t] * b2[t];
        c3 += a[t] * b3[t];
    }
    r[0] = c0;
    r[1] = c1;
    r[2] = c2;
    r[3] = c3;
}

/* Keys are taken KEY_BLOCK at a time with a running softmax (flash-attention style), so the scratch
   holds [heads, rows, KEY_BLOCK] scores whatever the context length. */
#define KEY_BLOCK 256
#define AHEAD 4     /* slots fetched ahead of use */
/* a multi-row register tile: ROWS query rows x KEYS keys (scores) or KEYS output columns (P V), as
   many independent FMA chains as the vector registers allow */
#ifdef __AVX512F__
#define ROWS 8
#else
#define ROWS 4
#endif
#define KEYS 16
/* segments of up to DOT_ROWS rows take the decode row's code, row by row (a dot product per key, summed
   as a decode row sums it): a verify segment (speculative decoding, k <= 3 drafts) then gives each row the
   bits a decode row would get, so greedy answers and their logits match plain decoding's exactly. The
   register tiles, faster from a few rows on, sum along d in another order (fp32 rounding apart). */
#define DOT_ROWS 4

static inline void prefetch_row(const float *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 16) __builtin_prefetch(p + o);    /* 16 floats: one 64-byte line */
}

/* Output columns [t0, t0 + KEYS) of ROWS query rows over `keys` keys: a[u][t0...] += p[u][j] * V_j, in
   registers along the keys, each column summing its keys in order. V_j is `base + slot[j] * stride + t0`
   (read in place through the slot list, fetched ahead) or, without slots, `base + j * stride + t0` (a
   copied block). Only the first `kept` rows are stored (the others repeat a row to fill the tile). */
static inline void pv_tile(const float *const p[ROWS], float *const a[ROWS], int64_t kept, int64_t t0,
                           int64_t keys, const float *base, const int64_t *slot, int64_t stride) {
    float r[ROWS][KEYS];
    for (int64_t u = 0; u < ROWS; u++)
        for (int64_t x = 0; x < KEYS; x++) r[u][x] = a[u][t0 + x];
    for (int64_t j = 0; j < keys; j++) {
        if (slot && j + 2 * AHEAD < keys)       /* the line this pass reads, ahead */
            __builtin_prefetch(base + slot[j + 2 * AHEAD] * stride + t0);
        const float *v = base + (slot ? slot[j] : j) * stride + t0;
        for (int64_t u = 0; u < ROWS; u++) {
            const float pj = p[u][j];
#pragma omp simd
            for (int64_t x = 0; x < KEYS; x++) r[u][x] += pj * v[x];
        }
    }
    for (int64_t u = 0; u < kept; u++)
        for (int64_t x = 0; x < KEYS; x++) a[u][t0 + x] = r[u][x];
}

/* A decode row's PV for the query heads of one KV head: `R` heads (a constant at each call) x HEAD_COLS
   output columns [t0, t0 + HEAD_COLS) in registers along `keys` keys, V read in place through the slot list.
   Each output element sums its keys in order, as `pv_tile` sums it (the same bits), but one pass over the
   keys serves the whole group and all HEAD_COLS columns: `pv_tile`'s ROWS-row tile over KEYS columns took
   d / KEYS passes and computed ROWS rows for a group of 3-4 heads. */
#ifdef __AVX512F__
#define HEAD_COLS 64
#define HEAD_ROWS 6     /* R x 4 accumulators, with the 4 vectors of V: 28 of 32 registers */
static inline __attribute__((always_inline)) void pv_heads(const int R, const float *const *p, float *const *a,
        int64_t t0, int64_t keys, const float *base, const int64_t *slot, int64_t stride) {
    float r[HEAD_ROWS][HEAD_COLS];
#pragma GCC unroll 6
    for (int u = 0; u < R; u++)
        for (int64_t x = 0; x < HEAD_COLS; x++) r[u][x] = a[u][t0 + x];
    for (int64_t j = 0; j < keys; j++) {
        if (j + 2 * AHEAD < keys) {     /* the lines this pass reads, ahead */
            const float *next = base + slot[j + 2 * AHEAD] * stride + t0;
            for (int64_t x = 0; x < HEAD_COLS; x += 16) __builtin_prefetch(next + x);
        }
        const float *v = base + slot[j] * stride + t0;
#pragma GCC unroll 6
        for (int u = 0; u < R; u++) {
            const float pj = p[u][j];
#pragma omp simd
            for (int64_t x = 0; x < HEAD_COLS; x++) r[u][x] += pj * v[x];
        }
    }
#pragma GCC unroll 6
    for (int u = 0; u < R; u++)
        for (int64_t x = 0; x < HEAD_COLS; x++) a[u][t0 + x] = r[u][x];
}

/* `pv_heads` for `n` heads, R a constant per call. */
static void pv_group(int64_t n, const float *const *p, float *const *a, int64_t t0, int64_t keys,
                     const float *base, const int64_t *slot, int64_t stride) {
    switch (n) {
    case 1: pv_heads(1, p, a, t0, keys, base, slot, stride); break;
    case 2: pv_heads(2, p, a, t0, keys, base, slot, stride); break;
    case 3: pv_heads(3, p, a, t0, keys, base, slot, stride); break;
    case 4: pv_heads(4, p, a, t0, keys, base, slot, stride); break;
    case 5: pv_heads(5, p, a, t0, keys, base, slot, stride); break;
    default: pv_heads(6, p, a, t0, keys, base, slot, stride); break;
    }
}
#endif

/* Returns 0, or 1 when the scratch buffer cannot be allocated. */
int paged_attention_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                        const int64_t *q_start, const int64_t *q_len, const int64_t *k_start,
                        const int64_t *k_len, const int64_t *keys, int64_t segments, int64_t heads,
                        int64_t kv, int64_t d, float scale) {
    const int64_t rep = heads / kv, row = kv * d;
    int64_t max_q = 0;
    for (int64_t s = 0; s < segments; s++)
        if (q_len[s] > max_q) max_q = q_len[s];
    /* per segment: scores [heads, n, KEY_BLOCK] (query head hq of row i at (hq * n + i) * KEY_BLOCK),
       running max and sum [heads, n], output accumulator [n, heads, d] */
    const int64_t nh = heads * max_q, kt_size = max_q > 1 ? row * KEY_BLOCK : 0;
    float *scores = malloc(sizeof(float) * (size_t)(nh * KEY_BLOCK + nh * d + 2 * nh + kt_size));
    if (!scores) return 1;
    float *acc = scores + nh * KEY_BLOCK, *run_max = acc + nh * d, *run_sum = run_max + nh;
    float *kt = run_sum + nh;       /* multi-row segments: a block of K transposed [kv, d, KEY_BLOCK], then of V */
    for (int64_t s = 0; s < segments; s++) {
        const int64_t n = q_len[s], ks = k_len[s], lag = ks - n;    /* row i sees keys [0, lag + i + 1) */
        const int64_t group = rep * n;
        const int64_t *slot = keys + k_start[s];
        const float *qs = q + q_start[s] * heads * d;
        for (int64_t x = 0; x < heads * n; x++) { run_max[x] = -INFINITY; run_sum[x] = 0.0f; }
        memset(acc, 0, sizeof(float) * (size_t)(n * heads * d));
        for (int64_t j0 = 0; j0 < ks; j0 += KEY_BLOCK) {
            const int64_t j1 = j0 + KEY_BLOCK < ks ? j0 + KEY_BLOCK : ks;
            if (n <= DOT_ROWS) {
                /* key-major: one slot's K for all heads is contiguous; slots are scattered over pages,
                   so the hardware prefetcher loses them at page ends: fetch a few slots ahead */
                int64_t j = j0;
                for (; j + DOTS <= j1; j += DOTS) {
                    const float *kp[DOTS];
                    for (int64_t u = 0; u < DOTS; u++) {
                        if (j + u + DOTS * AHEAD < ks) prefetch_row(k_cache + slot[j + u + DOTS * AHEAD] * row, row);
                        kp[u] = k_cache + slot[j + u] * row;
                    }
                    for (int64_t i = 0; i < n; i++)
                        for (int64_t hq = 0; hq < heads; hq++) {
                            const int64_t h = (hq / rep) * d;
                            float r[DOTS];
                            dots(qs + (i * heads + hq) * d, kp[0] + h, kp[1] + h, kp[2] + h, kp[3] + h, d, r);
                            float *dst = scores + (hq * n + i) * KEY_BLOCK + j - j0;
                            for (int64_t u = 0; u < DOTS; u++) dst[u] = r[u] * scale;
                        }
                }
                for (; j < j1; j++) {
                    const float *kp = k_cache + slot[j] * row;
                    for (int64_t i = 0; i < n; i++)
                        for (int64_t hq = 0; hq < heads; hq++)
                            scores[(hq * n + i) * KEY_BLOCK + j - j0] =
                                dot(qs + (i * heads + hq) * d, kp + (hq / rep) * d, d) * scale;
                }
            } else {
                /* several rows share each key: copy the block's K once, transposed to [kv, d, keys], so
                   every row's scores are FMAs along contiguous keys (no horizontal sums per dot). KEYS
                   keys at a time, so that each store fills a whole line; the register tile reads up to
                   KEYS - 1 columns past the block: they repeat its last key (finite, never used) */
                for (int64_t jt = j0; jt < j1; jt += KEYS) {
                    const float *kp[KEYS];
                    for (int64_t u = 0; u < KEYS; u++) {
                        const int64_t j = jt + u < j1 ? jt + u : j1 - 1;
                        kp[u] = k_cache + slot[j] * row;
                        if (j + KEYS < ks) prefetch_row(k_cache + slot[j + KEYS] * row, row);
                    }
                    float *dst = kt + jt - j0;
                    for (int64_t x = 0; x < row; x++)
                        for (int64_t u = 0; u < KEYS; u++) dst[x * KEY_BLOCK + u] = kp[u][x];
                }
                const int64_t nb = j1 - j0;
                /* the rep query heads of KV head h read the same keys: their rep * n rows (head-major, as
                   the scores are laid out) form one group, tiled ROWS rows x KEYS keys */
                for (int64_t h = 0; h < kv; h++) {
                    const float *kh = kt + h * d * KEY_BLOCK;
                    for (int64_t x0 = 0; x0 < group; x0 += ROWS) {
                        const float *qr[ROWS];
                        for (int64_t u = 0; u < ROWS; u++) {
                            const int64_t x = x0 + u < group ? x0 + u : group - 1;
                            qr[u] = qs + ((x % n) * heads + h * rep + x / n) * d;
                        }
                        for (int64_t j = 0; j < nb; j += KEYS) {
                            float a[ROWS][KEYS] = {{0.0f}};
                            for (int64_t t = 0; t < d; t++) {
                                const float *kr = kh + t * KEY_BLOCK + j;
                                for (int64_t u = 0; u < ROWS; u++) {
                                    const float qv = qr[u][t];
#pragma omp simd
                                    for (int64_t x = 0; x < KEYS; x++) a[u][x] += qv * kr[x];
                                }
                            }
                            for (int64_t u = 0; u < ROWS && x0 + u < group; u++) {
                                float *r = scores + (h * group + x0 + u) * KEY_BLOCK + j;
                                for (int64_t x = 0; x < KEYS; x++) r[x] = a[u][x] * scale;
                            }
                        }
                    }
                }
            }
            for (int64_t hq = 0; hq < heads; hq++)
                for (int64_t i = 0; i < n; i++) {
                    const int64_t lim = (lag + i + 1 < j1 ? lag + i + 1 : j1) - j0, x = hq * n + i;
                    float *r = scores + x * KEY_BLOCK;
                    if (lim <= 0) {     /* the whole block is past this row: it adds nothing */
                        memset(r, 0, sizeof(float) * (size_t)(j1 - j0));
                        continue;
                    }
                    float m = run_max[x], sum = 0.0f;
#pragma omp simd reduction(max : m)
                    for (int64_t j = 0; j < lim; j++) m = r[j] > m ? r[j] : m;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < lim; j++) { r[j] = exp_approx(r[j] - m); sum += r[j]; }
                    for (int64_t j = lim; j < j1 - j0; j++) r[j] = 0.0f;
                    if (run_max[x] != m) {     /* rescale what earlier blocks accumulated */
                        const float c = run_max[x] == -INFINITY ? 0.0f : exp_approx(run_max[x] - m);
                        float *a = acc + (i * heads + hq) * d;
#pragma omp simd
                        for (int64_t t = 0; t < d; t++) a[t] *= c;
                        run_sum[x] *= c;
                        run_max[x] = m;
                    }
                    run_sum[x] += sum;
                }
#ifdef __AVX512F__
            if (n <= DOT_ROWS && d % HEAD_COLS == 0) {
                /* decode rows: each row's query heads of one KV head, HEAD_ROWS at a time, in one pass
                   over the keys per HEAD_COLS columns (`pv_heads`) */
                for (int64_t i = 0; i < n; i++) {
                    const int64_t lim = (lag + i + 1 < j1 ? lag + i + 1 : j1) - j0;
                    for (int64_t h = 0; h < kv && lim > 0; h++)
                        for (int64_t u0 = 0; u0 < rep; u0 += HEAD_ROWS) {
                            const int64_t count = rep - u0 < HEAD_ROWS ? rep - u0 : HEAD_ROWS;
                            const float *p[HEAD_ROWS];
                            float *a[HEAD_ROWS];
                            for (int64_t u = 0; u < count; u++) {
                                const int64_t hq = h * rep + u0 + u;
                                p[u] = scores + (hq * n + i) * KEY_BLOCK;
                                a[u] = acc + (i * heads + hq) * d;
                            }
                            for (int64_t t0 = 0; t0 < d; t0 += HEAD_COLS)
                                pv_group(count, p, a, t0, lim, v_cache + h * d, slot + j0, row);
                        }
                }
            } else
#endif
            if (n <= DOT_ROWS && d % KEYS == 0) {
                /* decode rows: each row's query heads of one KV head, ROWS at a time, keep KEYS output
                   columns in registers along the block's keys, V read in place; each output element still
                   sums its keys in order, as the loop below does, but without a load and a store of the
                   accumulator per key and head */
                for (int64_t i = 0; i < n; i++) {
                    const int64_t lim = (lag + i + 1 < j1 ? lag + i + 1 : j1) - j0;
                    for (int64_t h = 0; h < kv && lim > 0; h++)
                        for (int64_t u0 = 0; u0 < rep; u0 += ROWS) {
                            const float *p[ROWS];
                            float *a[ROWS];
                            for (int64_t u = 0; u < ROWS; u++) {    /* past the group: its last head again */
                                const int64_t hq = h * rep + (u0 + u < rep ? u0 + u : rep - 1);
                                p[u] = scores + (hq * n + i) * KEY_BLOCK;
                                a[u] = acc + (i * heads + hq) * d;
                            }
                            const int64_t kept = rep - u0 < ROWS ? rep - u0 : ROWS;
                            for (int64_t t0 = 0; t0 < d; t0 += KEYS)
                                pv_tile(p, a, kept, t0, lim, v_cache + h * d, slot + j0, row);
                        }
                }
            } else if (n <= DOT_ROWS || d % KEYS) {
                for (int64_t j = j0; j < j1; j++) {
                    if (j + AHEAD < ks) prefetch_row(v_cache + slot[j + AHEAD] * row, row);
                    const float *vp = v_cache + slot[j] * row;
                    for (int64_t i = j > lag ? j - lag : 0; i < n; i++)
                        for (int64_t hq = 0; hq < heads; hq++) {
                            const float p = scores[(hq * n + i) * KEY_BLOCK + j - j0];
                            const float *v = vp + (hq / rep) * d;
                            float *a = acc + (i * heads + hq) * d;
#pragma omp simd
                            for (int64_t t = 0; t < d; t++) a[t] += p * v[t];
                        }
                }
            } else {
                /* the block's V copied once as [kv, keys, d]; each row's output, KEYS values at a time,
                   stays in registers along the keys */
                for (int64_t j = j0; j < j1; j++) {
                    if (j + AHEAD < ks) prefetch_row(v_cache + slot[j + AHEAD] * row, row);
                    const float *vp = v_cache + slot[j] * row;
                    for (int64_t h = 0; h < kv; h++)
                        memcpy(kt + (h * KEY_BLOCK + j - j0) * d, vp + h * d, sizeof(float) * (size_t)d);
                }
                /* each group's rows, ROWS at a time, KEYS output columns in registers along the keys
                   (scores past a row's causal limit are zero, so a tile runs to its last row's limit) */
                for (int64_t h = 0; h < kv; h++) {
                    const float *vh = kt + h * KEY_BLOCK * d;
                    for (int64_t x0 = 0; x0 < group; x0 += ROWS) {
                        const float *p[ROWS];
                        float *a[ROWS];
                        int64_t upto = 0;
                        for (int64_t u = 0; u < ROWS; u++) {
                            const int64_t x = x0 + u < group ? x0 + u : group - 1, i = x % n;
                            const int64_t lim = (lag + i + 1 < j1 ? lag + i + 1 : j1) - j0;
                            upto = lim > upto ? lim : upto;
                            p[u] = scores + (h * group + x) * KEY_BLOCK;
                            a[u] = acc + (i * heads + h * rep + x / n) * d;
                        }
                        const int64_t kept = group - x0 < ROWS ? group - x0 : ROWS;
                        for (int64_t t0 = 0; t0 < d; t0 += KEYS) pv_tile(p, a, kept, t0, upto, vh, NULL, d);
                    }
                }
            }
        }
        float *o = out + q_start[s] * heads * d;
        for (int64_t i = 0; i < n; i++)
            for (int64_t hq = 0; hq < heads; hq++) {
                const float inv = 1.0f / run_sum[hq * n + i];
                const float *a = acc + (i * heads + hq) * d;
                float *dst = o + (i * heads + hq) * d;
#pragma omp simd
                for (int64_t t = 0; t < d; t++) dst[t] = a[t] * inv;
            }
    }
    free(scores);
    return 0;
}
