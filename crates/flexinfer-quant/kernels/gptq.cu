/*
 * GPTQ device kernels, one source for CUDA (compiled at run time by NVRTC) and HIP (same dialect). With
 * GPTQ_HOST defined it is also plain C: kernels/host_harness.c includes it and runs each launch on host
 * threads (one per device thread, a barrier for __syncthreads), so tests/kernels.rs checks these exact
 * kernels against the CPU backend without a GPU (docs/dev/gptq-device.md).
 *
 * Layout: every matrix is column-major with a leading dimension `ld*` (floats between columns), as the
 * engine's faer matrices are. Indices that can exceed 2^31 are computed in long long.
 *
 * Rounding: the in-block sweep must give the CPU backend's bits (src/numerics/gptq/tile.rs,
 * TileKernel): every product and sum is rounded on its own (GPTQ_MUL/GPTQ_ADD). Under NVRTC they are
 * __fmul_rn/__fadd_rn, which the compiler never fuses into an FMA. HIP's __fmul_rn & co. are plain `x * y`
 * inline functions, which clang's HIP default (-ffp-contract=fast-honor-pragmas) does fuse (seen in the
 * gfx906/gfx1100 disassembly), so for HIP this file turns contraction off itself and spells the operators
 * out (scripts/hip/build-code-objects.sh also passes -ffp-contract=off). The Hessian and block-update GEMMs
 * may contract (their summation order differs from faer's anyway; the tests state the tolerance).
 *
 * The sweep factor (the Cholesky factor of the reversed Hessian, columns scaled by their diagonal; see
 * src/numerics/linalg.rs) is computed here too, blocked by panels of columns (gptq_factor_fill; per panel
 * gptq_chol_panel_diag, gptq_chol_panel_rows and gptq_chol_trailing; then gptq_factor_scale), so no vendor
 * solver library is needed; where one is loaded, its potrf replaces the panels (gptq_factor_pivots reads the
 * pivots from its result) and its BLAS the Hessian and block-update products (gptq_gather_panel). The group parameters of the sweep are found here
 * as well (gptq_block_snapshot, gptq_group_params), so a module's sweep needs no transfer between its
 * upload and its results.
 */

#if defined(__HIP__) && !defined(GPTQ_HOST)
#pragma clang fp contract(off)
#define GPTQ_KERNEL extern "C" __global__
#define GPTQ_DEVICE static __device__ __forceinline__
#define GPTQ_MUL(a, b) ((a) * (b))
#define GPTQ_ADD(a, b) ((a) + (b))
#define GPTQ_SUB(a, b) ((a) - (b))
#define GPTQ_DIV(a, b) ((a) / (b))
#elif !defined(GPTQ_HOST)
#define GPTQ_KERNEL extern "C" __global__
#define GPTQ_DEVICE static __device__ __forceinline__
#define GPTQ_MUL(a, b) __fmul_rn((a), (b))
#define GPTQ_ADD(a, b) __fadd_rn((a), (b))
#define GPTQ_SUB(a, b) __fsub_rn((a), (b))
#define GPTQ_DIV(a, b) __fdiv_rn((a), (b))
#endif

/* Edge of the square thread blocks of the GEMM-like kernels (block = GPTQ_TILE x GPTQ_TILE threads). */
#define GPTQ_TILE 16
/* Largest in-block column count of the sweep kernel (the engine's block size is 128). */
#define GPTQ_MAX_BLOCK 128
/* Threads per block of the sweep kernel (one thread per row). */
#define GPTQ_SWEEP_THREADS 128
/* Threads per block of gptq_chol_panel_rows (one thread per row). */
#define GPTQ_COLUMN_THREADS 256
/* Threads of gptq_chol_panel_diag's one block: the widest panel of the factorisation. */
#define GPTQ_PANEL_THREADS 128
/* Finite test without math headers (NVRTC has none): x - x is 0 exactly for a finite x, NaN otherwise. */
#define GPTQ_FINITE(x) ((x) - (x) == 0.0f)

/* Output tile edge of the product kernels (gptq_hessian_lower, gptq_block_update, gptq_chol_trailing): a
 * 16 x 16 thread block computes a 64 x 64 tile, 4 x 4 entries per thread in registers; thread (tx, ty) owns
 * rows tx + 16p and columns ty + 16q (p, q < 4), so its writes to a column-major output are contiguous
 * across the threads of a warp. */
#define GPTQ_WIDE_TILE 64
/* Summation indices (tokens, or the inner dimension) staged in shared memory per step of those kernels. */
#define GPTQ_WIDE_STEP 16

/* One staged step of a product kernel: acc[p][q] += sum over the GPTQ_WIDE_STEP staged indices k of
 * a[k][tx + 16p] * b[k][ty + 16q] (a and b are the block's shared tiles, index-major). */
GPTQ_DEVICE void gptq_wide_step(float acc[4][4], float (*a)[GPTQ_WIDE_TILE + 1],
                                float (*b)[GPTQ_WIDE_TILE + 1], int tx, int ty)
{
    for (int k = 0; k < GPTQ_WIDE_STEP; ++k) {
        float x[4], y[4];
        for (int p = 0; p < 4; ++p)
            x[p] = a[k][tx + GPTQ_TILE * p];
        for (int q = 0; q < 4; ++q)
            y[q] = b[k][ty + GPTQ_TILE * q];
        for (int p = 0; p < 4; ++p)
            for (int q = 0; q < 4; ++q)
                acc[p][q] += x[p] * y[q];
    }
}

/* Adds alpha * acc to the lower triangle (i >= j, both < n) of the n x n matrix out (ld) at the thread's
 * entries of the tile at (row0, col0): rows row0 + tx + 16p, columns col0 + ty + 16q. */
GPTQ_DEVICE void gptq_wide_store_lower(float *out, int ld, int n, int row0, int col0, float acc[4][4],
                                       float alpha, int tx, int ty)
{
    for (int q = 0; q < 4; ++q) {
        int j = col0 + ty + GPTQ_TILE * q;
        for (int p = 0; p < 4; ++p) {
            int i = row0 + tx + GPTQ_TILE * p;
            if (i < n && j < n && i >= j)
                out[(long long)j * ld + i] += alpha * acc[p][q];
        }
    }
}

/* Zeroes a product kernel's 4 x 4 accumulators. */
GPTQ_DEVICE void gptq_wide_zero(float acc[4][4])
{
    for (int p = 0; p < 4; ++p)
        for (int q = 0; q < 4; ++q)
            acc[p][q] = 0.0f;
}

/*
 * H += alpha * X^T X on the lower triangle (diagonal included) of the n x n matrix H (ldh); X is tokens x n
 * (ldx), one calibration batch. Grid (ceil(n/64), ceil(n/64)), block (16, 16): block (bx, by) owns the
 * 64 x 64 tile of rows by*64.. and columns bx*64..; tiles wholly above the diagonal return at once (the whole
 * block, before any barrier). Each step stages 16 tokens of the tile's 64 row and 64 column features in
 * shared memory (4 loads per thread per matrix), read along the token axis (contiguous in X).
 */
GPTQ_KERNEL void gptq_hessian_lower(float *h, int ldh, const float *x, int ldx, int tokens, int n,
                                    float alpha)
{
    /* xa[k][c] = X[t0 + k, row0 + c], xb[k][c] = X[t0 + k, col0 + c] */
    __shared__ float xa[GPTQ_WIDE_STEP][GPTQ_WIDE_TILE + 1];
    __shared__ float xb[GPTQ_WIDE_STEP][GPTQ_WIDE_TILE + 1];
    int bx = blockIdx.x, by = blockIdx.y;
    if (bx > by)
        return;
    int tx = threadIdx.x, ty = threadIdx.y;
    int tid = ty * GPTQ_TILE + tx;
    int row0 = by * GPTQ_WIDE_TILE, col0 = bx * GPTQ_WIDE_TILE;
    float acc[4][4];
    gptq_wide_zero(acc);
    for (int t0 = 0; t0 < tokens; t0 += GPTQ_WIDE_STEP) {
        for (int l = 0; l < 4; ++l) {
            int idx = tid + l * GPTQ_TILE * GPTQ_TILE; /* 0 .. 1023: token fastest */
            int k = idx % GPTQ_WIDE_STEP, c = idx / GPTQ_WIDE_STEP;
            int t = t0 + k, fa = row0 + c, fb = col0 + c;
            xa[k][c] = (t < tokens && fa < n) ? x[(long long)fa * ldx + t] : 0.0f;
            xb[k][c] = (t < tokens && fb < n) ? x[(long long)fb * ldx + t] : 0.0f;
        }
        __syncthreads();
        gptq_wide_step(acc, xa, xb, tx, ty);
        __syncthreads();
    }
    gptq_wide_store_lower(h, ldh, n, row0, col0, acc, alpha, tx, ty);
}

/*
 * Copies the strict lower triangle of the n x n matrix H (ldh) into the upper one (finish_hessian).
 * Grid (ceil(n/16), ceil(n/16)), block (16, 16); thread (tx, ty) of block (bx, by) handles H[i, j] with
 * i = by*16 + tx (contiguous reads) and j = bx*16 + ty.
 */
GPTQ_KERNEL void gptq_mirror_lower(float *h, int ldh, int n)
{
    int i = blockIdx.y * GPTQ_TILE + threadIdx.x;
    int j = blockIdx.x * GPTQ_TILE + threadIdx.y;
    if (i < n && j < n && i > j)
        h[(long long)i * ldh + j] = h[(long long)j * ldh + i];
}

/*
 * The preparation of the mirrored Hessian (the CPU's sanitize and dead-column fix, src/numerics/hessian.rs):
 * every non-finite entry becomes 0, then a diagonal entry that is 0 becomes 1. Thread i owns row i (for each
 * column the threads of a block read adjacent addresses): bad[i] = the non-finite entries it replaced,
 * diag[i] = H[i, i] after that and before the fix (0 marks a dead column). Grid ceil(n/256), block 256.
 */
GPTQ_KERNEL void gptq_prepare_rows(float *h, int ldh, int n, int *bad, float *diag)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    int count = 0;
    for (int j = 0; j < n; ++j) {
        long long at = (long long)j * ldh + i;
        float v = h[at];
        if (!GPTQ_FINITE(v)) {
            h[at] = 0.0f;
            ++count;
        }
    }
    long long at = (long long)i * ldh + i;
    float d = h[at];
    diag[i] = d;
    if (d == 0.0f)
        h[at] = 1.0f;
    bad[i] = count;
}

/*
 * The act-order permutation of a symmetric matrix: dst[i, j] = src[perm[i], perm[j]] (both n x n, ldd / lds).
 * Grid (ceil(n/16), ceil(n/16)), block (16, 16); thread (tx, ty) of block (bx, by) writes dst[i, j] with
 * i = by*16 + tx (contiguous writes) and j = bx*16 + ty.
 */
GPTQ_KERNEL void gptq_permute_sym(const float *src, int lds, float *dst, int ldd, const int *perm, int n)
{
    int i = blockIdx.y * GPTQ_TILE + threadIdx.x;
    int j = blockIdx.x * GPTQ_TILE + threadIdx.y;
    if (i < n && j < n)
        dst[(long long)j * ldd + i] = src[(long long)perm[j] * lds + perm[i]];
}

/*
 * The lazy-batch block update W += D * F: W is rows x cols (ldw), D is rows x k (ldd), and F(u, c) is at
 * f[u * f_rs + c * f_cs] (signed strides, so the sweep factor can be read through its reversed view).
 * Grid (ceil(cols/64), ceil(rows/64)), block (16, 16): block (bx, by) owns the 64 x 64 tile of W's rows
 * by*64.. and columns bx*64..; each step stages 16 values of the inner dimension u of the tile's D rows
 * (loaded down D's columns) and F columns (loaded along u) in shared memory.
 */
GPTQ_KERNEL void gptq_block_update(float *w, int ldw, const float *d, int ldd, const float *f,
                                   long long f_rs, long long f_cs, int rows, int k, int cols)
{
    __shared__ float ds[GPTQ_WIDE_STEP][GPTQ_WIDE_TILE + 1]; /* ds[u][r] = D[row0 + r, u0 + u] */
    __shared__ float fs[GPTQ_WIDE_STEP][GPTQ_WIDE_TILE + 1]; /* fs[u][c] = F[u0 + u, col0 + c] */
    int tx = threadIdx.x, ty = threadIdx.y;
    int tid = ty * GPTQ_TILE + tx;
    int row0 = blockIdx.y * GPTQ_WIDE_TILE, col0 = blockIdx.x * GPTQ_WIDE_TILE;
    float acc[4][4];
    gptq_wide_zero(acc);
    for (int u0 = 0; u0 < k; u0 += GPTQ_WIDE_STEP) {
        for (int l = 0; l < 4; ++l) {
            int idx = tid + l * GPTQ_TILE * GPTQ_TILE; /* 0 .. 1023 */
            int r = idx % GPTQ_WIDE_TILE, ud = idx / GPTQ_WIDE_TILE; /* D: rows fastest */
            int uf = idx % GPTQ_WIDE_STEP, c = idx / GPTQ_WIDE_STEP; /* F: u fastest */
            ds[ud][r] = (row0 + r < rows && u0 + ud < k) ? d[(long long)(u0 + ud) * ldd + row0 + r] : 0.0f;
            fs[uf][c] = (u0 + uf < k && col0 + c < cols)
                            ? f[(long long)(u0 + uf) * f_rs + (long long)(col0 + c) * f_cs]
                            : 0.0f;
        }
        __syncthreads();
        gptq_wide_step(acc, ds, fs, tx, ty);
        __syncthreads();
    }
    for (int q = 0; q < 4; ++q) {
        int c = col0 + ty + GPTQ_TILE * q;
        for (int p = 0; p < 4; ++p) {
            int r = row0 + tx + GPTQ_TILE * p;
            if (r < rows && c < cols)
                w[(long long)c * ldw + r] += acc[p][q];
        }
    }
}

/*
 * The in-block column sweep of one block of `count` columns (count <= GPTQ_MAX_BLOCK), one thread per row,
 * columns in order; the same values as src/numerics/gptq/tile.rs's TileKernel to the bit.
 *   w      the block's columns of the working W as the block starts (ldw); read only
 *   w0     the same columns of W before the sweep (ld0): deltas are W0 - Q (see linalg.rs)
 *   d      out: W0 - Q per column (ldd), 0 for a column without group parameters
 *   codes  out: column i of the block at codes[i * ldq + r]
 *   coef   count x count row-major sweep coefficients, coef[i * count + j] used for j > i
 *   rdiag2 R_ii^2 per column (turns a squared error into its loss)
 *   param  index of each column's group parameters in scale/zero (p * rows + r); -1 for none
 *   acc    out: per row, the sum over the block of (w~ - q)^2 * R_ii^2 (the host halves and sums it)
 * Grid ceil(rows / GPTQ_SWEEP_THREADS), block GPTQ_SWEEP_THREADS.
 */
GPTQ_KERNEL void gptq_sweep_block(const float *w, int ldw, const float *w0, int ld0, float *d, int ldd,
                                  unsigned char *codes, int ldq, const float *coef, const float *rdiag2,
                                  const int *param, const float *scale, const float *zero, int rows,
                                  int count, float maxq, float *acc)
{
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows || count > GPTQ_MAX_BLOCK)
        return;
    float x[GPTQ_MAX_BLOCK];
    for (int i = 0; i < count; ++i)
        x[i] = w[(long long)i * ldw + r];
    float a = 0.0f;
    for (int i = 0; i < count; ++i) {
        float dl = 0.0f;
        unsigned char code = 0;
        int p = param[i];
        if (p >= 0) {
            float s = scale[(long long)p * rows + r];
            float z = zero[(long long)p * rows + r];
            /* quantizer.rs quantize_code: clamp(round_ties_even(x / s) + z, 0, maxq); NaN gives 0. */
            float q = fminf(fmaxf(GPTQ_ADD(rintf(GPTQ_DIV(x[i], s)), z), 0.0f), maxq);
            float dq = GPTQ_MUL(s, GPTQ_SUB(q, z));
            float diff = GPTQ_SUB(x[i], dq);
            a = GPTQ_ADD(a, GPTQ_MUL(GPTQ_MUL(diff, diff), rdiag2[i]));
            dl = GPTQ_SUB(w0[(long long)i * ld0 + r], dq);
            code = (unsigned char)q;
        }
        codes[(long long)i * ldq + r] = code;
        d[(long long)i * ldd + r] = dl;
        for (int j = i + 1; j < count; ++j)
            x[j] = GPTQ_ADD(x[j], GPTQ_MUL(dl, coef[i * count + j]));
    }
    acc[r] = a;
}

/*
 * The block-start snapshot of the `width` columns at the block's start (src/numerics/gptq/mod.rs,
 * block_snapshot): W as the reference sees it there, S = P + C * (F^-1 - I) with C = P - W0, where F is the
 * unit upper-triangular `width` x `width` block of the sweep factor (`coef`, row-major as gptq_gather_coef
 * writes it; only its strict upper triangle is read). Instead of inverting F, each row solves X * F = C by
 * forward substitution (x_j = c_j - sum over a < j of x_a * F[a, j]); then Y = X - C = -sum x_a * F[a, j]
 * and S_j = P_j + Y_j, so the first column is P's exactly, as on the CPU.
 *   snap  out: S (lds)           xs   out: X, scratch (ldx)
 *   p     the columns of the working W as the block starts (ldp)    w0  the same columns of W0 (ld0)
 * One thread per row, no shared memory. Grid ceil(rows / GPTQ_SWEEP_THREADS), block GPTQ_SWEEP_THREADS.
 */
GPTQ_KERNEL void gptq_block_snapshot(float *snap, int lds, float *xs, int ldx, const float *p, int ldp,
                                     const float *w0, int ld0, const float *coef, int width, int rows)
{
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows)
        return;
    for (int j = 0; j < width; ++j) {
        float pj = p[(long long)j * ldp + r];
        float c = pj - w0[(long long)j * ld0 + r];
        float y = 0.0f;
        for (int a = 0; a < j; ++a)
            y -= xs[(long long)a * ldx + r] * coef[(long long)a * width + j];
        xs[(long long)j * ldx + r] = c + y;
        snap[(long long)j * lds + r] = pj + y;
    }
}

/*
 * One group's parameters from `ncols` columns of the snapshot (lds), per row, as quantizer.rs find_params and
 * params_from_range compute them, to the bit: the range starts at [0, 0] and NaN values are skipped
 * (fminf/fmaxf, like f32::min/max); symmetric groups widen it to [-m, m]; an all-zero range becomes [-1, 1];
 * scale = (hi - lo) / maxq; zero = round_ties_even(-lo / scale), or (maxq + 1) / 2 when symmetric.
 * Writes scale[r] and zero[r] (the group's slices). Grid ceil(rows / GPTQ_SWEEP_THREADS), block
 * GPTQ_SWEEP_THREADS.
 */
GPTQ_KERNEL void gptq_group_params(const float *snap, int lds, int ncols, int rows, float maxq, int sym,
                                   float *scale, float *zero)
{
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows)
        return;
    float lo = 0.0f, hi = 0.0f;
    for (int c = 0; c < ncols; ++c) {
        float v = snap[(long long)c * lds + r];
        lo = fminf(lo, v);
        hi = fmaxf(hi, v);
    }
    if (sym) {
        hi = fmaxf(hi, fabsf(lo));
        if (lo < 0.0f)
            lo = -hi;
    }
    if (lo == 0.0f && hi == 0.0f) {
        lo = -1.0f;
        hi = 1.0f;
    }
    float s = GPTQ_DIV(GPTQ_SUB(hi, lo), maxq);
    scale[r] = s;
    zero[r] = sym ? GPTQ_DIV(GPTQ_ADD(maxq, 1.0f), 2.0f) : rintf(GPTQ_DIV(-lo, s));
}

/*
 * The factorisation's starting matrix: the lower triangle (diagonal included) of J*H*J with the diagonal
 * `diag` (given in H's order), J reversing rows and columns: M[i, j] = H[n-1-i, n-1-j] for i > j (read from
 * H's strict upper triangle) and M[j, j] = diag[n-1-j]. M (ldm) and H (ldh) are different buffers; H is not
 * modified, so a failed attempt can be retried with another diagonal. Grid (ceil(n/16), ceil(n/16)),
 * block (16, 16); thread x runs along i (contiguous in M).
 */
GPTQ_KERNEL void gptq_factor_fill(float *m, int ldm, const float *h, int ldh, const float *diag, int n)
{
    int i = blockIdx.y * GPTQ_TILE + threadIdx.x;
    int j = blockIdx.x * GPTQ_TILE + threadIdx.y;
    if (i >= n || j >= n || i < j)
        return;
    m[(long long)j * ldm + i] =
        (i == j) ? diag[n - 1 - j] : h[(long long)(n - 1 - j) * ldh + (n - 1 - i)];
}

/*
 * The factorisation is blocked by panels of columns [k0, k1), right-looking: when a panel starts, every one
 * of its columns has already received the contributions of the columns before k0. The panel's square
 * diagonal block is factored by one thread block (gptq_chol_panel_diag), the panel's rows below it by one
 * thread per row (gptq_chol_panel_rows), and the panel's contribution is then subtracted from the trailing
 * lower triangle in one tiled launch (gptq_chol_trailing): three launches per panel.
 *
 * Both panel kernels compute each entry the same way: L[i, j] = (M[i, j] - sum over k0 <= k < j of
 * L[i, k] * L[j, k]) / L[j, j], the sum in increasing k, with L[j, j] = sqrt(M[j, j] - the same sum for i = j).
 *
 * gptq_chol_panel_diag: one block of GPTQ_PANEL_THREADS threads (k1 - k0 <= GPTQ_PANEL_THREADS), column by
 * column; thread t owns row k0 + t. A pivot that is not a positive finite number means the matrix is not
 * (numerically) positive definite: status[0] = j + 1 and the kernel stops (every thread sees the same pivot,
 * so they stop together). r[n-1-j] = L[j, j] (the sweep factor's R diagonal, see linalg.rs); M[j, j] keeps
 * the value before the square root. Does nothing once status[0] is set (an earlier panel failed).
 * Grid 1, block GPTQ_PANEL_THREADS.
 */
GPTQ_KERNEL void gptq_chol_panel_diag(float *m, int ldm, int n, int k0, int k1, float *r, int *status)
{
    int i = k0 + threadIdx.x;
    if (status[0] != 0)
        return;
    for (int j = k0; j < k1; ++j) {
        if (i >= j && i < k1) {
            float s = m[(long long)j * ldm + i];
            for (int k = k0; k < j; ++k)
                s -= m[(long long)k * ldm + i] * m[(long long)k * ldm + j];
            m[(long long)j * ldm + i] = s;
        }
        __syncthreads();
        float d = sqrtf(m[(long long)j * ldm + j]);
        if (!(d > 0.0f && GPTQ_FINITE(d))) {
            if (threadIdx.x == 0)
                status[0] = j + 1;
            return;
        }
        if (i == j)
            r[n - 1 - j] = d;
        else if (i > j && i < k1)
            m[(long long)j * ldm + i] = GPTQ_DIV(m[(long long)j * ldm + i], d);
        __syncthreads();
    }
}

/*
 * gptq_chol_panel_rows: the panel's columns for the rows below its diagonal block, i in [k1, n), one thread
 * per row, after gptq_chol_panel_diag: L[i, j] = (M[i, j] - sum over k0 <= k < j of L[i, k] * L[j, k]) /
 * r[n-1-j], column after column. Does nothing once status[0] is set. Grid ceil((n - k1) /
 * GPTQ_COLUMN_THREADS), block GPTQ_COLUMN_THREADS.
 */
GPTQ_KERNEL void gptq_chol_panel_rows(float *m, int ldm, int n, int k0, int k1, const float *r,
                                      const int *status)
{
    int i = k1 + blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || status[0] != 0)
        return;
    for (int j = k0; j < k1; ++j) {
        float s = m[(long long)j * ldm + i];
        for (int k = k0; k < j; ++k)
            s -= m[(long long)k * ldm + i] * m[(long long)k * ldm + j];
        m[(long long)j * ldm + i] = GPTQ_DIV(s, r[n - 1 - j]);
    }
}

/*
 * After the panel [k0, k1) is factored: M[i, j] -= sum over k0 <= k < k1 of L[i, k] * L[j, k] for
 * k1 <= j <= i < n (the trailing lower triangle). Grid (ceil((n-k1)/64), ceil((n-k1)/64)), block (16, 16):
 * block (bx, by) owns rows k1 + by*64.. and columns k1 + bx*64..; tiles wholly above the diagonal, and every
 * tile once status[0] is set, return at once (the whole block, before any barrier). Each step stages 16 panel
 * columns of the tile's rows and of its columns in shared memory, loaded down the columns (contiguous in M).
 */
GPTQ_KERNEL void gptq_chol_trailing(float *m, int ldm, int n, int k0, int k1, const int *status)
{
    __shared__ float la[GPTQ_WIDE_STEP][GPTQ_WIDE_TILE + 1]; /* la[k][r] = L[row0 + r, kc + k] */
    __shared__ float lb[GPTQ_WIDE_STEP][GPTQ_WIDE_TILE + 1]; /* lb[k][c] = L[col0 + c, kc + k] */
    int bx = blockIdx.x, by = blockIdx.y;
    if (bx > by || status[0] != 0)
        return;
    int tx = threadIdx.x, ty = threadIdx.y;
    int tid = ty * GPTQ_TILE + tx;
    int row0 = k1 + by * GPTQ_WIDE_TILE, col0 = k1 + bx * GPTQ_WIDE_TILE;
    float acc[4][4];
    gptq_wide_zero(acc);
    for (int kc = k0; kc < k1; kc += GPTQ_WIDE_STEP) {
        for (int l = 0; l < 4; ++l) {
            int idx = tid + l * GPTQ_TILE * GPTQ_TILE; /* 0 .. 1023: rows fastest */
            int r = idx % GPTQ_WIDE_TILE, kk = idx / GPTQ_WIDE_TILE;
            int k = kc + kk;
            la[kk][r] = (k < k1 && row0 + r < n) ? m[(long long)k * ldm + row0 + r] : 0.0f;
            lb[kk][r] = (k < k1 && col0 + r < n) ? m[(long long)k * ldm + col0 + r] : 0.0f;
        }
        __syncthreads();
        gptq_wide_step(acc, la, lb, tx, ty);
        __syncthreads();
    }
    /* -1 * acc is exact, so this subtracts acc. */
    gptq_wide_store_lower(m, ldm, n, row0, col0, acc, -1.0f, tx, ty);
}

/*
 * The sweep factor from L: each column's entries below the diagonal times 1 / L[j, j] (= 1 / r[n-1-j]), as
 * linalg.rs's scale_columns; a result that is not finite sets status[1]. Grid (ceil(n/16), ceil(n/16)),
 * block (16, 16) as gptq_factor_fill.
 */
GPTQ_KERNEL void gptq_factor_scale(float *m, int ldm, int n, const float *r, int *status)
{
    int i = blockIdx.y * GPTQ_TILE + threadIdx.x;
    int j = blockIdx.x * GPTQ_TILE + threadIdx.y;
    if (i >= n || j >= n || i <= j || status[0] != 0)
        return;
    float inv = GPTQ_DIV(1.0f, r[n - 1 - j]);
    float v = GPTQ_MUL(m[(long long)j * ldm + i], inv);
    m[(long long)j * ldm + i] = v;
    if (!GPTQ_FINITE(v))
        status[1] = 1;
}

/*
 * After the vendor's potrf (cuSOLVER / rocSOLVER, lower, in place) of gptq_factor_fill's matrix: the pivots
 * r[n-1-j] = L[j, j] from M's diagonal, which potrf overwrote with L's; a pivot that is not a positive finite
 * number sets status[0] (potrf's own info may already have; nothing is done then). One thread per column:
 * grid ceil(n / GPTQ_COLUMN_THREADS), block GPTQ_COLUMN_THREADS. Then gptq_factor_scale as after the
 * kernels' own factorisation.
 */
GPTQ_KERNEL void gptq_factor_pivots(const float *m, int ldm, int n, float *r, int *status)
{
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n || status[0] != 0)
        return;
    float d = m[(long long)j * ldm + j];
    if (!(d > 0.0f && GPTQ_FINITE(d)))
        status[0] = j + 1;
    else
        r[n - 1 - j] = d;
}

/*
 * For the vendor's sgemm, the block update's factor panel dense and column-major: g[u + c * ldg] = F(i1 + u,
 * i2 + c) = M[n-1-i1-u, n-1-i2-c] for u < k, c < ncols (the factor through its reversed view, which a BLAS
 * cannot read: its strides are negative). Grid (ceil(k/16), ceil(ncols/16)), block (16, 16); thread x runs
 * along u (contiguous in g, and in M going down).
 */
GPTQ_KERNEL void gptq_gather_panel(float *g, int ldg, const float *m, int ldm, int n, int i1, int k, int i2,
                                   int ncols)
{
    int u = blockIdx.x * GPTQ_TILE + threadIdx.x;
    int c = blockIdx.y * GPTQ_TILE + threadIdx.y;
    if (u >= k || c >= ncols)
        return;
    g[(long long)c * ldg + u] = m[(long long)(n - 1 - i2 - c) * ldm + (n - 1 - i1 - u)];
}

/*
 * The sweep coefficients of the `count` columns from i1 on, dense and row-major as gptq_sweep_block reads
 * them: coef[a * count + b] = F(i1 + a, i1 + b) for a < b and 0 otherwise, where F(u, c) = M[n-1-u, n-1-c]
 * (the factor through its reversed view). Grid (ceil(count/16), ceil(count/16)), block (16, 16).
 */
GPTQ_KERNEL void gptq_gather_coef(float *coef, const float *m, int ldm, int n, int i1, int count)
{
    int a = blockIdx.y * GPTQ_TILE + threadIdx.y;
    int b = blockIdx.x * GPTQ_TILE + threadIdx.x;
    if (a >= count || b >= count)
        return;
    coef[a * count + b] =
        (a < b) ? m[(long long)(n - 1 - i1 - b) * ldm + (n - 1 - i1 - a)] : 0.0f;
}

/*
 * ---- The calibration forward (docs/dev/gptq-device.md, "The calibration forward on the device") ----
 * Activations are column-major `tokens x features` with a leading dimension (the engine's faer layout): one
 * thread per token reads a feature column's entries at adjacent addresses across a warp. The layer's GEMMs
 * go through the vendor's sgemm or gptq_block_update (src/device/kernel/forward.rs); these kernels do the
 * rest. Elementwise kernels: grid (ceil(tokens / GPTQ_FWD_THREADS), min(cols, 16)), block
 * GPTQ_FWD_THREADS; grid y strides over the columns.
 */
#define GPTQ_FWD_THREADS 128

/* y[t, c] = x[t, c] * s_t * w[c], s_t = 1 / sqrt(mean_c x[t, c]^2 + eps) (model/llama.rs rms_norm: the squares
 * summed in column order). One thread per token: grid ceil(tokens / GPTQ_FWD_THREADS). */
GPTQ_KERNEL void fwd_rms_norm(const float *x, int ldx, float *y, int ldy, const float *w, int tokens, int d,
                              float eps)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens)
        return;
    float ss = 0.0f;
    for (int c = 0; c < d; ++c) {
        float v = x[t + (long long)c * ldx];
        ss = GPTQ_ADD(ss, GPTQ_MUL(v, v));
    }
    float s = GPTQ_DIV(1.0f, sqrtf(GPTQ_ADD(GPTQ_DIV(ss, (float)d), eps)));
    for (int c = 0; c < d; ++c)
        y[t + (long long)c * ldy] = GPTQ_MUL(GPTQ_MUL(x[t + (long long)c * ldx], s), w[c]);
}

/* Per-head RMSNorm in place (Qwen3's q/k norm, Gemma 4's weightless v norm: w == 0). One thread per (token,
 * head): grid (ceil(tokens / GPTQ_FWD_THREADS), heads). */
GPTQ_KERNEL void fwd_head_norm(float *x, int ldx, int tokens, int d, const float *w, int has_w, float eps)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    int h = blockIdx.y;
    if (t >= tokens)
        return;
    float *xh = x + (long long)h * d * ldx + t;
    float ss = 0.0f;
    for (int i = 0; i < d; ++i) {
        float v = xh[(long long)i * ldx];
        ss = GPTQ_ADD(ss, GPTQ_MUL(v, v));
    }
    float s = GPTQ_DIV(1.0f, sqrtf(GPTQ_ADD(GPTQ_DIV(ss, (float)d), eps)));
    for (int i = 0; i < d; ++i)
        xh[(long long)i * ldx] = GPTQ_MUL(xh[(long long)i * ldx], has_w ? GPTQ_MUL(s, w[i]) : s);
}

/* Rotary embedding in place of one sequence's heads (token t is position t): the pairs (i, i + half), i < half,
 * of each head rotated by cos/sin[t * half + i]. One thread per (token, head): grid (ceil(tokens /
 * GPTQ_FWD_THREADS), heads). */
GPTQ_KERNEL void fwd_rope(float *x, int ldx, int tokens, int d, int half, const float *cosv, const float *sinv)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    int h = blockIdx.y;
    if (t >= tokens)
        return;
    float *xh = x + (long long)h * d * ldx + t;
    for (int i = 0; i < half; ++i) {
        float c = cosv[(long long)t * half + i], s = sinv[(long long)t * half + i];
        float a = xh[(long long)i * ldx], b = xh[(long long)(i + half) * ldx];
        xh[(long long)i * ldx] = GPTQ_SUB(GPTQ_MUL(a, c), GPTQ_MUL(b, s));
        xh[(long long)(i + half) * ldx] = GPTQ_ADD(GPTQ_MUL(b, c), GPTQ_MUL(a, s));
    }
}

/* The causal softmax of `rows` queries' scores, `batch` heads (grid y), in place: s is query-major (row i,
 * column j = key j; leading dimension lds, heads `stride` floats apart); query i is position q0 + i and sees
 * keys lo <= j <= q0 + i (lo = q0 + i + 1 - window with a window > 0, else 0). Each live score is multiplied by
 * `scale`, soft-capped (`softcap` > 0: cap * tanh(v / cap)) and softmaxed; every other entry of the row up to
 * `keys` becomes 0 (model/llama.rs causal_softmax). One thread per query: grid (ceil(rows /
 * GPTQ_FWD_THREADS), batch). */
GPTQ_KERNEL void fwd_softmax(float *s, int lds, long long stride, int rows, int keys, int q0, float scale,
                             int window, float softcap)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows)
        return;
    float *row = s + (long long)blockIdx.y * stride + i;
    int last = q0 + i;
    int lo = window > 0 ? last + 1 - window : 0;
    if (lo < 0)
        lo = 0;
    float m = -3.402823466e+38f;
    for (int j = lo; j <= last && j < keys; ++j) {
        float v = GPTQ_MUL(row[(long long)j * lds], scale);
        if (softcap > 0.0f)
            v = GPTQ_MUL(softcap, tanhf(GPTQ_DIV(v, softcap)));
        row[(long long)j * lds] = v;
        m = fmaxf(m, v);
    }
    float sum = 0.0f;
    for (int j = lo; j <= last && j < keys; ++j) {
        float e = expf(GPTQ_SUB(row[(long long)j * lds], m));
        row[(long long)j * lds] = e;
        sum = GPTQ_ADD(sum, e);
    }
    for (int j = 0; j < keys; ++j) {
        if (j < lo || j > last)
            row[(long long)j * lds] = 0.0f;
        else
            row[(long long)j * lds] = GPTQ_DIV(row[(long long)j * lds], sum);
    }
}

/* g[t, c] = act(g[t, c]) * u[t, c]: SiLU (gelu == 0) or GELU with the tanh approximation (Gemma). */
GPTQ_KERNEL void fwd_act_mul(float *g, int ldg, const float *u, int ldu, int tokens, int cols, int gelu)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens)
        return;
    for (int c = blockIdx.y; c < cols; c += gridDim.y) {
        float x = g[t + (long long)c * ldg], uv = u[t + (long long)c * ldu];
        float a;
        if (gelu) {
            float inner = GPTQ_MUL(0.7978846f, GPTQ_ADD(x, GPTQ_MUL(GPTQ_MUL(GPTQ_MUL(0.044715f, x), x), x)));
            a = GPTQ_MUL(GPTQ_MUL(0.5f, x), GPTQ_ADD(1.0f, tanhf(inner)));
        } else {
            a = GPTQ_DIV(x, GPTQ_ADD(1.0f, expf(-x)));
        }
        g[t + (long long)c * ldg] = GPTQ_MUL(a, uv);
    }
}

/* x[t, c] += y[t, c]. */
GPTQ_KERNEL void fwd_add(float *x, int ldx, const float *y, int ldy, int tokens, int cols)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens)
        return;
    for (int c = blockIdx.y; c < cols; c += gridDim.y)
        x[t + (long long)c * ldx] = GPTQ_ADD(x[t + (long long)c * ldx], y[t + (long long)c * ldy]);
}

/* y[t, c] += b[c] (a linear's bias). */
GPTQ_KERNEL void fwd_add_bias(float *y, int ldy, const float *b, int tokens, int cols)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens)
        return;
    for (int c = blockIdx.y; c < cols; c += gridDim.y)
        y[t + (long long)c * ldy] = GPTQ_ADD(y[t + (long long)c * ldy], b[c]);
}

/* x[t, c] = x[t, c] * a + b: Gemma 4's layer scalar (a, 0), and the zero fill before a product kernel
 * accumulates (0, 0). */
GPTQ_KERNEL void fwd_affine(float *x, int ldx, int tokens, int cols, float a, float b)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens)
        return;
    for (int c = blockIdx.y; c < cols; c += gridDim.y) {
        float v = x[t + (long long)c * ldx];
        x[t + (long long)c * ldx] = (a == 0.0f) ? b : GPTQ_ADD(GPTQ_MUL(v, a), b);
    }
}
