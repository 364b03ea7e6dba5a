// Builds with CUDA on the CPU only (chipStar + PoCL, docs/cuda-on-cpu.md): the environment its
// runtime needs, set by the program itself.
//
// chipStar's runtime (libCHIP.so) reads its configuration from environment variables while the
// library is loaded, before main() and before any constructor of the program runs: the device
// type (PoCL's device is a CPU; chipStar looks for a GPU unless told), where PoCL's OpenCL driver
// is, where the compiled kernels are cached. Setting them in main() is too late, and setenv()
// cannot run earlier either (the C library sets up the environment after .preinit_array).
// So a function in .preinit_array, which the loader calls before any library is initialised,
// looks at the environment the program was started with; if a variable is missing it executes
// the program again (same pid, same arguments) with the missing variables added. A value the
// user set wins. The cost is one exec at start-up, and nothing at all when the variables are set.
//
// Runs before the C library is initialised: no malloc, no stdio, no getenv; only static
// buffers and system calls.
#include <unistd.h>

#include <cstring>
#include <initializer_list>

namespace {

constexpr int kMaxEnv = 4096;  // entries of the environment we can extend (more: left alone)
constexpr int kMaxLen = 1024;  // length of one added NAME=value

/// The value of `name` in envp, or nullptr.
const char* find(char** envp, const char* name) {
  const size_t n = strlen(name);
  for (char** e = envp; *e != nullptr; ++e)
    if (strncmp(*e, name, n) == 0 && (*e)[n] == '=') return *e + n + 1;
  return nullptr;
}

/// Writes "NAME=part1part2part3" into out (truncated to kMaxLen).
void compose(char* out, const char* name, const char* a, const char* b = "", const char* c = "") {
  out[0] = '\0';
  for (const char* part : {name, "=", a, b, c}) strncat(out, part, kMaxLen - 1 - strlen(out));
}

void add_missing_and_reexec(int /*argc*/, char** argv, char** envp) {
  static char added[8][kMaxLen];
  static char* new_envp[kMaxEnv + 7];
  const char* root = CP_CUDA_CPU_ROOT;
  const char* xdg = find(envp, "XDG_CACHE_HOME");
  const char* home = find(envp, "HOME");
  const char* cache_base = xdg && *xdg ? xdg : home && *home ? home : "/tmp";
  const char* cache_sub = xdg && *xdg ? "/cp-course" : "/.cache/cp-course";

  int n_added = 0;
  auto want = [&](const char* name, const char* a, const char* b = "", const char* c = "") {
    if (find(envp, name) == nullptr) compose(added[n_added++], name, a, b, c);
  };
  want("CHIP_DEVICE_TYPE", "cpu");                                   // PoCL's device is a CPU
  want("CHIP_LOGLEVEL", "err");                                      // no start-up chatter
  want("OCL_ICD_VENDORS", root, "/etc/OpenCL/vendors");              // this PoCL, not another OpenCL
  want("POCL_PATH_LLVM_SPIRV", root, "/bin/llvm-spirv");             // PoCL's default is its build folder
  want("POCL_CACHE_DIR", cache_base, cache_sub, "/pocl");            // kernels compiled for the CPU...
  want("CHIP_MODULE_CACHE_DIR", cache_base, cache_sub, "/chipstar"); // ...cached across runs
  // How PoCL turns a kernel into a loop over the threads of a block. Its default ("loopvec")
  // makes one loop per stretch between barriers, and every warp shuffle is a barrier here: the
  // attention kernels' unrolled shuffles made compiling them 2.5 times slower than with "cbs"
  // (continuation-based synchronisation) (docs/cuda-on-cpu.md, measured).
  want("POCL_WORK_GROUP_METHOD", "cbs");
  // One compiled kernel for every block size, instead of a second one per block size at the first
  // launch: a quarter less compile time, for kernels that run as fast either way.
  want("POCL_WORK_GROUP_SPECIALIZATION", "0");
  if (n_added == 0) return;

  int n = 0;
  while (envp[n] != nullptr && n < kMaxEnv) new_envp[n] = envp[n], ++n;
  if (envp[n] != nullptr) return;  // an environment this large is left as it is
  for (int i = 0; i < n_added; ++i) new_envp[n++] = added[i];
  new_envp[n] = nullptr;
  execve("/proc/self/exe", argv, new_envp);
  static const char kFailed[] = "cp: could not restart with the environment of CUDA on the CPU (/proc/self/exe)\n";
  (void)!write(2, kFailed, sizeof(kFailed) - 1);  // carry on: chipStar will say what it misses
}

}  // namespace

/// The loader calls this before any shared library's initialiser. Global, so that the linker
/// keeps it (cp_cuda_runtime links every program with --undefined=cp_cuda_on_cpu_preinit).
extern "C" {
__attribute__((section(".preinit_array"), used)) void (*cp_cuda_on_cpu_preinit)(int, char**, char**) =
    add_missing_and_reexec;
}
