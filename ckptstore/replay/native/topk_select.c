/* Top-k selection by threshold for the topk gradient codec (ckptstore/replay/gradcodecs.py):
 * one pass over a float32 gradient that keeps every entry whose magnitude is not below a
 * threshold (NaN entries are kept, as torch.topk keeps them) and measures, in the same pass,
 * what the codec records about the error (format-spec/deltas.md, "err").
 *
 * ckpt_topk_select(x, n, thr, base, idx, idx_bytes, vals, cap, stats) scans x[0..n):
 *   kept(i)  = thr > 0 ? !(|x[i]| < thr) : !(|x[i]| <= 0)     (the torch path's rule)
 *   idx[c] = base + i (int32 when idx_bytes is 4, else int64) and vals[c] = x[i] (its exact
 *   bits) for the c-th kept entry, c < cap;
 *   stats[0] += sum of x[i]^2 over all entries, stats[1] += over dropped entries (doubles),
 *   stats[2] = max(stats[2], max |x[i]| over dropped entries);
 * and returns the number of kept entries (which may exceed cap: then only cap were written and
 * the caller falls back). Indices are increasing. No allocation, no global state: calls on
 * disjoint ranges run concurrently (ctypes releases the GIL).
 */
#include <float.h>
#include <math.h>
#include <string.h>
#include <stdint.h>

int ckpt_topk_abi(void) { return 4; }

/* ckpt_topk_kth_magnitude(x, n, pos, m, keep, keys, out) sets *out to the keep-th largest of
 * |x[pos[0..m)]| (of every entry, |x[0..n)|, when pos is NULL: then m must be n) and returns 0;
 * it returns -1 (out untouched) unless 1 <= keep <= m, and -2 when a position lies outside
 * [0, n) (checked while gathering: nothing is read out of bounds).
 * NaN is counted as larger than every number (a NaN's key is its bits): what
 * torch.topk(sample.abs(), keep).values[-1] gives for the codec's sampled threshold
 * (gradcodecs._sampled_threshold). A magnitude's bits (the sign cleared) order as the magnitudes
 * do, +inf below every NaN, so this is a selection on unsigned keys: an MSB-first radix select,
 * 11 + 11 + 10 bits, each pass over the keys still in the candidate bucket (no degenerate case:
 * ties, zeros and NaN cost what any sample costs). ``keys`` is caller scratch of m uint32. */
int ckpt_topk_kth_magnitude(const float *x, int64_t n, const int64_t *pos, int64_t m,
                            int64_t keep, uint32_t *keys, float *out) {
    if (keep < 1 || keep > m || (pos == NULL && m != n)) return -1;
    for (int64_t i = 0; i < m; i++) {
        int64_t at = pos == NULL ? i : pos[i];
        if ((uint64_t)at >= (uint64_t)n) return -2;
        uint32_t b;
        memcpy(&b, x + at, sizeof b);
        keys[i] = b & 0x7fffffffu;
    }
    static const int shifts[3] = {21, 10, 0};
    static const int widths[3] = {11, 11, 10};
    uint32_t prefix = 0, prefix_mask = 0;
    int64_t live = m;                       /* keys[0..live) match prefix under prefix_mask */
    int64_t rank = keep;                    /* the rank-th largest of the live keys is the answer */
    for (int p = 0; p < 3; p++) {
        int64_t count[2048] = {0};
        const int sh = shifts[p];
        const uint32_t bucket_mask = (1u << widths[p]) - 1u;
        for (int64_t i = 0; i < live; i++) count[(keys[i] >> sh) & bucket_mask]++;
        int64_t b = (int64_t)bucket_mask, above = 0;
        while (above + count[b] < rank) above += count[b--];
        rank -= above;
        prefix |= (uint32_t)b << sh;
        prefix_mask |= bucket_mask << sh;
        if (p == 2) break;                  /* every bit is chosen */
        int64_t w = 0;
        for (int64_t i = 0; i < live; i++)
            if ((keys[i] & prefix_mask) == prefix) keys[w++] = keys[i];
        live = w;
    }
    memcpy(out, &prefix, sizeof *out);
    return 0;
}

/* Kept entries are rare (~1%). Blocks of 32 entries (four vectors of 8) are reduced branch-free
 * with GCC/clang vector extensions: the dropped entries' squares in float lanes (four
 * independent accumulators, so the adds do not wait on each other), flushed into doubles every
 * FLUSH entries so that no float lane sums more than FLUSH/32 squares, and their largest
 * magnitude. A block holding a kept entry gets a 32-bit mask of its kept lanes, and only those
 * entries are emitted (in increasing order: lowest set bit first). A run whose float sum falls
 * outside [1e-30, 1e30] (or 0 while a dropped entry is not) is summed again in double, as
 * gradcodecs.sum_of_squares does. "dropped"
 * is |x| < t with t = thr when thr > 0, else the smallest positive float: for magnitudes (and
 * NaN, for which every comparison is false) that is exactly the rule above. A dropped entry's
 * masked magnitude is a non-negative float, never NaN, so its bits order as its value does and
 * the running maximum is an integer comparison. */
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef int64_t vl4 __attribute__((vector_size(32)));
#define FLUSH 512
/* a float run's sum of squares outside this range may have overflowed or lost precision */
#define SQUARES_SAFE_LOW 1e-30
#define SQUARES_SAFE_HIGH 1e30

/* bit l set where lane l of ``kept`` (0 or -1 per lane) is set */
static inline uint32_t lane_mask(vi8 kept) {
#if defined(__AVX__)
    return (uint32_t)__builtin_ia32_movmskps256((vf8)kept);
#else
    uint32_t m = 0;
    for (int l = 0; l < 8; l++) m |= (uint32_t)(kept[l] & 1) << l;
    return m;
#endif
}

static inline void put_index(void *idx, int idx_bytes, int64_t c, int64_t at) {
    if (idx_bytes == 4)
        ((int32_t *)idx)[c] = (int32_t)at;
    else
        ((int64_t *)idx)[c] = at;
}

int64_t ckpt_topk_select(const float *x, int64_t n, float thr, int64_t base, void *idx,
                         int idx_bytes, float *vals, int64_t cap, double *stats) {
    const float t = thr > 0.0f ? thr : FLT_TRUE_MIN;
    const vf8 tv = {t, t, t, t, t, t, t, t};
    const vi8 absmask = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff,
                         0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
    vi8 maxv[4] = {{0}, {0}, {0}, {0}};     /* bits of non-negative floats */
    int64_t c = 0;
    double dropped_sq = 0.0, kept_sq = 0.0;
    int64_t i = 0;
    while (i + 32 <= n) {
        vf8 acc[4] = {{0}, {0}, {0}, {0}};
        vi8 seen = {0};                     /* nonzero where a dropped entry was nonzero */
        int64_t start = i;
        int64_t stop = i + FLUSH <= n ? i + FLUSH : n - (n - i) % 32;
        for (; i < stop; i += 32) {
            vi8 keep[4];
            for (int q = 0; q < 4; q++) {
                vf8 v;
                memcpy(&v, x + i + 8 * q, sizeof v);
                vi8 a = (vi8)v & absmask;
                vi8 drop = (vf8)a < tv;             /* -1 where dropped */
                vi8 d = a & drop;
                acc[q] += (vf8)d * (vf8)d;
                seen |= d;
                vi8 more = d > maxv[q];
                maxv[q] = (d & more) | (maxv[q] & ~more);
                keep[q] = ~drop;
            }
            vl4 any = (vl4)(keep[0] | keep[1] | keep[2] | keep[3]);
            if (any[0] | any[1] | any[2] | any[3]) {
                uint32_t m = lane_mask(keep[0]) | lane_mask(keep[1]) << 8 |
                             lane_mask(keep[2]) << 16 | lane_mask(keep[3]) << 24;
                while (m) {
                    int l = __builtin_ctz(m);
                    m &= m - 1;
                    float v = x[i + l];
                    if (c < cap) {
                        put_index(idx, idx_bytes, c, base + i + l);
                        vals[c] = v;
                    }
                    kept_sq += (double)v * (double)v;
                    c++;
                }
            }
        }
        vf8 sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        double s = 0.0;
        for (int l = 0; l < 8; l++) s += (double)sum[l];
        vl4 nonzero = (vl4)seen;
        if ((s != 0.0 || (nonzero[0] | nonzero[1] | nonzero[2] | nonzero[3])) &&
                !(s >= SQUARES_SAFE_LOW && s <= SQUARES_SAFE_HIGH)) {
            /* squares that overflow, turn subnormal or vanish in float (every one of a run
             * underflowing to 0 while its entries are not 0): this run again in double */
            s = 0.0;
            for (int64_t j = start; j < stop; j++) {
                double a = fabs((double)x[j]);
                if (a < (double)t) s += a * a;
            }
        }
        dropped_sq += s;
    }
    float m = (float)stats[2];
    for (int q = 0; q < 4; q++)
        for (int l = 0; l < 8; l++) {
            float lane;
            memcpy(&lane, (const int32_t *)&maxv[q] + l, sizeof lane);
            if (lane > m) m = lane;
        }
    for (; i < n; i++) {
        float v = x[i];
        float a = fabsf(v);
        if (!(a < t)) {
            if (c < cap) {
                put_index(idx, idx_bytes, c, base + i);
                vals[c] = v;
            }
            kept_sq += (double)v * (double)v;
            c++;
        } else {
            dropped_sq += (double)a * (double)a;
            if (a > m) m = a;
        }
    }
    /* NaN entries are kept: the dropped sum stays finite, the total is NaN, as in torch's path */
    stats[0] += dropped_sq + kept_sq;
    stats[1] += dropped_sq;
    stats[2] = (double)m;
    return c;
}

/* ckpt_topk_exact(x, n, k, idx, idx_bytes, vals, stats, keys) keeps exactly k entries of x[0..n)
 * (1 <= k <= n, else returns -1): every entry whose magnitude key (its bits, sign cleared: NaN
 * above +inf) is above the k-th largest key T, then entries whose key equals T in increasing
 * index order until k are kept (gradcodecs._largest's rule for the exact path). Writes idx, vals
 * and stats as ckpt_topk_select does (stats start at 0) and returns k. ``keys``: scratch of n. */
int64_t ckpt_topk_exact(const float *x, int64_t n, int64_t k, void *idx, int idx_bytes,
                        float *vals, double *stats, uint32_t *keys) {
    float kth;
    if (ckpt_topk_kth_magnitude(x, n, NULL, n, k, keys, &kth) != 0) return -1;
    uint32_t t;
    memcpy(&t, &kth, sizeof t);
    int64_t above = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, sizeof b);
        above += (b & 0x7fffffffu) > t;
    }
    int64_t ties = k - above, c = 0;       /* equal keys still to keep, front to back */
    double dropped_sq = 0.0, kept_sq = 0.0;
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        uint32_t b;
        memcpy(&b, &v, sizeof b);
        b &= 0x7fffffffu;
        if (b > t || (b == t && ties > 0)) {
            if (b == t) ties--;
            put_index(idx, idx_bytes, c, i);
            vals[c++] = v;
            kept_sq += (double)v * (double)v;
        } else {
            float a = fabsf(v);            /* NaN only when more NaNs than k: then it sticks, */
            dropped_sq += (double)a * (double)a;  /* as torch's max and sum propagate it */
            if (a > m || a != a) m = a;
        }
    }
    stats[0] = dropped_sq + kept_sq;
    stats[1] = dropped_sq;
    stats[2] = (double)m;
    return c;
}

/* One gradient's whole selection for ckpt_topk_run: the threshold is the keep-th largest sampled
 * magnitude (ckpt_topk_kth_magnitude over x[pos[0..m)], scratch ``keys``), then the pass
 * (ckpt_topk_select with base 0); or, when pos is NULL, exactly ``keep`` entries
 * (ckpt_topk_exact, scratch ``keys`` of n). Outputs: ``status`` (0, or kth_magnitude's -1 / -2:
 * then nothing else is meaningful), ``threshold`` (sampled only), ``kept`` and ``stats`` as the
 * selection leaves them (stats start at 0). The layout is mirrored by ctypes in
 * ckptstore/replay/native/topk.py. */
typedef struct {
    const float *x;
    int64_t n;
    const int64_t *pos;                     /* NULL: exactly ``keep`` entries (ckpt_topk_exact) */
    int64_t m;
    int64_t keep;
    void *idx;
    float *vals;
    int64_t cap;
    uint32_t *keys;
    int32_t idx_bytes;
    int32_t status;
    int64_t kept;
    double stats[3];
    float threshold;
} ckpt_topk_job;

/* Runs jobs[0..count) in order on the calling thread (one call per worker thread: a batch of
 * gradients costs one crossing into C instead of two per gradient). */
void ckpt_topk_run(ckpt_topk_job *jobs, int64_t count) {
    for (int64_t j = 0; j < count; j++) {
        ckpt_topk_job *job = jobs + j;
        job->stats[0] = job->stats[1] = job->stats[2] = 0.0;
        job->kept = 0;
        if (job->pos == NULL) {
            job->kept = ckpt_topk_exact(job->x, job->n, job->keep, job->idx, job->idx_bytes,
                                        job->vals, job->stats, job->keys);
            job->status = job->kept < 0 ? -1 : 0;
            continue;
        }
        job->status = ckpt_topk_kth_magnitude(job->x, job->n, job->pos, job->m, job->keep,
                                              job->keys, &job->threshold);
        if (job->status != 0) continue;
        job->kept = ckpt_topk_select(job->x, job->n, job->threshold, 0, job->idx, job->idx_bytes,
                                     job->vals, job->cap, job->stats);
    }
}
