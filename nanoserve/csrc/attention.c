/* Paged attention on the CPU in bf16 (AVX-512; AVX-512 BF16 where the CPU has it), behind nanoserve/cpu_kernels.py.

   decode_attention    one query token per sequence (a decode batch), optionally
                       after prefix_attention over a prefix every sequence shares
                       (cascade attention)
   chunk_attention     prefill chunks: a flash-attention tile loop over the paged context
   prefix_attention    cascade attention's shared part

   Shapes follow nanoserve/kernels.py: q [tokens, heads, HEAD_DIM], caches
   [blocks, block_size, kv_heads, HEAD_DIM], block tables int32. Scores, softmax
   and P.V are fp32; outputs are rounded to bf16 once. The torch reference in
   kernels.py is the oracle (tests/test_cpu_kernels.py). */
#include "bf16.h"
#include "expf.h"
/* dot2(acc, a, b): acc + a.b over each fp32 lane's two bf16 pairs. With AVX-512 BF16
   one instruction; without it (Skylake-SP to Ice Lake, VMs that hide the flag) each half
   widened by a mask or a shift and two FMAs: a product of two bf16 is exact in fp32,
   so this adds in the instruction's order (odd element first) with its rounding, except
   that the instruction flushes denormals. */
#if defined(__AVX512BF16__)
#define dot2(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))
#else
static inline __m512 dot2(__m512 acc, __m512i a, __m512i b) {
    const __m512i hi = _mm512_set1_epi32((int32_t)0xffff0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi)), _mm512_castsi512_ps(_mm512_and_si512(b, hi)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
}
#endif
/* GROUP (query heads per kv head) and HEAD_DIM (a multiple of 32) come as -D flags:
   constant sizes let the compiler keep a K/V row in registers. */
#define C32 (HEAD_DIM / 32)
#define C16 (HEAD_DIM / 16)

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's .to() */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the
   next one: while row j of a block is used, row j of the next block is fetched
   into L1 and row j of the block after that into L2. One row at a time, not a
   block in one burst: a burst fills the miss queue and the core stalls on the
   prefetch instructions themselves (perf: a fifth of the kernel's samples). */
static inline void prefetch_row(const uint16_t *p, int64_t n) {
    for (int64_t l = 0; l < n; l += 32) _mm_prefetch((const char *)(p + l), _MM_HINT_T0);
}
static inline void prefetch_row_l2(const uint16_t *p, int64_t n) {
    for (int64_t l = 0; l < n; l += 32) _mm_prefetch((const char *)(p + l), _MM_HINT_T1);
}

/* q, out [n, kvh * GROUP, HEAD_DIM]; k_cache, v_cache [blocks, bs, kvh, HEAD_DIM];
   block_tables [n, bt_stride]; each task owns one sequence and hb kv heads.
   Keys start .. seq_len-1 (start a multiple of bs); with start > 0, o_pre, m_pre
   and l_pre [n * heads (* HEAD_DIM)] hold what prefix_attention computed over keys
   0 .. start-1, and each row's two parts are merged at the end. With a sliding
   window (window > 0, and start 0) a sequence's keys are its last window only:
   from lo = seq_len - window, anywhere in a block. */
void decode_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                      uint16_t *out, int64_t n, int64_t kvh, int64_t bs, float scale,
                      int64_t hb, int64_t start, const float *o_pre, const float *m_pre,
                      const float *l_pre, int64_t window, int nthreads) {
    const int64_t heads = kvh * GROUP, row = kvh * HEAD_DIM, blk = bs * row, runs = kvh / hb;
    const int64_t rows = hb * GROUP, width = hb * HEAD_DIM;
    #pragma omp parallel num_threads(nthreads)
    {
        float *s = NULL, *acc = aligned_alloc(64, rows * HEAD_DIM * sizeof(float));
        int64_t cap = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n * runs; task++) {
            const int64_t i = task / runs, h0 = task % runs * hb, len = seq_lens[i];
            const int64_t lo = window > 0 && len - window > start ? len - window : start, span = len - lo;
            const int32_t *bt = block_tables + i * bt_stride;
            const uint16_t *qi = q + (i * heads + h0 * GROUP) * HEAD_DIM;
            if (rows * span > cap) { free(s); cap = 2 * rows * span; s = malloc(cap * sizeof(float)); }
            /* pass 1: s[r * span + t - lo] = scale * q_r . k_t, r = head * GROUP + g */
            for (int64_t t0 = lo - lo % bs; t0 < len; t0 += bs) {
                const uint16_t *kb = k_cache + bt[t0 / bs] * blk + h0 * HEAD_DIM;
                const uint16_t *next = t0 + bs < len ? k_cache + bt[t0 / bs + 1] * blk + h0 * HEAD_DIM : NULL;
                const uint16_t *next2 = t0 + 2 * bs < len ? k_cache + bt[t0 / bs + 2] * blk + h0 * HEAD_DIM : NULL;
                for (int64_t j = t0 < lo ? lo - t0 : 0; j < bs && t0 + j < len; j++) {
                    if (next) prefetch_row(next + j * row, width);
                    if (next2) prefetch_row_l2(next2 + j * row, width);
                    for (int64_t h = 0; h < hb; h++) {
                        __m512i k[C32];
                        for (int c = 0; c < C32; c++) k[c] = _mm512_loadu_si512(kb + j * row + h * HEAD_DIM + 32 * c);
                        for (int g = 0; g < GROUP; g++) {
                            const uint16_t *qr = qi + (h * GROUP + g) * HEAD_DIM;
                            __m512 a = _mm512_setzero_ps();
                            for (int c = 0; c < C32; c++)
                                a = dot2(a, _mm512_loadu_si512(qr + 32 * c), k[c]);
                            s[(h * GROUP + g) * span + t0 - lo + j] = _mm512_reduce_add_ps(a) * scale;
                        }
                    }
                }
            }
            /* softmax of each row, left unnormalised: out = acc / sum at the end */
            float inv[rows], mx[rows], sm[rows];
            for (int64_t r = 0; r < rows; r++) {
                float *sr = s + r * span;
                int64_t t = 0;
                __m512 vm = _mm512_set1_ps(-INFINITY);
                for (; t + 16 <= span; t += 16) vm = _mm512_max_ps(_mm512_loadu_ps(sr + t), vm);  /* NaN: skipped */
                float m = _mm512_reduce_max_ps(vm);
                for (; t < span; t++) m = sr[t] > m ? sr[t] : m;
                for (t = 0; t + 16 <= span; t += 16)
                    _mm512_storeu_ps(sr + t, expf16_glibc(_mm512_sub_ps(_mm512_loadu_ps(sr + t), _mm512_set1_ps(m))));
                for (; t < span; t++) sr[t] = expf(sr[t] - m);
                mx[r] = m;
                sm[r] = 0.f;  /* summed in pass 2, in the same order, off the critical path */
            }
            /* pass 2: acc[r] = sum_t p[r, t] * v_t */
            memset(acc, 0, rows * HEAD_DIM * sizeof(float));
            for (int64_t t0 = lo - lo % bs; t0 < len; t0 += bs) {
                const uint16_t *vb = v_cache + bt[t0 / bs] * blk + h0 * HEAD_DIM;
                const uint16_t *next = t0 + bs < len ? v_cache + bt[t0 / bs + 1] * blk + h0 * HEAD_DIM : NULL;
                const uint16_t *next2 = t0 + 2 * bs < len ? v_cache + bt[t0 / bs + 2] * blk + h0 * HEAD_DIM : NULL;
                for (int64_t j = t0 < lo ? lo - t0 : 0; j < bs && t0 + j < len; j++) {
                    if (next) prefetch_row(next + j * row, width);
                    if (next2) prefetch_row_l2(next2 + j * row, width);
                    for (int64_t h = 0; h < hb; h++) {
                        __m512 v[C16];
                        for (int c = 0; c < C16; c++) v[c] = load_bf16x16(vb + j * row + h * HEAD_DIM + 16 * c);
                        for (int g = 0; g < GROUP; g++) {
                            const float pr = s[(h * GROUP + g) * span + t0 - lo + j];
                            const __m512 p = _mm512_set1_ps(pr);
                            float *ar = acc + (h * GROUP + g) * HEAD_DIM;
                            sm[h * GROUP + g] += pr;
                            for (int c = 0; c < C16; c++)
                                _mm512_store_ps(ar + 16 * c, _mm512_fmadd_ps(p, v[c], _mm512_load_ps(ar + 16 * c)));
                        }
                    }
                }
            }
            for (int64_t r = 0; r < rows; r++) inv[r] = 1.f / sm[r];
            uint16_t *o = out + (i * heads + h0 * GROUP) * HEAD_DIM;
            if (o_pre == NULL) {
                for (int64_t r = 0; r < rows; r++)
                    for (int d = 0; d < HEAD_DIM; d++) o[r * HEAD_DIM + d] = to_bf16(acc[r * HEAD_DIM + d] * inv[r]);
            } else {  /* softmax over both parts: rescale each to the larger max */
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t pr = i * heads + h0 * GROUP + r;
                    const float m = mx[r] > m_pre[pr] ? mx[r] : m_pre[pr];
                    const float a = expf(mx[r] - m), b = expf(m_pre[pr] - m);
                    const float norm = 1.f / (sm[r] * a + l_pre[pr] * b);
                    const float *op = o_pre + pr * HEAD_DIM;
                    for (int d = 0; d < HEAD_DIM; d++)
                        o[r * HEAD_DIM + d] = to_bf16((acc[r * HEAD_DIM + d] * a + op[d] * b) * norm);
                }
            }
        }
        free(s);
        free(acc);
    }
}

/* e^x for 16 lanes: Cephes' expf polynomial on x - n ln2, scaled by 2^n (~1 ulp) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* Prefill chunks: sequence i's q_len = query_start_loc[i+1] - query_start_loc[i]
   tokens (those with q_len > 1; decodes go to decode_attention) at positions
   seq_len - q_len .. seq_len - 1, causal over the paged context; with a sliding
   window (window > 0) a token at p sees keys p - window + 1 .. p only. A task owns one
   kv head and a tile of up to 32 / GROUP query tokens: its 32 query rows (token,
   group head) sit in the lanes of two vectors, so scores, the running max and the
   softmax are lane-wise, and q.k is a bf16 dot product of each row with a
   broadcast pair of K values. */
#define ROWS 32
#define TILE_Q (ROWS / GROUP)
#define TILE_K 16
/* A tile's query rows r = token * GROUP + g (nq tokens from q0, their heads
   heads apart) as bf16 pairs in qt, [d/2][ROWS]; rows past them get q = 0. */
static void pack_rows(uint32_t *qt, const uint16_t *q0, int64_t nq, int64_t heads) {
    for (int r = 0; r < ROWS; r++) {
        const int tq = r / GROUP, g = r % GROUP, live = r < TILE_Q * GROUP && tq < nq;
        const uint32_t *qr = (const uint32_t *)(q0 + (tq * heads + g) * HEAD_DIM);
        for (int p = 0; p < HEAD_DIM / 2; p++) qt[p * ROWS + r] = live ? qr[p] : 0;
    }
}

/* One tile: ROWS query rows (their q as bf16 pairs in qt, [d/2][ROWS]) against keys
   lo .. end-1 of kv head h through a block table, key t visible to row r when
   from[r] <= t <= pos[r] (from[r] >= lo: a sliding window's first key, else lo).
   Keys before lo are never read: with a window the blocks wholly before it are the
   null block, and a masked key's V would still enter P.V as 0 * v (NaN for NaN).
   Leaves each row's unnormalised output in o [ROWS][HEAD_DIM] and its running max
   and sum in m and l; vt and pt are scratch. Inlined with ``windowed`` a constant, so
   that the compiler drops the window's masks where there is none (they cost a plain
   prefill ~20%: registers the dot products need). */
static inline __attribute__((always_inline)) void attend_tile(
        const uint32_t *qt, const int32_t *pos, const int32_t *from, const uint16_t *k_cache,
        const uint16_t *v_cache, const int32_t *bt, int64_t lo, int64_t end, int64_t h, int64_t bs, int64_t row,
        float scale, float *o, float *vt, float *pt, float *m, float *l, const int windowed) {
    const int64_t blk = bs * row;
    const __m512i pos0 = _mm512_loadu_si512(pos), pos1 = _mm512_loadu_si512(pos + 16);
    const __m512i from0 = windowed ? _mm512_loadu_si512(from) : _mm512_setzero_si512();
    const __m512i from1 = windowed ? _mm512_loadu_si512(from + 16) : _mm512_setzero_si512();
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, l0 = _mm512_setzero_ps(), l1 = l0;
    memset(o, 0, ROWS * HEAD_DIM * 4);
    for (int64_t k0 = lo; k0 < end; k0 += TILE_K) {
        const int64_t nk = end - k0 < TILE_K ? end - k0 : TILE_K;
        const uint32_t *kr[TILE_K];
        for (int j = 0; j < nk; j++) {
            const int64_t t = k0 + j, b = bt[t / bs];
            kr[j] = (const uint32_t *)(k_cache + b * blk + (t % bs) * row + h * HEAD_DIM);
            const uint16_t *vr = v_cache + b * blk + (t % bs) * row + h * HEAD_DIM;
            for (int c = 0; c < HEAD_DIM / 16; c++) _mm512_store_ps(vt + j * HEAD_DIM + 16 * c, load_bf16x16(vr + 16 * c));
        }
        __m512 s0[TILE_K], s1[TILE_K];
        for (int j = 0; j < TILE_K; j += 4) {
            __m512 a[8];
            for (int u = 0; u < 8; u++) a[u] = _mm512_setzero_ps();
            if (j < nk) {
                const uint32_t *k_a = kr[j], *k_b = kr[j + 1 < nk ? j + 1 : j];
                const uint32_t *k_c = kr[j + 2 < nk ? j + 2 : j], *k_d = kr[j + 3 < nk ? j + 3 : j];
                for (int p = 0; p < HEAD_DIM / 2; p++) {
                    const __m512i qa = _mm512_load_si512(qt + p * ROWS), qb = _mm512_load_si512(qt + p * ROWS + 16);
                    const __m512i ka = _mm512_set1_epi32(k_a[p]), kb = _mm512_set1_epi32(k_b[p]);
                    const __m512i kc = _mm512_set1_epi32(k_c[p]), kd = _mm512_set1_epi32(k_d[p]);
                    a[0] = dot2(a[0], qa, ka); a[1] = dot2(a[1], qb, ka);
                    a[2] = dot2(a[2], qa, kb); a[3] = dot2(a[3], qb, kb);
                    a[4] = dot2(a[4], qa, kc); a[5] = dot2(a[5], qb, kc);
                    a[6] = dot2(a[6], qa, kd); a[7] = dot2(a[7], qb, kd);
                }
            }
            for (int u = 0; u < 4; u++) {  /* scale; -inf where the key is in a row's future or before its window */
                const __m512i kp = _mm512_set1_epi32((int32_t)(k0 + j + u));
                const __mmask16 in0 = windowed ? _mm512_cmpge_epi32_mask(kp, from0) : 0xFFFF;
                const __mmask16 in1 = windowed ? _mm512_cmpge_epi32_mask(kp, from1) : 0xFFFF;
                const __mmask16 ok0 = j + u < nk ? _mm512_mask_cmple_epi32_mask(in0, kp, pos0) : 0;
                const __mmask16 ok1 = j + u < nk ? _mm512_mask_cmple_epi32_mask(in1, kp, pos1) : 0;
                s0[j + u] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), ok0, a[2 * u], _mm512_set1_ps(scale));
                s1[j + u] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), ok1, a[2 * u + 1], _mm512_set1_ps(scale));
            }
        }
        __m512 n0 = m0, n1 = m1;  /* online softmax: new running max, rescale what came before */
        for (int j = 0; j < nk; j++) { n0 = _mm512_max_ps(n0, s0[j]); n1 = _mm512_max_ps(n1, s1[j]); }
        /* 0 for a row that has seen no key yet (its window may begin past this tile's
           first keys: then m and n are both -inf, and -inf - -inf is NaN); without a
           window every row sees key 0 in the first tile */
        const __mmask16 seen0 = windowed ? _mm512_cmp_ps_mask(m0, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ) : 0xFFFF;
        const __mmask16 seen1 = windowed ? _mm512_cmp_ps_mask(m1, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ) : 0xFFFF;
        const __m512 alpha0 = _mm512_maskz_mov_ps(seen0, exp16(_mm512_sub_ps(m0, n0)));
        const __m512 alpha1 = _mm512_maskz_mov_ps(seen1, exp16(_mm512_sub_ps(m1, n1)));
        l0 = _mm512_mul_ps(l0, alpha0); l1 = _mm512_mul_ps(l1, alpha1);
        for (int j = 0; j < nk; j++) {
            const __m512 e0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0[j], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), exp16(_mm512_sub_ps(s0[j], n0)));
            const __m512 e1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1[j], _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), exp16(_mm512_sub_ps(s1[j], n1)));
            l0 = _mm512_add_ps(l0, e0); l1 = _mm512_add_ps(l1, e1);
            _mm512_store_ps(pt + j * ROWS, e0); _mm512_store_ps(pt + j * ROWS + 16, e1);
        }
        float al[ROWS];
        _mm512_storeu_ps(al, alpha0); _mm512_storeu_ps(al + 16, alpha1);
        m0 = n0; m1 = n1;
        for (int r = 0; r < ROWS; r++) {
            __m512 acc[HEAD_DIM / 16];
            const __m512 ar = _mm512_set1_ps(al[r]);
            for (int c = 0; c < HEAD_DIM / 16; c++) acc[c] = _mm512_mul_ps(ar, _mm512_load_ps(o + r * HEAD_DIM + 16 * c));
            for (int j = 0; j < nk; j++) {
                const __m512 pj = _mm512_set1_ps(pt[j * ROWS + r]);
                for (int c = 0; c < HEAD_DIM / 16; c++) acc[c] = _mm512_fmadd_ps(pj, _mm512_load_ps(vt + j * HEAD_DIM + 16 * c), acc[c]);
            }
            for (int c = 0; c < HEAD_DIM / 16; c++) _mm512_store_ps(o + r * HEAD_DIM + 16 * c, acc[c]);
        }
    }
    _mm512_storeu_ps(m, m0); _mm512_storeu_ps(m + 16, m1);
    _mm512_storeu_ps(l, l0); _mm512_storeu_ps(l + 16, l1);
}

void chunk_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                     const int32_t *query_start_loc, uint16_t *out, int64_t n, int64_t kvh,
                     int64_t bs, float scale, int64_t window, int nthreads) {
    const int64_t heads = kvh * GROUP, row = kvh * HEAD_DIM;
    int64_t *first = malloc((n + 1) * sizeof(int64_t));   /* first tile of each sequence */
    first[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t q_len = query_start_loc[i + 1] - query_start_loc[i];
        first[i + 1] = first[i] + (q_len > 1 ? (q_len + TILE_Q - 1) / TILE_Q : 0);
    }
    const int64_t tasks = first[n] * kvh;
    #pragma omp parallel num_threads(nthreads)
    {
        uint32_t *qt = aligned_alloc(64, HEAD_DIM / 2 * ROWS * 4);   /* q pairs, [d/2][row] */
        float *o = aligned_alloc(64, ROWS * HEAD_DIM * 4);           /* unnormalised output */
        float *vt = aligned_alloc(64, TILE_K * HEAD_DIM * 4);        /* the tile's V, fp32 */
        float *pt = aligned_alloc(64, TILE_K * ROWS * 4);            /* softmax weights [key][row] */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t tile = task / kvh, h = task % kvh;
            int64_t i = 0;
            while (first[i + 1] <= tile) i++;
            const int64_t len = seq_lens[i], q_len = query_start_loc[i + 1] - query_start_loc[i];
            const int64_t t0 = (tile - first[i]) * TILE_Q, nq = q_len - t0 < TILE_Q ? q_len - t0 : TILE_Q;
            const int64_t p0 = len - q_len + t0;                 /* position of the tile's first token */
            const int32_t *bt = block_tables + i * bt_stride;
            const uint16_t *qrow0 = q + ((query_start_loc[i] + t0) * heads + h * GROUP) * HEAD_DIM;
            /* with a window the tile reads from its first token's window on: the
               blocks before it may be the null block */
            const int64_t lo = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
            /* rows past the tile's tokens see everything read (their q is 0) */
            int32_t pos[ROWS], from[ROWS];
            for (int r = 0; r < ROWS; r++) {
                const int live = r < TILE_Q * GROUP && r / GROUP < nq;
                pos[r] = live ? (int32_t)(p0 + r / GROUP) : (int32_t)len;
                from[r] = live && window > 0 && pos[r] - window + 1 > lo ? (int32_t)(pos[r] - window + 1) : (int32_t)lo;
            }
            pack_rows(qt, qrow0, nq, heads);
            float mv[ROWS], lv[ROWS];
            if (window > 0)
                attend_tile(qt, pos, from, k_cache, v_cache, bt, lo, p0 + nq, h, bs, row, scale, o, vt, pt, mv, lv, 1);
            else
                attend_tile(qt, pos, from, k_cache, v_cache, bt, 0, p0 + nq, h, bs, row, scale, o, vt, pt, mv, lv, 0);
            for (int r = 0; r < TILE_Q * GROUP; r++) {
                const int tq = r / GROUP, g = r % GROUP;
                if (tq >= nq) break;
                uint16_t *orow = out + ((query_start_loc[i] + t0 + tq) * heads + h * GROUP + g) * HEAD_DIM;
                for (int d = 0; d < HEAD_DIM; d++) orow[d] = to_bf16(o[r * HEAD_DIM + d] / lv[r]);
            }
        }
        free(qt); free(o); free(vt); free(pt);
    }
    free(first);
}

/* Cascade attention's shared part (vLLM's name): when every sequence of a decode
   batch begins with the same prefix_len tokens in the same blocks (prefix_table),
   the n queries attend to that prefix together, ROWS (sequence, head) rows to a
   tile, so a prefix K/V row is read once per tile rather than once per sequence and
   its dot products fill whole vectors. Leaves each row's unnormalised output, max
   and sum in o_pre, m_pre, l_pre [n * heads (* HEAD_DIM)] for decode_attention,
   which attends to the rest of each context and merges the two. */
void prefix_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int32_t *prefix_table, int64_t prefix_len, float *o_pre, float *m_pre,
                      float *l_pre, int64_t n, int64_t kvh, int64_t bs, float scale, int nthreads) {
    const int64_t heads = kvh * GROUP, row = kvh * HEAD_DIM, tasks = (n + TILE_Q - 1) / TILE_Q * kvh;
    #pragma omp parallel num_threads(nthreads)
    {
        uint32_t *qt = aligned_alloc(64, HEAD_DIM / 2 * ROWS * 4);
        float *o = aligned_alloc(64, ROWS * HEAD_DIM * 4);
        float *vt = aligned_alloc(64, TILE_K * HEAD_DIM * 4);
        float *pt = aligned_alloc(64, TILE_K * ROWS * 4);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t s0 = task / kvh * TILE_Q, h = task % kvh, ns = n - s0 < TILE_Q ? n - s0 : TILE_Q;
            /* the tile's tokens are ns sequences' decode tokens, each seeing the whole prefix */
            int32_t pos[ROWS], from[ROWS];
            for (int r = 0; r < ROWS; r++) pos[r] = (int32_t)prefix_len, from[r] = 0;
            pack_rows(qt, q + (s0 * heads + h * GROUP) * HEAD_DIM, ns, heads);
            float mv[ROWS], lv[ROWS];
            attend_tile(qt, pos, from, k_cache, v_cache, prefix_table, 0, prefix_len, h, bs, row, scale, o, vt, pt,
                        mv, lv, 0);
            for (int r = 0; r < TILE_Q * GROUP && r / GROUP < ns; r++) {
                const int64_t pr = (s0 + r / GROUP) * heads + h * GROUP + r % GROUP;
                m_pre[pr] = mv[r];
                l_pre[pr] = lv[r];
                memcpy(o_pre + pr * HEAD_DIM, o + r * HEAD_DIM, HEAD_DIM * 4);
            }
        }
        free(qt); free(o); free(vt); free(pt);
    }
}
