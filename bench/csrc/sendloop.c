/* sock_send_length's cost by itself: N sends of one byte on a UDP socket
 * that has no destination (each refused at once, EDESTADDRREQ, and each
 * still passing the tracepoint, which fires with the send's result).
 * Prints the CPU nanoseconds per send (the thread's own time: a machine
 * shared with others preempts it). */
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 1000000;
	int fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0 || send(fd, "x", 1, 0) != -1 || errno != EDESTADDRREQ) {
		perror("a UDP socket refusing a send without a destination");
		return 1;
	}
	struct timespec t0, t1;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
	for (long i = 0; i < n; i++)
		send(fd, "x", 1, 0);
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
	double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
	printf("%.1f\n", ns / n);
	return 0;
}
