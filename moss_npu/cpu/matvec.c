/* One-row products y = x · W (+ bias, + residual) with W stored compactly: float32, bf16 or int8 values, float32
 * arithmetic; the entry points that moss_npu/cpu/matvec.py calls through ctypes.
 *
 * W (in, out) is stored in tiles of TILE output columns (the caller pads `out` to a multiple): tile after tile,
 * and in each tile row after row, so a tile's weights are read once, front to back, in one stream, and its sums
 * stay in registers for all `in` rows. The tile functions exist once per instruction set (matvec_tiles.c,
 * compiled with each target's flags into this one library); `moss_targets` says which this CPU runs and the
 * caller names one in every call: an index into a table of constant function pointers.
 *
 * Threads: a product's tiles are shared out over a small pool (`moss_pool_new`): the calling thread and the
 * workers each claim the next unclaimed tile until none is left, so a worker that the system has descheduled
 * delays a product by at most the one tile it claimed, and the caller takes the rest. The pool shares any task
 * of independent units the same way (`moss_share`: a fused block's attention heads, fused_block.c). Workers spin
 * between tasks for up to SPIN_SECONDS and then sleep until the next task; one that `moss_pool_use` leaves out
 * sleeps at once, until a `moss_pool_use` takes it in again (the tasks meanwhile do not wake it).
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "matvec.h"

#define DECLARE(target)                                                                                         \
    void moss_tile_f32_##target(const float *, long, long, const void *, float *, long, const float *,         \
                                const float *, const float *, long);                                          \
    void moss_tile_bf16_##target(const float *, long, long, const void *, float *, long, const float *,        \
                                 const float *, const float *, long);                                         \
    void moss_tile_int8_##target(const float *, long, long, const void *, float *, long, const float *,        \
                                 const float *, const float *, long);
#define ROW(target) {moss_tile_f32_##target, moss_tile_bf16_##target, moss_tile_int8_##target}

DECLARE(portable)
#if defined(__x86_64__)
DECLARE(avx2)
DECLARE(avx512)
static const TileFunction TABLE[TARGETS][FORMATS] = {ROW(portable), ROW(avx2), ROW(avx512), {0, 0, 0}};
#elif defined(__aarch64__)
DECLARE(neon)
static const TileFunction TABLE[TARGETS][FORMATS] = {ROW(portable), {0, 0, 0}, {0, 0, 0}, ROW(neon)};
#else
static const TileFunction TABLE[TARGETS][FORMATS] = {ROW(portable), {0, 0, 0}, {0, 0, 0}, {0, 0, 0}};
#endif

#ifndef MOSS_SOURCES
#define MOSS_SOURCES "unknown"
#endif

/* The digest of the sources this library was built from (moss_npu/native/build.py). */
const char *moss_sources(void) { return MOSS_SOURCES; }

/* Bit t set: target t is in this library and this CPU runs it (AVX-512F, AVX2 with FMA; NEON is part of every
 * aarch64 CPU that Linux runs on). */
int moss_targets(void) {
    int mask = 1 << PORTABLE;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) mask |= 1 << AVX2;
    if (__builtin_cpu_supports("avx512f")) mask |= 1 << AVX512;
#elif defined(__aarch64__)
    mask |= 1 << NEON;
#endif
    return mask;
}

/* One product, as the pool shares it out: unit j is tile j, columns [j·TILE, (j+1)·TILE) of every row. Whole
 * tiles, each one contiguous block of weights, let every thread stream its own memory: half tiles (each thread
 * half of every tile row) read more slowly on two threads than whole tiles, and for bf16 more slowly than one
 * thread alone (docs/native.md#threads). */
typedef struct {
    TileFunction tile;
    const float *x, *scale, *bias, *residual;
    const char *w;
    float *y;
    long rows, in, out, tile_bytes;
    int gelu;  /* the tanh GELU on each finished column (moss_product) */
} Job;

EXP_PARTS(exp_parts, float)

/* e^x without a call or a branch, so that a row of them vectorizes (x clamped to where e^x is a normal float or just
 * overflows to infinity; EXP_PARTS, matvec.h). */
static inline float exp_float(float x) {
    x = x < -87.3f ? -87.3f : x > 88.7f ? 88.7f : x;
    float n;
    const float p = exp_parts(x, &n);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* The tanh GELU (``gelu_new``: x/2 · (1 + tanh u), u = √(2/π) (x + 0.044715 x³)) as x / (1 + e^(−2u)), the same
 * function without tanh's cancellation near −1, in vectors (libm's tanhf, one value per call, took a seventh of a
 * batch's frame). Agrees with cpu/blocks.py's _gelu_tanh to float rounding. */
WIDEST static void gelu_tanh(float *y, long n) {
    for (long c = 0; c < n; c++) {
        const float x = y[c];
        const float inner = (x * x * x * 0.044715f + x) * 0.7978845608028654f;
        y[c] = x / (1.0f + exp_float(-2.0f * inner));
    }
}

static void run_tile(const void *task, long j) {
    const Job *job = task;
    const long first = j * TILE;
    const void *tile = job->w + j * job->tile_bytes;
    const float *scale = job->scale ? job->scale + first : NULL, *bias = job->bias ? job->bias + first : NULL;
    job->tile(job->x, job->in, job->rows, tile, job->y + first, job->out, scale, bias,
              job->residual ? job->residual + first : NULL, job->in);
    for (long r = 0; r < job->rows && job->gelu; r++) gelu_tanh(job->y + r * job->out + first, TILE);
}

/* The ticket says which product is on (its number, 24 bits, counted modulo 2^24), how many tiles it has and how
 * many are claimed (20 bits each): a claim is one compare-and-swap, and a worker still busy with an earlier
 * product can never claim a tile of the next one. */
#define FIELD 20
#define FIELD_MASK ((1ull << FIELD) - 1)
#define NUMBER_MASK ((1ull << (64 - 2 * FIELD)) - 1)
#define MAX_TILES ((long)FIELD_MASK)

typedef struct Pool Pool;

typedef struct {
    Pool *pool;
    int index;  /* 1 .. threads - 1: the caller is thread 0 */
} Worker;

struct Pool {
    int threads;  /* the caller and threads - 1 workers */
    atomic_int active;  /* how many of them a product uses (moss_pool_use) */
    pthread_t *threads_started;
    Worker *workers;
    int started;
    pthread_mutex_t caller;  /* held by the thread whose product is being shared */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_ullong ticket;
    atomic_long finished;  /* units of the current task done */
    atomic_int sleepers, stop;
    UnitFunction unit;  /* the current task: unit(task, j) for each of its units */
    const void *task;  /* the sharing caller's, alive until every unit is done */
    Pool *next;  /* in the list of live pools (after_fork_in_child) */
};

static unsigned long long product_of(unsigned long long ticket) { return ticket >> (2 * FIELD); }

/* Claim and run tiles of product `number` until none is left; return how many this thread ran. */
static long work(Pool *pool, unsigned long long number) {
    long done = 0;
    for (;;) {
        unsigned long long ticket = atomic_load(&pool->ticket);
        unsigned long long claimed = ticket & FIELD_MASK, tiles = (ticket >> FIELD) & FIELD_MASK;
        if (product_of(ticket) != number || claimed >= tiles) return done;
        if (!atomic_compare_exchange_weak(&pool->ticket, &ticket, ticket + 1)) continue;
        pool->unit(pool->task, (long)claimed);
        atomic_fetch_add(&pool->finished, 1);
        done++;
    }
}

static double seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A worker's wait for the next task before it sleeps: longer than the Python between two products of a frame,
 * so that a frame never waits for a worker to wake (a shorter wait left products on one thread:
 * docs/native.md#threads); yielding meanwhile. A worker the products no longer use (moss_pool_use) sleeps at
 * once: the core it spun on was lent and is wanted back (tts/engine.py). */
#define SPIN_SECONDS 2000e-6

static void *worker(void *argument) {
    Pool *pool = ((Worker *)argument)->pool;
    const int index = ((Worker *)argument)->index;
    unsigned long long seen = product_of(atomic_load(&pool->ticket));
    while (!atomic_load(&pool->stop)) {
        double until = seconds() + SPIN_SECONDS;
        unsigned long long number = seen;
        for (int spins = 0; (number = product_of(atomic_load(&pool->ticket))) == seen; spins++) {
            if (atomic_load(&pool->stop)) return NULL;
            relax();
            if ((spins & 1023) == 1023) sched_yield();  /* another runnable thread here (the codec's) goes first */
            if ((spins & 63) != 63) continue;
            const int left_out = index >= atomic_load(&pool->active);
            if (!left_out && seconds() <= until) continue;
            pthread_mutex_lock(&pool->lock);
            if (left_out) {
                /* asleep until a moss_pool_use takes it in again; not a sleeper, so that the products it no
                 * longer joins do not wake it */
                while (index >= atomic_load(&pool->active) && !atomic_load(&pool->stop))
                    pthread_cond_wait(&pool->wake, &pool->lock);
            } else {
                atomic_fetch_add(&pool->sleepers, 1);
                while (product_of(atomic_load(&pool->ticket)) == seen && !atomic_load(&pool->stop))
                    pthread_cond_wait(&pool->wake, &pool->lock);
                atomic_fetch_sub(&pool->sleepers, 1);
            }
            pthread_mutex_unlock(&pool->lock);
            until = seconds() + SPIN_SECONDS;
        }
        seen = number;
        if (index < atomic_load(&pool->active)) work(pool, number);
    }
    return NULL;
}

/* Start the workers a pool lacks (all of them when new, again in a child process after fork); 0 where one
 * cannot be started (the pool then has the ones started so far). */
static int start_workers(Pool *pool) {
    for (; pool->started < pool->threads - 1; pool->started++) {
        pool->workers[pool->started] = (Worker){pool, pool->started + 1};
        if (pthread_create(&pool->threads_started[pool->started], NULL, worker, &pool->workers[pool->started]) != 0)
            return 0;
    }
    return 1;
}

/* The pools alive in this process. fork copies a pool's memory into the child but none of its threads, and
 * leaves its locks as they were at that instant: the child handler makes every pool a pool with no workers and
 * fresh locks, which starts its workers again at its next task (moss_share), and frees without joining threads
 * that the child never had. pthread_atfork keeps process-wide state, so the list of pools is such state too. */
static pthread_mutex_t pools_lock = PTHREAD_MUTEX_INITIALIZER;
static Pool *pools;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void before_fork(void) { pthread_mutex_lock(&pools_lock); }

static void after_fork_in_parent(void) { pthread_mutex_unlock(&pools_lock); }

static void after_fork_in_child(void) {
    for (Pool *pool = pools; pool != NULL; pool = pool->next) {
        pthread_mutex_init(&pool->caller, NULL);
        pthread_mutex_init(&pool->lock, NULL);
        pthread_cond_init(&pool->wake, NULL);
        pool->started = 0;
        atomic_store(&pool->sleepers, 0);
    }
    pthread_mutex_init(&pools_lock, NULL);
}

static void register_atfork(void) { pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child); }

void moss_pool_free(void *handle);

/* A pool for `threads` threads in all (the caller included): NULL where the threads cannot be started. */
void *moss_pool_new(int threads) {
    pthread_once(&atfork_once, register_atfork);
    Pool *pool = calloc(1, sizeof(Pool));
    if (pool == NULL) return NULL;
    pool->threads = threads < 1 ? 1 : threads;
    atomic_init(&pool->active, pool->threads);
    pthread_mutex_init(&pool->caller, NULL);
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pool->threads_started = calloc((size_t)pool->threads, sizeof(pthread_t));
    pool->workers = calloc((size_t)pool->threads, sizeof(Worker));
    pthread_mutex_lock(&pools_lock);
    pool->next = pools, pools = pool;
    pthread_mutex_unlock(&pools_lock);
    if (pool->threads_started == NULL || pool->workers == NULL || !start_workers(pool)) {
        moss_pool_free(pool);
        return NULL;
    }
    return pool;
}

void moss_pool_free(void *handle) {
    Pool *pool = handle;
    if (pool == NULL) return;
    pthread_mutex_lock(&pools_lock);
    for (Pool **at = &pools; *at != NULL; at = &(*at)->next)
        if (*at == pool) {
            *at = pool->next;
            break;
        }
    pthread_mutex_unlock(&pools_lock);
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->stop, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int t = 0; t < pool->started; t++) pthread_join(pool->threads_started[t], NULL);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->caller);
    free(pool->threads_started);
    free(pool->workers);
    free(pool);
}

int moss_pool_threads(void *handle) { return ((Pool *)handle)->threads; }

/* For the tests (tests/native/check_kernels.c): make `number` the last product shared, no task on. */
void moss_pool_set_product(void *handle, unsigned long long number) {
    atomic_store(&((Pool *)handle)->ticket, (number & NUMBER_MASK) << (2 * FIELD));
}

/* Use `threads` of the pool's threads (1 .. its size) for the products that follow; the workers this takes in
 * again wake now. */
void moss_pool_use(void *handle, int threads) {
    Pool *pool = handle;
    int wanted = threads < 1 ? 1 : threads > pool->threads ? pool->threads : threads;
    if (atomic_exchange(&pool->active, wanted) < wanted) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }
}

static void share(Pool *pool, UnitFunction unit, const void *task, long units) {
    unsigned long long number = (product_of(atomic_load(&pool->ticket)) + 1) & NUMBER_MASK;
    pool->unit = unit;
    pool->task = task;
    atomic_store(&pool->finished, 0);
    atomic_store(&pool->ticket, (number << (2 * FIELD)) | ((unsigned long long)units << FIELD));
    if (atomic_load(&pool->sleepers) > 0) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }
    work(pool, number);
    for (int spins = 0; atomic_load(&pool->finished) < units; spins++) {
        relax();
        if ((spins & 1023) == 1023) sched_yield();  /* a worker holding a unit was descheduled */
    }
}

void moss_share(void *handle, UnitFunction unit, const void *task, long units) {
    Pool *pool = handle;
    /* Alone: no pool, one thread asked for, or another thread's task holding the pool. */
    if (pool == NULL || units < 2 || units > MAX_TILES || atomic_load(&pool->active) < 2 ||
        pthread_mutex_trylock(&pool->caller)) {
        for (long j = 0; j < units; j++) unit(task, j);
        return;
    }
    if (pool->started < pool->threads - 1) start_workers(pool);  /* in a child after fork */
    share(pool, unit, task, units);
    pthread_mutex_unlock(&pool->caller);
}

int moss_product(void *pool, int target, int format, const float *x, const void *w, const float *scale,
                 const float *bias, const float *residual, float *y, long rows, long in, long out, int gelu) {
    if (target < 0 || target >= TARGETS || format < 0 || format >= FORMATS || !(moss_targets() >> target & 1))
        return BAD_CALL;
    if (rows < 1 || in < 1 || out < TILE || out % TILE != 0 || out / TILE > MAX_TILES) return BAD_CALL;
    if (format == INT8 && scale == NULL) return BAD_CALL;
    const Job job = {TABLE[target][format], x, scale, bias, residual, (const char *)w, y, rows, in, out,
                     in * TILE * value_bytes(format), gelu};
    moss_share(pool, run_tile, &job, out / TILE);
    return 0;
}

/* y (rows × out) = x (rows × in) · W + bias (+ residual), W in `format`'s tiles; `out` a multiple of TILE;
 * scale (int8 only), bias and residual may be NULL. `pool` may be NULL (this thread alone). Returns 0, or
 * BAD_CALL for a target this library or CPU lacks, an unknown format or sizes it cannot take. */
int moss_matvec(void *pool, int target, int format, const float *x, const void *w, const float *scale,
                const float *bias, const float *residual, float *y, long rows, long in, long out) {
    return moss_product(pool, target, format, x, w, scale, bias, residual, y, rows, in, out, 0);
}
