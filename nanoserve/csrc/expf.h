/* e^x in 16 lanes, bit for bit glibc's expf: attention.c's decode softmax
   calls it, and tests/test_cpu_kernels.py checks it against libm over many inputs. */
#pragma once
#include "bf16.h"

/* e^x for 16 lanes, bit for bit glibc's expf (2.28 on, its FMA build: e_expf.c),
   which the softmax below called once per score: x = (k + r) ln2 / 32 in double,
   2^(k/32) from a 32-entry table, 2^(r/32) from a cubic. Lanes with |x| >= 88 or
   NaN take libm's expf itself. tests/test_kernels.py compares with libm. */
static const uint64_t EXP2F_TAB[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540};

static inline __m256 expf8_glibc(__m256 x) {
    const __m512d invln2n = _mm512_set1_pd(0x1.71547652b82fep+0 * 32), shift = _mm512_set1_pd(0x1.8p+52);
    const __m512d xd = _mm512_cvtps_pd(x);
    const __m512d kshift = _mm512_fmadd_pd(invln2n, xd, shift);  /* k + shift: k in the low bits */
    const __m512i k = _mm512_castpd_si512(kshift);
    const __m512d r = _mm512_fmsub_pd(invln2n, xd, _mm512_sub_pd(kshift, shift));
    const __m512i i = _mm512_and_si512(k, _mm512_set1_epi64(31));
    __m512i t = _mm512_mask_blend_epi64(
        _mm512_test_epi64_mask(i, _mm512_set1_epi64(16)),
        _mm512_permutex2var_epi64(_mm512_loadu_si512(EXP2F_TAB), i, _mm512_loadu_si512(EXP2F_TAB + 8)),
        _mm512_permutex2var_epi64(_mm512_loadu_si512(EXP2F_TAB + 16), i, _mm512_loadu_si512(EXP2F_TAB + 24)));
    t = _mm512_add_epi64(t, _mm512_slli_epi64(k, 47));           /* 2^(k/32) */
    const __m512d z = _mm512_fmadd_pd(r, _mm512_set1_pd(0x1.c6af84b912394p-5 / 32 / 32 / 32),
                                      _mm512_set1_pd(0x1.ebfce50fac4f3p-3 / 32 / 32));
    const __m512d y = _mm512_fmadd_pd(r, _mm512_set1_pd(0x1.62e42ff0c52d6p-1 / 32), _mm512_set1_pd(1.0));
    return _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_fmadd_pd(z, _mm512_mul_pd(r, r), y), _mm512_castsi512_pd(t)));
}

static inline __m512 expf16_glibc(__m512 x) {
    __m512 e = _mm512_insertf32x8(_mm512_castps256_ps512(expf8_glibc(_mm512_castps512_ps256(x))),
                                  expf8_glibc(_mm512_extractf32x8_ps(x, 1)), 1);
    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 20), _mm512_set1_epi32(0x7ff));
    const __mmask16 special = _mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(0x42a));
    if (special) {
        float xs[16], es[16];
        _mm512_storeu_ps(xs, x);
        _mm512_storeu_ps(es, e);
        for (int l = 0; l < 16; l++) if (special >> l & 1) es[l] = expf(xs[l]);
        e = _mm512_loadu_ps(es);
    }
    return e;
}
