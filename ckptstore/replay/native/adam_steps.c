/* Several consecutive torch.optim.Adam / AdamW steps (the single-tensor "for-loop" path) over
 * one contiguous float32 range, rounding exactly as torch's eager CPU kernels do.
 *
 * Built and loaded by ckptstore/native/build.py; used only after ckptstore/native/adam.py has
 * checked, on this machine and torch build, that it reproduces torch's step bit for bit.
 *
 * Per element, per step s (scalars already rounded to float32 by the caller, as torch rounds a
 * Python scalar operand):
 *   g  = maximize ? -grad : grad
 *   L2 weight decay:        g = fma(p, wd, g)                     torch: grad.add(param, alpha=wd)
 *   decoupled weight decay: p = p * (1 - lr*wd)                   torch: param.mul_(1 - lr*wd)
 *   m = fma(c, g - m, |w| < 0.5 ? m : g), c = w or w - 1         torch: exp_avg.lerp_(g, w = 1-beta1)
 *   v = fma((1-beta2) * g, g, v * beta2)                          torch: v.mul_(b2).addcmul_(g, g, 1-b2)
 *   p = p + (-step_size * m) / (sqrt(v) / bc2_sqrt + eps)         torch: param.addcdiv_(m, denom, -ss)
 * sqrt is the caller's vector square root (torch's own, e.g. MKL's vmsSqrt, which is not always
 * correctly rounded), else sqrtf. Built with -ffp-contract=off: only the fmaf calls fuse.
 * vmsSqrt is correctly rounded on +0 and positive subnormals but takes a slow path on them (7x
 * for zeros, 30x for subnormals on a 2-core EPYC), and a lane's result does not depend on the
 * other lanes; so those lanes take sqrtf and only the others go through vsqrt. (Checked at
 * calibration, whose tensors hold zeros and subnormals, like torch's, see native/adam.py.)
 *
 * Memory: each BLOCK of p, m and v stays in cache for all k steps; only the k gradients stream.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* n as 64 bits: right for MKL's LP64 (int n: the callee reads the low half of the register)
 * and ILP64 (MKL_INT64 n) interfaces alike, since n <= BLOCK */
typedef void (*ckpt_vsqrt_fn)(long long n, const float *in, float *out, long long mode);

enum { CKPT_DECOUPLED = 1, CKPT_WEIGHT_DECAY = 2, CKPT_MAXIMIZE = 4 };
enum { CKPT_SCALARS = 8 }; /* per step: wd_mul, wd, w, beta2, 1-beta2, bc2_sqrt, eps, -step_size */
#define BLOCK 4096

int ckpt_adam_abi(void) { return 3; }

/* A step's gradient over the call's n entries: dense (values at dense[0..n)), or sparse (the
 * entries at positions idx[j] - origin, strictly increasing, values vals[j]; zero elsewhere:
 * a topk payload without its dense decode). */
typedef struct {
    const float *dense;
    const int64_t *idx;
    const float *vals;
    int64_t count;
} ckpt_grad;

/* +0 or a positive subnormal: the lanes vsqrt is slow on and sqrtf gets right */
static inline int tiny(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u < 0x00800000u;
}

/* root[i] = sqrt(v[i]) for i < n, as vsqrt computes it (see the header comment). */
static void block_sqrt(const float *restrict v, float *restrict root, int n, ckpt_vsqrt_fn vsqrt,
                       long long mode) {
    if (!vsqrt) {
        for (int i = 0; i < n; i++) root[i] = sqrtf(v[i]);
        return;
    }
    int tinies = 0;
    for (int i = 0; i < n; i++) tinies += tiny(v[i]);
    if (tinies == 0) {
        vsqrt(n, v, root, mode);
        return;
    }
    int at[BLOCK];
    float packed[BLOCK] __attribute__((aligned(64))), packed_root[BLOCK] __attribute__((aligned(64)));
    for (int i = 0; i < n; i++) root[i] = sqrtf(v[i]);
    int k = 0;
    for (int i = 0; i < n; i++) {
        at[k] = i;
        k += !tiny(v[i]);
    }
    if (k == 0) return;
    for (int j = 0; j < k; j++) packed[j] = v[at[j]];
    vsqrt(k, packed, packed_root, mode);
    for (int j = 0; j < k; j++) root[at[j]] = packed_root[j];
}

/* First j with idx[j] >= x. */
static int64_t lower_bound(const int64_t *idx, int64_t count, int64_t x) {
    int64_t lo = 0, hi = count;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (idx[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* k steps over n entries; sparse gradients' positions are relative to `origin`. At most
 * CKPT_MAX_STEPS steps per call. */
enum { CKPT_MAX_STEPS = 64 };
void ckpt_adam_steps(float *restrict p, float *restrict m, float *restrict v,
                     const ckpt_grad *grads, int64_t origin, int64_t n, int k,
                     const float *scalars, int flags, ckpt_vsqrt_fn vsqrt, long long vsqrt_mode) {
    float root[BLOCK] __attribute__((aligned(64)));
    float sparse_block[BLOCK] __attribute__((aligned(64)));
    int64_t cursor[CKPT_MAX_STEPS];
    if (k > CKPT_MAX_STEPS) return;
    for (int s = 0; s < k; s++)
        cursor[s] = grads[s].dense ? 0 : lower_bound(grads[s].idx, grads[s].count, origin);
    const int decoupled = flags & CKPT_DECOUPLED, decay = flags & CKPT_WEIGHT_DECAY;
    const float sign = (flags & CKPT_MAXIMIZE) ? -1.0f : 1.0f;
    for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
        const int nb = (int)(n - i0 < BLOCK ? n - i0 : BLOCK);
        float *restrict pb = p + i0, *restrict mb = m + i0, *restrict vb = v + i0;
        for (int s = 0; s < k; s++) {
            const float *restrict g;
            if (grads[s].dense) {
                g = grads[s].dense + i0;
            } else {  /* scatter this block's entries into a zeroed block */
                const int64_t end = origin + i0 + nb;
                memset(sparse_block, 0, sizeof(float) * (size_t)nb);
                int64_t j = cursor[s];
                for (; j < grads[s].count && grads[s].idx[j] < end; j++) {
                    /* the caller passes increasing positions; skipping any below the block
                     * keeps every write inside it even if one did not */
                    const int64_t at = grads[s].idx[j] - origin - i0;
                    if (at >= 0) sparse_block[at] = grads[s].vals[j];
                }
                cursor[s] = j;
                g = sparse_block;
            }
            const float *c = scalars + CKPT_SCALARS * s;
            const float wd_mul = c[0], wd = c[1], w = c[2], beta2 = c[3], one_minus_beta2 = c[4],
                        bc2_sqrt = c[5], eps = c[6], neg_step = c[7];
            const int small = fabsf(w) < 0.5f;
            const float coeff = small ? w : w - 1.0f;
            if (decay && !decoupled) {
                if (small)
                    for (int i = 0; i < nb; i++) {
                        const float gi = fmaf(pb[i], wd, sign * g[i]);
                        mb[i] = fmaf(coeff, gi - mb[i], mb[i]);
                        vb[i] = fmaf(one_minus_beta2 * gi, gi, vb[i] * beta2);
                    }
                else
                    for (int i = 0; i < nb; i++) {
                        const float gi = fmaf(pb[i], wd, sign * g[i]);
                        mb[i] = fmaf(coeff, gi - mb[i], gi);
                        vb[i] = fmaf(one_minus_beta2 * gi, gi, vb[i] * beta2);
                    }
            } else {
                if (decay)
                    for (int i = 0; i < nb; i++) pb[i] = pb[i] * wd_mul;
                if (small)
                    for (int i = 0; i < nb; i++) {
                        const float gi = sign * g[i];
                        mb[i] = fmaf(coeff, gi - mb[i], mb[i]);
                        vb[i] = fmaf(one_minus_beta2 * gi, gi, vb[i] * beta2);
                    }
                else
                    for (int i = 0; i < nb; i++) {
                        const float gi = sign * g[i];
                        mb[i] = fmaf(coeff, gi - mb[i], gi);
                        vb[i] = fmaf(one_minus_beta2 * gi, gi, vb[i] * beta2);
                    }
            }
            block_sqrt(vb, root, nb, vsqrt, vsqrt_mode);
            for (int i = 0; i < nb; i++) pb[i] = pb[i] + neg_step * mb[i] / (root[i] / bc2_sqrt + eps);
        }
    }
}
