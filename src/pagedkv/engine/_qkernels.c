/* Matrix products with GGUF-quantized weights and float32 activations (pagedkv.engine.qmatmul).
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
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define PKV_W 16
#elif defined(__AVX2__)
#include <immintrin.h>
#define PKV_W 8
#else
#define PKV_W 1
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define PKV_RB 4 /* rows of x sharing one dequantized group */

/* Software prefetch ahead of the weight streams (bytes): one core streaming the blocks reached ~6.5 GB/s on its
 * own, ~2x that with these (benchmarks/qmatmul_ab.py; 2-4 KB ahead in the values, 1 KB in the scales) */
#define PKV_PF_QS 4096
#define PKV_PF_D 1024
#define PKV_PREFETCH(p, ahead) __builtin_prefetch((const char *)(p) + (ahead), 0, 3)

const char *pkv_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}

/* --------------------------------------------------------------------------------------------- one weight row */

#if PKV_W == 16
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* A tile: R weight rows (n .. n + R - 1) against NB rows of x; R, NB compile-time constants after inlining.
 * Q4_1 weights come from a per-group table of the 16 values d * q + m (q = 0..15), looked up by the nibbles
 * (vpermps reads the low 4 bits of each index lane): 8 vector operations per 32 weights instead of 12. */
static inline __attribute__((always_inline)) void q41_tile(const float *x, int64_t ldx, int64_t G,
                                                           const uint8_t *qs, const float *d, const float *m,
                                                           int64_t n, float *y, int64_t ldy, const int R,
                                                           const int NB) {
    __m512 acc[4][PKV_RB][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b][0] = acc[r][b][1] = _mm512_setzero_ps();
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t g = 0; g < G; g++) {
        const float *xg = x + 32 * g;
        for (int r = 0; r < R; r++) {
            const int64_t row = (n + r) * G + g;
            PKV_PREFETCH(qs + 16 * row, PKV_PF_QS);
            PKV_PREFETCH(d + row, PKV_PF_D);
            __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d[row]), iota), _mm512_set1_ps(m[row]));
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * row)));
            __m512 w0 = _mm512_permutexvar_ps(v, table);
            __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
            for (int b = 0; b < NB; b++) {
                acc[r][b][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg + b * ldx), acc[r][b][0]);
                acc[r][b][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + b * ldx + 16), acc[r][b][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) y[b * ldy + n + r] = hsum(_mm512_add_ps(acc[r][b][0], acc[r][b][1]));
}

static inline __attribute__((always_inline)) void q80_tile(const float *x, int64_t ldx, int64_t G,
                                                           const int8_t *qs, const float *d, const float *m,
                                                           int64_t n, float *y, int64_t ldy, const int R,
                                                           const int NB) {
    (void)m;
    __m512 acc[4][PKV_RB][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b][0] = acc[r][b][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const float *xg = x + 32 * g;
        for (int r = 0; r < R; r++) {
            const int64_t row = (n + r) * G + g;
            PKV_PREFETCH(qs + 32 * row, PKV_PF_QS);
            PKV_PREFETCH(d + row, PKV_PF_D);
            __m512 D = _mm512_set1_ps(d[row]);
            __m512 w0 = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(qs + 32 * row)))));
            __m512 w1 = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(qs + 32 * row + 16)))));
            for (int b = 0; b < NB; b++) {
                acc[r][b][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg + b * ldx), acc[r][b][0]);
                acc[r][b][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + b * ldx + 16), acc[r][b][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) y[b * ldy + n + r] = hsum(_mm512_add_ps(acc[r][b][0], acc[r][b][1]));
}

/* Q5_0: two tables, d * (q - 16) for q = 0..15 and 16..31, looked up by 5-bit indices (vpermt2ps); the fifth
 * bits set bit 4 of the indices through a mask register */
static inline __attribute__((always_inline)) void q50_tile(const float *x, int64_t ldx, int64_t G,
                                                           const uint8_t *qs, const float *d, const uint32_t *qh,
                                                           int64_t n, float *y, int64_t ldy, const int R,
                                                           const int NB) {
    __m512 acc[4][PKV_RB][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b][0] = acc[r][b][1] = _mm512_setzero_ps();
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 iota16 = _mm512_sub_ps(iota, _mm512_set1_ps(16.0f));
    const __m512i low = _mm512_set1_epi32(15), bit4 = _mm512_set1_epi32(16);
    for (int64_t g = 0; g < G; g++) {
        const float *xg = x + 32 * g;
        for (int r = 0; r < R; r++) {
            const int64_t row = (n + r) * G + g;
            PKV_PREFETCH(qs + 16 * row, PKV_PF_QS);
            PKV_PREFETCH(d + row, PKV_PF_D);
            const __m512 D = _mm512_set1_ps(d[row]);
            const __m512 t_lo = _mm512_mul_ps(D, iota16), t_hi = _mm512_mul_ps(D, iota);
            const uint32_t h = qh[row];
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * row)));
            __m512i i0 = _mm512_and_si512(v, low), i1 = _mm512_srli_epi32(v, 4);
            i0 = _mm512_mask_or_epi32(i0, (__mmask16)(h & 0xFFFFu), i0, bit4);
            i1 = _mm512_mask_or_epi32(i1, (__mmask16)(h >> 16), i1, bit4);
            __m512 w0 = _mm512_permutex2var_ps(t_lo, i0, t_hi);
            __m512 w1 = _mm512_permutex2var_ps(t_lo, i1, t_hi);
            for (int b = 0; b < NB; b++) {
                acc[r][b][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg + b * ldx), acc[r][b][0]);
                acc[r][b][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + b * ldx + 16), acc[r][b][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) y[b * ldy + n + r] = hsum(_mm512_add_ps(acc[r][b][0], acc[r][b][1]));
}

static inline __attribute__((always_inline)) void q816_tile(const float *x, int64_t ldx, int64_t G,
                                                            const int8_t *qs, const float *d, const float *m,
                                                            int64_t n, float *y, int64_t ldy, const int R,
                                                            const int NB) {
    (void)m;
    __m512 acc[4][PKV_RB][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b][0] = acc[r][b][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const float *xg = x + 32 * g;
        for (int r = 0; r < R; r++) {
            const int64_t row = (n + r) * G + g;
            PKV_PREFETCH(qs + 32 * row, PKV_PF_QS);
            PKV_PREFETCH(d + 2 * row, PKV_PF_D);
            __m512 w0 = _mm512_mul_ps(_mm512_set1_ps(d[2 * row]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(qs + 32 * row)))));
            __m512 w1 = _mm512_mul_ps(_mm512_set1_ps(d[2 * row + 1]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(qs + 32 * row + 16)))));
            for (int b = 0; b < NB; b++) {
                acc[r][b][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg + b * ldx), acc[r][b][0]);
                acc[r][b][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + b * ldx + 16), acc[r][b][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) y[b * ldy + n + r] = hsum(_mm512_add_ps(acc[r][b][0], acc[r][b][1]));
}

#define PKV_TILED 1

#elif PKV_W == 8
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline void q41_row(const float *x, int64_t ldx, int nb, int64_t G, const uint8_t *qs, const float *d,
                           const float *m, float *out) {
    __m256 a[PKV_RB][2];
    for (int b = 0; b < PKV_RB; b++) a[b][0] = a[b][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi32(15);
    for (int64_t g = 0; g < G; g++) {
        PKV_PREFETCH(qs + 16 * g, PKV_PF_QS);
        PKV_PREFETCH(d + g, PKV_PF_D);
        __m256 D = _mm256_set1_ps(d[g]), M = _mm256_set1_ps(m[g]);
        __m256 w[4];
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 16 * g + 8 * h)));
            w[h] = _mm256_add_ps(_mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_and_si256(v, low))), M);
            w[h + 2] = _mm256_add_ps(_mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4))), M);
        }
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

static inline void q80_row(const float *x, int64_t ldx, int nb, int64_t G, const int8_t *qs, const float *d,
                           float *out) {
    __m256 a[PKV_RB][2];
    for (int b = 0; b < PKV_RB; b++) a[b][0] = a[b][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        PKV_PREFETCH(qs + 32 * g, PKV_PF_QS);
        PKV_PREFETCH(d + g, PKV_PF_D);
        __m256 D = _mm256_set1_ps(d[g]);
        __m256 w[4];
        for (int h = 0; h < 4; h++)
            w[h] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(qs + 32 * g + 8 * h)))));
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

static inline void q50_row(const float *x, int64_t ldx, int nb, int64_t G, const uint8_t *qs, const float *d,
                           const uint32_t *qh, float *out) {
    __m256 a[PKV_RB][2];
    for (int b = 0; b < PKV_RB; b++) a[b][0] = a[b][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1), sixteen = _mm256_set1_epi32(16);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t g = 0; g < G; g++) {
        PKV_PREFETCH(qs + 16 * g, PKV_PF_QS);
        PKV_PREFETCH(d + g, PKV_PF_D);
        __m256 D = _mm256_set1_ps(d[g]);
        __m256i H = _mm256_set1_epi32((int)qh[g]);
        __m256 w[4];
        for (int h = 0; h < 2; h++) {  /* elements 8h..8h+7 (low nibbles) and 16+8h.. (high nibbles) */
            __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 16 * g + 8 * h)));
            __m256i b0 = _mm256_and_si256(_mm256_srlv_epi32(H, _mm256_add_epi32(iota, _mm256_set1_epi32(8 * h))), one);
            __m256i b1 = _mm256_and_si256(_mm256_srlv_epi32(H, _mm256_add_epi32(iota, _mm256_set1_epi32(16 + 8 * h))), one);
            __m256i q0 = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_slli_epi32(b0, 4));
            __m256i q1 = _mm256_or_si256(_mm256_srli_epi32(v, 4), _mm256_slli_epi32(b1, 4));
            w[h] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_sub_epi32(q0, sixteen)));
            w[h + 2] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_sub_epi32(q1, sixteen)));
        }
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

static inline void q816_row(const float *x, int64_t ldx, int nb, int64_t G, const int8_t *qs, const float *d,
                            float *out) {
    __m256 a[PKV_RB][2];
    for (int b = 0; b < PKV_RB; b++) a[b][0] = a[b][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        PKV_PREFETCH(qs + 32 * g, PKV_PF_QS);
        PKV_PREFETCH(d + 2 * g, PKV_PF_D);
        __m256 w[4];
        for (int h = 0; h < 4; h++)
            w[h] = _mm256_mul_ps(_mm256_set1_ps(d[2 * g + h / 2]), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(qs + 32 * g + 8 * h)))));
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
static inline void q41_row(const float *x, int64_t ldx, int nb, int64_t G, const uint8_t *qs, const float *d,
                           const float *m, float *out) {
    for (int b = 0; b < nb; b++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < G; g++)
            for (int j = 0; j < 16; j++) {
                float w0 = d[g] * (float)(qs[16 * g + j] & 15), w1 = d[g] * (float)(qs[16 * g + j] >> 4);
                w0 = w0 + m[g];
                w1 = w1 + m[g];
                acc += w0 * x[b * ldx + 32 * g + j];
                acc += w1 * x[b * ldx + 32 * g + 16 + j];
            }
        out[b] = acc;
    }
}

static inline void q80_row(const float *x, int64_t ldx, int nb, int64_t G, const int8_t *qs, const float *d,
                           float *out) {
    for (int b = 0; b < nb; b++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < G; g++)
            for (int j = 0; j < 32; j++) acc += (d[g] * (float)qs[32 * g + j]) * x[b * ldx + 32 * g + j];
        out[b] = acc;
    }
}
static inline void q50_row(const float *x, int64_t ldx, int nb, int64_t G, const uint8_t *qs, const float *d,
                           const uint32_t *qh, float *out) {
    for (int b = 0; b < nb; b++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < G; g++)
            for (int j = 0; j < 16; j++) {
                int q0 = (qs[16 * g + j] & 15) | (int)(((qh[g] >> j) & 1u) << 4);
                int q1 = (qs[16 * g + j] >> 4) | (int)(((qh[g] >> (j + 16)) & 1u) << 4);
                acc += (d[g] * (float)(q0 - 16)) * x[b * ldx + 32 * g + j];
                acc += (d[g] * (float)(q1 - 16)) * x[b * ldx + 32 * g + 16 + j];
            }
        out[b] = acc;
    }
}
static inline void q816_row(const float *x, int64_t ldx, int nb, int64_t G, const int8_t *qs, const float *d,
                            float *out) {
    for (int b = 0; b < nb; b++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < G; g++)
            for (int j = 0; j < 32; j++) acc += (d[2 * g + j / 16] * (float)qs[32 * g + j]) * x[b * ldx + 32 * g + j];
        out[b] = acc;
    }
}
#endif

#ifndef PKV_TILED
/* no tiled kernels for this ISA: a tile is its rows one by one */
static inline void q41_tile(const float *x, int64_t ldx, int64_t G, const uint8_t *qs, const float *d,
                            const float *m, int64_t n, float *y, int64_t ldy, const int R, const int NB) {
    float out[PKV_RB];
    for (int r = 0; r < R; r++) {
        q41_row(x, ldx, NB, G, qs + (n + r) * 16 * G, d + (n + r) * G, m + (n + r) * G, out);
        for (int b = 0; b < NB; b++) y[b * ldy + n + r] = out[b];
    }
}

static inline void q80_tile(const float *x, int64_t ldx, int64_t G, const int8_t *qs, const float *d,
                            const float *m, int64_t n, float *y, int64_t ldy, const int R, const int NB) {
    float out[PKV_RB];
    (void)m;
    for (int r = 0; r < R; r++) {
        q80_row(x, ldx, NB, G, qs + (n + r) * 32 * G, d + (n + r) * G, out);
        for (int b = 0; b < NB; b++) y[b * ldy + n + r] = out[b];
    }
}
static inline void q50_tile(const float *x, int64_t ldx, int64_t G, const uint8_t *qs, const float *d,
                            const uint32_t *qh, int64_t n, float *y, int64_t ldy, const int R, const int NB) {
    float out[PKV_RB];
    for (int r = 0; r < R; r++) {
        q50_row(x, ldx, NB, G, qs + (n + r) * 16 * G, d + (n + r) * G, qh + (n + r) * G, out);
        for (int b = 0; b < NB; b++) y[b * ldy + n + r] = out[b];
    }
}
static inline void q816_tile(const float *x, int64_t ldx, int64_t G, const int8_t *qs, const float *d,
                             const float *m, int64_t n, float *y, int64_t ldy, const int R, const int NB) {
    float out[PKV_RB];
    (void)m;
    for (int r = 0; r < R; r++) {
        q816_row(x, ldx, NB, G, qs + (n + r) * 32 * G, d + (n + r) * 2 * G, out);
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

/* one tile of R weight rows at n, over all rows of x in chunks of PKV_RB (constants spelled out per case) */
#define PKV_CASE(TILE, R, NB) \
    case (R) * 8 + (NB): TILE(xb, ldx, G, qs, d, m, n, yb, ldy, R, NB); break;
#define PKV_TILE_ALL_NB(TILE, R) PKV_CASE(TILE, R, 1) PKV_CASE(TILE, R, 2) PKV_CASE(TILE, R, 3) PKV_CASE(TILE, R, 4)
#define PKV_DRIVER(TILE, QT)                                                                                    \
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
                switch (R * 8 + nb) { PKV_TILE_ALL_NB(TILE, 4) PKV_TILE_ALL_NB(TILE, 2) }                       \
            } else {                                                                                            \
                for (int r = 0; r < r_here; r++) {                                                              \
                    const int64_t nr = n + r;                                                                   \
                    switch (nb) {                                                                               \
                        case 1: TILE(xb, ldx, G, qs, d, m, nr, yb, ldy, 1, 1); break;                           \
                        case 2: TILE(xb, ldx, G, qs, d, m, nr, yb, ldy, 1, 2); break;                           \
                        case 3: TILE(xb, ldx, G, qs, d, m, nr, yb, ldy, 1, 3); break;                           \
                        default: TILE(xb, ldx, G, qs, d, m, nr, yb, ldy, 1, 4); break;                          \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }

void pkv_q4_1_mm(const float *x, int64_t B, int64_t ldx, int64_t K, const uint8_t *qs, const float *d,
                 const float *m, int64_t n0, int64_t n1, float *y, int64_t ldy, int nthreads) {
    PKV_DRIVER(q41_tile, uint8_t)
}

/* Every entry point has one signature: aux is Q4_1's offsets m, Q5_0's fifth bits, unused for Q8_0. */
void pkv_q5_0_mm(const float *x, int64_t B, int64_t ldx, int64_t K, const uint8_t *qs, const float *d,
                 const uint32_t *m, int64_t n0, int64_t n1, float *y, int64_t ldy, int nthreads) {
    PKV_DRIVER(q50_tile, uint8_t)
}

void pkv_q8_0_mm(const float *x, int64_t B, int64_t ldx, int64_t K, const int8_t *qs, const float *d,
                 const void *aux, int64_t n0, int64_t n1, float *y, int64_t ldy, int nthreads) {
    const float *m = NULL;
    (void)aux;
    PKV_DRIVER(q80_tile, int8_t)
}

void pkv_q8_16_mm(const float *x, int64_t B, int64_t ldx, int64_t K, const int8_t *qs, const float *d,
                  const void *aux, int64_t n0, int64_t n1, float *y, int64_t ldy, int nthreads) {
    const float *m = NULL;
    (void)aux;
    PKV_DRIVER(q816_tile, int8_t)
}
