/* How the lab's host threads wait: blocked (the default: in poll(2) or on a
 * condition variable, state S) or spinning (LABNCCL_WAIT=spin: runnable the
 * whole time, state R, as CUDA's spin synchronisation and NCCL's busy
 * polling wait on a real cluster).  A spinning waiter yields its CPU between
 * checks so that a two-core machine still runs the peers it waits for. */
#ifndef LAB_WAIT_H
#define LAB_WAIT_H

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

static inline int labSpinWait(void) {
    static int spin = -1; /* read once: the mode is fixed for the process */
    if (spin < 0) {
        const char *env = getenv("LABNCCL_WAIT");
        spin = env && strcmp(env, "spin") == 0;
    }
    return spin;
}

/* pthread_cond_wait, or (spinning) let go of the lock, yield, take it back:
 * the caller re-checks its condition either way. */
static inline void labCondWait(pthread_cond_t *cv, pthread_mutex_t *mu) {
    if (!labSpinWait()) {
        pthread_cond_wait(cv, mu);
        return;
    }
    pthread_mutex_unlock(mu);
    sched_yield();
    pthread_mutex_lock(mu);
}

#endif
