/*
 * Host stand-ins for the vendor math libraries the GPU session loads at run time (cuBLAS, cuSOLVER, rocBLAS,
 * rocSOLVER), with the C prototypes of their headers (cublas_api.h, cusolverDn.h, rocblas-functions.h,
 * rocsolver-functions.h) and "device" pointers that are host pointers. tests/gpu_session.rs builds this file
 * into one shared library, points FLEXINFER_CUBLAS / _CUSOLVER / _ROCBLAS / _ROCSOLVER at it, and drives the
 * session through the engine's own loader and calls (src/device/driver/math.rs), so the entry-point names,
 * the argument order, the enum values and the handle and workspace protocol are exercised without a GPU.
 *
 * Every routine checks what the real one would reject (a handle it did not create, an enum value outside the
 * header's, a leading dimension too small, cuSOLVER's workspace) and returns the library's error status then
 * (cuBLAS/cuSOLVER 7 = *_STATUS_INVALID_VALUE, 1 = *_NOT_INITIALIZED; rocBLAS 1 =
 * rocblas_status_invalid_handle, 11 = rocblas_status_invalid_value). Only what the session uses is implemented: A
 * not transposed in sgemm (B either way; the strided-batched sgemm likewise), lower/transposed ssyrk, lower potrf.
 */
#include <math.h>
#include <stdlib.h>

enum { CALL_CREATE, CALL_DESTROY, CALL_SGEMM, CALL_SSYRK, CALL_POTRF_SIZE, CALL_POTRF, CALL_SGEMM_BATCHED, CALL_COUNT };
static int calls[2][CALL_COUNT]; /* [0] NVIDIA names, [1] AMD names */

/* How often a routine was called: api 0 = cuBLAS/cuSOLVER, 1 = rocBLAS/rocSOLVER. */
int stub_calls(int api, int call) { return calls[api][call]; }

struct handle {
    int kind; /* 1 cuBLAS, 2 cuSOLVER, 3 rocBLAS */
    int lwork_asked;
};

static struct handle *make(int kind)
{
    struct handle *h = calloc(1, sizeof *h);
    if (h)
        h->kind = kind;
    return h;
}

/* C = alpha * A * op(B) + beta * C; op(B) = B (k x n) or, with tb, the transpose of the stored n x k B. A beta of 0
 * does not read C (as BLAS: C may hold anything, NaN included). */
static void gemm_n(int tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                   float beta, float *c, int ldc)
{
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            float s = 0.0f;
            for (int u = 0; u < k; ++u)
                s += a[i + (long)u * lda] * (tb ? b[j + (long)u * ldb] : b[u + (long)j * ldb]);
            c[i + (long)j * ldc] = beta == 0.0f ? alpha * s : alpha * s + beta * c[i + (long)j * ldc];
        }
}

static void syrk_lower_t(int n, int k, float alpha, const float *a, int lda, float beta, float *c, int ldc)
{
    for (int j = 0; j < n; ++j)
        for (int i = j; i < n; ++i) {
            float s = 0.0f;
            for (int t = 0; t < k; ++t)
                s += a[t + (long)i * lda] * a[t + (long)j * lda];
            c[i + (long)j * ldc] = alpha * s + beta * c[i + (long)j * ldc];
        }
}

/* LAPACK's unblocked lower Cholesky; returns info. */
static int potrf_lower(int n, float *a, int lda)
{
    for (int j = 0; j < n; ++j) {
        float d = a[j + (long)j * lda];
        for (int k = 0; k < j; ++k)
            d -= a[j + (long)k * lda] * a[j + (long)k * lda];
        if (!(d > 0.0f) || isnan(d))
            return j + 1;
        d = sqrtf(d);
        a[j + (long)j * lda] = d;
        for (int i = j + 1; i < n; ++i) {
            float s = a[i + (long)j * lda];
            for (int k = 0; k < j; ++k)
                s -= a[i + (long)k * lda] * a[j + (long)k * lda];
            a[i + (long)j * lda] = s / d;
        }
    }
    return 0;
}

static int max1(int v) { return v > 1 ? v : 1; }

/* What the APIs share, parameterised by their numbers: `api` counts the call (0 NVIDIA, 1 AMD), `kind` is the
 * handle a call must get, `n_op`/`t_op`/`lower` are the header's enum values, `invalid` its status for a bad
 * argument. */
struct api_numbers {
    int api, kind, n_op, t_op, lower, invalid, no_handle, alloc_failed;
};
static const struct api_numbers CUBLAS = {0, 1, 0, 1, 0, 7, 1, 3};    /* cublas_api.h */
static const struct api_numbers CUSOLVER = {0, 2, 0, 1, 0, 7, 1, 2}; /* cusolver_common.h: its own handle */
static const struct api_numbers ROCBLAS = {1, 3, 111, 112, 122, 11, 1, 5}; /* rocblas-types.h */

static int create(const struct api_numbers *b, struct handle **h)
{
    calls[b->api][CALL_CREATE]++;
    *h = make(b->kind);
    return *h ? 0 : b->alloc_failed;
}

static int destroy(const struct api_numbers *b, struct handle *h)
{
    calls[b->api][CALL_DESTROY]++;
    if (!h || h->kind != b->kind)
        return b->no_handle;
    free(h);
    return 0;
}

static int sgemm(const struct api_numbers *b, struct handle *h, int transa, int transb, int m, int n, int k,
                 const float *alpha, const float *a, int lda, const float *bm, int ldb, const float *beta, float *c,
                 int ldc)
{
    calls[b->api][CALL_SGEMM]++;
    if (!h || h->kind != b->kind)
        return b->no_handle;
    if (transa != b->n_op || (transb != b->n_op && transb != b->t_op) || m < 0 || n < 0 || k < 0 ||
        lda < max1(m) || ldb < max1(transb == b->t_op ? n : k) || ldc < max1(m))
        return b->invalid;
    gemm_n(transb == b->t_op, m, n, k, *alpha, a, lda, bm, ldb, *beta, c, ldc);
    return 0;
}

static int sgemm_batched(const struct api_numbers *b, struct handle *h, int transa, int transb, int m, int n, int k,
                         const float *alpha, const float *a, int lda, long long sa, const float *bm, int ldb,
                         long long sb, const float *beta, float *c, int ldc, long long sc, int count)
{
    calls[b->api][CALL_SGEMM_BATCHED]++;
    if (!h || h->kind != b->kind)
        return b->no_handle;
    if (transa != b->n_op || (transb != b->n_op && transb != b->t_op) || m < 0 || n < 0 || k < 0 || count < 0 ||
        lda < max1(m) || ldb < max1(transb == b->t_op ? n : k) || ldc < max1(m) || sa < 0 || sb < 0 || sc < 0)
        return b->invalid;
    for (int i = 0; i < count; ++i)
        gemm_n(transb == b->t_op, m, n, k, *alpha, a + i * sa, lda, bm + i * sb, ldb, *beta, c + i * sc, ldc);
    return 0;
}

static int ssyrk(const struct api_numbers *b, struct handle *h, int uplo, int trans, int n, int k, const float *alpha,
                 const float *a, int lda, const float *beta, float *c, int ldc)
{
    calls[b->api][CALL_SSYRK]++;
    if (!h || h->kind != b->kind)
        return b->no_handle;
    if (uplo != b->lower || trans != b->t_op || n < 0 || k < 0 || lda < max1(k) || ldc < max1(n))
        return b->invalid;
    syrk_lower_t(n, k, *alpha, a, lda, *beta, c, ldc);
    return 0;
}

/* ---- cuBLAS: cublasStatus_t is an int enum, CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_FILL_MODE_LOWER = 0 */
int cublasCreate_v2(struct handle **h) { return create(&CUBLAS, h); }
int cublasDestroy_v2(struct handle *h) { return destroy(&CUBLAS, h); }
int cublasSgemm_v2(struct handle *h, int transa, int transb, int m, int n, int k, const float *alpha,
                   const float *a, int lda, const float *b, int ldb, const float *beta, float *c, int ldc)
{
    return sgemm(&CUBLAS, h, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
int cublasSgemmStridedBatched(struct handle *h, int transa, int transb, int m, int n, int k, const float *alpha,
                              const float *a, int lda, long long sa, const float *b, int ldb, long long sb,
                              const float *beta, float *c, int ldc, long long sc, int count)
{
    return sgemm_batched(&CUBLAS, h, transa, transb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, count);
}
int cublasSsyrk_v2(struct handle *h, int uplo, int trans, int n, int k, const float *alpha, const float *a, int lda,
                   const float *beta, float *c, int ldc)
{
    return ssyrk(&CUBLAS, h, uplo, trans, n, k, alpha, a, lda, beta, c, ldc);
}

/* ---- cuSOLVER dense: cusolverStatus_t, cublasFillMode_t as above (its own handle kind 2) */
int cusolverDnCreate(struct handle **h) { return create(&CUSOLVER, h); }
int cusolverDnDestroy(struct handle *h) { return destroy(&CUSOLVER, h); }
int cusolverDnSpotrf_bufferSize(struct handle *h, int uplo, int n, float *a, int lda, int *lwork)
{
    calls[0][CALL_POTRF_SIZE]++;
    if (!h || h->kind != 2)
        return 1;
    if (uplo != 0 || n < 0 || lda < max1(n) || !lwork)
        return 7;
    (void)a;
    *lwork = 3 * n + 5; /* any size: the caller must provide what was asked */
    h->lwork_asked = *lwork;
    return 0;
}
int cusolverDnSpotrf(struct handle *h, int uplo, int n, float *a, int lda, float *work, int lwork, int *info)
{
    calls[0][CALL_POTRF]++;
    if (!h || h->kind != 2)
        return 1;
    if (uplo != 0 || n < 0 || lda < max1(n) || !work || lwork < h->lwork_asked || !info)
        return 7;
    for (int i = 0; i < lwork; ++i) /* the workspace must be lwork floats */
        work[i] = 0.0f;
    *info = potrf_lower(n, a, lda);
    return 0;
}

/* ---- rocBLAS: rocblas_status (0 success, 1 invalid_handle, 5 memory_error, 11 invalid_value),
 * rocblas_operation_none = 111, _transpose = 112, rocblas_fill_lower = 122; host pointer mode */
int rocblas_create_handle(struct handle **h) { return create(&ROCBLAS, h); }
int rocblas_destroy_handle(struct handle *h) { return destroy(&ROCBLAS, h); }
int rocblas_sgemm(struct handle *h, int transa, int transb, int m, int n, int k, const float *alpha, const float *a,
                  int lda, const float *b, int ldb, const float *beta, float *c, int ldc)
{
    return sgemm(&ROCBLAS, h, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
int rocblas_sgemm_strided_batched(struct handle *h, int transa, int transb, int m, int n, int k, const float *alpha,
                                  const float *a, int lda, long long sa, const float *b, int ldb, long long sb,
                                  const float *beta, float *c, int ldc, long long sc, int count)
{
    return sgemm_batched(&ROCBLAS, h, transa, transb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc,
                         count);
}
int rocblas_ssyrk(struct handle *h, int uplo, int trans, int n, int k, const float *alpha, const float *a, int lda,
                  const float *beta, float *c, int ldc)
{
    return ssyrk(&ROCBLAS, h, uplo, trans, n, k, alpha, a, lda, beta, c, ldc);
}

/* ---- rocSOLVER: runs on a rocBLAS handle; info is a device rocblas_int */
int rocsolver_spotrf(struct handle *h, int uplo, int n, float *a, int lda, int *info)
{
    calls[1][CALL_POTRF]++;
    if (!h || h->kind != 3)
        return 1;
    if (uplo != 122 || n < 0 || lda < max1(n) || !info)
        return 11;
    *info = potrf_lower(n, a, lda);
    return 0;
}
