/* bng_half.c: binary16 <-> double conversions (see bng_half.h). */
#include "bng_half.h"

#include <math.h>
#include <string.h>

double bng_half_to_double(uint16_t bits)
{
    int exponent = (bits >> 10) & 0x1f;
    int mantissa = bits & 0x3ff;
    double v;

    if (exponent == 0)              /* zero or subnormal: mantissa * 2^-24 */
        v = ldexp((double)mantissa, -24);
    else if (exponent == 31)
        v = mantissa ? NAN : INFINITY;
    else                            /* (1024 + mantissa) * 2^(exponent - 25) */
        v = ldexp((double)(mantissa + 1024), exponent - 25);
    return (bits & 0x8000) ? -v : v;
}

uint16_t bng_double_to_half(double value)
{
    uint64_t b, sig, rem, halfway, q;
    uint16_t sign;
    int e, target, shift;

    memcpy(&b, &value, sizeof b);
    sign = (uint16_t)((b >> 48) & 0x8000);
    b &= 0x7fffffffffffffffULL;
    if (b >= 0x7ff0000000000000ULL)                 /* inf or NaN */
        return (uint16_t)(sign | (b > 0x7ff0000000000000ULL ? 0x7e00 : 0x7c00));
    e = (int)(b >> 52) - 1023;                      /* value = sig * 2^(e - 52) */
    if (e > 15)                                     /* >= 2^16: beyond every half */
        return (uint16_t)(sign | 0x7c00);
    if (e < -25)                                    /* < 2^-25: rounds to zero */
        return sign;
    sig = (b & 0x000fffffffffffffULL) | 0x0010000000000000ULL;
    /* Count in units of the result's last place, 2^(target - 10), where target is the
     * exponent of the half (-14 at least: below it the half is subnormal). */
    target = e < -14 ? -14 : e;
    shift = 42 + (target - e);                      /* 42 .. 53 */
    q = sig >> shift;
    rem = sig & ((1ULL << shift) - 1);
    halfway = 1ULL << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1)))
        q++;
    /* q < 1024 only for a subnormal (target -14); q = 2048 carries into the exponent; either
     * way the bits are (target + 14) * 1024 + q, and 2^16 after rounding comes out as inf */
    return (uint16_t)(sign | (uint16_t)((uint64_t)(target + 14) * 1024 + q));
}
