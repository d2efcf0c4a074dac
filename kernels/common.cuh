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

// A batched launch runs gridDim.z products of one shape: blockIdx.z picks one, and the kernel's A, B and C move to
// its operands and its product. A_STRIDE and B_STRIDE are the elements from one product's operand to the next's:
// M*K and K*N for a stack stored back to back, 0 for a matrix every product shares (numpy.matmul's broadcasting),
// which is so read where it lies rather than copied into a stack. A macro, not a function: it puts the same
// statements in each kernel, so each compiles alike; an inline function taking the pointers by reference let NVRTC
// order the offset arithmetic differently in naive and coalesced.
#define SELECT_BATCH_PRODUCT(A, B, C, M, N, A_STRIDE, B_STRIDE) \
    do {                                                        \
        (A) += (size_t)blockIdx.z * (A_STRIDE);                 \
        (B) += (size_t)blockIdx.z * (B_STRIDE);                 \
        (C) += (size_t)blockIdx.z * (M) * (N);                  \
    } while (0)

#endif  // MATMUL_COMMON_CUH
