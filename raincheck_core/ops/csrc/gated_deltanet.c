/* A Gated DeltaNet token mixer's core over packed sequences, on the CPU: short convolution, SiLU,
   q/k L2 normalisation and the gated delta rule token by token, one call per layer.

   Built and loaded by raincheck_core/ops/native.py; the contract is that of the torch path in
   `gated_deltanet_varlen` (raincheck_core/ops/gdn_varlen.py): `causal_conv1d_varlen`, then `split_qkv`,
   then `chunk_gated_delta_rule_varlen`. The packed rows are read where they lie: packed row r is row
   source[r] of the step's u (row stride ld_u), g and beta, or, when source[r] < 0, appended row
   -1 - source[r] of xu, xg, xb (a deferred chunk's recorded conv lead); its output goes to row source[r]
   of o, and is dropped for an appended row; with x_out, its [q | k | v] as the delta rule reads them (q
   scaled, q and k normalised) also go to row source[r] of x_out [., C] (the factors a join's map is built
   from). Sequence s has len[s] packed rows from start[s]. It starts from the conv history and state of
   pool slot slot[s] (hist + slot[s] * hist_stride, state_in + slot[s] * state_stride: the pools are read
   in place), or, where seed_hist_at[s] / seed_state_at[s] >= 0, from that row of seed_hist [., K-1, C] /
   seed_state [., H, Dk, Dv] (a live state a join corrected in this step). It leaves its history and
   state in pool row out_row[s] when that is >= 0 (the other row of its slot: the engine's update then
   makes it current, cache/gdn_state.py), else in row -1 - out_row[s] of tails / state_out (row s when
   out_row is NULL); when split_row[s] >= 0 the history and state after its first split_row[s] rows are
   also written, at split index i = split_index[s], to pool row split_out_row[i] or to split_tails /
   split_out (the same rule). With cap_first (else NULL), the history and state after packed row
   cap_row[m] of sequence s (ascending, for m in [cap_first[s], cap_first[s + 1])) are written to row m of
   cap_hist / cap_state (rows cap_hist_stride / cap_state_stride floats apart): states at chosen rows
   (raincheck_core/ops/gdn_rows.py). Every pool row written is one no sequence reads. Once the first
   joins_after sequences are done (all of them when joins_after >= n), each of the `joins` joins j
   corrects the live state in pool row live_slot[j] by the sequence join_seq[j] < joins_after (which ran
   from the prefix state with the lead appended, so its final state is S_lead'):
   corrected[j] = live + P_j (S_lead' - s_ref_j), P_j = p + j * p_stride [H, Dk, Dk] and
   s_ref_j = s_ref + j * ref_stride [H, Dk, Dv]; the sequences after them (a joining turn's decode row)
   may start from a corrected state and a joined sequence's tails (seeds pointing into this call's own
   outputs). Per row, with conv channels [q | k | v]:
       x = silu(conv(u)); q, k L2-normalised per key head (q also scaled by dk^-1/2);
       per value head h (key head h / (heads / key_heads)), with S [Dk, Dv]:
       S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q.
   u and xu [., C] (u's rows ld_u apart), conv weight [C, K], a slot's history and tails [., K-1, C], g,
   beta, xg, xb [., H], a slot's state and the other states [., H, Dk, Dv], o [., H, Dv]: fp32, each row
   contiguous. Rows of the outputs are out_state_stride (state_out, split_out, corrected) and
   out_hist_stride (tails, split_tails) floats apart, rows of the seeds seed_state_stride and
   seed_hist_stride: the engine passes one layer's rows of buffers that hold every layer's, [rows,
   layers, ...], so that the update writes all layers' new states with one copy.

   Why native: a deferred chunk (7-63 rows plus its 3-row lead) is a short sequence, and the torch path's
   ~50 tensor ops per layer cost more in dispatch than their arithmetic; token by token, a head's state
   stays in L1 and the whole layer is one call. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_math.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* One token of one head: decay, read S^T k from the decayed state, rank-1 write, o = S^T q. The decay
   reads the state from `from` (S itself, or a sequence's start state: its first token then moves the state
   into S with no copy beforehand). */
static inline void delta_step(float *S, const float *from, const float *restrict q, const float *restrict k,
                              const float *restrict v, float alpha, float b, float *restrict o,
                              float *restrict delta, int64_t dk, int64_t dv) {
    for (int64_t j = 0; j < dv; j++) delta[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float *src = from + i * dv, ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) { row[j] = src[j] * alpha; delta[j] += ki * row[j]; }
    }
#pragma omp simd
    for (int64_t j = 0; j < dv; j++) delta[j] = (v[j] - delta[j]) * b;
    for (int64_t j = 0; j < dv; j++) o[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i], qi = q[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) { row[j] += ki * delta[j]; o[j] += qi * row[j]; }
    }
}

#ifdef __AVX512F__
/* `delta_step` for a sequence's only token, dv = 16 * NV (NV <= 8), its new state streamed to memory. The
   first pass reads the start state for S^T k without writing anything; the second decays it again (the same
   product), adds the rank-1 term and writes the new state with non-temporal stores: its lines are not read
   for ownership (a third of the state traffic), nor left dirty in the cache, where the next layers' weights,
   streaming in, had to write them back (16 rows' states written the old way between the `bench` model's
   linear layers slowed those by ~0.4 ms a step). Each output's operations are those of `delta_step`, in the
   same order: the same bits. */
static inline __attribute__((always_inline)) void delta_step_stream(const int NV, float *S, const float *from,
        const float *restrict q, const float *restrict k, const float *restrict v, float alpha, float b,
        float *restrict o, int64_t dk) {
    const int64_t dv = 16 * NV;
    const __m512 decay = _mm512_set1_ps(alpha);
    __m512 delta[8], out[8];
    for (int c = 0; c < NV; c++) delta[c] = out[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dk; i++) {
        const __m512 ki = _mm512_set1_ps(k[i]);
        for (int c = 0; c < NV; c++)
            delta[c] = _mm512_fmadd_ps(ki, _mm512_mul_ps(_mm512_loadu_ps(from + i * dv + 16 * c), decay), delta[c]);
    }
    const __m512 beta = _mm512_set1_ps(b);
    for (int c = 0; c < NV; c++) delta[c] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + 16 * c), delta[c]), beta);
    for (int64_t i = 0; i < dk; i++) {
        const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
        for (int c = 0; c < NV; c++) {
            const __m512 row = _mm512_fmadd_ps(ki, delta[c], _mm512_mul_ps(_mm512_loadu_ps(from + i * dv + 16 * c), decay));
            _mm512_stream_ps(S + i * dv + 16 * c, row);
            out[c] = _mm512_fmadd_ps(qi, row, out[c]);
        }
    }
    for (int c = 0; c < NV; c++) _mm512_storeu_ps(o + 16 * c, out[c]);
}
#endif

/* One token of one head; `only`: the sequence's only token (a decode row), whose state is streamed out where
   the build and the shapes allow (`delta_step_stream`: AVX-512, dv a multiple of 16 up to 128, S aligned). */
static inline void delta_token(int only, float *S, const float *from, const float *restrict q,
                               const float *restrict k, const float *restrict v, float alpha, float b,
                               float *restrict o, float *restrict delta, int64_t dk, int64_t dv) {
#ifdef __AVX512F__
    if (only && ((uintptr_t)S & 63) == 0)
        switch (dv) {
        case 16: delta_step_stream(1, S, from, q, k, v, alpha, b, o, dk); return;
        case 32: delta_step_stream(2, S, from, q, k, v, alpha, b, o, dk); return;
        case 48: delta_step_stream(3, S, from, q, k, v, alpha, b, o, dk); return;
        case 64: delta_step_stream(4, S, from, q, k, v, alpha, b, o, dk); return;
        case 128: delta_step_stream(8, S, from, q, k, v, alpha, b, o, dk); return;
        }
#endif
    delta_step(S, from, q, k, v, alpha, b, o, delta, dk, dv);
}

static inline void l2norm(float *restrict x, int64_t n, float scale) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < n; i++) sq += x[i] * x[i];
    const float r = 1.0f / sqrtf(sq + 1e-6f);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * r * scale;
}

/* The join's register tile: JOIN_ROWS rows of P x JOIN_COLS columns of the state, as many independent
   FMA chains as the vector registers allow. */
#ifdef __AVX512F__
#define JOIN_ROWS 8
#else
#define JOIN_ROWS 4
#endif
#define JOIN_COLS 16

/* y = live + P (final - ref) for each head: the join (docs/mechanism.md §5), P on the left. */
static void join_heads(float *restrict y, const float *live, const float *P, const float *final, const float *ref,
                       float *restrict d, int64_t heads, int64_t dk, int64_t dv) {
    for (int64_t h = 0; h < heads; h++) {
        const int64_t so = h * dk * dv;
        const float *Ph = P + h * dk * dk;
#pragma omp simd
        for (int64_t x = 0; x < dk * dv; x++) d[x] = final[so + x] - ref[so + x];
        if (dv % JOIN_COLS) {       /* no whole tiles: row by row */
            memcpy(y + so, live + so, sizeof(float) * (size_t)(dk * dv));
            for (int64_t a = 0; a < dk; a++) {
                float *row = y + so + a * dv;
                for (int64_t c = 0; c < dk; c++) {
                    const float pc = Ph[a * dk + c], *dc = d + c * dv;
#pragma omp simd
                    for (int64_t b = 0; b < dv; b++) row[b] += pc * dc[b];
                }
            }
            continue;
        }
        for (int64_t a0 = 0; a0 < dk; a0 += JOIN_ROWS)
            for (int64_t b0 = 0; b0 < dv; b0 += JOIN_COLS) {
                /* rows past dk repeat the last one (computed, not stored) */
                int64_t ra[JOIN_ROWS];
                for (int64_t u = 0; u < JOIN_ROWS; u++) ra[u] = a0 + u < dk ? a0 + u : dk - 1;
                float acc[JOIN_ROWS][JOIN_COLS];
                for (int64_t u = 0; u < JOIN_ROWS; u++)
                    for (int64_t b = 0; b < JOIN_COLS; b++) acc[u][b] = live[so + ra[u] * dv + b0 + b];
                for (int64_t c = 0; c < dk; c++) {
                    const float *dc = d + c * dv + b0;
                    for (int64_t u = 0; u < JOIN_ROWS; u++) {
                        const float pc = Ph[ra[u] * dk + c];
#pragma omp simd
                        for (int64_t b = 0; b < JOIN_COLS; b++) acc[u][b] += pc * dc[b];
                    }
                }
                for (int64_t u = 0; u < JOIN_ROWS && a0 + u < dk; u++)
                    for (int64_t b = 0; b < JOIN_COLS; b++) y[so + (a0 + u) * dv + b0 + b] = acc[u][b];
            }
    }
}

/* Everything one call reads and writes, as named in the comment at the top. One struct rather than ~50
   arguments: ops/gdn_kernel.py mirrors it field by field (`GDNArgs`), fills what a step's layers share
   once, and sets only a layer's own pointers before each call. */
typedef struct {
    /* the layer's step rows, gates, conv weight and outputs */
    const float *u;
    int64_t ld_u;
    const float *g, *beta, *conv_w;
    float *o, *x_out;
    /* the layer's part of what the step's layers share */
    const float *xu, *xg, *xb;
    float *hist, *state_in;     /* the pools: read at slot[], written at out_row[] and split_out_row[] */
    const float *seed_state, *seed_hist, *p, *s_ref;
    float *state_out, *split_out, *tails, *split_tails, *corrected;
    /* the step's sequences and joins */
    const int64_t *source, *start, *len, *split_row, *split_index, *slot, *seed_state_at, *seed_hist_at,
        *join_seq, *live_slot, *out_row, *split_out_row;
    int64_t n, joins, joins_after;
    /* row strides, in floats */
    int64_t hist_stride, state_stride, seed_state_stride, seed_hist_stride, p_stride, ref_stride,
        out_state_stride, out_hist_stride;
    /* shapes */
    int64_t kernel, key_heads, heads, dk, dv;
    /* states at chosen rows (cap_first NULL: none) */
    const int64_t *cap_first, *cap_row;
    float *cap_state, *cap_hist;
    int64_t cap_state_stride, cap_hist_stride;
    /* threads the call may use (each takes a block of key heads and the value heads that read them) */
    int64_t threads;
} gdn_args;

/* The kernel's work for key heads [a0, a1) and the value heads that read them: their conv channels (q, k
   and v blocks), l2 norms, delta rules, states, histories and joins. Heads share nothing, so parts run
   side by side, and a head's arithmetic is the same whatever part it is in (a row's bits do not depend
   on the thread count). `wt`: the conv weight tap-major [K, C], shared; `scratch`: this part's own. */
static void run_part(const gdn_args *args, const float *wt, int64_t a0, int64_t a1, float *scratch) {
    const float *u = args->u, *g = args->g, *beta = args->beta, *xu = args->xu, *xg = args->xg, *xb = args->xb,
                *seed_state = args->seed_state, *seed_hist = args->seed_hist, *p = args->p, *s_ref = args->s_ref;
    float *hist = args->hist, *state_in = args->state_in, *o = args->o, *x_out = args->x_out,
          *state_out = args->state_out, *split_out = args->split_out, *tails = args->tails,
          *split_tails = args->split_tails, *corrected = args->corrected;
    const int64_t *source = args->source, *start = args->start, *len = args->len, *split_row = args->split_row,
                  *split_index = args->split_index, *slot = args->slot, *seed_state_at = args->seed_state_at,
                  *seed_hist_at = args->seed_hist_at, *join_seq = args->join_seq, *live_slot = args->live_slot,
                  *out_row = args->out_row, *split_out_row = args->split_out_row;
    const int64_t ld_u = args->ld_u, n = args->n, joins = args->joins, joins_after = args->joins_after,
                  hist_stride = args->hist_stride, state_stride = args->state_stride,
                  seed_state_stride = args->seed_state_stride, seed_hist_stride = args->seed_hist_stride,
                  p_stride = args->p_stride, ref_stride = args->ref_stride,
                  out_state_stride = args->out_state_stride, out_hist_stride = args->out_hist_stride,
                  kernel = args->kernel, key_heads = args->key_heads, heads = args->heads, dk = args->dk,
                  dv = args->dv;
    const int64_t kd = key_heads * dk, C = 2 * kd + heads * dv, hist_rows = kernel - 1, rep = heads / key_heads;
    const int64_t state_size = dk * dv, h0 = a0 * rep, h1 = a1 * rep, part_state = (h1 - h0) * state_size;
    /* this part's channels: its q block, k block and v block of [q | k | v] */
    const int64_t lo[3] = {a0 * dk, kd + a0 * dk, 2 * kd + h0 * dv}, hi[3] = {a1 * dk, kd + a1 * dk, 2 * kd + h1 * dv};
    const int64_t *cap_first = args->cap_first, *cap_row = args->cap_row;
    float *cap_state = args->cap_state, *cap_hist = args->cap_hist;
    const int64_t cap_state_stride = args->cap_state_stride, cap_hist_stride = args->cap_hist_stride;
    const float q_scale = 1.0f / sqrtf((float)dk);
    float *x = scratch, *delta = x + C, *dropped = delta + dv, *diff = dropped + dv;
    /* where sequence s's (and split i's) new state and history go: a pool row, or a row of the buffers */
#define OUT(rows, s, pool, pool_stride, buf, buf_stride)                                                 \
    ((rows) && (rows)[s] >= 0 ? (pool) + (rows)[s] * (pool_stride)                                    \
                              : (buf) + ((rows) ? -1 - (rows)[s] : (s)) * (buf_stride))
#define FINAL(s) OUT(out_row, s, state_in, state_stride, state_out, out_state_stride)
#define TAIL(s) OUT(out_row, s, hist, hist_stride, tails, out_hist_stride)
#define SPLIT_FINAL(i) OUT(split_out_row, i, state_in, state_stride, split_out, out_state_stride)
#define SPLIT_TAIL(i) OUT(split_out_row, i, hist, hist_stride, split_tails, out_hist_stride)
    /* this part's channels of a row (dst and src rows of C floats) */
#define COPY_CHANNELS(dst, src)                                                                            \
    for (int b = 0; b < 3; b++) memcpy((dst) + lo[b], (src) + lo[b], sizeof(float) * (size_t)(hi[b] - lo[b]))
    /* the joins run once the first joins_after sequences are done: later sequences (a joining turn's
       decode row) may start from the states they correct */
#define RUN_JOINS()                                                                                        \
    for (int64_t j = 0; j < joins; j++)                                                                   \
        join_heads(corrected + j * out_state_stride + h0 * state_size,                                    \
                   state_in + live_slot[j] * state_stride + h0 * state_size, p + j * p_stride + h0 * dk * dk, \
                   FINAL(join_seq[j]) + h0 * state_size, s_ref + j * ref_stride + h0 * state_size, diff,  \
                   h1 - h0, dk, dv)
    for (int64_t s = 0; s < n; s++) {
        if (s == joins_after) RUN_JOINS();
        const int64_t first = start[s], end = start[s] + len[s];
        /* where the sequence starts: its pool slot, or a seed (a state corrected by a join this step) */
        const float *h0p = seed_hist_at && seed_hist_at[s] >= 0 ? seed_hist + seed_hist_at[s] * seed_hist_stride
                                                               : hist + slot[s] * hist_stride;
        const float *s0 = seed_state_at && seed_state_at[s] >= 0 ? seed_state + seed_state_at[s] * seed_state_stride
                                                                 : state_in + slot[s] * state_stride;
        /* a packed row of this sequence, or before its first row, its history (oldest first) */
#define ROW(pos) ((pos) >= first ? (source[pos] >= 0 ? u + source[pos] * ld_u : xu + (-1 - source[pos]) * C) \
                                 : h0p + (hist_rows - (first - (pos))) * C)
        float *const S0 = FINAL(s);
        if (len[s] == 0) memcpy(S0 + h0 * state_size, s0 + h0 * state_size, sizeof(float) * (size_t)part_state);
        int64_t m = cap_first ? cap_first[s] : 0;
        const int64_t m_end = cap_first ? cap_first[s + 1] : 0;
        for (int64_t t = first; t < end; t++) {
            for (int b = 0; b < 3; b++) {
                /* taps in order, oldest row first, as the torch path accumulates them */
                const float *r0 = ROW(t - hist_rows);
#pragma omp simd
                for (int64_t c = lo[b]; c < hi[b]; c++) x[c] = r0[c] * wt[c];
                for (int64_t j = 1; j < kernel; j++) {
                    const float *r = ROW(t - hist_rows + j), *w = wt + j * C;
#pragma omp simd
                    for (int64_t c = lo[b]; c < hi[b]; c++) x[c] += r[c] * w[c];
                }
#pragma omp simd
                for (int64_t c = lo[b]; c < hi[b]; c++) x[c] = x[c] / (1.0f + exp_approx(-x[c]));
            }
            for (int64_t a = a0; a < a1; a++) {
                l2norm(x + a * dk, dk, q_scale);
                l2norm(x + kd + a * dk, dk, 1.0f);
            }
            const int64_t src = source[t];
            if (x_out && src >= 0) COPY_CHANNELS(x_out + src * C, x);
            const float *gt = src >= 0 ? g + src * heads : xg + (-1 - src) * heads;
            const float *bt = src >= 0 ? beta + src * heads : xb + (-1 - src) * heads;
            for (int64_t h = h0; h < h1; h++) {
                const int64_t a = h / rep;
                float *S = S0 + h * state_size;
                delta_token(len[s] == 1, S, t == first ? s0 + h * state_size : S, x + a * dk, x + kd + a * dk, x + 2 * kd + h * dv,
                           expf(gt[h]), bt[h],
                           src >= 0 ? o + (src * heads + h) * dv : dropped, delta, dk, dv);
                if (split_row[s] >= 0 && t - first + 1 == split_row[s])
                    memcpy(SPLIT_FINAL(split_index[s]) + h * state_size, S, sizeof(float) * (size_t)state_size);
            }
            if (m < m_end && cap_row[m] == t - first) {     /* a chosen row: a copy, the state stays in cache */
                memcpy(cap_state + m * cap_state_stride + h0 * state_size, S0 + h0 * state_size,
                       sizeof(float) * (size_t)part_state);
                for (int64_t i = 0; i < hist_rows; i++)
                    COPY_CHANNELS(cap_hist + m * cap_hist_stride + i * C, ROW(t + 1 - hist_rows + i));
                m++;
            }
        }
        for (int64_t i = 0; i < hist_rows; i++) {
            COPY_CHANNELS(TAIL(s) + i * C, ROW(end - hist_rows + i));
            if (split_row[s] >= 0)
                COPY_CHANNELS(SPLIT_TAIL(split_index[s]) + i * C, ROW(first + split_row[s] - hist_rows + i));
        }
#undef ROW
    }
    if (joins_after >= n) RUN_JOINS();
#ifdef __AVX512F__
    _mm_sfence();       /* the streamed states are visible to whatever reads them next, on any thread */
#endif
#undef RUN_JOINS
#undef COPY_CHANNELS
#undef SPLIT_TAIL
#undef SPLIT_FINAL
#undef TAIL
#undef FINAL
#undef OUT
}

/* A part of the call, run by one thread. */
typedef struct {
    const gdn_args *args;
    const float *wt;
    int64_t a0, a1;
    float *scratch;
} gdn_part;

static void *run_thread(void *arg) {
    const gdn_part *p = arg;
    run_part(p->args, p->wt, p->a0, p->a1, p->scratch);
    return NULL;
}

/* Returns 0, or 1 when the scratch buffer cannot be allocated. */
int gated_deltanet_f32(const gdn_args *args) {
    const int64_t key_heads = args->key_heads, heads = args->heads, dv = args->dv, dk = args->dk,
                  kernel = args->kernel;
    const int64_t C = 2 * key_heads * dk + heads * dv;
    int64_t parts = args->threads < key_heads ? args->threads : key_heads;
    if (parts < 1) parts = 1;
    /* scratch: the weight tap-major [K, C]; per part one conv row [C], delta [Dv], a dropped output row
       [Dv], the join's difference of states [Dk, Dv] */
    const int64_t per_part = C + 2 * dv + (args->joins ? dk * dv : 0);
    float *wt = malloc(sizeof(float) * (size_t)(kernel * C + parts * per_part));
    if (!wt) return 1;
    for (int64_t c = 0; c < C; c++)
        for (int64_t j = 0; j < kernel; j++) wt[j * C + c] = args->conv_w[c * kernel + j];
    float *scratch = wt + kernel * C;
    if (parts == 1) {
        run_part(args, wt, 0, key_heads, scratch);
        free(wt);
        return 0;
    }
    gdn_part part[parts];
    pthread_t thread[parts];
    int started[parts];
    for (int64_t i = 0; i < parts; i++) {
        part[i] = (gdn_part){args, wt, key_heads * i / parts, key_heads * (i + 1) / parts, scratch + i * per_part};
        /* part 0 runs on this thread; a thread that cannot start leaves its part to this one too */
        started[i] = i > 0 && pthread_create(&thread[i], NULL, run_thread, &part[i]) == 0;
    }
    for (int64_t i = 0; i < parts; i++)
        if (!started[i]) run_part(args, wt, part[i].a0, part[i].a1, part[i].scratch);
    for (int64_t i = 1; i < parts; i++)
        if (started[i]) pthread_join(thread[i], NULL);
    free(wt);
    return 0;
}

/* Appends n tokens to each of `maps` affine maps P [Dk, Dk] (contiguous, one after another) in place:
   P <- e^g (I - beta k k^T) P for t in order (docs/mechanism.md §5), k [n, maps, Dk], g and beta
   [n, maps]. One map at a time, so that it stays in L1 over its tokens: two passes over it per token
   (w = k^T P, then the rank-1 update and the decay), where the torch ops made five over every map. */
void fold_maps_f32(float *P, int64_t maps, int64_t dk, const float *k, const float *g, const float *beta,
                   int64_t n) {
    float w[dk];
    for (int64_t m = 0; m < maps; m++) {
        float *Pm = P + m * dk * dk;
        for (int64_t t = 0; t < n; t++) {
            const float *kt = k + (t * maps + m) * dk;
            const float b = beta[t * maps + m], decay = expf(g[t * maps + m]);
            for (int64_t j = 0; j < dk; j++) w[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                const float ki = kt[i], *row = Pm + i * dk;
#pragma omp simd
                for (int64_t j = 0; j < dk; j++) w[j] += ki * row[j];
            }
            for (int64_t i = 0; i < dk; i++) {
                const float c = -b * kt[i];
                float *row = Pm + i * dk;
#pragma omp simd
                for (int64_t j = 0; j < dk; j++) row[j] = (row[j] + c * w[j]) * decay;
            }
        }
    }
}
