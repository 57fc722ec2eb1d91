/* Matrix products with GGUF-quantized weights and float32 activations (pagedkv.engine.qmatmul).
 *
 *   y[b, n] = sum_k w[n, k] * x[b, k]        b < B (a few rows), n in [n0, n1), k < K (a multiple of 32)
 *
 * The weight w[n, k] is rebuilt in float32 exactly as gguf-py's dequantize() builds it, so the product is the one
 * of the dequantized float32 matrix, up to float32 summation order (which any GEMM chooses freely):
 *
 *   Q4_1  w = d * q + m     q in 0..15, two roundings: (d * q) first, then + m   (compiled with -ffp-contract=off)
 *   Q8_0  w = d * q         q in -128..127, one rounding
 *
 * Layouts (one group = 32 consecutive k of one row n; G = K / 32 groups per row):
 *   Q4_1  qs: uint8 (N, G, 16), byte j of a group holds q[j] (low nibble) and q[j + 16] (high nibble);
 *         d, m: float32 (N, G) (the file's float16 scales, widened exactly)
 *   Q8_0  qs: int8 (N, G, 32); d: float32 (N, G)
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

/* rows [0, nb) of x (nb <= PKV_RB) against one weight row of G groups; out[b] = dot */
static inline void q41_row(const float *x, int64_t ldx, int nb, int64_t G, const uint8_t *qs, const float *d,
                           const float *m, float *out) {
    __m512 a0[PKV_RB], a1[PKV_RB];
    for (int b = 0; b < PKV_RB; b++) a0[b] = a1[b] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < G; g++) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * g)));
        __m512 D = _mm512_set1_ps(d[g]), M = _mm512_set1_ps(m[g]);
        __m512 w0 = _mm512_add_ps(_mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_and_si512(v, low))), M);
        __m512 w1 = _mm512_add_ps(_mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))), M);
        const float *xg = x + 32 * g;
        for (int b = 0; b < nb; b++) {
            a0[b] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg + b * ldx), a0[b]);
            a1[b] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + b * ldx + 16), a1[b]);
        }
    }
    for (int b = 0; b < nb; b++) out[b] = hsum(_mm512_add_ps(a0[b], a1[b]));
}

static inline void q80_row(const float *x, int64_t ldx, int nb, int64_t G, const int8_t *qs, const float *d,
                           float *out) {
    __m512 a0[PKV_RB], a1[PKV_RB];
    for (int b = 0; b < PKV_RB; b++) a0[b] = a1[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 D = _mm512_set1_ps(d[g]);
        __m512 w0 = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(qs + 32 * g)))));
        __m512 w1 = _mm512_mul_ps(D, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(qs + 32 * g + 16)))));
        const float *xg = x + 32 * g;
        for (int b = 0; b < nb; b++) {
            a0[b] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg + b * ldx), a0[b]);
            a1[b] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + b * ldx + 16), a1[b]);
        }
    }
    for (int b = 0; b < nb; b++) out[b] = hsum(_mm512_add_ps(a0[b], a1[b]));
}

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
#endif

/* ------------------------------------------------------------------------------------------------ entry points */

static int pick_threads(int nthreads, int64_t rows) {
    int nt = nthreads < 1 ? 1 : nthreads;
    int64_t most = rows / 64; /* at least 64 weight rows per thread */
    if (most < 1) most = 1;
    return nt > most ? (int)most : nt;
}

void pkv_q4_1_mm(const float *x, int64_t B, int64_t ldx, int64_t K, const uint8_t *qs, const float *d,
                 const float *m, int64_t n0, int64_t n1, float *y, int64_t ldy, int nthreads) {
    const int64_t G = K / 32;
    const int nt = pick_threads(nthreads, n1 - n0);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t n = n0; n < n1; n++) {
        float out[PKV_RB];
        for (int64_t b0 = 0; b0 < B; b0 += PKV_RB) {
            int nb = (int)(B - b0 < PKV_RB ? B - b0 : PKV_RB);
            q41_row(x + b0 * ldx, ldx, nb, G, qs + n * 16 * G, d + n * G, m + n * G, out);
            for (int b = 0; b < nb; b++) y[(b0 + b) * ldy + n] = out[b];
        }
    }
}

void pkv_q8_0_mm(const float *x, int64_t B, int64_t ldx, int64_t K, const int8_t *qs, const float *d, int64_t n0,
                 int64_t n1, float *y, int64_t ldy, int nthreads) {
    const int64_t G = K / 32;
    const int nt = pick_threads(nthreads, n1 - n0);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t n = n0; n < n1; n++) {
        float out[PKV_RB];
        for (int64_t b0 = 0; b0 < B; b0 += PKV_RB) {
            int nb = (int)(B - b0 < PKV_RB ? B - b0 : PKV_RB);
            q80_row(x + b0 * ldx, ldx, nb, G, qs + n * 32 * G, d + n * G, out);
            for (int b = 0; b < nb; b++) y[(b0 + b) * ldy + n] = out[b];
        }
    }
}
