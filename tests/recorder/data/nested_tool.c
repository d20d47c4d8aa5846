/* Another tool's tracing program, for the nesting test: on task:task_rename,
 * for the tasks that rename themselves "swspin" only, it runs for SPIN_NS
 * (at most SPIN_STEPS clock reads).  While it runs the kernel runs no other
 * tracepoint program on that CPU: the interrupts and softirqs that come
 * meanwhile (a timer waking a task, a retransmission timer) get none. */
TRACEPOINT_PROBE(task, task_rename)
{
	if (args->newcomm[0] != 's' || args->newcomm[1] != 'w' || args->newcomm[2] != 's' ||
	    args->newcomm[3] != 'p' || args->newcomm[4] != 'i' || args->newcomm[5] != 'n')
		return 0;
	u64 end = bpf_ktime_get_ns() + SPIN_NS;
#pragma clang loop unroll(disable)
	for (int i = 0; i < SPIN_STEPS; i++) {
		if (bpf_ktime_get_ns() >= end)
			break;
	}
	return 0;
}
