/* The sum of each group of 32 inputs, which both quantized products take (a group's minimum
 * times it): halves added pairwise (16 sums, then 8, 4, 2, 1), one fixed order the compiler
 * vectorises, where a running sum is 32 dependent additions. */
#ifndef TRIODE_GROUP_SUM_H
#define TRIODE_GROUP_SUM_H

#include <stdint.h>

#include "bf16.h"

#define SUM_GROUP 32

static inline float group_sum(const float *x) {
    float s[SUM_GROUP];
    for (int k = 0; k < SUM_GROUP; k++) s[k] = x[k];
    for (int half = SUM_GROUP / 2; half > 0; half /= 2)
        for (int k = 0; k < half; k++) s[k] += s[k + half];
    return s[0];
}

static inline float group_sum_bf16(const uint16_t *x) {
    float f[SUM_GROUP];
    for (int k = 0; k < SUM_GROUP; k++) f[k] = bf16_f32(x[k]);
    return group_sum(f);
}

#endif
