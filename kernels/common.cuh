// What several kernels share: the vector type of their 16-byte loads and stores, and the choice of one product
// in a batched launch. Each kernel source includes it; the registry puts its text in place of the #include
// before NVRTC compiles, so that a change here changes the source CuPy's kernel cache is keyed on.
#ifndef MATMUL_COMMON_CUH
#define MATMUL_COMMON_CUH

// W elements of T as one unit aligned to its size, so that loading or storing a Chunk is one vector instruction
// (16 bytes when W = 16 / sizeof(T)); W = 1 is a plain scalar access.
template <typename T, int W>
struct alignas(sizeof(T) * W) Chunk {
    T v[W];
};

// A batched launch runs gridDim.z products of one shape, stored back to back: blockIdx.z picks one, and the
// kernel's A, B and C move to its operands and its product. A macro, not a function: it puts the same statements
// in each kernel as before, so each compiles to the same PTX; an inline function taking the pointers by reference
// let NVRTC order the offset arithmetic differently in naive and coalesced.
#define SELECT_BATCH_PRODUCT(A, B, C, M, N, K) \
    do {                                        \
        (A) += (size_t)blockIdx.z * (M) * (K);  \
        (B) += (size_t)blockIdx.z * (K) * (N);  \
        (C) += (size_t)blockIdx.z * (M) * (N);  \
    } while (0)

#endif  // MATMUL_COMMON_CUH
