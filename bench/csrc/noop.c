/* The benchmark's floor: a uprobe and a uretprobe that do nothing, so that
 * the cost of stallwatch's own probes can be given as a ratio to it. */
#include <uapi/linux/ptrace.h>

int handle_noop(struct pt_regs *ctx)
{
	return 0;
}
