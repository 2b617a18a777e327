#pragma once

namespace jnntile {

// Makes a fatal signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) in this process print the native stack to
// stderr before the handler installed before it (Python's faulthandler prints the Python stack): a crash
// inside StarPU or a kernel then says where, also on machines without a debugger. Called once at import.
void report_native_stack_on_crash();

}  // namespace jnntile
