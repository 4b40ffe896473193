/*
 * Runs the kernels of gptq.cu on the host, for tests/kernels.rs and tests/gpu_session.rs (no GPU needed): the
 * file is included as C with GPTQ_HOST, and each launch runs every block in turn with one coroutine
 * (ucontext) per device thread on the calling thread. __syncthreads hands over to the next thread of the
 * block; once every thread has reached it (or returned), the threads go on, in turn again: the barrier's
 * meaning on a card. The order alternates between ascending and descending thread index from one barrier
 * interval to the next, so a read of another thread's write that lacks its barrier sees the stale value in
 * one of the two orders. __shared__ arrays are static (one block runs at a time, so they are the block's
 * shared memory); threadIdx/blockIdx are set for the running thread. Products and sums are plain C
 * operations; the test build passes -ffp-contract=off so none is fused, like __fmul_rn/__fadd_rn.
 * (Coroutines instead of one OS thread per device thread: a block of 256 threads meeting at a barrier on a
 * 2-core machine spent most of the test time switching threads.)
 *
 * Build (the test does this): cc -std=c11 -O2 -ffp-contract=off -fPIC -shared -pthread host_harness.c -lm
 * Each exported gptq_host_* function returns 0, or -1 when the coroutines could not be set up.
 */
#define GPTQ_HOST 1
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

typedef struct {
    int x, y, z;
} gptq_dim3;

static gptq_dim3 threadIdx, blockIdx;
static gptq_dim3 blockDim, gridDim;
/* One launch at a time in the process: the coroutines, the shared arrays and blockDim are global. */
static pthread_mutex_t gptq_launch_lock = PTHREAD_MUTEX_INITIALIZER;

static ucontext_t gptq_scheduler;
static ucontext_t *gptq_fibers;
static int gptq_current;

/* Back to the scheduler until every thread of the block has arrived. */
static void gptq_syncthreads(void) { swapcontext(&gptq_fibers[gptq_current], &gptq_scheduler); }

#define __syncthreads() gptq_syncthreads()
#define __shared__ static
#define GPTQ_KERNEL static
#define GPTQ_DEVICE static inline
#define GPTQ_MUL(a, b) ((a) * (b))
#define GPTQ_ADD(a, b) ((a) + (b))
#define GPTQ_SUB(a, b) ((a) - (b))
#define GPTQ_DIV(a, b) ((a) / (b))

#include "gptq.cu"

typedef void (*gptq_body)(void *args);

struct thread_ctx {
    gptq_dim3 tid;
    gptq_body body;
    void *args;
    int done;
};

static struct thread_ctx *gptq_threads;

static void fiber_main(void)
{
    struct thread_ctx *c = &gptq_threads[gptq_current];
    c->body(c->args);
    c->done = 1;
    /* returning resumes uc_link: the scheduler */
}

enum { FIBER_STACK = 64 * 1024 };

/* Emulated launch: blocks one after another, each block's threads as coroutines (see the top). */
static int launch(gptq_dim3 grid, gptq_dim3 block, gptq_body body, void *args)
{
    int nt = block.x * block.y * block.z;
    ucontext_t *fibers = (ucontext_t *)calloc((size_t)nt, sizeof(ucontext_t));
    struct thread_ctx *ctx = (struct thread_ctx *)calloc((size_t)nt, sizeof(struct thread_ctx));
    char *stacks = (char *)malloc((size_t)nt * FIBER_STACK);
    int rc = 0;
    if (!fibers || !ctx || !stacks) {
        free(fibers);
        free(ctx);
        free(stacks);
        return -1;
    }
    pthread_mutex_lock(&gptq_launch_lock);
    gridDim = grid;
    blockDim = block;
    gptq_fibers = fibers;
    gptq_threads = ctx;
    for (int bz = 0; bz < grid.z && rc == 0; ++bz)
        for (int by = 0; by < grid.y && rc == 0; ++by)
            for (int bx = 0; bx < grid.x && rc == 0; ++bx) {
                int t = 0;
                for (int tz = 0; tz < block.z; ++tz)
                    for (int ty = 0; ty < block.y; ++ty)
                        for (int tx = 0; tx < block.x; ++tx, ++t) {
                            struct thread_ctx *c = &ctx[t];
                            c->tid.x = tx;
                            c->tid.y = ty;
                            c->tid.z = tz;
                            c->body = body;
                            c->args = args;
                            c->done = 0;
                            if (getcontext(&fibers[t]) != 0) {
                                rc = -1;
                                break;
                            }
                            fibers[t].uc_stack.ss_sp = stacks + (size_t)t * FIBER_STACK;
                            fibers[t].uc_stack.ss_size = FIBER_STACK;
                            fibers[t].uc_link = &gptq_scheduler;
                            makecontext(&fibers[t], fiber_main, 0);
                        }
                if (rc != 0)
                    break;
                blockIdx.x = bx;
                blockIdx.y = by;
                blockIdx.z = bz;
                /* One round per barrier interval: every thread not done runs to its next barrier or end. */
                for (int round = 0, live = nt; live > 0; ++round) {
                    live = 0;
                    for (int k = 0; k < nt; ++k) {
                        int i = (round & 1) ? nt - 1 - k : k;
                        if (ctx[i].done)
                            continue;
                        gptq_current = i;
                        threadIdx = ctx[i].tid;
                        swapcontext(&gptq_scheduler, &fibers[i]);
                        if (!ctx[i].done)
                            ++live;
                    }
                }
            }
    gptq_fibers = NULL;
    gptq_threads = NULL;
    pthread_mutex_unlock(&gptq_launch_lock);
    free(fibers);
    free(ctx);
    free(stacks);
    return rc;
}

static int cdiv(int a, int b) { return (a + b - 1) / b; }

struct hessian_args {
    float *h;
    int ldh;
    const float *x;
    int ldx, tokens, n;
    float alpha;
};

static void hessian_body(void *p)
{
    struct hessian_args *a = (struct hessian_args *)p;
    gptq_hessian_lower(a->h, a->ldh, a->x, a->ldx, a->tokens, a->n, a->alpha);
}

int gptq_host_hessian_lower(float *h, int ldh, const float *x, int ldx, int tokens, int n, float alpha)
{
    struct hessian_args a = {h, ldh, x, ldx, tokens, n, alpha};
    gptq_dim3 grid = {cdiv(n, GPTQ_WIDE_TILE), cdiv(n, GPTQ_WIDE_TILE), 1},
              block = {GPTQ_TILE, GPTQ_TILE, 1};
    return launch(grid, block, hessian_body, &a);
}

struct mirror_args {
    float *h;
    int ldh, n;
};

static void mirror_body(void *p)
{
    struct mirror_args *a = (struct mirror_args *)p;
    gptq_mirror_lower(a->h, a->ldh, a->n);
}

int gptq_host_mirror_lower(float *h, int ldh, int n)
{
    struct mirror_args a = {h, ldh, n};
    gptq_dim3 grid = {cdiv(n, GPTQ_TILE), cdiv(n, GPTQ_TILE), 1}, block = {GPTQ_TILE, GPTQ_TILE, 1};
    return launch(grid, block, mirror_body, &a);
}

struct update_args {
    float *w;
    int ldw;
    const float *d;
    int ldd;
    const float *f;
    long long f_rs, f_cs;
    int rows, k, cols;
};

static void update_body(void *p)
{
    struct update_args *a = (struct update_args *)p;
    gptq_block_update(a->w, a->ldw, a->d, a->ldd, a->f, a->f_rs, a->f_cs, a->rows, a->k, a->cols);
}

int gptq_host_block_update(float *w, int ldw, const float *d, int ldd, const float *f, long long f_rs,
                           long long f_cs, int rows, int k, int cols)
{
    struct update_args a = {w, ldw, d, ldd, f, f_rs, f_cs, rows, k, cols};
    gptq_dim3 grid = {cdiv(cols, GPTQ_WIDE_TILE), cdiv(rows, GPTQ_WIDE_TILE), 1},
              block = {GPTQ_TILE, GPTQ_TILE, 1};
    return launch(grid, block, update_body, &a);
}

struct sweep_args {
    const float *w;
    int ldw;
    const float *w0;
    int ld0;
    float *d;
    int ldd;
    unsigned char *codes;
    int ldq;
    const float *coef, *rdiag2;
    const int *param;
    const float *scale, *zero;
    int rows, count;
    float maxq;
    float *acc;
};

static void sweep_body(void *p)
{
    struct sweep_args *a = (struct sweep_args *)p;
    gptq_sweep_block(a->w, a->ldw, a->w0, a->ld0, a->d, a->ldd, a->codes, a->ldq, a->coef, a->rdiag2, a->param,
                     a->scale, a->zero, a->rows, a->count, a->maxq, a->acc);
}

int gptq_host_sweep_block(const float *w, int ldw, const float *w0, int ld0, float *d, int ldd,
                          unsigned char *codes, int ldq, const float *coef, const float *rdiag2, const int *param,
                          const float *scale, const float *zero, int rows, int count, float maxq, float *acc)
{
    struct sweep_args a = {w, ldw, w0, ld0, d, ldd, codes, ldq, coef, rdiag2, param, scale, zero, rows, count, maxq, acc};
    gptq_dim3 grid = {cdiv(rows, GPTQ_SWEEP_THREADS), 1, 1}, block = {GPTQ_SWEEP_THREADS, 1, 1};
    return launch(grid, block, sweep_body, &a);
}

struct snapshot_args {
    float *snap;
    int lds;
    float *xs;
    int ldx;
    const float *p;
    int ldp;
    const float *w0;
    int ld0;
    const float *coef;
    int width, rows;
};

static void snapshot_body(void *p)
{
    struct snapshot_args *a = (struct snapshot_args *)p;
    gptq_block_snapshot(a->snap, a->lds, a->xs, a->ldx, a->p, a->ldp, a->w0, a->ld0, a->coef, a->width, a->rows);
}

int gptq_host_block_snapshot(float *snap, int lds, float *xs, int ldx, const float *p, int ldp, const float *w0,
                             int ld0, const float *coef, int width, int rows)
{
    struct snapshot_args a = {snap, lds, xs, ldx, p, ldp, w0, ld0, coef, width, rows};
    gptq_dim3 grid = {cdiv(rows, GPTQ_SWEEP_THREADS), 1, 1}, block = {GPTQ_SWEEP_THREADS, 1, 1};
    return launch(grid, block, snapshot_body, &a);
}

struct params_args {
    const float *snap;
    int lds, ncols, rows;
    float maxq;
    int sym;
    float *scale, *zero;
};

static void params_body(void *p)
{
    struct params_args *a = (struct params_args *)p;
    gptq_group_params(a->snap, a->lds, a->ncols, a->rows, a->maxq, a->sym, a->scale, a->zero);
}

int gptq_host_group_params(const float *snap, int lds, int ncols, int rows, float maxq, int sym, float *scale,
                           float *zero)
{
    struct params_args a = {snap, lds, ncols, rows, maxq, sym, scale, zero};
    gptq_dim3 grid = {cdiv(rows, GPTQ_SWEEP_THREADS), 1, 1}, block = {GPTQ_SWEEP_THREADS, 1, 1};
    return launch(grid, block, params_body, &a);
}

/* The kernels' block geometry, so the test can check it against what it assumes. */
int gptq_host_max_block(void) { return GPTQ_MAX_BLOCK; }

/*
 * Launch by entry name with the driver APIs' calling convention (cuLaunchKernel / hipModuleLaunchKernel):
 * `params[i]` points at the value of argument i. This is what the device session's host vendor calls
 * (tests/gpu_session.rs), so the session's argument lists and launch geometry are the ones a GPU gets.
 * Returns 0, -1 when a thread could not be started, -2 for an unknown name or a count that is not the
 * kernel's.
 */
#define P(i, t) (*(t *)params[i])
#define BODY(name, call)                                                                                       \
    static void name##_launch(void *a)                                                                         \
    {                                                                                                          \
        void **params = (void **)a;                                                                            \
        call;                                                                                                  \
    }
BODY(hessian, gptq_hessian_lower(P(0, float *), P(1, int), P(2, const float *), P(3, int), P(4, int), P(5, int),
                                 P(6, float)))
BODY(mirror, gptq_mirror_lower(P(0, float *), P(1, int), P(2, int)))
BODY(update, gptq_block_update(P(0, float *), P(1, int), P(2, const float *), P(3, int), P(4, const float *),
                               P(5, long long), P(6, long long), P(7, int), P(8, int), P(9, int)))
BODY(sweep, gptq_sweep_block(P(0, const float *), P(1, int), P(2, const float *), P(3, int), P(4, float *),
                             P(5, int), P(6, unsigned char *), P(7, int), P(8, const float *), P(9, const float *),
                             P(10, const int *), P(11, const float *), P(12, const float *), P(13, int), P(14, int),
                             P(15, float), P(16, float *)))
BODY(fill, gptq_factor_fill(P(0, float *), P(1, int), P(2, const float *), P(3, int), P(4, const float *),
                            P(5, int)))
BODY(panel_diag, gptq_chol_panel_diag(P(0, float *), P(1, int), P(2, int), P(3, int), P(4, int), P(5, float *),
                                     P(6, int *)))
BODY(panel_rows, gptq_chol_panel_rows(P(0, float *), P(1, int), P(2, int), P(3, int), P(4, int), P(5, const float *),
                                     P(6, const int *)))
BODY(chol_trailing,
     gptq_chol_trailing(P(0, float *), P(1, int), P(2, int), P(3, int), P(4, int), P(5, const int *)))
BODY(scale, gptq_factor_scale(P(0, float *), P(1, int), P(2, int), P(3, const float *), P(4, int *)))
BODY(gather, gptq_gather_coef(P(0, float *), P(1, const float *), P(2, int), P(3, int), P(4, int), P(5, int)))
BODY(snapshot, gptq_block_snapshot(P(0, float *), P(1, int), P(2, float *), P(3, int), P(4, const float *),
                                   P(5, int), P(6, const float *), P(7, int), P(8, const float *), P(9, int),
                                   P(10, int)))
BODY(group_params, gptq_group_params(P(0, const float *), P(1, int), P(2, int), P(3, int), P(4, float), P(5, int),
                                     P(6, float *), P(7, float *)))
BODY(pivots, gptq_factor_pivots(P(0, const float *), P(1, int), P(2, int), P(3, float *), P(4, int *)))
BODY(prepare_rows, gptq_prepare_rows(P(0, float *), P(1, int), P(2, int), P(3, int *), P(4, float *)))
BODY(permute_sym, gptq_permute_sym(P(0, const float *), P(1, int), P(2, float *), P(3, int), P(4, const int *),
                                   P(5, int)))
BODY(gather_panel, gptq_gather_panel(P(0, float *), P(1, int), P(2, const float *), P(3, int), P(4, int), P(5, int),
                                     P(6, int), P(7, int), P(8, int)))

BODY(fwd_rms_norm, fwd_rms_norm(P(0, const float *), P(1, int), P(2, float *), P(3, int), P(4, const float *),
                                 P(5, int), P(6, int), P(7, float)))
BODY(fwd_head_norm, fwd_head_norm(P(0, float *), P(1, int), P(2, int), P(3, int), P(4, const float *), P(5, int),
                                   P(6, float)))
BODY(fwd_rope, fwd_rope(P(0, float *), P(1, int), P(2, int), P(3, int), P(4, int), P(5, const float *),
                         P(6, const float *)))
BODY(fwd_softmax, fwd_softmax(P(0, float *), P(1, int), P(2, long long), P(3, int), P(4, int), P(5, int), P(6, float),
                               P(7, int), P(8, float)))
BODY(fwd_act_mul, fwd_act_mul(P(0, float *), P(1, int), P(2, const float *), P(3, int), P(4, int), P(5, int),
                               P(6, int)))
BODY(fwd_add, fwd_add(P(0, float *), P(1, int), P(2, const float *), P(3, int), P(4, int), P(5, int)))
BODY(fwd_add_bias, fwd_add_bias(P(0, float *), P(1, int), P(2, const float *), P(3, int), P(4, int)))
BODY(fwd_affine, fwd_affine(P(0, float *), P(1, int), P(2, int), P(3, int), P(4, float), P(5, float)))

static const struct {
    const char *name;
    gptq_body body;
    int nargs;
} gptq_entries[] = {
    {"gptq_hessian_lower", hessian_launch, 7},  {"gptq_mirror_lower", mirror_launch, 3},
    {"gptq_block_update", update_launch, 10},   {"gptq_sweep_block", sweep_launch, 17},
    {"gptq_factor_fill", fill_launch, 6},       {"gptq_chol_panel_diag", panel_diag_launch, 7},
    {"gptq_chol_panel_rows", panel_rows_launch, 7}, {"gptq_factor_scale", scale_launch, 5},
    {"gptq_gather_coef", gather_launch, 6},     {"gptq_chol_trailing", chol_trailing_launch, 6},
    {"gptq_block_snapshot", snapshot_launch, 11}, {"gptq_group_params", group_params_launch, 8},
    {"gptq_factor_pivots", pivots_launch, 5},   {"gptq_gather_panel", gather_panel_launch, 9},
    {"gptq_prepare_rows", prepare_rows_launch, 5}, {"gptq_permute_sym", permute_sym_launch, 6},
    {"fwd_rms_norm", fwd_rms_norm_launch, 8},   {"fwd_head_norm", fwd_head_norm_launch, 7},
    {"fwd_rope", fwd_rope_launch, 7},           {"fwd_softmax", fwd_softmax_launch, 9},
    {"fwd_act_mul", fwd_act_mul_launch, 7},     {"fwd_add", fwd_add_launch, 6},
    {"fwd_add_bias", fwd_add_bias_launch, 5},   {"fwd_affine", fwd_affine_launch, 6},
};

int gptq_host_launch(const char *name, int nargs, int gx, int gy, int gz, int bx, int by, int bz, void **params)
{
    for (size_t e = 0; e < sizeof gptq_entries / sizeof gptq_entries[0]; ++e) {
        if (strcmp(gptq_entries[e].name, name) != 0)
            continue;
        if (nargs != gptq_entries[e].nargs)
            return -2;
        gptq_dim3 grid = {gx, gy, gz}, block = {bx, by, bz};
        return launch(grid, block, gptq_entries[e].body, params);
    }
    return -2;
}
