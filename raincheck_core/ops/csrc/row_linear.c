/* A linear layer's product for one row, in the summation order of oneDNN's many-row products.

   Built and loaded by raincheck_core/ops/native.py; used by raincheck_core/ops/row_linear.py. At one row
   oneDNN's prepacked matmul (layers/linear.py) runs at about half the rate of a plain pass over the weight,
   and for K > 1024 it sums in another order than it does at two rows or more, so a row's result depended
   on whether it ran alone. Here out[n] = sum_k x[k] * w[n][k] is summed as oneDNN sums each row of a
   many-row product: K in blocks of `kb` rows, each block's partial sum from zero by one FMA per k in
   order, the partials added left to right, then the bias. The Python side checks that order against
   oneDNN on the layer's own weight before it uses the kernel, and keeps oneDNN where they differ.

   The weight is packed once as [tiles][K][TILE] (TILE output columns per tile, the last one zero-padded),
   so a tile's pass over K streams one contiguous block and keeps TILE accumulators in vector registers.
   `threads` > 1 splits the tiles among threads (each output is summed by one thread, in the same order). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>

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

struct part {
    const float *x, *packed, *bias;
    float *out;
    int64_t k, n, kb, first, last;      /* tiles [first, last) */
};

static void *run_part(void *arg) {
    const struct part *p = arg;
    for (int64_t t = p->first; t < p->last; t++) {
        const float *wt = p->packed + t * p->k * TILE;
        float total[TILE], acc[TILE];
        for (int64_t k0 = 0; k0 < p->k; k0 += p->kb) {
            const int64_t k1 = k0 + p->kb < p->k ? k0 + p->kb : p->k;
#pragma omp simd
            for (int64_t j = 0; j < TILE; j++) acc[j] = 0.0f;
            for (int64_t i = k0; i < k1; i++) {
                const float xv = p->x[i];
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
        const int64_t width = p->n - t * TILE < TILE ? p->n - t * TILE : TILE;
        float *o = p->out + t * TILE;
        for (int64_t j = 0; j < width; j++) o[j] = p->bias ? total[j] + p->bias[t * TILE + j] : total[j];
    }
    return NULL;
}

/* out[n] for one row x[k]; `bias` may be NULL. */
void row_linear_f32(const float *x, const float *packed, const float *bias, float *out, int64_t k, int64_t n,
                    int64_t kb, int64_t threads) {
    const int64_t tiles = (n + TILE - 1) / TILE;
    int64_t parts = threads < tiles ? threads : tiles;
    if (parts < 1) parts = 1;
    struct part part[parts];
    pthread_t thread[parts];
    int started[parts];
    for (int64_t i = 0; i < parts; i++)
        part[i] = (struct part){x, packed, bias, out, k, n, kb, tiles * i / parts, tiles * (i + 1) / parts};
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
