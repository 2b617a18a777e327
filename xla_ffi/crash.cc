#include "crash.h"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

namespace jnntile {
namespace {

constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
struct sigaction previous_action[NSIG];

void print_native_stack(int sig, siginfo_t*, void*) {
  static const char header[] = "\njnntile: fatal signal; native stack (innermost first):\n";
  void* frames[64];
  int depth = backtrace(frames, 64);
  if (write(STDERR_FILENO, header, sizeof header - 1) > 0) backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  // The signal stays blocked while this handler runs: raised again, it reaches the previous handler once this
  // one returns (a fault would also repeat by itself).
  sigaction(sig, &previous_action[sig], nullptr);
  raise(sig);
}

}  // namespace

void report_native_stack_on_crash() {
  void* warm_up[1];
  backtrace(warm_up, 1);  // loads the unwinder now: its first call allocates, which a signal handler must not
  struct sigaction action {};
  action.sa_sigaction = print_native_stack;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (int sig : kFatalSignals) sigaction(sig, &action, &previous_action[sig]);
}

}  // namespace jnntile
