/* Matrix products with GGUF-quantized weights and float32 activations (pagedkv.engine.model.QuantLinear; built by
 * pagedkv.engine.cpu).
 *
 *   y[b, n] = sum_k w[n, k] * x[b, k]        b < B (a few rows), n in [n0, n1), k < K (a multiple of 32)
 *
 * The weight w[n, k] is rebuilt in float32 exactly as gguf-py's dequantize() builds it, so the product is the one
 * of the dequantized float32 matrix, up to float32 summation order (which any GEMM chooses freely):
 *
 *   Q4_1  w = d * q + m     q in 0..15
 *   Q5_0  w = d * (q - 16)  q in 0..31 (a nibble and a fifth bit)
 *   Q8_0  w = d * q         q in -128..127
 *   Q8_16 w = d * q         q in -128..127, one scale per 16 weights (Q6_K's layout: d = the block's scale times
 *                           the sub-block's 8-bit scale, exact in float32; q = the 6-bit value - 32)
 *   (Q4_K is read as Q4_1: d = the block's scale times the sub-block's 6-bit scale, m = -(dmin times its 6-bit
 *   min), both exact in float32, so d * q + m is gguf's d * q - dm, the one rounding included.)
 *
 * d and m are float16 values, so d * q (11 + 8 significant bits at most) is exact in float32: the only rounding
 * of a weight is Q4_1's "+ m", the same in a fused multiply-add as in gguf's two numpy operations.
 *
 * Layouts (one group = 32 consecutive k of one row n; G = K / 32 groups per row):
 *   Q4_1  qs: uint8 (N, G, 16), byte j of a group holds q[j] (low nibble) and q[j + 16] (high nibble);
 *         d, m: float32 (N, G) (the file's float16 scales, widened exactly)
 *   Q5_0  qs as Q4_1's (the low 4 bits); qh: uint32 (N, G), bit j = the fifth bit of q[j]; d: float32 (N, G)
 *   Q8_0  qs: int8 (N, G, 32); d: float32 (N, G)
 *   Q8_16 qs: int8 (N, G, 32); d: float32 (N, 2 G)
 * x is float32 (B, K) row-major with row stride ldx, y float32 (B, ldy) row-major; only columns [n0, n1) of y are
 * written. Rows of w are independent: callers split [0, N) across threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define PKV_W 16
#elif defined(__AVX2__)
#include <immintrin.h>
#define PKV_W 8
#else
#define PKV_W 1
#endif

#define PKV_RB 4 /* rows of x sharing one dequantized group */

/* Software prefetch ahead of the weight streams (bytes): one core streaming the blocks reached ~6.5 GB/s on its
 * own, ~2x that with these (benchmarks/qmatmul_ab.py; 2-4 KB ahead in the values, 1 KB in the scales) */
#define PKV_PF_QS 4096
#define PKV_PF_D 1024
#define PKV_PREFETCH(p, ahead) __builtin_prefetch((const char *)(p) + (ahead), 0, 3)

/* The layouts. Every function below takes the layout as a constant (KIND) and is inlined into one entry point per
 * layout, so each branch on KIND is resolved at compile time. */
enum { PKV_Q4_1, PKV_Q5_0, PKV_Q8_0, PKV_Q8_16 };
#define PKV_QBYTES(KIND) ((KIND) == PKV_Q8_0 || (KIND) == PKV_Q8_16 ? 32 : 16) /* value bytes per group */
#define PKV_DSTEP(KIND) ((KIND) == PKV_Q8_16 ? 2 : 1)                           /* scales per group */
#define PKV_INLINE static inline __attribute__((always_inline))

/* aux (Q4_1's offsets, Q5_0's fifth bits: 4 bytes per group) from group i on */
PKV_INLINE const void *aux_at(const void *aux, int64_t i) { return aux ? (const char *)aux + 4 * i : aux; }

const char *pkv_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}

/* -------------------------------------------------------------------------------------- one group of 32 weights */

#if PKV_W == 16
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* Weights 0..15 and 16..31 of group i (an index into qs / d / aux).
 * Q4_1: a table of the 16 values d * q + m (q = 0..15) looked up by the nibbles (vpermps reads the low 4 bits of
 * each index lane): 8 vector operations per 32 weights instead of 12. Q5_0: two tables, d * (q - 16) for
 * q = 0..15 and 16..31, looked up by 5-bit indices (vpermt2ps), the fifth bits setting bit 4 through a mask. */
PKV_INLINE void deq32(const int KIND, const uint8_t *qs, const float *d, const void *aux, int64_t i, __m512 *w0,
                      __m512 *w1) {
    const uint8_t *q = qs + PKV_QBYTES(KIND) * i;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (KIND == PKV_Q4_1) {
        __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d[i]), iota),
                                     _mm512_set1_ps(((const float *)aux)[i]));
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        *w0 = _mm512_permutexvar_ps(v, table);
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    } else if (KIND == PKV_Q5_0) {
        const __m512 D = _mm512_set1_ps(d[i]);
        const __m512 t_lo = _mm512_mul_ps(D, _mm512_sub_ps(iota, _mm512_set1_ps(16.0f))), t_hi = _mm512_mul_ps(D, iota);
        const __m512i bit4 = _mm512_set1_epi32(16);
        const uint32_t h = ((const uint32_t *)aux)[i];
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        __m512i i0 = _mm512_and_si512(v, _mm512_set1_epi32(15)), i1 = _mm512_srli_epi32(v, 4);
        i0 = _mm512_mask_or_epi32(i0, (__mmask16)(h & 0xFFFFu), i0, bit4);
        i1 = _mm512_mask_or_epi32(i1, (__mmask16)(h >> 16), i1, bit4);
        *w0 = _mm512_permutex2var_ps(t_lo, i0, t_hi);
        *w1 = _mm512_permutex2var_ps(t_lo, i1, t_hi);
    } else { /* Q8_0, Q8_16 (a scale per 16) */
        const float *s = d + PKV_DSTEP(KIND) * i;
        *w0 = _mm512_mul_ps(_mm512_set1_ps(s[0]),
                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
        *w1 = _mm512_mul_ps(_mm512_set1_ps(s[PKV_DSTEP(KIND) - 1]),
                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))));
    }
}

/* A tile: R weight rows (n .. n + R - 1) against NB rows of x (R, NB constants after inlining). */
PKV_INLINE void tile(const int KIND, const float *x, int64_t ldx, int64_t G, const uint8_t *qs, const float *d,
                     const void *aux, int64_t n, float *y, int64_t ldy, const int R, const int NB) {
    __m512 acc[4][PKV_RB][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b][0] = acc[r][b][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const float *xg = x + 32 * g;
        for (int r = 0; r < R; r++) {
            const int64_t i = (n + r) * G + g;
            PKV_PREFETCH(qs + PKV_QBYTES(KIND) * i, PKV_PF_QS);
            PKV_PREFETCH(d + PKV_DSTEP(KIND) * i, PKV_PF_D);
            __m512 w0, w1;
            deq32(KIND, qs, d, aux, i, &w0, &w1);
            for (int b = 0; b < NB; b++) {
                acc[r][b][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg + b * ldx), acc[r][b][0]);
                acc[r][b][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + b * ldx + 16), acc[r][b][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) y[b * ldy + n + r] = hsum(_mm512_add_ps(acc[r][b][0], acc[r][b][1]));
}

#else
#if PKV_W == 8
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* Weights 8h .. 8h + 7 of group i, h = 0..3, in w[h] */
PKV_INLINE void deq32(const int KIND, const uint8_t *qs, const float *d, const void *aux, int64_t i, __m256 w[4]) {
    const uint8_t *q = qs + PKV_QBYTES(KIND) * i;
    if (KIND == PKV_Q8_0 || KIND == PKV_Q8_16) {
        for (int h = 0; h < 4; h++)
            w[h] = _mm256_mul_ps(
                _mm256_set1_ps(d[PKV_DSTEP(KIND) * i + (KIND == PKV_Q8_16 ? h / 2 : 0)]),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * h)))));
        return;
    }
    const __m256 D = _mm256_set1_ps(d[i]);
    const __m256i low = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; h++) { /* values 8h .. 8h + 7 (low nibbles) and 16 + 8h .. (high nibbles) */
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * h)));
        __m256i q0 = _mm256_and_si256(v, low), q1 = _mm256_srli_epi32(v, 4);
        if (KIND == PKV_Q4_1) {
            const __m256 M = _mm256_set1_ps(((const float *)aux)[i]);
            w[h] = _mm256_add_ps(_mm256_mul_ps(D, _mm256_cvtepi32_ps(q0)), M);
            w[h + 2] = _mm256_add_ps(_mm256_mul_ps(D, _mm256_cvtepi32_ps(q1)), M);
        } else { /* Q5_0: the fifth bits from qh, then q - 16 */
            const __m256i H = _mm256_set1_epi32((int)((const uint32_t *)aux)[i]), one = _mm256_set1_epi32(1);
            const __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * h));
            __m256i b0 = _mm256_and_si256(_mm256_srlv_epi32(H, at), one);
            __m256i b1 = _mm256_and_si256(_mm256_srlv_epi32(H, _mm256_add_epi32(at, _mm256_set1_epi32(16))), one);
            const __m256i sixteen = _mm256_set1_epi32(16);
            q0 = _mm256_sub_epi32(_mm256_or_si256(q0, _mm256_slli_epi32(b0, 4)), sixteen);
            q1 = _mm256_sub_epi32(_mm256_or_si256(q1, _mm256_slli_epi32(b1, 4)), sixteen);
            w[h] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(q0));
            w[h + 2] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(q1));
        }
    }
}

/* One weight row (qs, d, aux from its first group) against nb rows of x */
PKV_INLINE void row_dot(const int KIND, const float *x, int64_t ldx, int nb, int64_t G, const uint8_t *qs,
                        const float *d, const void *aux, float *out) {
    __m256 a[PKV_RB][2];
    for (int b = 0; b < PKV_RB; b++) a[b][0] = a[b][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        PKV_PREFETCH(qs + PKV_QBYTES(KIND) * g, PKV_PF_QS);
        PKV_PREFETCH(d + PKV_DSTEP(KIND) * g, PKV_PF_D);
        __m256 w[4];
        deq32(KIND, qs, d, aux, g, w);
        const float *xg = x + 32 * g;
        for (int b = 0; b < nb; b++) {
            const float *xb = xg + b * ldx;
            a[b][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), a[b][0]);
            a[b][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), a[b][1]);
            a[b][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), a[b][0]);
            a[b][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), a[b][1]);
        }
    }
    for (int b = 0; b < nb; b++) out[b] = hsum(_mm256_add_ps(a[b][0], a[b][1]));
}

#else
/* Weight j (0..31) of group i */
PKV_INLINE float weight(const int KIND, const uint8_t *qs, const float *d, const void *aux, int64_t i, int j) {
    if (KIND == PKV_Q8_0 || KIND == PKV_Q8_16)
        return d[PKV_DSTEP(KIND) * i + (KIND == PKV_Q8_16 ? j / 16 : 0)] * (float)(int8_t)qs[32 * i + j];
    const uint8_t byte = qs[16 * i + (j & 15)];
    int q = j < 16 ? byte & 15 : byte >> 4;
    if (KIND == PKV_Q4_1) return d[i] * (float)q + ((const float *)aux)[i];
    q |= (int)((((const uint32_t *)aux)[i] >> j) & 1u) << 4; /* Q5_0 */
    return d[i] * (float)(q - 16);
}

PKV_INLINE void row_dot(const int KIND, const float *x, int64_t ldx, int nb, int64_t G, const uint8_t *qs,
                        const float *d, const void *aux, float *out) {
    for (int b = 0; b < nb; b++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < G; g++)
            for (int j = 0; j < 32; j++) acc += weight(KIND, qs, d, aux, g, j) * x[b * ldx + 32 * g + j];
        out[b] = acc;
    }
}
#endif

/* no tiled kernels for this ISA: a tile is its rows one by one */
PKV_INLINE void tile(const int KIND, const float *x, int64_t ldx, int64_t G, const uint8_t *qs, const float *d,
                     const void *aux, int64_t n, float *y, int64_t ldy, const int R, const int NB) {
    float out[PKV_RB];
    for (int r = 0; r < R; r++) {
        const int64_t i = (n + r) * G; /* the row's first group */
        row_dot(KIND, x, ldx, NB, G, qs + PKV_QBYTES(KIND) * i, d + PKV_DSTEP(KIND) * i, aux_at(aux, i), out);
        for (int b = 0; b < NB; b++) y[b * ldy + n + r] = out[b];
    }
}
#endif

/* ------------------------------------------------------------------------------------------------ entry points */

static int pick_threads(int nthreads, int64_t rows) {
    int nt = nthreads < 1 ? 1 : nthreads;
    int64_t most = rows / 64; /* at least 64 weight rows per thread */
    if (most < 1) most = 1;
    return nt > most ? (int)most : nt;
}

/* The body of an entry point for layout KIND (a macro, so that KIND stays a constant inside the OpenMP region):
 * tiles of R weight rows over all rows of x in chunks of PKV_RB, the constants spelled out per case. */
#define PKV_CASE(KIND, NR, R, NB) \
    case (R) * 8 + (NB): tile(KIND, xb, ldx, G, qs, d, aux, NR, yb, ldy, R, NB); break;
#define PKV_ALL_NB(KIND, NR, R) \
    PKV_CASE(KIND, NR, R, 1) PKV_CASE(KIND, NR, R, 2) PKV_CASE(KIND, NR, R, 3) PKV_CASE(KIND, NR, R, 4)
#define PKV_DRIVER(KIND)                                                                                        \
    const int64_t G = K / 32, rows = n1 - n0;                                                                   \
    const int R = B == 1 ? 4 : 2; /* weight rows per tile: more independent sums when x has one row */        \
    const int64_t tiles = (rows + R - 1) / R;                                                                   \
    const int nt = pick_threads(nthreads, rows);                                                                \
    _Pragma("omp parallel for schedule(static) num_threads(nt) if (nt > 1)")                                    \
    for (int64_t t = 0; t < tiles; t++) {                                                                       \
        const int64_t n = n0 + t * R;                                                                           \
        const int r_here = n + R <= n1 ? R : (int)(n1 - n); /* the last tile may be short: rows one by one */  \
        for (int64_t b0 = 0; b0 < B; b0 += PKV_RB) {                                                            \
            const int nb = (int)(B - b0 < PKV_RB ? B - b0 : PKV_RB);                                            \
            const float *xb = x + b0 * ldx;                                                                     \
            float *yb = y + b0 * ldy;                                                                           \
            if (r_here == R) {                                                                                  \
                switch (R * 8 + nb) { PKV_ALL_NB(KIND, n, 4) PKV_ALL_NB(KIND, n, 2) }                           \
            } else {                                                                                            \
                for (int64_t nr = n; nr < n + r_here; nr++) {                                                   \
                    switch (8 + nb) { PKV_ALL_NB(KIND, nr, 1) }                                                 \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }

/* One signature for every layout: aux is Q4_1's offsets m, Q5_0's fifth bits, unused (NULL) for the others. */
#define PKV_ENTRY(NAME, KIND)                                                                                   \
    void NAME(const float *x, int64_t B, int64_t ldx, int64_t K, const uint8_t *qs, const float *d,             \
              const void *aux, int64_t n0, int64_t n1, float *y, int64_t ldy, int nthreads) {                   \
        PKV_DRIVER(KIND)                                                                                        \
    }
PKV_ENTRY(pkv_q4_1_mm, PKV_Q4_1)
PKV_ENTRY(pkv_q5_0_mm, PKV_Q5_0)
PKV_ENTRY(pkv_q8_0_mm, PKV_Q8_0)
PKV_ENTRY(pkv_q8_16_mm, PKV_Q8_16)

/* ------------------------------------------------------------------------ paged attention over each sequence's own
 * blocks (pagedkv.engine.paged_attention, the "ragged" path).
 *
 * For each sequence s < S, seqs[4 s ..] = (table row, first query row in the flat batch, q_len, context): its query
 * row i (position p = context - q_len + i) attends the keys at positions max(0, p - window + 1) .. p (window <= 0:
 * from 0), read through its row of block ids (tables + row * ldt), each key at kv[0, block, pos % bs, h, :] and its
 * value at kv[1, ...]: kv is (2, num_blocks, bs, n_kv, d) float32, contiguous. Query head hq (n_head = n_kv * ng,
 * grouped queries: KV head hq / ng) of row r is q[r * ldq + hq * d ..]; out row r gets the heads one after another
 * (ldo floats apart). Softmax in float32 over the exact key range: no padding, no mask, nothing gathered.
 * Work: O(sum over rows of keys x n_head x d); OpenMP over sequences (or (sequence, KV head) when there are fewer
 * sequences than threads). Returns the
 * number of keys read through block ids that were NULL (< 0) or >= num_blocks (those keys are skipped; the caller
 * raises), -1 for head counts it does not take (n_head not a multiple of n_kv, or over PKV_MAX_HEADS). */
#define PKV_MAX_HEADS 256
PKV_INLINE float pkv_dot(const float *a, const float *b, const int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The query rows of one sequence for KV heads [h0, h1) (their ng query heads each): per row, the scores of every
 * key (each key's heads read together: one contiguous run of the cache), the softmax, the weighted values. D is a
 * constant where inlined for d = 64 (unrolled loops), else the run-time d. sc: (h1 - h0) * ng * (keys of the
 * longest row) floats; acc: (h1 - h0) * ng * D. */
PKV_INLINE int64_t attn_seq(const int64_t D, const float *q, int64_t ldq, const float *kv, int64_t num_blocks,
                            int64_t bs, int64_t n_kv, int64_t ng, const int32_t *table, int64_t row0, int64_t qlen,
                            int64_t ctx, int64_t window, float scale, int64_t h0, int64_t h1, float *out,
                            int64_t ldo, float *sc, float *acc) {
    const float *vbase = kv + num_blocks * bs * n_kv * D;
    const int64_t nh = (h1 - h0) * ng; /* query heads handled here, from query head h0 * ng on */
    int64_t bad = 0;
    float mx[PKV_MAX_HEADS];
    for (int64_t i = 0; i < qlen; i++) {
        const int64_t r = row0 + i, pos = ctx - qlen + i;
        const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0, n = pos - lo + 1;
        const float *qr = q + r * ldq + h0 * ng * D;
        for (int64_t j = 0; j < nh; j++) mx[j] = -INFINITY;
        for (int64_t p = lo; p <= pos;) { /* scores, block by block */
            const int64_t blk = table[p / bs], end = (p / bs + 1) * bs <= pos + 1 ? (p / bs + 1) * bs : pos + 1;
            if (blk < 0 || blk >= num_blocks) {
                bad += end - p;
                for (; p < end; p++)
                    for (int64_t j = 0; j < nh; j++) sc[j * n + p - lo] = -INFINITY;
                continue;
            }
            for (; p < end; p++) {
                const float *kp = kv + ((blk * bs + p % bs) * n_kv + h0) * D;
                for (int64_t j = 0; j < nh; j++) {
                    const float x = pkv_dot(qr + j * D, kp + (j / ng) * D, D) * scale;
                    sc[j * n + p - lo] = x;
                    if (x > mx[j]) mx[j] = x;
                }
            }
        }
        for (int64_t j = 0; j < nh; j++) {
            float *sj = sc + j * n, m = mx[j], t = 0.f;
            for (int64_t x = 0; x < n; x++) t += sj[x] = expf(sj[x] - m);
            mx[j] = 1.f / t; /* from here on: the normalizer */
        }
        for (int64_t x = 0; x < nh * D; x++) acc[x] = 0.f;
        for (int64_t p = lo; p <= pos;) { /* the values, weighted */
            const int64_t blk = table[p / bs], end = (p / bs + 1) * bs <= pos + 1 ? (p / bs + 1) * bs : pos + 1;
            if (blk < 0 || blk >= num_blocks) {
                p = end;
                continue;
            }
            for (; p < end; p++) {
                const float *vp = vbase + ((blk * bs + p % bs) * n_kv + h0) * D;
                for (int64_t j = 0; j < nh; j++) {
                    const float w = sc[j * n + p - lo], *vj = vp + (j / ng) * D;
                    float *a = acc + j * D;
#pragma omp simd
                    for (int64_t x = 0; x < D; x++) a[x] += w * vj[x];
                }
            }
        }
        for (int64_t j = 0; j < nh; j++) {
            float *o = out + r * ldo + (h0 * ng + j) * D;
            for (int64_t x = 0; x < D; x++) o[x] = acc[j * D + x] * mx[j];
        }
    }
    return bad;
}

static int64_t attn_seq_any(int64_t d, const float *q, int64_t ldq, const float *kv, int64_t num_blocks, int64_t bs,
                            int64_t n_kv, int64_t ng, const int32_t *table, int64_t row0, int64_t qlen, int64_t ctx,
                            int64_t window, float scale, int64_t h0, int64_t h1, float *out, int64_t ldo, float *sc,
                            float *acc) {
#define PKV_ATTN_D(DC)                                                                                         \
    if (d == (DC))                                                                                             \
        return attn_seq((DC), q, ldq, kv, num_blocks, bs, n_kv, ng, table, row0, qlen, ctx, window, scale, h0, h1, \
                        out, ldo, sc, acc);
    PKV_ATTN_D(64) PKV_ATTN_D(128) PKV_ATTN_D(256) /* SmolLM2, many others, Gemma 3: loops unrolled */
    return attn_seq(d, q, ldq, kv, num_blocks, bs, n_kv, ng, table, row0, qlen, ctx, window, scale, h0, h1, out, ldo,
                    sc, acc);
}

int64_t pkv_paged_attn(const float *q, int64_t ldq, const float *kv, int64_t num_blocks, int64_t bs, int64_t n_kv,
                       int64_t d, int64_t n_head, const int32_t *tables, int64_t ldt, const int64_t *seqs, int64_t S,
                       int64_t window, float scale, float *out, int64_t ldo, int nthreads) {
    const int64_t ng = n_kv > 0 ? n_head / n_kv : 0;
    int64_t most = 0, bad = 0; /* the longest key range of a row: the scratch of one task */
    if (ng < 1 || ng * n_kv != n_head || n_head > PKV_MAX_HEADS) return -1;
    for (int64_t s = 0; s < S; s++) {
        const int64_t ctx = seqs[4 * s + 3];
        const int64_t n = window > 0 && window < ctx ? window : ctx;
        if (n > most) most = n;
    }
    int nt = nthreads < 1 ? 1 : nthreads;
    /* one task per sequence (all its heads: each key one contiguous read) when there are enough for the threads,
     * else one per (sequence, KV head) */
    const int64_t split = S >= nt ? 1 : n_kv, tasks = S * split, hs = n_kv / split;
    if (nt > tasks) nt = (int)(tasks > 0 ? tasks : 1);
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(+ : bad)
    {
        float *acc = (float *)malloc(sizeof(float) * (size_t)(hs * ng * (most + d) + 1)); /* acc, then scores */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t s = t / split, h0 = (t % split) * hs;
            const int64_t *e = seqs + 4 * s;
            if (acc == NULL) {
                bad += 1;
                continue;
            }
            bad += attn_seq_any(d, q, ldq, kv, num_blocks, bs, n_kv, ng, tables + e[0] * ldt, e[1], e[2], e[3], window,
                                scale, h0, h0 + hs, out, ldo, acc + hs * ng * d, acc);
        }
        free(acc);
    }
    return bad;
}

/* ---------------------------------------------------------------- a whole few-row decode step of a Llama model
 * (pagedkv.engine.cpu.FusedLlama): every layer in one call, for steps whose products all read quantized blocks
 * and whose attention is all ragged (decodes, short queries). The layer's float32 arithmetic is that of the torch
 * ops it replaces (PagedLlama.hidden), in the same order (-ffp-contract=off: no fused multiply-add), except for
 * summation orders (the mean of squares of RMSNorm: accumulated in double) and expf (glibc's, where torch uses its
 * own vectorized exp in SiLU): differences of the order of float32 rounding, as any BLAS makes. */
typedef struct {
    int64_t kind; /* PKV_Q4_1 .. PKV_Q8_16 */
    const uint8_t *qs;
    const float *d;
    const void *aux;
    int64_t row, n; /* output rows [row, row + n) of the product */
} pkv_part;

#define PKV_MAX_PARTS 4
typedef struct {
    pkv_part parts[PKV_MAX_PARTS];
    int64_t nparts;
} pkv_lin;

typedef struct {
    const float *attn_norm, *ffn_norm;
    pkv_lin qkv, o, gu, down;
} pkv_layer;

static void lin_apply(const pkv_lin *lin, const float *x, int64_t B, int64_t ldx, int64_t K, float *y, int64_t ldy,
                      int nthreads) {
    for (int64_t i = 0; i < lin->nparts; i++) {
        const pkv_part *p = lin->parts + i;
        float *yp = y + p->row;
        switch (p->kind) {
        case PKV_Q4_1: pkv_q4_1_mm(x, B, ldx, K, p->qs, p->d, p->aux, 0, p->n, yp, ldy, nthreads); break;
        case PKV_Q5_0: pkv_q5_0_mm(x, B, ldx, K, p->qs, p->d, p->aux, 0, p->n, yp, ldy, nthreads); break;
        case PKV_Q8_0: pkv_q8_0_mm(x, B, ldx, K, p->qs, p->d, p->aux, 0, p->n, yp, ldy, nthreads); break;
        default: pkv_q8_16_mm(x, B, ldx, K, p->qs, p->d, p->aux, 0, p->n, yp, ldy, nthreads); break;
        }
    }
}

/* x += add (add may be NULL), then out = (x * (1 / sqrt(mean(x^2) + eps))) * w; T rows of n floats */
static void add_rmsnorm(float *x, const float *add, int64_t T, int64_t n, const float *w, float eps, float *out) {
    for (int64_t t = 0; t < T; t++) {
        float *xr = x + t * n;
        if (add) {
            const float *ar = add + t * n;
            for (int64_t i = 0; i < n; i++) xr[i] = xr[i] + ar[i];
        }
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++) ss += (double)xr[i] * (double)xr[i];
        const float mean = (float)(ss / (double)n);
        const float r = 1.0f / sqrtf(mean + eps);
        float *o = out + t * n;
        for (int64_t i = 0; i < n; i++) o[i] = (xr[i] * r) * w[i];
    }
}

int64_t pkv_llama_step(const pkv_layer *layers, int64_t n_layer, int64_t T, int64_t E, int64_t n_head, int64_t n_kv,
                       int64_t hd, int64_t n_ff, float eps, float scale, float *x, float *h, float *qkv, float *attn,
                       float *tmp, float *gu, float *act, const float *cos_t, const float *sin_t, const int64_t *pos,
                       const int64_t *slots, float *kv, int64_t num_blocks, int64_t bs, const int32_t *tables,
                       int64_t ldt, const int64_t *seqs, int64_t S, int64_t window, const float *out_norm, float *out,
                       int nthreads) {
    const int64_t nq = n_head * hd, nqkv = (n_head + 2 * n_kv) * hd, half = hd / 2;
    const int64_t plane = num_blocks * bs * n_kv * hd; /* floats of one layer's keys (then its values) */
    int64_t bad = 0;
    for (int64_t l = 0; l < n_layer; l++) {
        const pkv_layer *L = layers + l;
        float *kvl = kv + 2 * plane * l;
        add_rmsnorm(x, l ? tmp : NULL, T, E, L->attn_norm, eps, h); /* (the previous layer's down product) */
        lin_apply(&L->qkv, h, T, E, E, qkv, nqkv, nthreads);
        for (int64_t t = 0; t < T; t++) { /* rotary embeddings of queries and keys; keys and values into the cache */
            const float *c = cos_t + pos[t] * hd, *s = sin_t + pos[t] * hd;
            float *row = qkv + t * nqkv;
            for (int64_t hh = 0; hh < n_head + n_kv; hh++) {
                float *v = row + hh * hd;
                for (int64_t i = 0; i < half; i++) {
                    const float a = v[i], b = v[i + half];
                    v[i] = a * c[i] + (-b) * s[i];
                    v[i + half] = b * c[i + half] + a * s[i + half];
                }
            }
            float *kd = kvl + slots[t] * n_kv * hd, *vd = kvl + plane + slots[t] * n_kv * hd;
            for (int64_t i = 0; i < n_kv * hd; i++) {
                kd[i] = row[nq + i];
                vd[i] = row[nq + n_kv * hd + i];
            }
        }
        const int64_t r = pkv_paged_attn(qkv, nqkv, kvl, num_blocks, bs, n_kv, hd, n_head, tables, ldt, seqs, S,
                                         window, scale, attn, nq, nthreads);
        if (r < 0) return r;
        bad += r;
        lin_apply(&L->o, attn, T, nq, nq, tmp, E, nthreads);
        add_rmsnorm(x, tmp, T, E, L->ffn_norm, eps, h);
        lin_apply(&L->gu, h, T, E, E, gu, 2 * n_ff, nthreads);
        for (int64_t t = 0; t < T; t++) {
            const float *g = gu + t * 2 * n_ff, *u = g + n_ff;
            float *a = act + t * n_ff;
            for (int64_t i = 0; i < n_ff; i++) a[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
        }
        lin_apply(&L->down, act, T, n_ff, n_ff, tmp, E, nthreads);
    }
    add_rmsnorm(x, n_layer ? tmp : NULL, T, E, out_norm, eps, out);
    return bad;
}

/* Gemma 3's few-row step (pagedkv.engine.gemma3.PagedGemma3): as pkv_llama_step, with Gemma's layer: the scaled
 * embedding, RMSNorm multipliers (1 + w, folded at load), per-head query and key norms, a norm after the attention
 * and after the MLP, GELU (tanh form, torch's formula), and per layer its own KV slot, rotary tables and attention
 * plan: lay[9 l ..] = (KV layer, cos table, sin table, block tables, their row stride, sequences, S, window, slots of
 * the new tokens), the pointers as integers. */
typedef struct {
    const float *attn_norm, *qk_norm, *post_attn_norm, *ffn_norm, *post_ffw_norm;
    pkv_lin qkv, o, gu, down;
} pkv_glayer;

/* out = (x * (1 / sqrt(mean(x^2) + eps))) * w over n floats; x and out may be the same */
static void rmsnorm1(const float *x, int64_t n, const float *w, float eps, float *out) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    const float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] * r) * w[i];
}

int64_t pkv_gemma3_step(const pkv_glayer *layers, const int64_t *lay, int64_t n_layer, int64_t T, int64_t E,
                        int64_t n_head, int64_t n_kv, int64_t hd, int64_t n_ff, float eps, float scale, float *x,
                        float *h, float *qkv, float *attn, float *tmp, float *gu, float *act, const int64_t *pos,
                        int64_t num_blocks, int64_t bs, const float *out_norm, float *out, int nthreads) {
    const int64_t nq = n_head * hd, nqkv = (n_head + 2 * n_kv) * hd, half = hd / 2;
    const int64_t plane = num_blocks * bs * n_kv * hd;
    const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
    int64_t bad = 0;
    for (int64_t l = 0; l < n_layer; l++) {
        const pkv_glayer *L = layers + l;
        const int64_t *e = lay + 9 * l;
        const int64_t *slots = (const int64_t *)(intptr_t)e[8];
        float *kvl = (float *)(intptr_t)e[0];
        const float *cos_t = (const float *)(intptr_t)e[1], *sin_t = (const float *)(intptr_t)e[2];
        for (int64_t t = 0; t < T; t++) rmsnorm1(x + t * E, E, L->attn_norm, eps, h + t * E);
        lin_apply(&L->qkv, h, T, E, E, qkv, nqkv, nthreads);
        for (int64_t t = 0; t < T; t++) {
            const float *c = cos_t + pos[t] * hd, *s = sin_t + pos[t] * hd;
            float *row = qkv + t * nqkv;
            for (int64_t hh = 0; hh < n_head + n_kv; hh++) {
                float *v = row + hh * hd;
                rmsnorm1(v, hd, L->qk_norm + hh * hd, eps, v);
                for (int64_t i = 0; i < half; i++) {
                    const float a = v[i], b = v[i + half];
                    v[i] = a * c[i] + (-b) * s[i];
                    v[i + half] = b * c[i + half] + a * s[i + half];
                }
            }
            float *kd = kvl + slots[t] * n_kv * hd, *vd = kvl + plane + slots[t] * n_kv * hd;
            for (int64_t i = 0; i < n_kv * hd; i++) {
                kd[i] = row[nq + i];
                vd[i] = row[nq + n_kv * hd + i];
            }
        }
        const int64_t r = pkv_paged_attn(qkv, nqkv, kvl, num_blocks, bs, n_kv, hd, n_head,
                                         (const int32_t *)(intptr_t)e[3], e[4], (const int64_t *)(intptr_t)e[5], e[6],
                                         e[7], scale, attn, nq, nthreads);
        if (r < 0) return r;
        bad += r;
        lin_apply(&L->o, attn, T, nq, nq, tmp, E, nthreads);
        for (int64_t t = 0; t < T; t++) {
            float *xr = x + t * E, *tr = tmp + t * E;
            rmsnorm1(tr, E, L->post_attn_norm, eps, tr);
            for (int64_t i = 0; i < E; i++) xr[i] = xr[i] + tr[i];
            rmsnorm1(xr, E, L->ffn_norm, eps, h + t * E);
        }
        lin_apply(&L->gu, h, T, E, E, gu, 2 * n_ff, nthreads);
        for (int64_t t = 0; t < T; t++) {
            const float *g = gu + t * 2 * n_ff, *u = g + n_ff;
            float *a = act + t * n_ff;
            for (int64_t i = 0; i < n_ff; i++) {
                const float xv = g[i], cube = xv * xv * xv;
                const float inner = beta * (xv + kappa * cube);
                a[i] = ((0.5f * xv) * (1.0f + tanhf(inner))) * u[i];
            }
        }
        lin_apply(&L->down, act, T, n_ff, n_ff, tmp, E, nthreads);
        for (int64_t t = 0; t < T; t++) {
            float *xr = x + t * E, *tr = tmp + t * E;
            rmsnorm1(tr, E, L->post_ffw_norm, eps, tr);
            for (int64_t i = 0; i < E; i++) xr[i] = xr[i] + tr[i];
        }
    }
    for (int64_t t = 0; t < T; t++) rmsnorm1(x + t * E, E, out_norm, eps, out + t * E);
    return bad;
}
