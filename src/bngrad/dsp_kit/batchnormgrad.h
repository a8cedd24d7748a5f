/*
 * batchnormgrad.h: the DSP library's BatchNormGrad (FT78NE: fp32; MT7004: fp16 and fp32), as
 * the bngrad verification kit calls it. Written by `bngrad dsp-kit`; see README.txt.
 *
 * Data (x, dy, dx) is row-major [batch][channel], channel fastest. Per channel c, over the
 * m = batch rows, with xhat = (x - mean) * invar:
 *
 *     dbias  = sum(dy)            dscale = sum(dy * xhat)
 *     train: dx = scale * invar / m * (m*dy - sum(dy) - xhat * sum(dy * xhat))
 *     eval:  dx = dy * invar * scale        (mean, invar: the running statistics)
 *
 * params, as in the operator reference (long long params[12]):
 *     [0] mean   [1] invar = 1/sqrt(var + eps)   [2] scale (gamma)     per-channel pointers
 *     [3] dbias  [4] dscale                                            per-channel outputs
 *     [5] batch  [6] channel  [7] is_train (0/1)  [8..11] reserved (0)
 * Pointers are stored as (long long)(intptr_t)ptr and read back the same way.
 *
 * THE SHARED-STORAGE PROTOTYPE. The operator reference lists
 *     void fp_batch_norm_grad_s(float *x, float *dy, float *dx, int core_mask)
 * without params, yet its own example fills params before the call, and nothing else could
 * carry mean, invar, scale, dbias, dscale, batch, channel and is_train. This kit therefore
 * declares the _s functions with params before core_mask, in the private-storage functions'
 * position (the same order as bngrad.dsp in Python):
 *     void fp_batch_norm_grad_s(float *x, float *dy, float *dx, long long *params, int core_mask)
 * If your library receives params some other way (a global, a setter), change only the two
 * BNG_CALL_*_S macros in bng_harness.c; nothing else in the kit depends on it.
 *
 * HALF. `half` is a 16-bit IEEE 754 binary16 value. The kit stores it as its bit pattern
 * (uint16_t), which needs no compiler support; if your toolchain's header already defines
 * `half`, build with -DBNG_HAVE_HALF_TYPE so that this header does not define it again.
 *
 * hp_ PARAMETER TYPE. The reference does not say whether the hp_ functions' mean, invar,
 * scale, dbias and dscale are half or float. By default this kit passes half; build with
 * -DBNG_HP_PARAMS_FLOAT for a library that takes float. The harness skips (and says so) the
 * cases whose parameter type the build does not take: bngrad's vectors record it as
 * param_dtype.
 */
#ifndef BATCHNORMGRAD_H
#define BATCHNORMGRAD_H

#include <stdint.h>

#ifndef BNG_HAVE_HALF_TYPE
typedef uint16_t half;
#endif

#ifdef BNG_HP_PARAMS_FLOAT
typedef float bng_hp_param;     /* what params[0..4] point to for the hp_ functions */
#define BNG_HP_PARAM_DTYPE "fp32"
#else
typedef half bng_hp_param;
#define BNG_HP_PARAM_DTYPE "fp16"
#endif

#define BNG_PARAMS_LEN 12

#ifdef __cplusplus
extern "C" {
#endif

/* shared storage: one worker per core set in core_mask (0xff = 8 cores) */
void fp_batch_norm_grad_s(float *x, float *dy, float *dx, long long *params, int core_mask);
void hp_batch_norm_grad_s(half *x, half *dy, half *dx, long long *params, int core_mask);

/* private storage: one core */
void fp_batch_norm_grad_p(float *x, float *dy, float *dx, long long *params);
void hp_batch_norm_grad_p(half *x, half *dy, half *dx, long long *params);

#ifdef __cplusplus
}
#endif

#endif /* BATCHNORMGRAD_H */
