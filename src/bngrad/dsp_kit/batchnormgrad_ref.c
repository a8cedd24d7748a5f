/*
 * batchnormgrad_ref.c: a host reference implementation of the four BatchNormGrad functions,
 * for checking the harness and the vectors on a workstation. Swap this file (and bng_half.c)
 * for your library to run the same harness on the board or simulator.
 *
 * Sums accumulate in double and every output is rounded once, from double, into its buffer:
 * the golden vectors' expected values are computed the same way (from float64), so this
 * passes even the exact-data cases, whose default check is exact equality. The arithmetic
 * follows bngrad.reference step by step. One core whatever core_mask says.
 */
#include "batchnormgrad.h"
#include "bng_half.h"

#include <stddef.h>
#include <string.h>

/* the kit moves half values as 16-bit patterns, whatever type `half` is */
typedef char bng_half_is_16_bits[sizeof(half) == 2 ? 1 : -1];

typedef double (*load_fn)(const void *base, size_t i);
typedef void (*store_fn)(void *base, size_t i, double value);

static double load_f32(const void *base, size_t i)
{
    return ((const float *)base)[i];
}

static void store_f32(void *base, size_t i, double value)
{
    ((float *)base)[i] = (float)value;
}

static double load_f16(const void *base, size_t i)
{
    uint16_t bits;
    memcpy(&bits, (const unsigned char *)base + 2 * i, 2);
    return bng_half_to_double(bits);
}

static void store_f16(void *base, size_t i, double value)
{
    uint16_t bits = bng_double_to_half(value);
    memcpy((unsigned char *)base + 2 * i, &bits, 2);
}

static void *param_pointer(const long long *params, int i)
{
    return (void *)(intptr_t)params[i];
}

/* dx may be x or dy itself: each channel's sums are taken before its dx is written, and dx
 * at (b, c) is computed from x and dy at (b, c) only. */
static void batch_norm_grad(const void *x, const void *dy, void *dx, const long long *params,
                            load_fn load_data, store_fn store_data,
                            load_fn load_param, store_fn store_param)
{
    const void *mean_p = param_pointer(params, 0), *invar_p = param_pointer(params, 1);
    const void *scale_p = param_pointer(params, 2);
    void *dbias_p = param_pointer(params, 3), *dscale_p = param_pointer(params, 4);
    long long batch = params[5], channel = params[6];
    int train = params[7] != 0;
    size_t m, nc, b, c;

    if (batch <= 0 || channel <= 0)     /* nothing to compute, and nothing C could report */
        return;
    m = (size_t)batch;
    nc = (size_t)channel;
    for (c = 0; c < nc; c++) {
        double mean = load_param(mean_p, c), invar = load_param(invar_p, c);
        double scale = load_param(scale_p, c);
        double sum_dy = 0.0, sum_dy_xmu = 0.0, mean_dy, mean_dy_xmu;

        for (b = 0; b < m; b++) {
            double g = load_data(dy, b * nc + c);
            sum_dy += g;
            sum_dy_xmu += g * (load_data(x, b * nc + c) - mean);
        }
        mean_dy = sum_dy / (double)m;
        mean_dy_xmu = sum_dy_xmu / (double)m;
        for (b = 0; b < m; b++) {
            size_t i = b * nc + c;
            double g = load_data(dy, i), v;
            if (train)
                v = (g - mean_dy - (load_data(x, i) - mean) * mean_dy_xmu * (invar * invar))
                    * invar * scale;
            else
                v = g * invar * scale;
            store_data(dx, i, v);
        }
        store_param(dbias_p, c, sum_dy);
        store_param(dscale_p, c, sum_dy_xmu * invar);
    }
}

#ifdef BNG_HP_PARAMS_FLOAT
#define HP_LOAD_PARAM load_f32
#define HP_STORE_PARAM store_f32
#else
#define HP_LOAD_PARAM load_f16
#define HP_STORE_PARAM store_f16
#endif

void fp_batch_norm_grad_s(float *x, float *dy, float *dx, long long *params, int core_mask)
{
    (void)core_mask;    /* one core on the host */
    batch_norm_grad(x, dy, dx, params, load_f32, store_f32, load_f32, store_f32);
}

void hp_batch_norm_grad_s(half *x, half *dy, half *dx, long long *params, int core_mask)
{
    (void)core_mask;
    batch_norm_grad(x, dy, dx, params, load_f16, store_f16, HP_LOAD_PARAM, HP_STORE_PARAM);
}

void fp_batch_norm_grad_p(float *x, float *dy, float *dx, long long *params)
{
    batch_norm_grad(x, dy, dx, params, load_f32, store_f32, load_f32, store_f32);
}

void hp_batch_norm_grad_p(half *x, half *dy, half *dx, long long *params)
{
    batch_norm_grad(x, dy, dx, params, load_f16, store_f16, HP_LOAD_PARAM, HP_STORE_PARAM);
}
