/* A linear layer with bf16 weights and fp32 arithmetic on a CPU with AVX-512 but no bf16
   matrix instructions (AVX-512 BF16, AMX), behind nanoserve/cpu_kernels.py.

   On such a CPU oneDNN emulates bf16 GEMMs at several times an fp32 GEMM's cost, and
   fp32 copies of the weights double the bytes a decode step streams. Here the weights
   stay bf16 and each is widened in a register just before its fp32 FMAs (bf16 is the
   high half of an fp32: a shift or a mask), so a step streams bf16 bytes and
   multiplies at fp32's rate.

   Weight layout (cpu_kernels.pack_linear_weight): w [N, K] -> [ceil(N / 32), K / 2, 32, 2],
   a panel of 32 outputs at a time, and in it, for each input pair (k, k + 1), the 32
   outputs' two weights side by side: one 64-byte load is 16 outputs' pair, whose low
   halves (weights of k) and high halves (of k + 1) are two fp32 vectors after a shift
   and a mask. The input row's x[k] is broadcast to all lanes.

   Each output is bias (or 0) + x[0] w[0] + x[1] w[1] + ..., added in that order, one
   rounding per FMA (a product of two bf16 is exact in fp32): a row's result depends
   neither on the other rows of the batch nor on the number of threads. */
#include "bf16.h"

#define NR 32        /* outputs per panel: two vectors */
#define MR 12        /* rows per tile: 12 x 2 accumulators, 4 widened weight vectors, of 32 registers */
#define AHEAD 32     /* input pairs (4 KiB of the panel) fetched ahead: at a few rows a tile streams
                        the panel faster than the hardware prefetcher brings it (a decode step) */

static inline __m256i to_bf16x16(__m512 f) {  /* round to nearest even, as torch's .to(); NaN stays NaN */
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

static inline void store16(void *out, int64_t at, int out_fp32, __mmask16 mask, __m512 v) {
    if (out_fp32) _mm512_mask_storeu_ps((float *)out + at, mask, v);
    else _mm256_mask_storeu_epi16((uint16_t *)out + at, mask, to_bf16x16(v));
}

/* rows (mr <= MR, a constant once inlined) x one panel: x fp32 [mr, ldx], wp the
   panel [K / 2, 32, 2], bias the panel's 32 (or NULL); ncols outputs written at
   out[at + r * ldo + c], fp32 or bf16. */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t ldx, int64_t K,
                                                       const uint16_t *wp, const float *bias, void *out,
                                                       int64_t at, int64_t ldo, int out_fp32, int ncols) {
    __m512 acc[MR][2];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 2; j++) acc[r][j] = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int32_t)0xffff0000u);
    for (int64_t p = 0; p < K / 2; p++) {
        /* past the panel this is the next one, which this thread takes next; a prefetch never faults */
        _mm_prefetch((const char *)(wp + (p + AHEAD) * 2 * NR), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + (p + AHEAD) * 2 * NR + NR), _MM_HINT_T0);
        __m512 lo[2], hi[2];  /* the weights of input 2p and of input 2p + 1, for 2 x 16 outputs */
        for (int j = 0; j < 2; j++) {
            const __m512i w = _mm512_loadu_si512(wp + p * 2 * NR + j * NR);
            lo[j] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            hi[j] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
        }
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(x[r * ldx + 2 * p]), b = _mm512_set1_ps(x[r * ldx + 2 * p + 1]);
            for (int j = 0; j < 2; j++) acc[r][j] = _mm512_fmadd_ps(b, hi[j], _mm512_fmadd_ps(a, lo[j], acc[r][j]));
        }
    }
    const __mmask16 m0 = ncols >= 16 ? 0xffff : (1u << ncols) - 1;
    const __mmask16 m1 = ncols >= 32 ? 0xffff : ncols <= 16 ? 0 : (1u << (ncols - 16)) - 1;
    for (int r = 0; r < mr; r++) {
        store16(out, at + r * ldo, out_fp32, m0, acc[r][0]);
        store16(out, at + r * ldo + 16, out_fp32, m1, acc[r][1]);
    }
}

/* All the rows against one panel, MR at a time (the remainder by a tile of its own size). */
static void panel(int64_t rows, const float *x, int64_t ldx, int64_t K, const uint16_t *wp, const float *bias,
                  void *out, int64_t at, int64_t ldo, int out_fp32, int ncols) {
    int64_t m = 0;
    for (; m + MR <= rows; m += MR) tile(MR, x + m * ldx, ldx, K, wp, bias, out, at + m * ldo, ldo, out_fp32, ncols);
    x += m * ldx, at += m * ldo;
    switch (rows - m) {  /* a constant row count per case: the tile's loops unroll */
#define REST(n) case n: tile(n, x, ldx, K, wp, bias, out, at, ldo, out_fp32, ncols); break;
    REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10) REST(11)
#undef REST
    default: break;
    }
}

/* x [M, ldx] (fp32) = the bf16 rows x16 [M, K] widened, the rows shared out between the
   threads of the enclosing parallel region (an orphaned omp for). */
static void widen_rows(const uint16_t *x16, int64_t M, int64_t K, float *x, int64_t ldx) {
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) _mm512_store_ps(x + m * ldx + k, load_bf16x16(x16 + m * K + k));
        for (; k < K; k++) x[m * ldx + k] = bf16_to_f32(x16[m * K + k]);
    }
}

/* out [M, N] (fp32 if out_fp32, else bf16) = x [M, K] (bf16) . w^T + bias, with wp the
   packed weights and bias fp32 [ceil(N / 32) * 32] or NULL. K is even. The rows are
   widened to fp32 once, with a stride that keeps rows a multiple of 4 KiB apart out of
   the same L1 sets; then a chunk of rows that fits half the L2 meets every panel in
   turn, the panels split between the threads. Returns 0, or -1 if the widened rows
   found no memory. */
int linear(const uint16_t *x16, int64_t M, int64_t K, const uint16_t *wp, int64_t N, const float *bias,
           void *out, int out_fp32, int nthreads) {
    const int64_t ldx = (K + 15) / 16 * 16 + 16, panels = (N + NR - 1) / NR;
    const int64_t chunk = ((1 << 20) / (ldx * 4)) / MR * MR > MR ? ((1 << 20) / (ldx * 4)) / MR * MR : MR;
    float *x = aligned_alloc(64, M * ldx * sizeof(float));
    if (x == NULL) return -1;
    #pragma omp parallel num_threads(nthreads)
    {
        widen_rows(x16, M, K, x, ldx);
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
            #pragma omp for schedule(static)
            for (int64_t b = 0; b < panels; b++)
                panel(rows, x + m0 * ldx, ldx, K, wp + b * K * NR, bias ? bias + b * NR : NULL, out,
                      m0 * N + b * NR, N, out_fp32, N - b * NR < NR ? (int)(N - b * NR) : NR);
        }
    }
    free(x);
    return 0;
}

/* A mixture-of-experts layer's projection, every expert at once: x [M, K] (bf16) holds the
   rows of expert e at offsets[e] .. offsets[e + 1] (offsets [E + 1]), wp the E experts'
   packed weights one after another (each [ceil(N / 32), K / 2, 32, 2]); out [M, N] gets
   each row times its expert's w^T (no bias), each output summed in linear()'s order, so
   a row's result is what linear() gives it with that expert's weight alone. One parallel
   region for all the experts, not one (and its barrier) per expert: the (expert, panel)
   pairs are shared out between the threads as they come free (an expert's rows vary).
   Returns 0, or -1 if the widened rows found no memory. */
int moe_linear(const uint16_t *x16, int64_t M, int64_t K, const uint16_t *wp, int64_t E, const int64_t *offsets,
               int64_t N, void *out, int out_fp32, int nthreads) {
    const int64_t ldx = (K + 15) / 16 * 16 + 16, panels = (N + NR - 1) / NR;
    float *x = aligned_alloc(64, (M > 0 ? M : 1) * ldx * sizeof(float));
    if (x == NULL) return -1;
    #pragma omp parallel num_threads(nthreads)
    {
        widen_rows(x16, M, K, x, ldx);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < E * panels; t++) {
            const int64_t e = t / panels, b = t % panels, first = offsets[e], rows = offsets[e + 1] - first;
            if (rows > 0)
                panel(rows, x + first * ldx, ldx, K, wp + (e * panels + b) * K * NR, NULL, out,
                      first * N + b * NR, N, out_fp32, N - b * NR < NR ? (int)(N - b * NR) : NR);
        }
    }
    free(x);
    return 0;
}
