/* Row-wise ops on the CPU in bf16 (AVX-512), behind nanoserve/cpu_kernels.py:
   RMSNorm, the rotary embedding, SiLU-and-mul, the KV-cache store and argmax.

   The first three compute bit for bit what kernels.py's torch references do
   (tests/test_cpu_kernels.py checks torch.equal, and cpu_backend.py checks it
   again at start-up on the model's shapes before it takes them):
   * every bf16 intermediate eager torch stores is rounded here too (round_bf16);
   * RMSNorm's mean of squares adds in the order of ATen's CPU sum over a
     contiguous row (aten_sum_of_squares), not in a faster one;
   * SiLU looks its value up in a table of torch's own F.silu over all 65536
     bf16 values, so it carries torch's exp whatever libm this is. */
#include "bf16.h"

/* fp32 -> nearest-even bf16 -> fp32, as ATen converts (a NaN becomes 0xffff) */
static inline __m512 round_bf16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_castsi512_ps(r);
}
static inline void store_bf16x16(uint16_t *p, __m512 exact) {  /* exact: already a bf16 value */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(exact), 16)));
}
static inline __m256 square_bf16x8(const uint16_t *p) {  /* exact in fp32 */
    const __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_mul_ps(f, f);
}

/* The sum of the squares of n bf16 values in ATen's order for a contiguous row
   (SumKernel.cpp, row_sum/multi_row_sum): 8-lane vectors into four interleaved
   accumulators, folded every 16 rounds through a cascade of levels, the four
   added in order, then the tail and the 8 lanes one by one. */
static float aten_sum_of_squares(const uint16_t *x, int64_t n) {
    const int64_t nv = n / 8, rounds = nv / 4, step = 16;  /* 16: ATen's level_step below 2^19 rounds */
    __m256 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[j][k] = _mm256_setzero_ps();
    int64_t i = 0;
    while (i + step <= rounds) {
        for (int64_t e = i + step; i < e; i++)
            for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], square_bf16x8(x + (4 * i + k) * 8));
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if (i & ((step - 1) << (4 * j))) break;
        }
    }
    for (; i < rounds; i++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], square_bf16x8(x + (4 * i + k) * 8));
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    for (int64_t v = rounds * 4; v < nv; v++) acc[0][0] = _mm256_add_ps(acc[0][0], square_bf16x8(x + v * 8));
    __m256 sum = acc[0][0];
    for (int k = 1; k < 4; k++) sum = _mm256_add_ps(sum, acc[0][k]);
    float total = 0.f, lanes[8];
    for (int64_t t = nv * 8; t < n; t++) total += bf16_to_f32(x[t]) * bf16_to_f32(x[t]);
    _mm256_storeu_ps(lanes, sum);
    for (int l = 0; l < 8; l++) total += lanes[l];
    return total;
}

/* kernels.rms_norm_torch for one row of n (n % 16 == 0):
   weight * bf16(x * 1/sqrt(mean + eps)), kept as exact bf16 values in fp32 */
static inline void rms_norm_row(const uint16_t *x, const uint16_t *w, int64_t n, float eps, float *y) {
    const float r = 1.f / sqrtf(aten_sum_of_squares(x, n) / (float)n + eps);
    const __m512 vr = _mm512_set1_ps(r);
    for (int64_t c = 0; c < n; c += 16)
        _mm512_storeu_ps(y + c, round_bf16(_mm512_mul_ps(load_bf16x16(w + c),
                                                         round_bf16(_mm512_mul_ps(load_bf16x16(x + c), vr)))));
}

/* x [rows, heads, n] (row stride ld, heads contiguous) -> out [rows, heads, n]
   contiguous: the RMSNorm of every vector of n. heads is 1 for the hidden
   states, the number of q or k heads for Qwen3's per-head norms. */
void rms_norm(const uint16_t *x, int64_t ld, const uint16_t *w, uint16_t *out, int64_t rows, int64_t heads,
              int64_t n, float eps, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        float *y = aligned_alloc(64, n * sizeof(float));
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++)
            for (int64_t h = 0; h < heads; h++) {
                rms_norm_row(x + t * ld + h * n, w, n, eps, y);
                uint16_t *o = out + (t * heads + h) * n;
                for (int64_t c = 0; c < n; c += 16) store_bf16x16(o + c, _mm512_loadu_ps(y + c));
            }
        free(y);
    }
}

/* kernels.rotary_torch for q [rows, hq, d] and k [rows, hk, d] (row strides
   ldq, ldk; heads contiguous) into contiguous outputs, neox style over the first
   r dims of each head (cos/sin tables r wide; r < d: partial rotary, the other
   dims copied): out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), cos and
   sin rounded to bf16 first, as eager torch does. */
void rotary(const uint16_t *q, int64_t ldq, const uint16_t *k, int64_t ldk, uint16_t *q_out, uint16_t *k_out,
            int64_t rows, int64_t hq, int64_t hk, int64_t d, int64_t r, const int64_t *positions,
            const float *cos_cache, const float *sin_cache, int nthreads) {
    const int64_t half = r / 2;
    #pragma omp parallel num_threads(nthreads)
    {
        float *y = aligned_alloc(64, 3 * r * sizeof(float)), *cs = y + r, *sn = y + 2 * r;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            for (int64_t c = 0; c < r; c += 16) {  /* this position's cos and sin, as bf16 */
                _mm512_storeu_ps(cs + c, round_bf16(_mm512_loadu_ps(cos_cache + positions[t] * r + c)));
                _mm512_storeu_ps(sn + c, round_bf16(_mm512_loadu_ps(sin_cache + positions[t] * r + c)));
            }
            for (int64_t h = 0; h < hq + hk; h++) {
                const int is_q = h < hq;
                const uint16_t *x = is_q ? q + t * ldq + h * d : k + t * ldk + (h - hq) * d;
                uint16_t *o = is_q ? q_out + (t * hq + h) * d : k_out + (t * hk + h - hq) * d;
                for (int64_t c = 0; c < r; c += 16) _mm512_storeu_ps(y + c, load_bf16x16(x + c));
                for (int64_t c = 0; c < r; c += 16) {
                    const __m512 v = _mm512_loadu_ps(y + c);
                    const __m512 rot = c < half ? _mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(y + c + half))
                                                : _mm512_loadu_ps(y + c - half);
                    const __m512 a = round_bf16(_mm512_mul_ps(v, _mm512_loadu_ps(cs + c)));
                    const __m512 b = round_bf16(_mm512_mul_ps(rot, _mm512_loadu_ps(sn + c)));
                    store_bf16x16(o + c, round_bf16(_mm512_add_ps(a, b)));
                }
                memcpy(o + r, x + r, (d - r) * sizeof(uint16_t));  /* the dims that do not turn */
            }
        }
        free(y);
    }
}

/* kernels.store_kvcache_torch: key, value [n, row] (row = kv heads x head_dim; row
   strides ldk, ldv) into the caches' num_slots slots, a slot of -1 being
   padding; returns how many slots were out of range (and not written) */
int64_t store_kvcache(const uint16_t *key, int64_t ldk, const uint16_t *value, int64_t ldv, uint16_t *k_cache,
                      uint16_t *v_cache, const int64_t *slots, int64_t n, int64_t row, int64_t num_slots) {
    int64_t bad = 0;
    for (int64_t t = 0; t < n; t++) {
        if (slots[t] == -1) continue;
        if (slots[t] < 0 || slots[t] >= num_slots) { bad++; continue; }
        memcpy(k_cache + slots[t] * row, key + t * ldk, row * sizeof(uint16_t));
        if (v_cache != k_cache)  /* one tensor for both (MLA's latent): written once */
            memcpy(v_cache + slots[t] * row, value + t * ldv, row * sizeof(uint16_t));
    }
    return bad;
}

/* kernels.silu_and_mul_torch: gate_up [rows, 2n] -> bf16(silu(gate) * up) [rows, n];
   silu_table[bits] is the fp32 value of torch's bf16 F.silu of those bf16 bits */
void silu_and_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t n, const float *silu_table,
                  int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *g = gate_up + t * 2 * n, *u = g + n;
        for (int64_t c = 0; c < n; c += 16) {
            const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + c)));
            const __m512 s = _mm512_i32gather_ps(bits, silu_table, 4);
            store_bf16x16(out + t * n + c, round_bf16(_mm512_mul_ps(s, load_bf16x16(u + c))));
        }
    }
}

/* greedy sampling: the first index of each row's largest value, the first NaN
   where a row has one (torch's argmax rules); the bf16 logits are read once */
void argmax_rows(const uint16_t *x, int64_t rows, int64_t n, int64_t ld, int64_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *p = x + r * ld;
        /* per lane: the largest value so far and its first index */
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i best_i = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                        9, 10, 11, 12, 13, 14, 15);
        __mmask16 nan = 0;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = load_bf16x16(p + i);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best = _mm512_mask_mov_ps(best, gt, v);
            best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
        }
        /* across lanes: the largest value, the smallest index that holds it */
        float m = _mm512_reduce_max_ps(best);
        int64_t arg = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ),
                                                   best_i);
        if (m == -INFINITY) arg = 0;  /* no lane moved: every value so far is -inf */
        for (; i < n; i++) {  /* the ragged end */
            const float f = bf16_to_f32(p[i]);
            if (f != f) { nan = 1; break; }
            if (f > m) { m = f; arg = i; }
        }
        if (nan)  /* torch's argmax takes NaN as the largest: the first one wins */
            for (i = 0; i < n; i++)
                if ((p[i] & 0x7fff) > 0x7f80) { arg = i; break; }
        out[r] = arg;
    }
}
