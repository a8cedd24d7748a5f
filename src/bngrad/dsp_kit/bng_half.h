/*
 * bng_half.h: IEEE 754 binary16 <-> double in software, for compilers without _Float16.
 * Half values travel as their 16-bit patterns.
 */
#ifndef BNG_HALF_H
#define BNG_HALF_H

#include <stdint.h>

/* exact: every binary16 value is a double */
double bng_half_to_double(uint16_t bits);

/* rounded once, to nearest with ties to even (not through float, which would round twice);
 * beyond the largest half, +-inf; NaN stays NaN */
uint16_t bng_double_to_half(double value);

#endif /* BNG_HALF_H */
