/* The attachments' own cost: programs that do nothing on sock_send_length,
 * one as a tracepoint's (the kernel copies the event's fields for it first),
 * one as a raw tracepoint's (it gets the arguments). */
TRACEPOINT_PROBE(sock, sock_send_length)
{
	return 0;
}

RAW_TRACEPOINT_PROBE(sock_send_length)
{
	return 0;
}
