/* A frame's audio channels for n slots in one call: the part of nano/decoder.py's _audio that ran ~16 times a
 * frame in Python between kernel calls. For channel c = 0 .. channels - 1, every row:
 *
 *   the local decoder's blocks on the row's input at local position start + c (the first block's qkv ready-made:
 *   the text decision's row for c = 0, then the table row of channel c - 1's code), its final norm on the last;
 *   channel c's head (its tiles: the logits); their float sum (finite or not: the decoder's check);
 *   the code: the repetition penalty on the ids the channel has produced, then greedy argmax (first on ties) or
 *   sampling.py's filters (temperature, top-k with ties at the k-th value kept, top-p keeping the crossing token,
 *   softmax) and a pick: the official sampler's (sample_token: torch.multinomial's, the first largest p / q over
 *   the Exp(1) variates q that torch drew for the row) or the noise-fed one's (sample_with_noise: the inverse-CDF
 *   pick of the row's uniform over ids in order);
 *   the next input: embedding c's row of the code, added to the next global row's embedding where c < nq.
 *
 * The blocks and heads are the one-slot step's (moss_block_rows, moss_product over n rows), so a row gets the bits it
 * gets alone. The sampler's exponentials and sums differ from torch's vectorized ones in the last bits: a sampled
 * code can differ from torch's only where two ids' p / q, or the uniform and a CDF boundary, or the mass and top_p
 * lie within float rounding of each other.
 * Shapes: n rows, E hidden, H heads, D head dim, M local cache rows (Q + 1), V_c channel c's codebook.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fused_block.h"

typedef struct {
    const Block *blocks;             /* the local decoder's blocks, its final norm on the last */
    long layers;
    int head_format;                 /* the heads' tiles' format (an int8 model's heads are float32) */
    const Product *heads;            /* Q heads, without bias columns beyond V_c */
    const long *vocab;               /* Q codebook sizes V_c */
    const float *const *embeddings;  /* Q tables (V_c, E) */
    const float *const *qkv;         /* Q - 1 tables (V_c, 3E): the first block's c_attn(ln_1(.)) of embedding c */
    long channels;                   /* Q */
} LocalLoop;

typedef struct {
    const uint8_t *do_sample;                    /* (n) bool */
    const float *temperature, *top_p, *penalty;  /* (n) */
    const int64_t *top_k;                        /* (n), 0: off */
    const float *noise;                          /* (n, noise_width): channel c's uniform at column c + 1 */
    long noise_width;
    const float *exponential;                    /* NULL, or (n, Q, width): channel c's Exp(1) variates */
    long exponential_width;
} Sampling;

typedef struct {
    float score;
    int32_t id;
} Candidate;

/* Up to this top-k the k largest scores are found by insertion (one pass, most scores below the smallest kept);
 * above it by sorting every score. */
#define INSERTED_K 64

static long padded(long n) { return (n + TILE - 1) / TILE * TILE; }

static long largest_vocab(const LocalLoop *loop) {
    long v = 1;
    for (long c = 0; c < loop->channels; c++) v = loop->vocab[c] > v ? loop->vocab[c] : v;
    return v;
}

/* Floats of scratch a call for n rows attending at most `attended` local rows needs. */
long moss_local_audio_scratch(const LocalLoop *loop, long n, long attended) {
    const long e = loop->blocks[0].embed, v = largest_vocab(loop);
    return n * (e + 3 * e + padded(v) + moss_row_block_scratch(&loop->blocks[0], attended)) + 4 * v;
}

/* torch.sort(descending=True, stable=True): higher scores first, equal scores by id. */
static int descending(const void *a, const void *b) {
    const Candidate *x = a, *y = b;
    if (x->score > y->score) return -1;
    if (x->score < y->score) return 1;
    return (x->id > y->id) - (x->id < y->id);
}

static int by_id(const void *a, const void *b) {
    const Candidate *x = a, *y = b;
    return (x->id > y->id) - (x->id < y->id);
}

/* The score the top-k filter keeps down to: the k-th in descending order (the smallest where k is off). */
static float kth_score(const float *scores, long v, long k, Candidate *all) {
    float threshold = scores[0];
    if (k >= v) {
        for (long i = 1; i < v; i++) threshold = scores[i] < threshold ? scores[i] : threshold;
        return threshold;
    }
    if (k <= INSERTED_K) {
        long count = 0;
        for (long i = 0; i < v; i++) {
            const float s = scores[i];
            if (count == k && !(s > all[k - 1].score)) continue;
            long at = count < k ? count++ : k - 1;
            for (; at > 0 && all[at - 1].score < s; at--) all[at] = all[at - 1];
            all[at] = (Candidate){s, (int32_t)i};
        }
        return all[k - 1].score;
    }
    for (long i = 0; i < v; i++) all[i] = (Candidate){scores[i], (int32_t)i};
    qsort(all, (size_t)v, sizeof(Candidate), descending);
    return all[k - 1].score;
}

/* The official filters on one row of penalized scores (V,): temperature, top-k (ties at the k-th value kept), top-p
 * (the crossing token kept). Leaves the kept ids in `kept` [0, m), highest score first (equal scores by id), with
 * weights[j] = exp(score_j - the top score), their sum in *total; returns m (0: every score NaN). */
static long filter(float *scores, long v, float temperature, int64_t top_k, float top_p, Candidate *kept,
                   float *weights, double *total) {
    for (long i = 0; i < v; i++) scores[i] = scores[i] / temperature;
    const long k = top_k > 0 && top_k < v ? (long)top_k : v;
    const float threshold = kth_score(scores, v, k, kept);
    long m = 0;
    for (long i = 0; i < v; i++)
        if (scores[i] >= threshold) kept[m++] = (Candidate){scores[i], (int32_t)i};
    if (m == 0) return 0;
    qsort(kept, (size_t)m, sizeof(Candidate), descending);
    const float top = kept[0].score;
    *total = 0.0;
    for (long j = 0; j < m; j++) *total += weights[j] = expf(kept[j].score - top);
    if (top_p < 1.0f) {  /* the smallest prefix whose mass exceeds top_p, the crossing token included */
        const float inverse = 1.0f / (float)*total;
        double mass = 0.0;
        long cut = m;
        for (long j = 0; j + 1 < m; j++) {
            mass += weights[j] * inverse;  /* cumsum of float32 probabilities: double sums, float values */
            if ((float)mass > top_p) {
                cut = j + 1;
                break;
            }
        }
        m = cut;
        *total = 0.0;
        for (long j = 0; j < m; j++) *total += weights[j];
    }
    return m;
}

/* sample_with_noise's pick from filter's m kept ids: the inverse CDF of `uniform` over the kept ids in id order. */
static long pick_uniform(Candidate *kept, const float *weights, long m, double total, float uniform) {
    if (m == 0) return 0;  /* every score NaN: the decoder's finiteness check drops the frame */
    for (long j = 0; j < m; j++) kept[j].score = weights[j];  /* the kept rows' weights, now put in id order */
    qsort(kept, (size_t)m, sizeof(Candidate), by_id);
    const float inverse = 1.0f / (float)total;
    double sum = 0.0;
    for (long j = 0; j < m; j++) sum += kept[j].score * inverse;
    const float target = uniform * (float)sum;
    long last = 0;  /* as sample_with_noise: id 0 where no probability is positive (NaN weights) */
    double cdf = 0.0;
    for (long j = 0; j < m; j++) {
        const float p = kept[j].score * inverse;
        cdf += p;
        if (p > 0.0f) last = kept[j].id;
        if ((float)cdf > target) return kept[j].id;
    }
    return last;  /* rounding put the target on the total mass: the last id with probability */
}

/* sample_token's draw from filter's m kept ids, as torch.multinomial draws one sample on the CPU: the first id
 * with the largest p / q, p the softmax (float32: each weight times the inverse of their sum), q (V,) the Exp(1)
 * variates torch drew for the row. A top score that is not finite (or no kept id) softmaxes to NaN, which sample_token turns into 1.0 everywhere;
 * a NaN ratio (0 / 0) wins, as in torch's argmax. `p` is scratch of V floats. */
static long pick_exponential(const Candidate *kept, const float *weights, long m, double total, const float *q,
                             long v, float *p) {
    const int ones = m == 0 || !isfinite(kept[0].score);
    for (long i = 0; i < v; i++) p[i] = ones ? 1.0f : 0.0f;
    const float inverse = ones ? 1.0f : 1.0f / (float)total;
    for (long j = 0; j < m && !ones; j++) p[kept[j].id] = weights[j] * inverse;
    long best = 0;
    float most = p[0] / q[0];
    for (long i = 0; i < v && !isnan(most); i++) {
        const float ratio = p[i] / q[i];
        if (ratio > most || isnan(ratio)) most = ratio, best = i;
    }
    return best;
}

/* One row's code from logits (V,): the repetition penalty on the `seen` ids, then argmax (first on ties) or, where
 * `do_sample`, the official filters and the pick: with the Exp(1) variates `exponential` (V,) where given, else with
 * `uniform`; scratch of 4 V floats. */
static long decide(const float *logits, long v, const uint8_t *seen, int do_sample, float temperature,
                   int64_t top_k, float top_p, float penalty, float uniform, const float *exponential,
                   float *scratch) {
    float *scores = scratch, *weights = scores + v;
    for (long i = 0; i < v; i++) {
        const float x = logits[i];
        scores[i] = seen[i] ? (x < 0 ? x * penalty : x / penalty) : x;
    }
    if (do_sample) {
        Candidate *kept = (Candidate *)(weights + v);
        double total = 0.0;
        const long m = filter(scores, v, temperature, top_k, top_p, kept, weights, &total);
        return exponential != NULL ? pick_exponential(kept, weights, m, total, exponential, v, scores)
                                   : pick_uniform(kept, weights, m, total, uniform);
    }
    long best = 0;
    for (long i = 1; i < v; i++)
        if (scores[i] > scores[best]) best = i;
    return best;
}

/* decide, as the checks call it (tests/native/check_kernels.c, moss_npu/cpu/local_loop.py). */
long moss_local_decide(const float *logits, long v, const uint8_t *seen, int do_sample, float temperature,
                       int64_t top_k, float top_p, float penalty, float uniform, const float *exponential,
                       float *scratch) {
    if (v < 1 || !(temperature > 0.0f)) return BAD_CALL;
    return decide(logits, v, seen, do_sample, temperature, top_k, top_p, penalty, uniform, exponential, scratch);
}

/* Channels [0, channels) of a frame for rows [0, n) (see the file's comment). `cache` is the local decoder's
 * (layers, 2, slots, H, M, D) keys and values, row r in slot r, written at positions start .. start + channels - 1;
 * `rotation` (M, D / 2 pairs) the local RoPE table; `first` (n, E) and `first_qkv` (n, 3E) channel 0's input and
 * its ready qkv; `seen` (slots, Q, seen_width) bool the ids each channel has produced; `nq` (n) each row's channel
 * count. Writes `codes` (n, channels): each channel's code (also where c >= nq: the caller pads those),
 * `finite` (n): whether every logits row of a channel below nq summed to a finite value, and adds each code's
 * embedding below nq to `embed` (n, E). Returns 0, or BAD_CALL for sizes that do not fit (nothing is written but
 * cache rows). */
int moss_local_audio(void *pool, const LocalLoop *loop, long n, long start, long channels, float *cache, long slots,
                     long rows, const float *rotation, const float *first, const float *first_qkv,
                     const Sampling *sampling, const uint8_t *seen, long seen_width, const int64_t *nq,
                     int64_t *codes, uint8_t *finite, float *embed, float *scratch) {
    if (loop->layers < 1 || n < 1 || n > slots || channels < 1 || channels > loop->channels || start < 0 ||
        start + channels > rows || sampling->noise_width < channels + 1)
        return BAD_CALL;
    const Block *head_block = &loop->blocks[0];
    const long e = head_block->embed, heads = head_block->heads, dim = e / heads, v_max = largest_vocab(loop);
    if (seen_width < v_max || (sampling->exponential != NULL && sampling->exponential_width < v_max)) return BAD_CALL;
    for (long c = 0; c < channels; c++)
        if (loop->heads[c].in != e || loop->heads[c].columns != padded(loop->vocab[c])) return BAD_CALL;
    const long slot_stride = heads * rows * dim, layer_stride = 2 * slots * slot_stride;
    float *x = scratch, *qkv = x + n * e, *logits = qkv + 3 * n * e, *block_scratch = logits + n * padded(v_max);
    float *decisions = block_scratch + n * moss_row_block_scratch(head_block, start + channels);  /* decide's */
    memcpy(x, first, sizeof(float) * (size_t)(n * e));
    memcpy(qkv, first_qkv, sizeof(float) * (size_t)(3 * n * e));
    for (long r = 0; r < n; r++) finite[r] = 1;
    for (long c = 0; c < channels; c++) {
        const long position = start + c, attended = position + 1, v = loop->vocab[c], columns = padded(v);
        const Places at = {&position, &attended, rotation + position * dim, 0};
        for (long i = 0; i < loop->layers; i++) {
            float *keys = cache + i * layer_stride, *values = keys + slots * slot_stride;
            if (moss_block_rows(pool, &loop->blocks[i], n, x, &at, keys, values, slot_stride, rows,
                                i == 0 ? qkv : NULL, block_scratch))
                return BAD_CALL;
        }
        const Product *head = &loop->heads[c];
        if (moss_product(pool, head_block->target, loop->head_format, x, head->w, head->scale, head->bias, NULL,
                         logits, n, e, columns, 0))
            return BAD_CALL;
        for (long r = 0; r < n; r++) {
            const float *row = logits + r * columns;
            const int within = c < nq[r];
            float sum = 0.0f;
            for (long i = 0; i < v; i++) sum += row[i];
            if (within && !isfinite(sum)) finite[r] = 0;
            const long at = r * loop->channels + c;
            long code = decide(row, v, seen + at * seen_width, sampling->do_sample[r], sampling->temperature[r],
                               sampling->top_k[r], sampling->top_p[r], sampling->penalty[r],
                               sampling->noise[r * sampling->noise_width + c + 1],
                               sampling->exponential ? sampling->exponential + at * sampling->exponential_width : NULL,
                               decisions);
            code = code < 0 ? 0 : code >= v ? v - 1 : code;
            codes[r * channels + c] = code;
            const float *embedding = loop->embeddings[c] + code * e;
            memcpy(x + r * e, embedding, sizeof(float) * (size_t)e);
            if (within)
                for (long i = 0; i < e; i++) embed[r * e + i] += embedding[i];
            if (c + 1 < channels)
                memcpy(qkv + r * 3 * e, loop->qkv[c] + code * 3 * e, sizeof(float) * (size_t)(3 * e));
        }
    }
    return 0;
}
