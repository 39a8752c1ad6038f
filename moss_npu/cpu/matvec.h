/* What matvec.c and the per-target tiles (matvec_tiles.c) share. */
#ifndef MOSS_MATVEC_H
#define MOSS_MATVEC_H

#define TILE 256 /* output columns per tile: matrices are padded to a multiple */

/* One tile of a product: y[0..TILE) = x · tile, then finished with the tile's columns of scale (int8 only),
 * bias and residual (either may be NULL). */
typedef void (*TileFunction)(const float *x, const void *tile, float *y, const float *scale, const float *bias,
                             const float *residual, long in);

#endif
