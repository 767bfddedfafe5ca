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
   so a tile's pass over K streams one contiguous block. With AVX-512 a lone row goes over two tiles at once
   (six accumulator vectors, two streams), and up to eight rows go through one pass over a tile (three
   vectors each: up to 24 accumulator registers), which is what makes 2-16 rows faster than oneDNN
   (`row_linear_max_rows`); without it a row keeps a tile's accumulators in vector registers. Where rows take
   two passes, each pulls half of the next tile into L2 as it computes (`ahead`).
   `threads` > 1 splits the tiles among threads (each output is summed by one thread, in the same order). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* 48 columns (three vectors) rather than 64: eight rows fit a pass (8 x 3 accumulators, three weight vectors
   and a broadcast: 28 of 32 registers) where 64 columns took six (6 x 4), so 13-16 rows take two passes over
   a tile instead of three (6 + 6 + 4, whose third pass ran at two thirds of the others' rate), 7-8 rows one
   instead of two, and 2-3 rows a pass of their own size rather than of four. */
#define TILE 48
#define VECTORS (TILE / 16)

void row_linear_pack_f32(const float *w, float *packed, int64_t n, int64_t k) {
    const int64_t tiles = (n + TILE - 1) / TILE;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < TILE; j++) {
                const int64_t col = t * TILE + j;
                packed[(t * k + i) * TILE + j] = col < n ? w[col * k + i] : 0.0f;
            }
}

/* Output columns per packed tile: the Python side sizes the packed copy by it. */
int64_t row_linear_tile(void) {
    return TILE;
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

/* One row of one tile (without AVX-512, or a lone row's last odd tile). */
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
/* R rows of one tile in one pass over it: each output's FMAs and block sums exactly as `tile_row` does them.
   R is a constant at each call: the accumulators (R x 3 vectors) stay in registers. */
static inline __attribute__((always_inline)) void tile_rows(const int R, const float *const *x, const float *wt,
        int64_t k, int64_t kb, float *const *out, const float *bias, int64_t width, const struct ahead *ahead) {
    float total[8][TILE];
    for (int64_t k0 = 0; k0 < k; k0 += kb) {
        const int64_t k1 = k0 + kb < k ? k0 + kb : k;
        __m512 acc[8][VECTORS];
#pragma GCC unroll 8
        for (int u = 0; u < R; u++)
#pragma GCC unroll 3
            for (int c = 0; c < VECTORS; c++) acc[u][c] = _mm512_setzero_ps();
        for (int64_t i = k0; i < k1; i++) {
            pull(ahead, i);
            const float *w = wt + i * TILE;
            const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32);
#pragma GCC unroll 8
            for (int u = 0; u < R; u++) {
                const __m512 b = _mm512_set1_ps(x[u][i]);
                acc[u][0] = _mm512_fmadd_ps(b, w0, acc[u][0]);
                acc[u][1] = _mm512_fmadd_ps(b, w1, acc[u][1]);
                acc[u][2] = _mm512_fmadd_ps(b, w2, acc[u][2]);
            }
        }
#pragma GCC unroll 8
        for (int u = 0; u < R; u++)
#pragma GCC unroll 3
            for (int c = 0; c < VECTORS; c++) {
                float *t = total[u] + 16 * c;
                _mm512_storeu_ps(t, k0 == 0 ? acc[u][c] : _mm512_add_ps(_mm512_loadu_ps(t), acc[u][c]));
            }
    }
    for (int64_t u = 0; u < R; u++) store(out[u], total[u], bias, width);
}
#endif

#ifdef __AVX512F__
/* A lone row over two adjacent tiles in one pass (six accumulator vectors, two weight streams): each output's
   FMAs and block sums as `tile_row` does them. One tile at a time kept three FMA chains in flight, and the
   `bench` Qwen3-VL's one-session decode step was 1-3% slower than with 64-column tiles; two at a time both
   families' take 0.98-1.00 of it (bench.kernel_ab). No pulls: a lone pass is bound by memory, and the
   hardware's prefetch follows both streams. */
static void pair_row(const float *x, const float *wa, const float *wb, int64_t k, int64_t kb, float *out,
                     const float *bias, int64_t width) {
    float total[2 * TILE];
    for (int64_t k0 = 0; k0 < k; k0 += kb) {
        const int64_t k1 = k0 + kb < k ? k0 + kb : k;
        __m512 acc[2 * VECTORS];
        for (int c = 0; c < 2 * VECTORS; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t i = k0; i < k1; i++) {
            const __m512 b = _mm512_set1_ps(x[i]);
            const float *a = wa + i * TILE, *w = wb + i * TILE;
            acc[0] = _mm512_fmadd_ps(b, _mm512_loadu_ps(a), acc[0]);
            acc[1] = _mm512_fmadd_ps(b, _mm512_loadu_ps(a + 16), acc[1]);
            acc[2] = _mm512_fmadd_ps(b, _mm512_loadu_ps(a + 32), acc[2]);
            acc[3] = _mm512_fmadd_ps(b, _mm512_loadu_ps(w), acc[3]);
            acc[4] = _mm512_fmadd_ps(b, _mm512_loadu_ps(w + 16), acc[4]);
            acc[5] = _mm512_fmadd_ps(b, _mm512_loadu_ps(w + 32), acc[5]);
        }
        for (int c = 0; c < 2 * VECTORS; c++) {
            float *t = total + 16 * c;
            _mm512_storeu_ps(t, k0 == 0 ? acc[c] : _mm512_add_ps(_mm512_loadu_ps(t), acc[c]));
        }
    }
    store(out, total, bias, width);
}
#endif

struct part {
    const float *x, *packed, *bias;
    float *out;
    int64_t rows, k, n, kb, first, last;        /* tiles [first, last) */
};

/* The rows of each pass over a tile, in order: with AVX-512 as few passes as take at most eight rows each,
   the rows shared evenly among them (10 = 5 + 5, 13 = 6 + 7: the same FMAs per weight load in each pass; eight
   then the rest was 3-10% slower at 10-16 rows); a lone row alone. Returns the number of passes. */
static int64_t passes(int64_t rows, int64_t *group) {
    int64_t n = 0;
#ifdef __AVX512F__
    if (rows >= 2) {
        n = (rows + 7) / 8;
        for (int64_t j = 0; j < n; j++) group[j] = rows * (j + 1) / n - rows * j / n;
        return n;
    }
#endif
    for (; n < rows; n++) group[n] = 1;
    return n;
}

/* What pass `j` of `count` over a tile of `k` rows pulls of the next tile (`next`; NULL: none): with two
   passes (9-16 rows; their rows and so their FMAs within one of each other) each pulls half of it, 3/2 lines
   per k, so that the pulls keep pace with the arithmetic and the next tile is in L2 when its first pass
   begins. Measured with 64-column tiles in A/B (bench.kernel_ab, decode steps), against the second pass
   alone pulling half the tile: 7-12 rows' steps 0.91-0.93x, and the second pass pulling all of it 1.09x. A
   lone pass pulls nothing: it is bound by memory anyway, and pulling beside the hardware's prefetch slowed
   a one-session decode step by a fifth. */
static struct ahead ahead_of(const float *next, int64_t k, int64_t j, int64_t count) {
    _Static_assert(TILE == 48, "two passes pull a 48-column tile's 3 lines per k, 3 per two k each");
    struct ahead a = {NULL, NULL, 0};
    if (!next || count != 2) return a;
    a.per2 = 3;
    a.from = (const char *)next + j * 3 * k * 32;
    a.end = (const char *)(next + k * TILE);
    return a;
}

static void *run_part(void *arg) {
    const struct part *p = arg;
    int64_t group[p->rows];     /* a pass has one row or more */
    const int64_t count = passes(p->rows, group);
    int64_t first = p->first;
#ifdef __AVX512F__
    if (p->rows == 1) {         /* pairs of tiles, then the last one alone where the part's count is odd */
        for (int64_t t = p->first; t + 1 < p->last; t += 2) {
            const float *wt = p->packed + t * p->k * TILE;
            const int64_t width = p->n - t * TILE < 2 * TILE ? p->n - t * TILE : 2 * TILE;
            pair_row(p->x, wt, wt + p->k * TILE, p->k, p->kb, p->out + t * TILE, p->bias ? p->bias + t * TILE : NULL,
                     width);
        }
        if ((p->last - p->first) % 2 == 0) return NULL;
        first = p->last - 1;
    }
#endif
    for (int64_t t = first; t < p->last; t++) {
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
            const float *x[8];
            float *out[8];
            for (int64_t u = 0; u < group[j]; u++) {
                x[u] = p->x + (r0 + u) * p->k;
                out[u] = p->out + (r0 + u) * p->n + t * TILE;
            }
            switch (group[j]) {     /* R a constant in each: its accumulators stay in registers */
            case 2: tile_rows(2, x, wt, p->k, p->kb, out, bias, width, &a); break;
            case 3: tile_rows(3, x, wt, p->k, p->kb, out, bias, width, &a); break;
            case 4: tile_rows(4, x, wt, p->k, p->kb, out, bias, width, &a); break;
            case 5: tile_rows(5, x, wt, p->k, p->kb, out, bias, width, &a); break;
            case 6: tile_rows(6, x, wt, p->k, p->kb, out, bias, width, &a); break;
            case 7: tile_rows(7, x, wt, p->k, p->kb, out, bias, width, &a); break;
            default: tile_rows(8, x, wt, p->k, p->kb, out, bias, width, &a); break;
            }
            r0 += group[j];
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
