// naive: one thread per output element, the first rung of the ladder.
//
// Thread (x, y) of the 16x16 block computes C[row, col] with row = y and col = x, walking K with two
// global loads per multiply-add. Consecutive threads of a warp share `row` and take consecutive `col`,
// so the loads of B and the store of C are coalesced and the load of A is a broadcast; still every
// element of A is read N times and every element of B M times from global memory (L1/L2 absorb part
// of it), which is why this runs far below cuBLAS (docs/kernels.md). Bounds are checked on the output only: a
// thread that owns no element does no work, and there is no barrier for it to miss.

#include "common.cuh"

template <typename T>
__global__ void matmul_naive(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C,
                             int M, int N, int K, size_t a_batch_stride, size_t b_batch_stride) {
    SELECT_BATCH_PRODUCT(A, B, C, M, N, a_batch_stride, b_batch_stride);
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= M || col >= N) return;  // safe: this kernel has no barrier
    const T* a = A + (size_t)row * K;
    T acc = T(0);
    for (int k = 0; k < K; ++k) acc += a[k] * B[(size_t)k * N + col];
    C[(size_t)row * N + col] = acc;
}
