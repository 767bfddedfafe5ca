/* A linear layer's product for a few rows, in the summation order of oneDNN's many-row products.

   Built and loaded by raincheck_core/ops/native.py; used by raincheck_core/ops/row_linear.py. At a decode
   step's few rows oneDNN's prepacked matmul (layers/linear.py) runs well below the rate of a plain pass
   over the weight (at one row, half of it), and for K > 1024 it sums a lone row in another order than
   any row of a product of two rows or more, so a row's result depended on whether it ran alone. Here
   out[r][n] = sum_k x[r][k] * w[n][k] is summed as oneDNN sums each row of a many-row product: K in blocks
   of `kb`, each block's partial from zero by one FMA per k in order, the partials added left to right,
   then the bias. The Python side checks that order against oneDNN on the layer's own weight before it
   uses the kernel, and keeps oneDNN where they differ.

   The weight is packed once as [tiles][K][TILE] (TILE output columns per tile, the last one zero-padded),
   so a tile's pass over K streams one contiguous block. One row keeps its TILE accumulators in vector
   registers; with AVX-512, rows go six (or four) at a time through one pass over the tile (24 or 16
   accumulator registers), which is what makes 2-16 rows faster than oneDNN (`row_linear_max_rows`). Where
   rows take two or three passes, each pulls a share of the next tile into L2 as it computes (`ahead`).
   `threads` > 1 splits the tiles among threads (each output is summed by one thread, in the same order). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define TILE 64

void row_linear_pack_f32(const float *w, float *packed, int64_t n, int64_t k) {
    const int64_t tiles = (n + TILE - 1) / TILE;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < TILE; j++) {
                const int64_t col = t * TILE + j;
                packed[(t * k + i) * TILE + j] = col < n ? w[col * k + i] : 0.0f;
            }
}

/* Rows up to which the kernel is faster than oneDNN on the hosts measured (more go to oneDNN). */
int64_t row_linear_max_rows(void) {
#ifdef __AVX512F__
    return 16;
#else
    return 1;
#endif
}

/* The part of the next tile that one pass over a tile pulls into L2 as it goes (`per2` cache lines per two
   k, from `from`, short of `end`): without it a tile's first pass would wait on memory while the other
   passes, computing from L2, left the memory idle. */
struct ahead {
    const char *from, *end;
    int64_t per2;
};

static inline void pull(const struct ahead *a, int64_t i) {
    for (int64_t l = (i * a->per2) >> 1; l < ((i + 1) * a->per2) >> 1; l++) {
        const char *line = a->from + l * 64;
        if (line < a->end) __builtin_prefetch(line, 0, 2);
    }
}

/* The first `width` outputs of a tile's row `total`, plus the bias, to `out`. */
static inline void store(float *out, const float *total, const float *bias, int64_t width) {
    for (int64_t j = 0; j < width; j++) out[j] = bias ? total[j] + bias[j] : total[j];
}

/* One row of one tile. */
static void tile_row(const float *x, const float *wt, int64_t k, int64_t kb, float *out, const float *bias,
                     int64_t width, const struct ahead *ahead) {
    float total[TILE], acc[TILE];
    for (int64_t k0 = 0; k0 < k; k0 += kb) {
        const int64_t k1 = k0 + kb < k ? k0 + kb : k;
#pragma omp simd
        for (int64_t j = 0; j < TILE; j++) acc[j] = 0.0f;
        for (int64_t i = k0; i < k1; i++) {
            pull(ahead, i);
            const float xv = x[i];
            const float *w = wt + i * TILE;
#pragma omp simd
            for (int64_t j = 0; j < TILE; j++) acc[j] = fmaf(xv, w[j], acc[j]);
        }
        if (k0 == 0) {
#pragma omp simd
            for (int64_t j = 0; j < TILE; j++) total[j] = acc[j];
        } else {
#pragma omp simd
            for (int64_t j = 0; j < TILE; j++) total[j] = total[j] + acc[j];
        }
    }
    store(out, total, bias, width);
}

#ifdef __AVX512F__
/* R rows of one tile in one pass over it (rows past `kept` repeat the last and are not stored): each output's
   FMAs and block sums exactly as `tile_row` does them. R is a constant at each call: the accumulators
   (R x 4 vectors) stay in registers. */
static inline __attribute__((always_inline)) void tile_rows(const int R, const float *const *x, const float *wt,
        int64_t k, int64_t kb, float *const *out, const float *bias, int64_t kept, int64_t width,
        const struct ahead *ahead) {
    float total[6][TILE];
    for (int64_t k0 = 0; k0 < k; k0 += kb) {
        const int64_t k1 = k0 + kb < k ? k0 + kb : k;
        __m512 acc[6][4];
#pragma GCC unroll 6
        for (int u = 0; u < R; u++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[u][c] = _mm512_setzero_ps();
        for (int64_t i = k0; i < k1; i++) {
            pull(ahead, i);
            const float *w = wt + i * TILE;
            const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32),
                         w3 = _mm512_loadu_ps(w + 48);
#pragma GCC unroll 6
            for (int u = 0; u < R; u++) {
                const __m512 b = _mm512_set1_ps(x[u][i]);
                acc[u][0] = _mm512_fmadd_ps(b, w0, acc[u][0]);
                acc[u][1] = _mm512_fmadd_ps(b, w1, acc[u][1]);
                acc[u][2] = _mm512_fmadd_ps(b, w2, acc[u][2]);
                acc[u][3] = _mm512_fmadd_ps(b, w3, acc[u][3]);
            }
        }
#pragma GCC unroll 6
        for (int u = 0; u < R; u++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                float *t = total[u] + 16 * c;
                _mm512_storeu_ps(t, k0 == 0 ? acc[u][c] : _mm512_add_ps(_mm512_loadu_ps(t), acc[u][c]));
            }
    }
    for (int64_t u = 0; u < kept; u++) store(out[u], total[u], bias, width);
}
#endif

struct part {
    const float *x, *packed, *bias;
    float *out;
    int64_t rows, k, n, kb, first, last;        /* tiles [first, last) */
};

/* The rows of each pass over a tile, in order: with AVX-512 six rows a pass (24 accumulators: the most FMAs per
   weight load that fit the registers), four where fewer than five are left, and 8 as 4 + 4 rather than 6 + 2;
   a last row alone. Returns the number of passes. */
static int64_t passes(int64_t rows, int64_t *group) {
    int64_t n = 0, r0 = 0;
#ifdef __AVX512F__
    while (rows - r0 >= 2) {
        const int64_t left = rows - r0, size = left >= 5 && left != 8 ? 6 : 4;
        group[n++] = size;
        r0 += left < size ? left : size;
    }
#endif
    for (; r0 < rows; r0++) group[n++] = 1;
    return n;
}

/* What pass `j` of `count` over a tile of `k` rows pulls of the next tile (`next`; NULL: none): every pass a
   share in proportion to its FMAs, so that the pulls keep pace with the arithmetic and the next tile is in
   L2 when its first pass begins: two passes (7-12 rows) two lines per k each, three (13-16 rows: 6 + 6 + 4
   rows) 3/2, 3/2 and 1. Measured in A/B (bench.kernel_ab, decode steps), against the later passes alone
   pulling two lines per k: with two passes (where that pulled half the tile) 7-12 rows' steps 0.91-0.93x,
   and the second pass pulling all four lines instead 1.09x; with three, 13-16 rows' steps 0.97-0.98x (any
   other split within 1%: 1/1/2, 1/2/1 or 2/1.5/0.5 lines per k). A lone pass pulls nothing: it is bound by
   memory anyway, and pulling beside the hardware's prefetch slowed a one-session decode step by a fifth. */
static struct ahead ahead_of(const float *next, int64_t k, int64_t j, int64_t count) {
    _Static_assert(TILE == 64, "the shares add up to a 64-column tile's 4 lines per k");
    static const int64_t share[2][3] = {{4, 4, 0}, {3, 3, 2}};       /* lines per two k, per pass */
    struct ahead a = {NULL, NULL, 0};
    if (!next || count < 2 || count > 3) return a;
    const int64_t *per2 = share[count - 2];
    int64_t before = 0;
    for (int64_t p = 0; p < j; p++) before += per2[p];
    a.per2 = per2[j];
    a.from = (const char *)next + before * k * 32;
    a.end = (const char *)(next + k * TILE);
    return a;
}

static void *run_part(void *arg) {
    const struct part *p = arg;
    int64_t group[p->rows];     /* a pass has one row or more */
    const int64_t count = passes(p->rows, group);
    for (int64_t t = p->first; t < p->last; t++) {
        const float *wt = p->packed + t * p->k * TILE;
        const float *next = t + 1 < p->last ? wt + p->k * TILE : NULL;
        const float *bias = p->bias ? p->bias + t * TILE : NULL;
        const int64_t width = p->n - t * TILE < TILE ? p->n - t * TILE : TILE;
        int64_t r0 = 0;
        for (int64_t j = 0; j < count; j++) {
            const struct ahead a = ahead_of(next, p->k, j, count);
            if (group[j] == 1) {
                tile_row(p->x + r0 * p->k, wt, p->k, p->kb, p->out + r0 * p->n + t * TILE, bias, width, &a);
                r0++;
                continue;
            }
#ifdef __AVX512F__
            const float *x[6];
            float *out[6];
            const int64_t left = p->rows - r0, kept = left < group[j] ? left : group[j];
            for (int64_t u = 0; u < group[j]; u++) {
                const int64_t r = r0 + (u < kept ? u : kept - 1);
                x[u] = p->x + r * p->k;
                out[u] = p->out + r * p->n + t * TILE;
            }
            if (group[j] == 6)
                tile_rows(6, x, wt, p->k, p->kb, out, bias, kept, width, &a);
            else
                tile_rows(4, x, wt, p->k, p->kb, out, bias, kept, width, &a);
            r0 += kept;
#endif
        }
    }
    return NULL;
}

/* out[rows][n] for x[rows][k]; `bias` may be NULL. */
void row_linear_f32(const float *x, const float *packed, const float *bias, float *out, int64_t rows, int64_t k,
                    int64_t n, int64_t kb, int64_t threads) {
    const int64_t tiles = (n + TILE - 1) / TILE;
    int64_t parts = threads < tiles ? threads : tiles;
    if (parts < 1) parts = 1;
    struct part part[parts];
    pthread_t thread[parts];
    int started[parts];
    for (int64_t i = 0; i < parts; i++)
        part[i] = (struct part){x, packed, bias, out, rows, k, n, kb, tiles * i / parts, tiles * (i + 1) / parts};
    /* part 0 runs on this thread; a thread that cannot start leaves its part to this one too */
    for (int64_t i = 1; i < parts; i++) started[i] = pthread_create(&thread[i], NULL, run_part, &part[i]) == 0;
    run_part(&part[0]);
    for (int64_t i = 1; i < parts; i++) {
        if (started[i])
            pthread_join(thread[i], NULL);
        else
            run_part(&part[i]);
    }
}
