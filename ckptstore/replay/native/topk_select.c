/* Top-k selection by threshold for the topk gradient codec (ckptstore/replay/gradcodecs.py):
 * one pass over a float32 gradient that keeps every entry whose magnitude is not below a
 * threshold (NaN entries are kept, as torch.topk keeps them) and measures, in the same pass,
 * what the codec records about the error (format-spec/deltas.md, "err").
 *
 * ckpt_topk_select(x, n, thr, base, idx, vals, cap, stats) scans x[0..n):
 *   kept(i)  = thr > 0 ? !(|x[i]| < thr) : !(|x[i]| <= 0)     (the torch path's rule)
 *   idx[c] = base + i and vals[c] = x[i] (its exact bits) for the c-th kept entry, c < cap;
 *   stats[0] += sum of x[i]^2 over all entries, stats[1] += over dropped entries (doubles),
 *   stats[2] = max(stats[2], max |x[i]| over dropped entries);
 * and returns the number of kept entries (which may exceed cap: then only cap were written and
 * the caller falls back). Indices are increasing. No allocation, no global state: calls on
 * disjoint ranges run concurrently (ctypes releases the GIL).
 */
#include <math.h>
#include <stdint.h>

int ckpt_topk_abi(void) { return 1; }

/* Kept entries are rare (~1%): the selection branch is predictable, and the sums run in eight
 * independent lanes so that they are not bound by the latency of one chain of additions. */
#define LANES 8

int64_t ckpt_topk_select(const float *x, int64_t n, float thr, int64_t base, int64_t *idx,
                         float *vals, int64_t cap, double *stats) {
    int64_t c = 0;
    double all[LANES] = {0}, kept_sq = 0.0;  /* all[]: squares of the dropped entries */
    float maxd[LANES] = {0};
    int positive = thr > 0.0f;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int l = 0; l < LANES; l++) {
            float v = x[i + l];
            float a = fabsf(v);
            int drop = positive ? a < thr : a <= 0.0f;
            float dropped = drop ? a : 0.0f;
            all[l] += (double)dropped * (double)dropped;
            maxd[l] = dropped > maxd[l] ? dropped : maxd[l];
        }
        for (int l = 0; l < LANES; l++) {
            float v = x[i + l];
            float a = fabsf(v);
            if (positive ? !(a < thr) : !(a <= 0.0f)) {
                if (c < cap) {
                    idx[c] = base + i + l;
                    vals[c] = v;
                }
                kept_sq += (double)v * (double)v;
                c++;
            }
        }
    }
    for (; i < n; i++) {
        float v = x[i];
        float a = fabsf(v);
        if (positive ? !(a < thr) : !(a <= 0.0f)) {
            if (c < cap) {
                idx[c] = base + i;
                vals[c] = v;
            }
            kept_sq += (double)v * (double)v;
            c++;
        } else {
            all[0] += (double)a * (double)a;
            if (a > maxd[0]) maxd[0] = a;
        }
    }
    double dropped_sq = 0.0;
    float m = (float)stats[2];
    for (int l = 0; l < LANES; l++) {
        dropped_sq += all[l];
        if (maxd[l] > m) m = maxd[l];
    }
    /* NaN entries are kept: the dropped sum stays finite, the total is NaN, as in torch's path */
    stats[0] += dropped_sq + kept_sq;
    stats[1] += dropped_sq;
    stats[2] = (double)m;
    return c;
}
