/* SIGBUS guard for memory-mapped store files (map_guard.py loads it through ctypes).
 *
 * A file truncated under a process that maps it (an in-place `cp`, `rsync --inplace`, `truncate`) makes every read
 * of a page past the new end raise SIGBUS, whose default action kills the process. This handler turns such a fault
 * inside a registered mapping into a readable page of zeros (an anonymous page mapped over the vanished one) and
 * counts it per mapping; the faulting read then completes and the caller, after its kernel returns, sees the count
 * and answers DATA_LOSS instead of the result. Faults outside registered mappings go to the handler that was
 * installed before (Python's faulthandler, or the default action).
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_RANGES 4096

static uintptr_t range_lo[MAX_RANGES], range_hi[MAX_RANGES];
int64_t map_guard_fault_counts[MAX_RANGES];  /* read directly by map_guard.py (one load, no call) */
static int range_count;  /* slots ever used; entries are published with release stores */
static uintptr_t page_mask;
static struct sigaction previous;

static void chain(int sig, siginfo_t *info, void *uctx) {
    if ((previous.sa_flags & SA_SIGINFO) && previous.sa_sigaction != NULL) {
        previous.sa_sigaction(sig, info, uctx);
        return;
    }
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    /* Default action: restore it; a real fault re-executes the read and ends the process as before, a signal
       sent by kill() is raised again (it is delivered once this handler returns). */
    signal(sig, SIG_DFL);
    if (info == NULL || info->si_code <= 0) raise(sig);
}

static void on_sigbus(int sig, siginfo_t *info, void *uctx) {
    if (info != NULL && info->si_code > 0) { /* raised by the kernel for a memory access */
        uintptr_t addr = (uintptr_t)info->si_addr;
        int n = __atomic_load_n(&range_count, __ATOMIC_ACQUIRE);
        for (int i = 0; i < n; i++) {
            uintptr_t lo = __atomic_load_n(&range_lo[i], __ATOMIC_ACQUIRE);
            uintptr_t hi = __atomic_load_n(&range_hi[i], __ATOMIC_ACQUIRE);
            if (lo <= addr && addr < hi) {
                void *page = (void *)(addr & page_mask);
                if (mmap(page, ~page_mask + 1, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
                    __atomic_add_fetch(&map_guard_fault_counts[i], 1, __ATOMIC_RELAXED);
                    return;
                }
                break;
            }
        }
    }
    chain(sig, info, uctx);
}

/* Install the handler unless it is the current one (someone may have installed theirs since). 0 = ok. */
int map_guard_install(void) {
    struct sigaction cur, sa;
    page_mask = ~((uintptr_t)sysconf(_SC_PAGESIZE) - 1);
    if (sigaction(SIGBUS, NULL, &cur) != 0) return -1;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus) return 0;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    previous = cur;
    return sigaction(SIGBUS, &sa, NULL);
}

/* Watch [lo, hi) in `slot` (0 <= slot < MAX_RANGES; the caller hands out free slots). 0 = ok. */
int map_guard_add(int slot, uintptr_t lo, uintptr_t hi) {
    if (slot < 0 || slot >= MAX_RANGES) return -1;
    __atomic_store_n(&range_hi[slot], 0, __ATOMIC_RELEASE);
    __atomic_store_n(&map_guard_fault_counts[slot], 0, __ATOMIC_RELEASE);
    __atomic_store_n(&range_lo[slot], lo, __ATOMIC_RELEASE);
    __atomic_store_n(&range_hi[slot], hi, __ATOMIC_RELEASE);
    if (slot >= __atomic_load_n(&range_count, __ATOMIC_ACQUIRE))
        __atomic_store_n(&range_count, slot + 1, __ATOMIC_RELEASE);
    return 0;
}

void map_guard_remove(int slot) {
    if (slot < 0 || slot >= MAX_RANGES) return;
    __atomic_store_n(&range_hi[slot], 0, __ATOMIC_RELEASE);
    __atomic_store_n(&range_lo[slot], 0, __ATOMIC_RELEASE);
}

/* Faults turned into zero pages in `slot` since it was added. */
int64_t map_guard_faults(int slot) {
    if (slot < 0 || slot >= MAX_RANGES) return 0;
    return __atomic_load_n(&map_guard_fault_counts[slot], __ATOMIC_ACQUIRE);
}

int map_guard_capacity(void) { return MAX_RANGES; }
