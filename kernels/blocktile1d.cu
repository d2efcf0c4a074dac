// blocktile1d: shared-memory tiles with a column of TM outputs per thread, loaded 16 bytes at a time.
//
// What it changes over `coalesced` (and `tiled`): a block of BM*BN/TM threads computes a BM x BN tile of C,
// each thread a column of TM outputs. Per step of k a thread reads one B element from shared memory and
// reuses it for TM multiply-adds against TM A elements, which it reads as one run of TM consecutive words
// (A is stored transposed, As[k][m], so the run is contiguous and every lane of a warp reads the same run:
// a broadcast, vectorised by the compiler). Shared-memory loads per multiply-add drop from 2 (tiled) to
// about (1 + TM/4)/TM, so the kernel is no longer bound by shared-memory instructions. Global loads go
// through 16-byte vectors (VEC) when the row length allows it, a quarter of the load instructions.
//
// VEC requires K and N to be multiples of the vector width (16 / sizeof(T)), so that every vector lies
// wholly inside or wholly outside a row and starts 16-byte aligned; the registry launches the scalar
// instance otherwise. Out-of-range elements are stored as zeros, so the inner loop needs no bounds checks;
// every thread reaches both barriers, and only the final store is guarded.

#include "common.cuh"

template <typename T, int BM, int BN, int BK, int TM, bool VEC>
__global__ void __launch_bounds__(BM * BN / TM)
    matmul_blocktile1d(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K,
                       size_t a_batch_stride, size_t b_batch_stride) {
    constexpr int NT = BM * BN / TM;
    constexpr int W = VEC ? 16 / sizeof(T) : 1;
    using Vec = Chunk<T, W>;
    __shared__ __align__(16) T As[BK][BM];  // transposed: a thread's TM rows are contiguous at each k
    __shared__ __align__(16) T Bs[BK][BN];

    const int tid = threadIdx.x;
    const int m0 = blockIdx.y * BM;
    const int n0 = blockIdx.x * BN;
    const int tcol = tid % BN;  // consecutive lanes take consecutive columns: conflict-free reads of Bs
    const int trow = tid / BN;

    SELECT_BATCH_PRODUCT(A, B, C, M, N, a_batch_stride, b_batch_stride);

    T acc[TM] = {};
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
            const T b = Bs[k][tcol];
#pragma unroll
            for (int i = 0; i < TM; ++i) acc[i] += As[k][trow * TM + i] * b;
        }
        __syncthreads();  // everyone is done reading before the next step overwrites the tiles
    }
    const int col = n0 + tcol;
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = m0 + trow * TM + i;
        if (row < M && col < N) C[(size_t)row * N + col] = acc[i];
    }
}
