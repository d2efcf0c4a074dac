// Asynchronous copies from global to shared memory (cp.async, sm_80+), shared by the kernels that pipeline their
// tiles: `fast`, and the tensor-core rungs mma_sync.cu and dmma.cu.
#ifndef MATMUL_ASYNC_COPY_CUH
#define MATMUL_ASYNC_COPY_CUH

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Copy BYTES from global to shared memory asynchronously. A guarded copy with `valid` false reads nothing
// and fills the destination with zeros (the source-size operand is 0), so `src` need only be some valid
// address; an unguarded copy is unconditional and needs no predicate. `guarded` is a constant at every call
// (the function is inlined), so only one of the four forms is compiled in each place.
template <int BYTES>
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool guarded, bool valid) {
    // .cg for 16-byte copies: they may bypass L1, as each B element is used by this block only.
    if (!guarded && BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(dst)), "l"(src));
    } else if (!guarded) {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(shared_address(dst)), "l"(src), "n"(BYTES));
    } else if (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                     "r"(valid ? 16 : 0));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(shared_address(dst)), "l"(src),
                     "n"(BYTES), "r"(valid ? BYTES : 0));
    }
}

// Copy the first `bytes` (0..16) of a 16-byte unit asynchronously and fill the rest of it with zeros.
__device__ __forceinline__ void copy_async_prefix(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most PENDING committed groups of this thread are still in flight.
template <int PENDING>
__device__ __forceinline__ void copy_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

#endif  // MATMUL_ASYNC_COPY_CUH
