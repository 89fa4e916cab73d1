/* `execl`, `execlp` and `execle` for the preload library: variadic, which stable Rust cannot
 * define. Each collects its arguments into an argv array and calls the library's `execv`,
 * `execvp` or `execve` (crates/preload/src/exec.rs: the preloaded library's own names come
 * first), which write the profile and fix up the
 * environment. They can run in a forked child: no heap. The array is on the stack, or in an
 * anonymous mapping past STACK_ARGS arguments. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <sys/mman.h>
#include <unistd.h>

#define STACK_ARGS 256

extern char **environ;

enum kind { KIND_V, KIND_VP, KIND_VE };

/* Counts the arguments after `arg0` up to the terminating NULL. */
static size_t count_args(va_list ap) {
    size_t n = 0;
    while (va_arg(ap, char *) != NULL) n++;
    return n;
}

static int run(enum kind kind, const char *path, char *const argv[], char *const envp[]) {
    switch (kind) {
    /* The library is preloaded: these names resolve to its own hooks (exec.rs). */
    case KIND_V: return execv(path, argv);
    case KIND_VP: return execvp(path, argv);
    default: return execve(path, argv, envp);
    }
}

/* `n`: the arguments after arg0; `ap` positioned after arg0. For execle, the environment
 * follows the NULL. */
static int collect_and_run(enum kind kind, const char *path, const char *arg0, size_t n,
                           va_list ap) {
    char *stack[STACK_ARGS];
    char **argv = stack;
    size_t len = (n + 2) * sizeof(char *);
    if (n + 2 > STACK_ARGS) {
        void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            errno = E2BIG;
            return -1;
        }
        argv = m;
    }
    argv[0] = (char *)arg0;
    for (size_t i = 1; i <= n + 1; i++) argv[i] = va_arg(ap, char *); /* the last is NULL */
    char *const *envp = kind == KIND_VE ? va_arg(ap, char *const *) : environ;
    int r = run(kind, path, argv, envp);
    if (argv != stack) {
        int e = errno;
        munmap(argv, len);
        errno = e;
    }
    return r;
}

#define DEFINE(name, kind)                                                                      \
    int name(const char *path, const char *arg0, ...) {                             \
        va_list ap, ap2;                                                                        \
        va_start(ap, arg0);                                                                     \
        va_copy(ap2, ap);                                                                       \
        size_t n = arg0 ? count_args(ap2) : 0;                                                  \
        va_end(ap2);                                                                            \
        int r = arg0 ? collect_and_run(kind, path, arg0, n, ap)                                 \
                     : run(kind, path, (char *const[]){NULL},                                   \
                           kind == KIND_VE ? va_arg(ap, char *const *) : environ);              \
        va_end(ap);                                                                             \
        return r;                                                                               \
    }

DEFINE(execl, KIND_V)
DEFINE(execlp, KIND_VP)
DEFINE(execle, KIND_VE)
