/* One tile of a one-row product: y[0..TILE) = x · tile (+ bias, + residual), for one instruction set.
 *
 * Compiled once per target by moss_npu/native/build.py, with MOSS_TARGET naming it (avx512, avx2, neon,
 * portable) and that target's compiler flags; matvec.c picks the set the CPU runs. Every target sums each
 * column in the same order (row 0 to in - 1, one fused multiply-add per row where the target has FMA), so the
 * SIMD targets give the same bits; the portable C on a CPU without FMA rounds each product first.
 *
 * Several rows (a batch's) go through a tile together where the target has the registers: a chunk of the tile's
 * columns for a group of rows, each weight read and widened once for the whole group, so that rows cost FMAs, not
 * reads (one row alone is read-bound on every target). Each column of each row is summed in the same order as one
 * row alone, so a row gets the same bits in a group.
 *
 * The tile layouts (matvec.py): float32 and int8 tiles are `in` rows of TILE values; a bf16 tile row is TILE / 2
 * 32-bit words in groups of 16, word t of a group holding columns t (low half) and 16 + t (high half) of that
 * group's 32 columns on a little-endian CPU.
 */
#include <stdint.h>
#include <string.h>

#include "matvec.h"

#if defined(MOSS_AVX512) || defined(MOSS_AVX2)
#include <immintrin.h>
#elif defined(MOSS_NEON)
#include <arm_neon.h>
#endif

#define JOIN(a, b) a##_##b
#define NAMED(a, b) JOIN(a, b)
#define NAME(base) NAMED(base, MOSS_TARGET)

/* The tile's columns: the sums plus bias and residual (either may be NULL). */
static void add_finish(float *y, const float *bias, const float *residual) {
    for (int c = 0; c < TILE; c++) y[c] += (bias ? bias[c] : 0.0f) + (residual ? residual[c] : 0.0f);
}

static void int8_finish(float *y, const float *scale, const float *bias, const float *residual) {
    for (int c = 0; c < TILE; c++)
        y[c] = y[c] * scale[c] + (bias ? bias[c] : 0.0f) + (residual ? residual[c] : 0.0f);
}

#if defined(MOSS_AVX512)
/* 4 registers of 16 sums: a whole tile, so that the sums stay in registers. */
static void f32_sums(const float *x, const float *tile, float *sums, long in) {
    __m512 acc[TILE / 16];
    for (int a = 0; a < TILE / 16; a++) acc[a] = _mm512_setzero_ps();
    for (long i = 0; i < in; i++) {
        const __m512 xi = _mm512_set1_ps(x[i]);
        const float *row = tile + i * TILE;
        for (int a = 0; a < TILE / 16; a++) acc[a] = _mm512_fmadd_ps(xi, _mm512_loadu_ps(row + 16 * a), acc[a]);
    }
    for (int a = 0; a < TILE / 16; a++) _mm512_storeu_ps(sums + 16 * a, acc[a]);
}

/* `word << 16` is column t as a float32 and `word & 0xffff0000` column 16 + t: two instructions for 32 values. */
static void bf16_sums(const float *x, const uint32_t *tile, float *sums, long in) {
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
}

static void int8_sums(const float *x, const int8_t *tile, float *sums, long in) {
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
}



/* Row groups: up to 4 rows over a whole tile row (256 bytes of float32), 16 sums in registers. A block's rows are
 * then read front to back, which the hardware prefetcher follows; 8 rows over half rows read each block in two
 * strided passes and took ~10 % longer from memory at 2-8 rows. */
#define GROUP 4
#define CHUNK 64
#define VECTORS 4
typedef __m512 Vector;
static inline Vector zero(void) { return _mm512_setzero_ps(); }
static inline Vector broadcast(float v) { return _mm512_set1_ps(v); }
static inline Vector multiply_add(Vector a, Vector b, Vector acc) { return _mm512_fmadd_ps(a, b, acc); }
static inline void store(float *y, Vector v) { _mm512_storeu_ps(y, v); }
static inline Vector load(const float *y) { return _mm512_loadu_ps(y); }

/* Where chunk k of tile row i starts: CHUNK values of the row. */
static inline const char *chunk_at(int format, const void *tile, long i, long k) {
    return (const char *)tile + (i * TILE + CHUNK * k) * value_bytes(format);
}

/* A chunk as VECTORS vectors of float32: columns CHUNK·k + 16v. */
static inline void widen(int format, const char *chunk, Vector w[VECTORS]) {
    for (int h = 0; h < VECTORS / 2; h++) {
        if (format == F32) {
            w[2 * h] = _mm512_loadu_ps((const float *)chunk + 32 * h);
            w[2 * h + 1] = _mm512_loadu_ps((const float *)chunk + 32 * h + 16);
        } else if (format == BF16) {
            const __m512i v = _mm512_loadu_si512((const void *)(chunk + 64 * h));
            w[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            w[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
        } else {
            const __m128i *bytes = (const __m128i *)(chunk + 32 * h);
            w[2 * h] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
            w[2 * h + 1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes + 1)));
        }
    }
}

static inline long column(int format, long k, int v) {
    (void)format;
    return CHUNK * k + 16 * v;
}


#elif defined(MOSS_AVX2)
/* 8 registers of 8 sums: a whole tile. */
static void f32_sums(const float *x, const float *tile, float *sums, long in) {
    __m256 acc[TILE / 8];
    for (int a = 0; a < TILE / 8; a++) acc[a] = _mm256_setzero_ps();
    for (long i = 0; i < in; i++) {
        const __m256 xi = _mm256_set1_ps(x[i]);
        const float *row = tile + i * TILE;
        for (int a = 0; a < TILE / 8; a++) acc[a] = _mm256_fmadd_ps(xi, _mm256_loadu_ps(row + 8 * a), acc[a]);
    }
    for (int a = 0; a < TILE / 8; a++) _mm256_storeu_ps(sums + 8 * a, acc[a]);
}

/* A group's 16 words in two loads: the low halves are columns 0-7 and 8-15, the high halves 16-23 and 24-31. */
static void bf16_sums(const float *x, const uint32_t *tile, float *sums, long in) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[TILE / 8];  /* group g: acc[4g] columns 0-7, [4g+1] 8-15, [4g+2] 16-23, [4g+3] 24-31 */
    for (int a = 0; a < TILE / 8; a++) acc[a] = _mm256_setzero_ps();
    for (long i = 0; i < in; i++) {
        const __m256 xi = _mm256_set1_ps(x[i]);
        const uint32_t *row = tile + i * (TILE / 2);
        for (int g = 0; g < TILE / 32; g++)
            for (int h = 0; h < 2; h++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(row + 16 * g + 8 * h));
                acc[4 * g + h] = _mm256_fmadd_ps(xi, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), acc[4 * g + h]);
                acc[4 * g + 2 + h] = _mm256_fmadd_ps(xi, _mm256_castsi256_ps(_mm256_and_si256(v, high)),
                                                     acc[4 * g + 2 + h]);
            }
    }
    for (int a = 0; a < TILE / 8; a++) _mm256_storeu_ps(sums + 8 * a, acc[a]);
}

static void int8_sums(const float *x, const int8_t *tile, float *sums, long in) {
    __m256 acc[TILE / 8];
    for (int a = 0; a < TILE / 8; a++) acc[a] = _mm256_setzero_ps();
    for (long i = 0; i < in; i++) {
        const __m256 xi = _mm256_set1_ps(x[i]);
        const int8_t *row = tile + i * TILE;
        for (int a = 0; a < TILE / 8; a++) {
            __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + 8 * a)));
            acc[a] = _mm256_fmadd_ps(xi, _mm256_cvtepi32_ps(v), acc[a]);
        }
    }
    for (int a = 0; a < TILE / 8; a++) _mm256_storeu_ps(sums + 8 * a, acc[a]);
}


/* Row groups: up to 6 rows over a chunk of 16 columns, 12 sums in registers (of 16). */
#define GROUP 6
#define CHUNK 16
#define VECTORS 2
typedef __m256 Vector;
static inline Vector zero(void) { return _mm256_setzero_ps(); }
static inline Vector broadcast(float v) { return _mm256_set1_ps(v); }
static inline Vector multiply_add(Vector a, Vector b, Vector acc) { return _mm256_fmadd_ps(a, b, acc); }
static inline void store(float *y, Vector v) { _mm256_storeu_ps(y, v); }
static inline Vector load(const float *y) { return _mm256_loadu_ps(y); }

/* Where chunk k of tile row i starts: CHUNK values of the row; for bf16 8 words of a group, whose low halves are one
 * vector of columns and the high halves another (column()). */
static inline const char *chunk_at(int format, const void *tile, long i, long k) {
    if (format == BF16) return (const char *)((const uint32_t *)tile + i * (TILE / 2) + 16 * (k / 2) + 8 * (k % 2));
    return (const char *)tile + (i * TILE + CHUNK * k) * value_bytes(format);
}

/* A chunk as two vectors of float32, starting at column(format, k, v). */
static inline void widen(int format, const char *chunk, Vector w[2]) {
    if (format == F32) {
        w[0] = _mm256_loadu_ps((const float *)chunk), w[1] = _mm256_loadu_ps((const float *)chunk + 8);
    } else if (format == BF16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)chunk);
        w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        w[1] = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)chunk)));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(chunk + 8))));
    }
}

static inline long column(int format, long k, int v) {
    return format == BF16 ? 32 * (k / 2) + 8 * (k % 2) + 16 * v : CHUNK * k + 8 * v;
}


#elif defined(MOSS_NEON)
/* 16 of the 32 registers of 4 sums: a whole tile. */
static void f32_sums(const float *x, const float *tile, float *sums, long in) {
    float32x4_t acc[TILE / 4];
    for (int a = 0; a < TILE / 4; a++) acc[a] = vdupq_n_f32(0.0f);
    for (long i = 0; i < in; i++) {
        const float32x4_t xi = vdupq_n_f32(x[i]);
        const float *row = tile + i * TILE;
        for (int a = 0; a < TILE / 4; a++) acc[a] = vfmaq_f32(acc[a], xi, vld1q_f32(row + 4 * a));
    }
    for (int a = 0; a < TILE / 4; a++) vst1q_f32(sums + 4 * a, acc[a]);
}

/* bf16 widened in registers: a group's 16 words in four loads; word << 16 and word & 0xffff0000 as on x86. */
static void bf16_sums(const float *x, const uint32_t *tile, float *sums, long in) {
    const uint32x4_t high = vdupq_n_u32(0xffff0000u);
    float32x4_t acc[TILE / 4];  /* group g: acc[8g + q] columns 4q.. of its low halves, [8g + 4 + q] high */
    for (int a = 0; a < TILE / 4; a++) acc[a] = vdupq_n_f32(0.0f);
    for (long i = 0; i < in; i++) {
        const float32x4_t xi = vdupq_n_f32(x[i]);
        const uint32_t *row = tile + i * (TILE / 2);
        for (int g = 0; g < TILE / 32; g++)
            for (int q = 0; q < 4; q++) {
                uint32x4_t v = vld1q_u32(row + 16 * g + 4 * q);
                acc[8 * g + q] = vfmaq_f32(acc[8 * g + q], xi, vreinterpretq_f32_u32(vshlq_n_u32(v, 16)));
                acc[8 * g + 4 + q] = vfmaq_f32(acc[8 * g + 4 + q], xi, vreinterpretq_f32_u32(vandq_u32(v, high)));
            }
    }
    for (int a = 0; a < TILE / 4; a++) vst1q_f32(sums + 4 * a, acc[a]);
}

static void int8_sums(const float *x, const int8_t *tile, float *sums, long in) {
    float32x4_t acc[TILE / 4];
    for (int a = 0; a < TILE / 4; a++) acc[a] = vdupq_n_f32(0.0f);
    for (long i = 0; i < in; i++) {
        const float32x4_t xi = vdupq_n_f32(x[i]);
        const int8_t *row = tile + i * TILE;
        for (int b = 0; b < TILE / 16; b++) {
            int8x16_t v = vld1q_s8(row + 16 * b);
            int16x8_t low = vmovl_s8(vget_low_s8(v)), high = vmovl_s8(vget_high_s8(v));
            const int16x4_t parts[4] = {vget_low_s16(low), vget_high_s16(low), vget_low_s16(high),
                                        vget_high_s16(high)};
            for (int q = 0; q < 4; q++)
                acc[4 * b + q] = vfmaq_f32(acc[4 * b + q], xi, vcvtq_f32_s32(vmovl_s16(parts[q])));
        }
    }
    for (int a = 0; a < TILE / 4; a++) vst1q_f32(sums + 4 * a, acc[a]);
}

#else
static inline float bf16_value(uint16_t bits) {
    uint32_t word = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &word, 4);
    return f;
}

static void f32_sums(const float *x, const float *tile, float *sums, long in) {
    memset(sums, 0, TILE * sizeof(float));
    for (long i = 0; i < in; i++) {
        const float xi = x[i];
        const float *row = tile + i * TILE;
        for (int j = 0; j < TILE; j++) sums[j] += xi * row[j];
    }
}

/* Value by value, not word by word: which half of a word is column t depends on the byte order. */
static void bf16_sums(const float *x, const uint32_t *tile, float *sums, long in) {
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
}

static void int8_sums(const float *x, const int8_t *tile, float *sums, long in) {
    memset(sums, 0, TILE * sizeof(float));
    for (long i = 0; i < in; i++) {
        const float xi = x[i];
        const int8_t *row = tile + i * TILE;
        for (int j = 0; j < TILE; j++) sums[j] += xi * (float)row[j];
    }
}
#endif

/* One row through the tile: its sums (TILE,). */
static void row_sums(int format, const float *x, const void *tile, float *sums, long in) {
    if (format == F32)
        f32_sums(x, (const float *)tile, sums, in);
    else if (format == BF16)
        bf16_sums(x, (const uint32_t *)tile, sums, in);
    else
        int8_sums(x, (const int8_t *)tile, sums, in);
}

#if defined(GROUP)
/* Tile rows a group takes chunk by chunk before the next ones: few enough to stay in L1 for all chunks, so the
 * tile is read front to back once (chunk by chunk over the whole tile, each pass strided, read far slower). */
#define BLOCK 64

/* `rows` (2 .. GROUP, a constant where inlined) rows through tile rows [start, end), chunk by chunk: every weight
 * is read and widened once for the group. Each column's sum is the one-row order (row 0 to in - 1, one FMA each),
 * held in y between blocks (a float32 stored and loaded is the same float32). */
static inline __attribute__((always_inline)) void group_sums(int format, int rows, const float *x, long x_stride,
                                                             const void *tile, float *y, long y_stride, long start,
                                                             long end, long in) {
    for (long k = 0; k < TILE / CHUNK; k++) {
        Vector acc[GROUP][VECTORS];
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < VECTORS; v++)
                acc[r][v] = start == 0 ? zero() : load(y + r * y_stride + column(format, k, v));
        for (long i = start; i < end; i++) {
            Vector w[VECTORS];
            widen(format, chunk_at(format, tile, i, k), w);
            /* this chunk of the next block's row: strided reads defeat the hardware's prefetch */
            if (i + BLOCK < in) {
                const char *ahead = chunk_at(format, tile, i + BLOCK, k);
                for (long b = 0; b < CHUNK * value_bytes(format); b += 64) __builtin_prefetch(ahead + b);
            }
            for (int r = 0; r < rows; r++) {
                const Vector xi = broadcast(x[r * x_stride + i]);
                for (int v = 0; v < VECTORS; v++) acc[r][v] = multiply_add(xi, w[v], acc[r][v]);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < VECTORS; v++) store(y + r * y_stride + column(format, k, v), acc[r][v]);
    }
}

#define GROUP_OF(n) \
    case n:         \
        group_sums(format, n, x, x_stride, tile, y, y_stride, start, end, in); \
        return;

static void grouped(int format, long rows, const float *x, long x_stride, const void *tile, float *y,
                    long y_stride, long start, long end, long in) {
    switch (rows) {
        GROUP_OF(2) GROUP_OF(3) GROUP_OF(4)
#if GROUP == 6
        GROUP_OF(5) GROUP_OF(6)
#endif
    }
}
#endif

#if defined(GROUP)
/* Rows whose sums a call keeps on its own stack while the blocks go by, then copies to y once: y's rows need not be
 * 64-byte aligned, so the edges of neighbouring tiles, filled by other threads, share cache lines, and a group's
 * sums stored and loaded there between blocks bounced those lines between cores (four local products for 8 rows
 * took longer on 2 threads than on 1). */
#define SUMS_ROWS 32
#endif

/* `rows` rows of x (x_stride apart) through the tile into y (y_stride apart): where the target has groups, block
 * by block, each block in L1 for every group of about equal size; one by one elsewhere. */
static void rows_sums(int format, const float *x, long x_stride, long rows, const void *tile, float *y,
                      long y_stride, long in) {
#if defined(GROUP)
    float sums[SUMS_ROWS * TILE];
    for (long first = 0; first < rows && rows > 1; first += SUMS_ROWS) {
        const long count = rows - first < SUMS_ROWS ? rows - first : SUMS_ROWS;
        const float *part = x + first * x_stride;
        if (count == 1) {
            row_sums(format, part, tile, sums, in);
        } else {
            for (long start = 0; start < in; start += BLOCK) {
                const long end = start + BLOCK < in ? start + BLOCK : in;
                for (long r = 0, n = 0; r < count; r += n) {
                    const long left = count - r, groups = (left + GROUP - 1) / GROUP;
                    n = (left + groups - 1) / groups;
                    grouped(format, n, part + r * x_stride, x_stride, tile, sums + r * TILE, TILE, start, end, in);
                }
            }
        }
        for (long r = 0; r < count; r++) memcpy(y + (first + r) * y_stride, sums + r * TILE, sizeof(float) * TILE);
    }
    if (rows > 1) return;
#endif
    for (long r = 0; r < rows; r++) row_sums(format, x + r * x_stride, tile, y + r * y_stride, in);
}

void NAME(moss_tile_f32)(const float *x, long x_stride, long rows, const void *tile, float *y, long y_stride,
                         const float *scale, const float *bias, const float *residual, long in) {
    (void)scale;
    rows_sums(F32, x, x_stride, rows, tile, y, y_stride, in);
    for (long r = 0; r < rows; r++) add_finish(y + r * y_stride, bias, residual ? residual + r * y_stride : NULL);
}

void NAME(moss_tile_bf16)(const float *x, long x_stride, long rows, const void *tile, float *y, long y_stride,
                          const float *scale, const float *bias, const float *residual, long in) {
    (void)scale;
    rows_sums(BF16, x, x_stride, rows, tile, y, y_stride, in);
    for (long r = 0; r < rows; r++) add_finish(y + r * y_stride, bias, residual ? residual + r * y_stride : NULL);
}

void NAME(moss_tile_int8)(const float *x, long x_stride, long rows, const void *tile, float *y, long y_stride,
                          const float *scale, const float *bias, const float *residual, long in) {
    rows_sums(INT8, x, x_stride, rows, tile, y, y_stride, in);
    for (long r = 0; r < rows; r++)
        int8_finish(y + r * y_stride, scale, bias, residual ? residual + r * y_stride : NULL);
}
