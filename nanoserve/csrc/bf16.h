/* bf16 helpers shared by nanoserve's C kernels (attention.c, row_ops.c).
   bf16 is the high half of an fp32: widening is a shift, exact. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if !defined(__AVX512F__)
#error "this CPU has no AVX-512"
#endif

static inline __m512 load_bf16x16(const uint16_t *p) {  /* bf16 -> fp32: the high half */
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline float bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
