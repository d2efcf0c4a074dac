// fault_trap: not a matrix kernel, and not in the registry. It executes `trap`, which aborts the launch and
// leaves the process's CUDA context unusable ("sticky": every later CUDA call fails), as an out-of-bounds
// access in a real kernel would. The service compiles it, and accepts kernel=fault_trap, only when
// MATMUL_FAULT_INJECTION=1, so that tests can show it notices a lost device, answers 503 and exits to be
// restarted with a fresh context.
extern "C" __global__ void fault_trap() { asm volatile("trap;"); }
