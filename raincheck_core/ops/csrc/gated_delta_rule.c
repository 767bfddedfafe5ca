/* The gated delta rule token by token over packed sequences, on the CPU.

   Built and loaded by raincheck_core/ops/native.py; the contract is that of
   `chunk_gated_delta_rule_varlen` in raincheck_core/ops/gdn_varlen.py (same inputs, same outputs).
   Sequence s has len[s] rows at packed rows start[s]...; it starts from state_in[s] and leaves its final
   state in state_out[s]; when split_row[s] >= 0 the state after its first split_row[s] rows is also
   copied to split_out[split_index[s]]. Per row t and head h, with S [Dk, Dv]:
       S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q.
   q, k [R, H, Dk] (prepared), v, o [R, H, Dv], g, beta [R, H], states [., H, Dk, Dv]: fp32, contiguous.

   Why native: a deferred chunk (7-63 rows plus its 3-row lead) is a short sequence, and the chunked
   form's ~40 tensor ops per layer cost more in dispatch than its arithmetic; token by token, a head's
   state stays in L1 and the whole layer is one call. Long prefills keep the chunked form (matmuls). */
#include <math.h>
#include <stdint.h>
#include <string.h>

void gated_delta_rule_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                          const float *state_in, float *o, float *state_out, float *split_out,
                          const int64_t *start, const int64_t *len, const int64_t *split_row,
                          const int64_t *split_index, int64_t n, int64_t heads, int64_t dk, int64_t dv) {
    float delta[1024];      /* dv <= 1024, checked by the caller */
    for (int64_t s = 0; s < n; s++)
        for (int64_t h = 0; h < heads; h++) {
            float *S = state_out + (s * heads + h) * dk * dv;
            memcpy(S, state_in + (s * heads + h) * dk * dv, sizeof(float) * (size_t)(dk * dv));
            for (int64_t t = start[s]; t < start[s] + len[s]; t++) {
                const int64_t th = t * heads + h;
                const float *kt = k + th * dk, *qt = q + th * dk, *vt = v + th * dv;
                const float alpha = expf(g[th]), b = beta[th];
                /* decay, and read S^T k from the decayed state in the same pass */
                for (int64_t j = 0; j < dv; j++) delta[j] = 0.0f;
                for (int64_t i = 0; i < dk; i++) {
                    float *row = S + i * dv;
                    const float ki = kt[i];
#pragma omp simd
                    for (int64_t j = 0; j < dv; j++) { row[j] *= alpha; delta[j] += ki * row[j]; }
                }
#pragma omp simd
                for (int64_t j = 0; j < dv; j++) delta[j] = (vt[j] - delta[j]) * b;
                /* rank-1 write, and o = S^T q from the updated state in the same pass */
                float *ot = o + th * dv;
                for (int64_t j = 0; j < dv; j++) ot[j] = 0.0f;
                for (int64_t i = 0; i < dk; i++) {
                    float *row = S + i * dv;
                    const float ki = kt[i], qi = qt[i];
#pragma omp simd
                    for (int64_t j = 0; j < dv; j++) { row[j] += ki * delta[j]; ot[j] += qi * row[j]; }
                }
                if (split_row[s] >= 0 && t - start[s] + 1 == split_row[s])
                    memcpy(split_out + (split_index[s] * heads + h) * dk * dv, S, sizeof(float) * (size_t)(dk * dv));
            }
        }
}
