// coalesced: still one thread per output and no shared memory, but every global load is one full,
// coalesced line per warp.
//
// What it changes over `naive`: there a warp (two rows of 16 outputs) issues two loads per multiply-add:
// a 64-byte piece of a row of B and two scalar elements of A, each read by 16 lanes. Loads, not
// arithmetic, limit it: the load/store unit handles every one of those instructions, and each A element
// costs a whole instruction for 4 useful bytes. Here a warp owns 32 consecutive outputs of one row of C;
// it reads its row of A 32 elements at a time with one coalesced load (one element per lane) and hands
// element j to every lane with a register shuffle, so the A side costs one load per 32 multiply-adds
// instead of 32. Each B load is a full 128-byte line. Loads per multiply-add drop from 2 to about 1.03;
// the shuffles go through a separate, cheaper path.
//
// A warp is a row of the block (blockDim.x == 32), so `row` is the same for all its lanes: a warp whose row
// lies outside C returns as a whole, which is safe because the only synchronisation is within the warp.
// Lanes whose column lies outside C must stay to take part in the shuffles; they read column 0 of B
// (always valid) and skip the store.

#include "common.cuh"

template <typename T>
__global__ void matmul_coalesced(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C,
                                 int M, int N, int K, size_t a_batch_stride, size_t b_batch_stride) {
    SELECT_BATCH_PRODUCT(A, B, C, M, N, a_batch_stride, b_batch_stride);
    const int lane = threadIdx.x;
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    const int col = blockIdx.x * 32 + lane;
    if (row >= M) return;  // the whole warp: no lane of it is needed by another warp
    const bool col_in = col < N;
    const T* a = A + (size_t)row * K;
    const T* b = B + (col_in ? col : 0);

    T acc = T(0);
    for (int k0 = 0; k0 < K; k0 += 32) {
        const T a_lane = (k0 + lane < K) ? a[k0 + lane] : T(0);
        const T* b_k = b + (size_t)k0 * N;
        if (k0 + 32 <= K) {
#pragma unroll
            for (int j = 0; j < 32; ++j) acc += __shfl_sync(0xffffffffu, a_lane, j) * b_k[(size_t)j * N];
        } else {
            // The tail: k0 is the same for every lane, so the whole warp runs the same number of shuffles.
            for (int j = 0; j < K - k0; ++j) acc += __shfl_sync(0xffffffffu, a_lane, j) * b_k[(size_t)j * N];
        }
    }
    if (col_in) C[(size_t)row * N + col] = acc;
}
