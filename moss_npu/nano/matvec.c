/* One-row products y = x · W (+ bias, + residual) with W stored compactly: bf16 or int8 values, float32
 * arithmetic. Built at first use by moss_npu/nano/matvec.py with the system C compiler (-O3 -march=native)
 * and called through ctypes; see that module for why.
 *
 * W is (in, out) row-major, `out` a multiple of 32 (the caller pads). Rows are read in blocks of 1 or 8, one
 * broadcast x[i] per row, accumulating 32 outputs at a time into y (which stays in L1): the weights are read
 * once, front to back.
 *
 * bf16 layout: in each group of 32 columns the values are interleaved [c0, c16, c1, c17, ...], so one 32-bit
 * word holds columns t (low half) and 16 + t (high half): `word << 16` is column t as a float32 and
 * `word & 0xffff0000` column 16 + t, two instructions for 32 values.
 * int8: per-column float32 scales, applied once at the end.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static void start_sums(float *y, const float *bias, long out) {
    if (bias) memcpy(y, bias, (size_t)out * sizeof(float));
    else memset(y, 0, (size_t)out * sizeof(float));
}

static void add_residual(float *y, const float *residual, long out) {
    if (residual)
        for (long j = 0; j < out; j++) y[j] += residual[j];
}

static inline float bf16_low(uint32_t word) { word <<= 16; float f; memcpy(&f, &word, 4); return f; }
static inline float bf16_high(uint32_t word) { word &= 0xffff0000u; float f; memcpy(&f, &word, 4); return f; }

/* Rows [first, last) of a bf16 matrix, portable C (the compiler vectorizes the column loop). */
static void bf16_rows_portable(const float *x, const uint32_t *words, float *y, long first, long last, long out) {
    long groups = out / 32;
    for (long i = first; i < last; i++) {
        const float xi = x[i];
        const uint32_t *row = words + i * (out / 2);
        for (long g = 0; g < groups; g++)
            for (int t = 0; t < 16; t++) {
                y[32 * g + t] += xi * bf16_low(row[16 * g + t]);
                y[32 * g + 16 + t] += xi * bf16_high(row[16 * g + t]);
            }
    }
}

static void int8_rows_portable(const float *x, const int8_t *w, float *y, long first, long last, long out) {
    for (long i = first; i < last; i++) {
        const float xi = x[i];
        const int8_t *row = w + i * out;
        for (long j = 0; j < out; j++) y[j] += xi * (float)row[j];
    }
}

#define MAX_ROWS 8

/* Rows [0, in) rounded down to a multiple of `rows` of a bf16 matrix, AVX-512; returns the rows done. */
static inline __attribute__((always_inline)) long bf16_rows_avx512(const float *x, const uint32_t *words,
                                                                   float *y, long in, long out, int rows) {
    long i = 0;
#if defined(__AVX512F__)
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (; i + rows <= in; i += rows) {
        __m512 xs[MAX_ROWS];
        const uint32_t *row[MAX_ROWS];
        for (int k = 0; k < rows; k++) {
            xs[k] = _mm512_set1_ps(x[i + k]);
            row[k] = words + (i + k) * (out / 2);
        }
        for (long j = 0; j < out; j += 32) {
            __m512 low_sum = _mm512_loadu_ps(y + j), high_sum = _mm512_loadu_ps(y + j + 16);
            for (int k = 0; k < rows; k++) {
                __m512i v = _mm512_loadu_si512((const void *)(row[k] + j / 2));
                _mm_prefetch((const char *)(row[k] + j / 2 + rows * (out / 2)), _MM_HINT_T0);
                low_sum = _mm512_fmadd_ps(xs[k], _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), low_sum);
                high_sum = _mm512_fmadd_ps(xs[k], _mm512_castsi512_ps(_mm512_and_si512(v, high)), high_sum);
            }
            _mm512_storeu_ps(y + j, low_sum);
            _mm512_storeu_ps(y + j + 16, high_sum);
        }
    }
#endif
    return i;
}

static inline __attribute__((always_inline)) long int8_rows_avx512(const float *x, const int8_t *w, float *y,
                                                                   long in, long out, int rows) {
    long i = 0;
#if defined(__AVX512F__)
    for (; i + rows <= in; i += rows) {
        __m512 xs[MAX_ROWS];
        const int8_t *row[MAX_ROWS];
        for (int k = 0; k < rows; k++) {
            xs[k] = _mm512_set1_ps(x[i + k]);
            row[k] = w + (i + k) * out;
        }
        for (long j = 0; j < out; j += 32) {
            __m512 low_sum = _mm512_loadu_ps(y + j), high_sum = _mm512_loadu_ps(y + j + 16);
            for (int k = 0; k < rows; k++) {
                __m128i low = _mm_loadu_si128((const __m128i *)(row[k] + j));
                __m128i high = _mm_loadu_si128((const __m128i *)(row[k] + j + 16));
                _mm_prefetch((const char *)(row[k] + j + rows * out), _MM_HINT_T0);
                low_sum = _mm512_fmadd_ps(xs[k], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(low)), low_sum);
                high_sum = _mm512_fmadd_ps(xs[k], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(high)), high_sum);
            }
            _mm512_storeu_ps(y + j, low_sum);
            _mm512_storeu_ps(y + j + 16, high_sum);
        }
    }
#endif
    return i;
}

static inline __attribute__((always_inline)) void matvec_bf16(const float *x, const uint16_t *w, const float *bias,
                                                              const float *residual, float *y, long in, long out,
                                                              int rows) {
    const uint32_t *words = (const uint32_t *)w;
    start_sums(y, bias, out);
    long done = bf16_rows_avx512(x, words, y, in, out, rows);
    bf16_rows_portable(x, words, y, done, in, out);
    add_residual(y, residual, out);
}

static inline __attribute__((always_inline)) void matvec_int8(const float *x, const int8_t *w, const float *scale,
                                                              const float *bias, const float *residual, float *y,
                                                              long in, long out, int rows) {
    memset(y, 0, (size_t)out * sizeof(float));
    long done = int8_rows_avx512(x, w, y, in, out, rows);
    int8_rows_portable(x, w, y, done, in, out);
    for (long j = 0; j < out; j++) y[j] = y[j] * scale[j] + (bias ? bias[j] : 0.0f);
    add_residual(y, residual, out);
}

/* One row at a time for weights read once per frame (they stream from DRAM, and one stream streams fastest:
 * 21 against 13-15 GB/s for 2-8 rows measured); 8 rows for weights read again and again (the local decoder's,
 * from cache: fewer passes over y, 48 against 33 GB/s). */
void matvec_bf16_stream(const float *x, const uint16_t *w, const float *bias, const float *residual, float *y,
                        long in, long out) {
    matvec_bf16(x, w, bias, residual, y, in, out, 1);
}

void matvec_bf16_cached(const float *x, const uint16_t *w, const float *bias, const float *residual, float *y,
                        long in, long out) {
    matvec_bf16(x, w, bias, residual, y, in, out, MAX_ROWS);
}

void matvec_int8_stream(const float *x, const int8_t *w, const float *scale, const float *bias,
                        const float *residual, float *y, long in, long out) {
    matvec_int8(x, w, scale, bias, residual, y, in, out, 1);
}

void matvec_int8_cached(const float *x, const int8_t *w, const float *scale, const float *bias,
                        const float *residual, float *y, long in, long out) {
    matvec_int8(x, w, scale, bias, residual, y, in, out, MAX_ROWS);
}
