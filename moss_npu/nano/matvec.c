/* One-row products y = x · W (+ bias, + residual) with W stored compactly: bf16 or int8 values, float32
 * arithmetic. Built at first use by moss_npu/nano/matvec.py with the system C compiler (-O3 -march=native)
 * and called through ctypes; see that module for why.
 *
 * W (in, out) is stored in tiles of TILE output columns (the caller pads `out` to a multiple): tile after tile,
 * and in each tile row after row, so the weights are read once, front to back, in one stream. A tile's TILE
 * sums stay in registers for all `in` rows; y is written once.
 *
 * bf16 layout inside a tile row: groups of 32 columns interleaved [c0, c16, c1, c17, ...], so one 32-bit word
 * holds columns t (low half) and 16 + t (high half) on a little-endian CPU: `word << 16` is column t as a
 * float32 and `word & 0xffff0000` column 16 + t, two instructions for 32 values (AVX-512).
 * int8: per-column float32 scales, applied once at the end.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define TILE 256

static inline float bf16_value(uint16_t bits) {
    uint32_t word = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &word, 4);
    return f;
}

/* sums[0..TILE) = Σ_i x[i] · tile[i] for one bf16 tile (in rows of TILE / 2 words). */
static void bf16_tile(const float *x, const uint32_t *tile, float *sums, long in) {
#if defined(__AVX512F__)
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[TILE / 16];
    for (int a = 0; a < TILE / 16; a++) acc[a] = _mm512_setzero_ps();
    for (long i = 0; i < in; i++) {
        const __m512 xi = _mm512_set1_ps(x[i]);
        const uint32_t *row = tile + i * (TILE / 2);
        for (int g = 0; g < TILE / 32; g++) {
            __m512i v = _mm512_loadu_si512((const void *)(row + 16 * g));
            acc[2 * g] = _mm512_fmadd_ps(xi, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), acc[2 * g]);
            acc[2 * g + 1] = _mm512_fmadd_ps(xi, _mm512_castsi512_ps(_mm512_and_si512(v, high)), acc[2 * g + 1]);
        }
    }
    for (int a = 0; a < TILE / 16; a++) _mm512_storeu_ps(sums + 16 * a, acc[a]);
#else
    /* Value by value, not word by word: which half of a word is column t depends on the byte order. */
    memset(sums, 0, TILE * sizeof(float));
    for (long i = 0; i < in; i++) {
        const float xi = x[i];
        const uint16_t *row = (const uint16_t *)tile + i * TILE;
        for (int g = 0; g < TILE / 32; g++)
            for (int t = 0; t < 16; t++) {
                sums[32 * g + t] += xi * bf16_value(row[32 * g + 2 * t]);
                sums[32 * g + 16 + t] += xi * bf16_value(row[32 * g + 2 * t + 1]);
            }
    }
#endif
}

/* sums[0..TILE) = Σ_i x[i] · tile[i] for one int8 tile (in rows of TILE values). */
static void int8_tile(const float *x, const int8_t *tile, float *sums, long in) {
#if defined(__AVX512F__)
    __m512 acc[TILE / 16];
    for (int a = 0; a < TILE / 16; a++) acc[a] = _mm512_setzero_ps();
    for (long i = 0; i < in; i++) {
        const __m512 xi = _mm512_set1_ps(x[i]);
        const int8_t *row = tile + i * TILE;
        for (int a = 0; a < TILE / 16; a++) {
            __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * a)));
            acc[a] = _mm512_fmadd_ps(xi, _mm512_cvtepi32_ps(v), acc[a]);
        }
    }
    for (int a = 0; a < TILE / 16; a++) _mm512_storeu_ps(sums + 16 * a, acc[a]);
#else
    memset(sums, 0, TILE * sizeof(float));
    for (long i = 0; i < in; i++) {
        const float xi = x[i];
        const int8_t *row = tile + i * TILE;
        for (int j = 0; j < TILE; j++) sums[j] += xi * (float)row[j];
    }
#endif
}

/* sums[0..TILE) = Σ_i x[i] · tile[i] for one float32 tile (in rows of TILE values). */
static void f32_tile(const float *x, const float *tile, float *sums, long in) {
#if defined(__AVX512F__)
    __m512 acc[TILE / 16];
    for (int a = 0; a < TILE / 16; a++) acc[a] = _mm512_setzero_ps();
    for (long i = 0; i < in; i++) {
        const __m512 xi = _mm512_set1_ps(x[i]);
        const float *row = tile + i * TILE;
        for (int a = 0; a < TILE / 16; a++) acc[a] = _mm512_fmadd_ps(xi, _mm512_loadu_ps(row + 16 * a), acc[a]);
    }
    for (int a = 0; a < TILE / 16; a++) _mm512_storeu_ps(sums + 16 * a, acc[a]);
#else
    memset(sums, 0, TILE * sizeof(float));
    for (long i = 0; i < in; i++) {
        const float xi = x[i];
        const float *row = tile + i * TILE;
        for (int j = 0; j < TILE; j++) sums[j] += xi * row[j];
    }
#endif
}

/* Columns [first, first + TILE) of y: the tile's sums plus bias and residual (either may be NULL). */
static void add_finish(float *y, const float *bias, const float *residual, long first) {
    for (long c = first; c < first + TILE; c++) y[c] += (bias ? bias[c] : 0.0f) + (residual ? residual[c] : 0.0f);
}

/* y = x · W + bias (+ residual), W in float32 tiles; `out` a multiple of TILE; bias and residual may be NULL. */
void matvec_f32(const float *x, const float *w, const float *bias, const float *residual, float *y, long in,
                long out) {
    for (long j = 0; j < out; j += TILE) {
        f32_tile(x, w + j * in, y + j, in);
        add_finish(y, bias, residual, j);
    }
}

/* y = x · W + bias (+ residual), W in bf16 tiles; `out` a multiple of TILE; bias and residual may be NULL. */
void matvec_bf16(const float *x, const uint16_t *w, const float *bias, const float *residual, float *y,
                 long in, long out) {
    const uint32_t *words = (const uint32_t *)w;
    for (long j = 0; j < out; j += TILE) {
        bf16_tile(x, words + j / 2 * in, y + j, in);
        add_finish(y, bias, residual, j);
    }
}

static void int8_finish(float *y, const float *scale, const float *bias, const float *residual, long first) {
    for (long c = first; c < first + TILE; c++)
        y[c] = y[c] * scale[c] + (bias ? bias[c] : 0.0f) + (residual ? residual[c] : 0.0f);
}

/* y = (x · W) · scale + bias (+ residual), W in int8 tiles; as matvec_bf16 otherwise. */
void matvec_int8(const float *x, const int8_t *w, const float *scale, const float *bias, const float *residual,
                 float *y, long in, long out) {
    for (long j = 0; j < out; j += TILE) {
        int8_tile(x, w + j * in, y + j, in);
        int8_finish(y, scale, bias, residual, j);
    }
}

/* matvec_int8 for n rows (x n × in, y and residual n × out): tile by tile, each tile for every row while it is
 * in cache. Every row's sums are those matvec_int8 makes for it alone, bit for bit (the same tile function). */
void matvec_int8_rows(const float *x, const int8_t *w, const float *scale, const float *bias,
                      const float *residual, float *y, long n, long in, long out) {
    for (long j = 0; j < out; j += TILE)
        for (long r = 0; r < n; r++) {
            int8_tile(x + r * in, w + j * in, y + r * out + j, in);
            int8_finish(y + r * out, scale, bias, residual ? residual + r * out : NULL, j);
        }
}
