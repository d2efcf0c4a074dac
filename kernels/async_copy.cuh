// Asynchronous copies from global to shared memory (cp.async, sm_80+) and the loop over K that pipelines tiles
// through them, shared by `fast` and the tensor-core rungs mma_sync.cu and dmma.cu.
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

// The loop over K of a kernel whose tiles pass through STAGES stages of shared memory: `issue(stage, step)` starts
// this thread's copies of step's tiles into `stage`, `compute(stage)` multiplies the tiles that stage holds. The
// prologue fills STAGES - 1 stages. At each step the wait leaves this thread's copies of the step's tiles landed,
// and the barrier makes every thread's copies visible to all; it also says that every thread has finished the
// step before, whose stage is the one refilled, STAGES - 1 steps ahead. A group is committed even when empty, so
// that the group of step t is always the (t + 1)-th and the wait counts right on the last steps.
template <int STAGES, typename Issue, typename Compute>
__device__ __forceinline__ void pipelined_k_loop(int steps, Issue&& issue, Compute&& compute) {
    static_assert(STAGES >= 2, "a pipeline has a stage to read and one to fill");
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) issue(s, s);
        copy_async_commit();
    }
    int read_stage = 0;
    int write_stage = STAGES - 1;
    for (int step = 0; step < steps; ++step) {
        copy_async_wait<STAGES - 2>();
        __syncthreads();
        if (step + STAGES - 1 < steps) issue(write_stage, step + STAGES - 1);
        copy_async_commit();
        compute(read_stage);
        read_stage = read_stage == STAGES - 1 ? 0 : read_stage + 1;
        write_stage = write_stage == STAGES - 1 ? 0 : write_stage + 1;
    }
}

// The copies of the tile of K from k0 = step * BK into `stage`, by copy(guarded, stage, k0): guarded only in blocks on
// C's bottom or right edge (`edge_block`) and on the last step when BK does not divide K, the other steps' copies
// being one address and one cp.async each. `guarded` is a constant in each call of `copy` (it is inlined), so that
// each is compiled for it.
template <int BK, typename Copy>
__device__ __forceinline__ void copy_guarded_at_edges(bool edge_block, int K, int stage, int step, Copy&& copy) {
    const int k0 = step * BK;
    if (edge_block || k0 + BK > K) {
        copy(true, stage, k0);
    } else {
        copy(false, stage, k0);
    }
}

#endif  // MATMUL_ASYNC_COPY_CUH
