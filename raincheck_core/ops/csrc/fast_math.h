/* Fast math shared by the native kernels (raincheck_core/ops/csrc). */
#ifndef RAINCHECK_FAST_MATH_H
#define RAINCHECK_FAST_MATH_H

#include <math.h>
#include <stdint.h>

/* exp(x), Cephes' expf: relative error ~1e-7 over the float range, and written so that the compiler
   vectorizes it (the libm call does not). */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    const float fx = floorf(x * 1.44269504088896341f + 0.5f);
    x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)fx + 127) << 23};
    return y * scale.f;
}

#endif
