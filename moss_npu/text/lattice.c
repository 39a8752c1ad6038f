/* The lightest path of a grammar FST over a text, as OpenFst's ShortestPath finds it in the composed lattice
 * (lattice.py says why this is that answer).
 *
 * The lattice: states (position, grammar state), from (0, start); the arcs out of one are its grammar state's
 * arcs, in their order, that read nothing or the byte at that position. An arc is followed only where the state
 * it reaches can go on: read the byte at its position, or at the end reach a final state, without reading another
 * byte first (its "first set"), and then the byte after (its "pair set"); a state not followed so is on no
 * complete path. The lattice is then trimmed to the states on a complete path and searched: in topological order
 * (reverse depth-first finishing order) when the grammar is known to be acyclic or some arc weighs neither 0 nor
 * infinity, else last in, first out; float32 sums from the start, the first of equally light ways into a state
 * kept, the first final state reached at the lowest weight.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define WORDS 5        /* a first set: 256 byte bits and END_BIT */
#define PAIR_WORDS 8   /* a pair set: PAIR_BITS */
#define SET_WORDS (WORDS + PAIR_WORDS)  /* a state's lookahead: its first set, then its pair set */
#define END_BIT 256
#define NO_READING (-1)
#define NO_MEMORY (-2)
#define EPSILON_CYCLE (-4)

/* The grammar as the search reads it (lattice.py's `prepare`). */
typedef struct {
    long states;
    int32_t start;
    const int32_t *arc_start;  /* [states + 1]: state s's arcs are arc_start[s] .. arc_start[s + 1] - 1 */
    const int32_t *olabel;     /* by arc */
    const float *weight;       /* by arc */
    const float *final_weight; /* by state; INFINITY: not final */
    const int32_t *epsilons;   /* by state: how many of its arcs read nothing */
    const int32_t *sorted;     /* [3 * arcs]: each state's arcs by (ilabel, index): ilabel, next state, index */
    const int32_t *first;      /* by state: its first set's number in `sets` (few distinct sets: a table that stays in
                                  the cache, where a set per state would not) */
    const uint64_t *sets;      /* [SET_WORDS * sets] */
} Grammar;

static int has(const uint64_t *set, int bit) { return (int)((set[bit >> 6] >> (bit & 63)) & 1u); }
static void put(uint64_t *set, int bit) { set[bit >> 6] |= (uint64_t)1 << (bit & 63); }

/* The bit of the pair (byte, then byte or END_BIT) in a pair set: a hash into PAIR_BITS bits, so that a pair set
 * holds every pair a state can read first and, by collision, some others (a state is only ever let go when its
 * set lacks a pair, so the others cost pruning, never a path). */
#define PAIR_BITS 512
static int pair_bit(int first, int second) {
    return (int)(((uint32_t)(first * 257 + second) * 2654435761u) >> (32 - 9));
}

/* Each state's lookahead sets (SET_WORDS words): its first set, the bytes on the non-epsilon arcs of the states its
 * epsilon arcs reach (itself included) and END_BIT if a final state is among them; and its pair set, the pairs
 * (byte, what the state after it reads first) of those arcs. Worked out children first (depth-first post-order).
 * Returns 0, NO_MEMORY, or EPSILON_CYCLE: then a text's lattice would be cyclic, which this search does not take. */
int fst_lookahead_sets(long states, const int32_t *arc_start, const int32_t *ilabel, const int32_t *next,
                       const float *final_weight, uint64_t *sets) {
    size_t room = (size_t)(states > 0 ? states : 1);
    int32_t *order = malloc(sizeof(int32_t) * room), *stack = malloc(sizeof(int32_t) * room);
    int32_t *cursor = malloc(sizeof(int32_t) * room);
    uint8_t *seen = calloc(room, 1);
    int status = 0;
    long placed = 0;
    if (!order || !stack || !cursor || !seen) {
        status = NO_MEMORY;
        goto done;
    }
    memset(sets, 0, sizeof(uint64_t) * SET_WORDS * room);
    for (long s = 0; s < states; s++) {
        if (final_weight[s] != INFINITY) put(sets + SET_WORDS * s, END_BIT);
        for (int32_t a = arc_start[s]; a < arc_start[s + 1]; a++)
            if (ilabel[a] > 0 && ilabel[a] < 256) put(sets + SET_WORDS * s, ilabel[a]);
    }
    for (long root = 0; root < states; root++) {
        if (seen[root]) continue;
        long depth = 0;
        stack[0] = (int32_t)root, cursor[0] = arc_start[root], seen[root] = 1;
        while (depth >= 0) {
            int32_t s = stack[depth];
            if (cursor[depth] == arc_start[s + 1]) {
                seen[s] = 2, order[placed++] = s, depth--;
                continue;
            }
            int32_t a = cursor[depth]++;
            if (ilabel[a] != 0) continue;
            if (seen[next[a]] == 1) {  /* back to a state on the path: an epsilon cycle */
                status = EPSILON_CYCLE;
                goto done;
            }
            if (!seen[next[a]]) {
                seen[next[a]] = 1, depth++;
                stack[depth] = next[a], cursor[depth] = arc_start[next[a]];
            }
        }
    }
    for (long k = 0; k < states; k++) {  /* children first: each set is complete when it is read */
        uint64_t *into = sets + SET_WORDS * order[k];
        for (int32_t a = arc_start[order[k]]; a < arc_start[order[k] + 1]; a++)
            if (ilabel[a] == 0)
                for (int w = 0; w < WORDS; w++) into[w] |= sets[SET_WORDS * next[a] + w];
    }
    for (long k = 0; k < states; k++) {  /* the pairs: a byte read, then one its arc's target reads first */
        uint64_t *into = sets + SET_WORDS * order[k], *pairs = into + WORDS;
        for (int32_t a = arc_start[order[k]]; a < arc_start[order[k] + 1]; a++) {
            const uint64_t *then = sets + SET_WORDS * next[a];
            if (ilabel[a] == 0) {
                for (int w = 0; w < PAIR_WORDS; w++) pairs[w] |= then[WORDS + w];
                continue;
            }
            for (int second = 0; second <= END_BIT; second++)
                if (has(then, second)) put(pairs, pair_bit(ilabel[a], second));
        }
    }
done:
    free(order); free(stack); free(cursor); free(seen);
    return status;
}

typedef struct { int32_t q, pos, arcs, count; } LatticeState;  /* grammar state, position, its arcs' place, count */
typedef struct { int32_t to, arc; } LatticeArc;                 /* lattice state reached, grammar arc taken */
typedef struct { int32_t pos, id; } Slot;  /* a column's entry for one grammar state: position, lattice state */

typedef struct {
    LatticeState *states;
    LatticeArc *arcs;
    long n_states, cap_states, n_arcs, cap_arcs;
} Lattice;

typedef struct {  /* the lattice states of one position: slots[q].pos == that position where q has one */
    Slot *slots;
    int32_t *list;  /* in the order they were made, which is the order they are expanded in */
    long listed, cap;
    int back;       /* whether an epsilon arc leads to a state made before its source (see mark_live) */
} Column;

static int grow(void **items, long *cap, long need, size_t size) {
    if (need <= *cap) return 0;
    long wanted = *cap ? *cap : 4096;
    while (wanted < need) wanted *= 2;
    void *bigger = realloc(*items, size * (size_t)wanted);
    if (!bigger) return NO_MEMORY;
    *items = bigger, *cap = wanted;
    return 0;
}

/* The lattice state (pos, q): the column's, else a new one added to the lattice and the column. */
static long state_at(Lattice *lat, Column *col, int32_t q, int32_t pos) {
    if (col->slots[q].pos == pos) return col->slots[q].id;
    if (lat->n_states >= INT32_MAX) return NO_MEMORY;  /* states are numbered in int32 */
    if (grow((void **)&lat->states, &lat->cap_states, lat->n_states + 1, sizeof(LatticeState)) ||
        grow((void **)&col->list, &col->cap, col->listed + 1, sizeof(int32_t)))
        return NO_MEMORY;
    long id = lat->n_states++;
    lat->states[id] = (LatticeState){q, pos, 0, 0};
    col->slots[q] = (Slot){pos, (int32_t)id};
    col->list[col->listed++] = (int32_t)id;
    return id;
}

/* Whether a path that reaches a state of lookahead `set` before the byte `next` (END_BIT: the end of the text), with
 * `then` after it, can go on: it must read `next` first (or end at a final state), and `next` then `then`. */
static int goes_on(const uint64_t *set, int next, int then) {
    return has(set, next) && (next == END_BIT || has(set + WORDS, pair_bit(next, then)));
}

/* Add one lattice state's arcs: its grammar state's epsilon arcs and those reading text[p], merged back into the
 * grammar's order (`sorted` holds each state's epsilons first, then its arcs by label). */
static int expand(const Grammar *g, Lattice *lat, Column *here, Column *there, long k, const uint8_t *text, long p,
                  long n) {
    int32_t s = here->list[k], q = lat->states[s].q;
    const int32_t *eps = g->sorted + 3 * (long)g->arc_start[q], *end = g->sorted + 3 * (long)g->arc_start[q + 1];
    const int32_t *eps_end = eps + 3 * (long)g->epsilons[q], *byte = end, *byte_end = end;
    int now = p < n ? text[p] : END_BIT, then = p + 1 < n ? text[p + 1] : END_BIT;
    int after = p + 2 < n ? text[p + 2] : END_BIT;
    if (p < n) {
        long lo = 0, hi = (end - eps_end) / 3;
        while (lo < hi) {
            long mid = (lo + hi) / 2;
            if (eps_end[3 * mid] < now) lo = mid + 1; else hi = mid;
        }
        byte = byte_end = eps_end + 3 * lo;
        while (byte_end < end && byte_end[0] == now) byte_end += 3;
    }
    lat->states[s].arcs = (int32_t)lat->n_arcs;
    while (eps < eps_end || byte < byte_end) {
        int take_eps = byte == byte_end || (eps < eps_end && eps[2] < byte[2]);
        const int32_t *arc = take_eps ? eps : byte;
        long to;
        if (take_eps) eps += 3; else byte += 3;
        if (!goes_on(g->sets + SET_WORDS * (long)g->first[arc[1]], take_eps ? now : then, take_eps ? then : after))
            continue;
        if (take_eps && here->slots[arc[1]].pos == p && here->slots[arc[1]].id <= s) here->back = 1;
        to = take_eps ? state_at(lat, here, arc[1], (int32_t)p) : state_at(lat, there, arc[1], (int32_t)(p + 1));
        if (to < 0 || lat->n_arcs >= INT32_MAX ||
            grow((void **)&lat->arcs, &lat->cap_arcs, lat->n_arcs + 1, sizeof(LatticeArc)))
            return NO_MEMORY;
        lat->arcs[lat->n_arcs++] = (LatticeArc){(int32_t)to, arc[2]};
        lat->states[s].count++;
    }
    return 0;
}

/* What one search works in, kept between searches so that a long text's memory is mapped once, not on every call
 * (the kernel zeroing fresh pages cost as much as the search): the lattice, the two columns and a state's flags. */
typedef struct {
    long grammar_states;
    Lattice lat;
    Column cols[2];
    uint8_t *live, *seen;  /* by lattice state */
    int32_t *rank;         /* by lattice state: a live one's place in finishing order */
    long cap;              /* lattice states these hold */
    int32_t *order, *stack, *cursor, *parent, *source;  /* by live state (rank) */
    float *distance;
    long cap_live;
    int32_t *expanded;  /* the lattice states in the order they were expanded: position by position */
    long *columns;      /* [n + 2]: position p's states are expanded[columns[p] .. columns[p + 1] - 1] */
    uint8_t *backs;     /* [n + 1]: the columns' back flags */
    long n_expanded, cap_expanded, cap_columns, cap_backs;
    int32_t *out;       /* the last search's output labels (fst_workspace_output) */
    long cap_out;
} Workspace;

#define KEPT_STATES (1L << 21)  /* a workspace grown past this many lattice states is given back after its search */

static void release(Workspace *w) {
    free(w->lat.states), free(w->lat.arcs);
    free(w->live), free(w->seen), free(w->rank);
    free(w->order), free(w->stack), free(w->cursor), free(w->parent), free(w->source);
    free(w->distance), free(w->expanded), free(w->columns), free(w->backs);
    memset(&w->lat, 0, sizeof(w->lat));
    w->expanded = NULL, w->columns = NULL, w->backs = NULL, w->cap_expanded = w->cap_columns = w->cap_backs = 0;
    w->live = w->seen = NULL, w->rank = NULL, w->order = w->stack = w->cursor = w->parent = w->source = NULL;
    w->distance = NULL, w->cap = w->cap_live = 0;
}

void fst_workspace_free(void *handle) {
    Workspace *w = handle;
    if (!w) return;
    release(w);
    for (int k = 0; k < 2; k++) free(w->cols[k].slots), free(w->cols[k].list);
    free(w->out);
    free(w);
}

/* The output labels of the workspace's last search (fst_best_path's *out_len of them). */
const int32_t *fst_workspace_output(const void *handle) { return ((const Workspace *)handle)->out; }

/* A workspace for searches of a grammar of `states` states (NULL: no memory). */
void *fst_workspace_new(long states) {
    Workspace *w = calloc(1, sizeof(Workspace));
    if (!w) return NULL;
    w->grammar_states = states;
    for (int k = 0; k < 2; k++) {
        w->cols[k].slots = malloc(sizeof(Slot) * (size_t)(states > 0 ? states : 1));
        if (!w->cols[k].slots) {
            fst_workspace_free(w);
            return NULL;
        }
    }
    return w;
}

/* Room for `m` lattice states' flags and ranks, and for `live` live states' search arrays. */
static int room(Workspace *w, long m, long live) {
    long c = w->cap;
    if (m > w->cap) {
        if (grow((void **)&w->live, &c, m, 1)) return NO_MEMORY;
        c = w->cap;
        if (grow((void **)&w->seen, &c, m, 1)) return NO_MEMORY;
        c = w->cap;
        if (grow((void **)&w->rank, &c, m, 4)) return NO_MEMORY;
        w->cap = c;
    }
    if (live > w->cap_live) {
        void **arrays[] = {(void **)&w->order, (void **)&w->stack, (void **)&w->cursor, (void **)&w->parent,
                           (void **)&w->source, (void **)&w->distance};
        for (int k = 0; k < 6; k++) {
            c = w->cap_live;
            if (grow(arrays[k], &c, live, 4)) return NO_MEMORY;
        }
        w->cap_live = c;
    }
    return 0;
}

/* The lattice of text[0:n), position by position (state 0 is (0, start)). */
static int build(const Grammar *g, Workspace *w, const uint8_t *text, long n) {
    Lattice *lat = &w->lat;
    int status = 0;
    lat->n_states = lat->n_arcs = 0, w->n_expanded = 0;
    for (int k = 0; k < 2; k++) {
        memset(w->cols[k].slots, 0xff, sizeof(Slot) * (size_t)g->states);
        w->cols[k].listed = 0, w->cols[k].back = 0;
    }
    if (state_at(lat, &w->cols[0], g->start, 0) < 0) status = NO_MEMORY;
    for (long p = 0; p <= n && status == 0; p++) {
        Column *here = &w->cols[p & 1], *there = &w->cols[1 - (p & 1)];
        there->listed = 0;
        for (long k = 0; k < here->listed && status == 0; k++) status = expand(g, lat, here, there, k, text, p, n);
        if (status == 0 && (grow((void **)&w->expanded, &w->cap_expanded, w->n_expanded + here->listed, 4) ||
                            grow((void **)&w->columns, &w->cap_columns, p + 2, sizeof(long)) ||
                            grow((void **)&w->backs, &w->cap_backs, p + 1, 1)))
            status = NO_MEMORY;
        if (status) break;
        if (here->listed)  /* an empty column may have no list yet: memcpy from NULL is undefined even for 0 bytes */
            memcpy(w->expanded + w->n_expanded, here->list, sizeof(int32_t) * (size_t)here->listed);
        w->columns[p] = w->n_expanded, w->n_expanded += here->listed, w->columns[p + 1] = w->n_expanded;
        w->backs[p] = (uint8_t)here->back, here->back = 0;
    }
    return status;
}

/* Which lattice states are on a complete path (a final state at the end, or an arc to such a state): column by
 * column from the end, each column's states in reverse order of expansion. An arc leads to the next column (done) or
 * to a state of its own listed after its source (done before it), unless the column's back flag says some epsilon
 * arc leads to one listed before: that column is swept again until nothing changes. */
static long mark_live(const Grammar *g, const Workspace *w, long n, uint8_t *live) {
    const Lattice *lat = &w->lat;
    long count = 0;
    memset(live, 0, (size_t)lat->n_states);
    for (long p = n; p >= 0; p--) {
        int changed = 1;
        for (int sweep = 0; changed && (sweep == 0 || w->backs[p]); sweep++) {
            changed = 0;
            for (long k = w->columns[p + 1] - 1; k >= w->columns[p]; k--) {
                int32_t s = w->expanded[k];
                const LatticeState *st = &lat->states[s];
                if (live[s]) continue;
                int alive = p == n && g->final_weight[st->q] != INFINITY;
                for (int32_t j = 0; j < st->count && !alive; j++) alive = live[lat->arcs[st->arcs + j].to];
                if (alive) live[s] = 1, changed = 1, count++;
            }
        }
    }
    return count;
}

/* The live states in depth-first finishing order from state 0, following live states only (*placed of them), and
 * each one's place in it (`rank`). Dead states lead only to dead ones, so a pass through them too would finish the
 * live ones in this same order: it is the finishing order over the trimmed lattice. */
static void finish_order(const Lattice *lat, const uint8_t *live, uint8_t *seen, int32_t *rank, int32_t *stack,
                         int32_t *cursor, int32_t *order, long *placed) {
    long depth = 0;
    *placed = 0;
    stack[0] = 0, cursor[0] = 0, seen[0] = 1;
    while (depth >= 0) {
        const LatticeState *st = &lat->states[stack[depth]];
        if (cursor[depth] < st->count) {
            int32_t t = lat->arcs[st->arcs + cursor[depth]++].to;
            if (live[t] && !seen[t]) seen[t] = 1, depth++, stack[depth] = t, cursor[depth] = 0;
            continue;
        }
        rank[stack[depth]] = (int32_t)*placed;
        order[(*placed)++] = stack[depth--];
    }
}

/* Whether some arc between live states weighs neither 0 nor infinity (OpenFst's AutoQueue takes last in, first out
 * for a lattice with none). */
static int weighted(const Grammar *g, const Lattice *lat, const uint8_t *live, const int32_t *order, long placed) {
    for (long k = 0; k < placed; k++) {
        const LatticeState *st = &lat->states[order[k]];
        for (int32_t j = 0; j < st->count; j++) {
            const LatticeArc *arc = &lat->arcs[st->arcs + j];
            float w = g->weight[arc->arc];
            if (live[arc->to] && w != 0.0f && w != INFINITY) return 1;
        }
    }
    return 0;
}

/* The lightest path over text[0:n): its output labels (those not 0) into the workspace (fst_workspace_output),
 * *out_len of them. `acyclic`: the grammar's file says it is acyclic (OpenFst then knows the lattice is, and takes
 * topological order whatever the weights). Returns 0, NO_READING (no complete path) or NO_MEMORY. */
int fst_best_path(void *workspace, long states, int32_t start, int acyclic, const int32_t *arc_start,
                  const int32_t *olabel, const float *weight, const float *final_weight, const int32_t *epsilons,
                  const int32_t *sorted, const int32_t *first, const uint64_t *sets, const uint8_t *text, long n,
                  long *out_len) {
    Grammar g = {states, start, arc_start, olabel, weight, final_weight, epsilons, sorted, first, sets};
    Workspace *w = workspace;
    long placed = 0, m = 0, best_state = -1;
    float best = INFINITY;
    if (!w || w->grammar_states != states) return NO_MEMORY;
    int status = build(&g, w, text, n);
    if (status) goto done;
    m = w->lat.n_states;
    if (room(w, m, 0)) {
        status = NO_MEMORY;
        goto done;
    }
    long alive = mark_live(&g, w, n, w->live);
    if (!w->live[0]) {
        status = NO_READING;
        goto done;
    }
    if (room(w, m, alive)) {
        status = NO_MEMORY;
        goto done;
    }
    const Lattice lat = w->lat;
    uint8_t *live = w->live, *seen = w->seen;
    int32_t *rank = w->rank, *order = w->order, *stack = w->stack, *parent = w->parent, *source = w->source;
    float *distance = w->distance;
    memset(seen, 0, (size_t)m);
    finish_order(&lat, live, seen, rank, stack, w->cursor, order, &placed);
    for (long r = 0; r < placed; r++) distance[r] = INFINITY, parent[r] = -1;
    distance[placed - 1] = 0.0f;  /* state 0, the start, finishes last */
    int topological = acyclic || weighted(&g, &lat, live, order, placed);
    long pending = 1;  /* last in, first out: the stack of queued ranks; seen: queued */
    if (!topological) stack[0] = (int32_t)(placed - 1), memset(seen, 0, (size_t)m), seen[0] = 1;
    for (long next = placed; topological ? next > 0 : pending > 0;) {
        int32_t r;
        if (topological) {
            r = (int32_t)--next;
            if (distance[r] == INFINITY) continue;  /* never reached: never queued */
        } else {
            r = stack[--pending], seen[order[r]] = 0;
        }
        const LatticeState *st = &lat.states[order[r]];
        float d = distance[r];
        if (st->pos == n && final_weight[st->q] != INFINITY && d + final_weight[st->q] < best)
            best = d + final_weight[st->q], best_state = r;
        for (int32_t k = 0; k < st->count; k++) {
            const LatticeArc *arc = &lat.arcs[st->arcs + k];
            if (!live[arc->to]) continue;
            int32_t to = rank[arc->to];
            float reached = d + weight[arc->arc];
            if (!(reached < distance[to])) continue;
            distance[to] = reached, parent[to] = st->arcs + k, source[to] = r;
            if (!topological && !seen[arc->to]) seen[arc->to] = 1, stack[pending++] = to;
        }
    }
    if (best_state < 0) {
        status = NO_READING;
        goto done;
    }
    long length = 0;
    for (long r = best_state; parent[r] >= 0; r = source[r]) length += olabel[lat.arcs[parent[r]].arc] != 0;
    if (grow((void **)&w->out, &w->cap_out, length, sizeof(int32_t))) {
        status = NO_MEMORY;
        goto done;
    }
    *out_len = length;
    for (long r = best_state, k = length; parent[r] >= 0; r = source[r])
        if (olabel[lat.arcs[parent[r]].arc] != 0) w->out[--k] = olabel[lat.arcs[parent[r]].arc];
done:
    if (w && w->lat.cap_states > KEPT_STATES) release(w);
    return status;
}
