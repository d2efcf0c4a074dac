// tiled: the classic shared-memory kernel, TILE x TILE threads computing a TILE x TILE block of C.
//
// What it changes over `naive`: each step stages one TILE x TILE tile of A and one of B in shared memory,
// every thread loading one element of each, and then all threads read the tiles TILE times from shared
// memory. Global traffic drops by a factor of TILE (16 by default).
//
// Two barriers per step: the first so no thread reads a tile element before the thread owning it has
// stored it, the second so no thread overwrites the tiles for the next step while another still reads them.
//
// Edge tiles are zero-padded: a thread whose A or B element lies outside the matrix stores 0 (the guard
// is `row < M && a_col < K`, both conditions), so the inner product needs no bounds checks and sizes need
// not be multiples of TILE. A thread whose output lies outside C still loads and still reaches every
// barrier; it only skips the final store. (The classic documentation example returns early, before the
// barriers, and guards the loads with the wrong connective; both bugs give wrong answers or hangs on edges.)
//
// Shared-memory banks: As[ty][i] is one word for the whole warp row (a broadcast); Bs[i][tx] is a row of
// consecutive words (no conflict), so the tiles need no padding.

#include "common.cuh"

template <typename T, int TILE>
__global__ void matmul_tiled(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C,
                             int M, int N, int K, size_t a_batch_stride, size_t b_batch_stride) {
    SELECT_BATCH_PRODUCT(A, B, C, M, N, a_batch_stride, b_batch_stride);
    __shared__ T As[TILE][TILE];
    __shared__ T Bs[TILE][TILE];

    const int tx = threadIdx.x;
    const int ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty;
    const int col = blockIdx.x * TILE + tx;

    T acc = T(0);
    for (int k0 = 0; k0 < K; k0 += TILE) {
        const int a_col = k0 + tx;
        const int b_row = k0 + ty;
        As[ty][tx] = (row < M && a_col < K) ? A[(size_t)row * K + a_col] : T(0);
        Bs[ty][tx] = (b_row < K && col < N) ? B[(size_t)b_row * N + col] : T(0);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < TILE; ++i) acc += As[ty][i] * Bs[i][tx];
        __syncthreads();
    }
    if (row < M && col < N) C[(size_t)row * N + col] = acc;
}
