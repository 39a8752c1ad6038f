/* What fused_block.c (one block on new rows) and local_loop.c (a frame's audio channels) share: a block's
 * description, as moss_npu/cpu/fused_block.py mirrors it, and the block call. */
#ifndef MOSS_FUSED_BLOCK_H
#define MOSS_FUSED_BLOCK_H

#include "matvec.h"

typedef struct {
    const void *w;               /* the weight's tiles (matvec.c) */
    const float *scale, *bias;  /* per padded column: scale (int8 only), bias */
    long in, columns;           /* `columns`: the outputs padded to a multiple of TILE */
} Product;

typedef struct {
    int target, format;         /* the tiles' instruction set and format (matvec.c) */
    long embed, heads, inner;   /* E, H, F */
    float eps, scale;           /* layer norm epsilon, attention scale */
    const float *ln1_w, *ln1_b, *ln2_w, *ln2_b;
    Product attn, proj, fc_in, fc_out;
    const float *final_w, *final_b;  /* the decoder's final norm, on its last block's output; NULL otherwise */
} Block;

/* Floats of scratch one row attending `attended` rows needs (n rows: n times as many). */
long moss_row_block_scratch(const Block *b, long attended);

/* Where n new rows go: row r's key and value at positions[r · stride] of its cache, attending its first
 * attended[r · stride] rows, rotated by rotation + r · stride · D (D / 2 pairs cos, sin); stride 0: every row
 * alike (a frame's local rows), 1: a row each (slots at their own lengths). */
typedef struct {
    const long *positions, *attended;
    const float *rotation;
    long stride;
} Places;

int moss_block_rows(void *pool, const Block *b, long n, float *x, const Places *at, float *keys, float *values,
                    long cache_stride, long rows, const float *qkv, float *scratch);

#endif
