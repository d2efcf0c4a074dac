// blocktile2d: a TM x TN block of outputs per thread (an outer product per k), 16-byte loads throughout.
//
// What it changes over `blocktile1d`: each thread now owns TM rows *and* TN columns of C. Per step of k it
// reads TM elements of A and TN of B from shared memory (as 16-byte vectors: A is stored transposed, so
// both runs are contiguous) and does TM*TN multiply-adds with them, so shared-memory traffic per
// multiply-add falls from (1 + TM)/TM words to (TM + TN)/(TM*TN): 1/4 with 8 x 8 instead of 9/8. The
// 64 accumulators stay in registers. A 128 x 128 tile of C per block also halves global traffic per
// flop against 64 x 64.
//
// What it still leaves on the table (the next step, `fast`, takes it): global loads are issued only after
// the barrier that ends the previous step, so every step waits for memory with nothing to compute;
// each thread's TN columns are contiguous, so the eight lanes of a quarter-warp read 8 x 32 bytes of Bs
// and conflict two ways; and the loads and stores of the tiles take the registers and issue slots of the
// same threads that compute.
//
// Vector loads and stores (VEC) need K and N to be multiples of the vector width (16 / sizeof(T)); the
// registry launches the scalar instance otherwise. Out-of-range elements are zeros in shared memory, every
// thread reaches every barrier, and only the final store is guarded.

#include "common.cuh"

template <typename T, int BM, int BN, int BK, int TM, int TN, bool VEC>
__global__ void __launch_bounds__(BM * BN / (TM * TN))
    matmul_blocktile2d(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K,
                       size_t a_batch_stride, size_t b_batch_stride) {
    SELECT_BATCH_PRODUCT(A, B, C, M, N, a_batch_stride, b_batch_stride);
    constexpr int NT = BM * BN / (TM * TN);
    constexpr int W = VEC ? 16 / sizeof(T) : 1;
    constexpr int R = 16 / sizeof(T);  // shared-memory reads are always 16 bytes: the tiles are aligned
    using Vec = Chunk<T, W>;
    using Frag = Chunk<T, R>;
    __shared__ __align__(16) T As[BK][BM];
    __shared__ __align__(16) T Bs[BK][BN];

    const int tid = threadIdx.x;
    const int m0 = blockIdx.y * BM;
    const int n0 = blockIdx.x * BN;
    const int trow = tid / (BN / TN);
    const int tcol = tid % (BN / TN);

    T acc[TM][TN] = {};
    T a[TM];
    T b[TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int c = tid; c < BM * BK / W; c += NT) {
            const int m = c / (BK / W);
            const int k = (c % (BK / W)) * W;
            Vec v = {};
            if (m0 + m < M && k0 + k < K) v = *reinterpret_cast<const Vec*>(A + (size_t)(m0 + m) * K + k0 + k);
#pragma unroll
            for (int j = 0; j < W; ++j) As[k + j][m] = v.v[j];
        }
        for (int c = tid; c < BK * BN / W; c += NT) {
            const int k = c / (BN / W);
            const int n = (c % (BN / W)) * W;
            Vec v = {};
            if (k0 + k < K && n0 + n < N) v = *reinterpret_cast<const Vec*>(B + (size_t)(k0 + k) * N + n0 + n);
            *reinterpret_cast<Vec*>(&Bs[k][n]) = v;
        }
        __syncthreads();  // the tiles are complete before anyone reads them
#pragma unroll
        for (int k = 0; k < BK; ++k) {
#pragma unroll
            for (int i = 0; i < TM; i += R) *reinterpret_cast<Frag*>(&a[i]) = *reinterpret_cast<const Frag*>(&As[k][trow * TM + i]);
#pragma unroll
            for (int j = 0; j < TN; j += R) *reinterpret_cast<Frag*>(&b[j]) = *reinterpret_cast<const Frag*>(&Bs[k][tcol * TN + j]);
#pragma unroll
            for (int i = 0; i < TM; ++i) {
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += a[i] * b[j];
            }
        }
        __syncthreads();  // everyone is done reading before the next step overwrites the tiles
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = m0 + trow * TM + i;
        if (row >= M) continue;  // no barrier follows
#pragma unroll
        for (int j = 0; j < TN; j += W) {
            const int col = n0 + tcol * TN + j;
            if (VEC) {
                // N is a multiple of W and so is col: the vector is wholly inside the row or wholly outside.
                if (col < N) *reinterpret_cast<Vec*>(&C[(size_t)row * N + col]) = *reinterpret_cast<const Vec*>(&acc[i][j]);
            } else if (col < N) {
                C[(size_t)row * N + col] = acc[i][j];
            }
        }
    }
}
