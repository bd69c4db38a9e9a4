/* The floor of a store server, for bench/store_bench.py's rendezvous rows (--impl floor).
 *
 * It speaks just enough of gpucoll's store frames (gpucoll/store/_wire.py) for the load
 * generator's rendezvous script and for gpucoll's own client hammering a counter
 * (store_bench.py's add-throughput rows): HELLO is answered with the server's limits, and
 * every other complete frame (add, set, wait) at once with OK and one field, "1". It keeps
 * no keys and parks no wait, so a client's `wait` returns at once and no fan-out is needed.
 * Like gpucoll's server it also listens on the abstract Unix socket that same-host clients
 * try first ("\0gpucoll-store/127.0.0.1:<port>"). What is left is
 * what every store server pays per client, whatever its language: accept, register,
 * read, reply, close, one TCP connection each. Its rendezvous time and CPU per client
 * are a lower bound for any server driven by the same generator over TCP.
 *
 * Built by the benchmark with the machine's C compiler: cc -O2 -o store_floor store_floor.c
 * Usage: store_floor  (prints the port it listens on, on 127.0.0.1, then serves until killed)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define LISTENERS 8 /* as gpucoll's server: SO_REUSEPORT listeners, so no accept queue overflows */
#define LISTENER_TAG ((uint64_t)1 << 40)

/* A reply frame: length 6, status OK (0), one field of length 1: "1". */
static const unsigned char REPLY[10] = {6, 0, 0, 0, 0, 1, 0, 0, 0, '1'};
/* The reply to HELLO (opcode 1): OK and four fields, max key size, max value size, max
 * frame size, instance id ("4096", "1048576", "3145728", "floor"). */
static const unsigned char HELLO_REPLY[] = {
    40, 0, 0, 0, 0,
    4, 0, 0, 0, '4', '0', '9', '6',
    7, 0, 0, 0, '1', '0', '4', '8', '5', '7', '6',
    7, 0, 0, 0, '3', '1', '4', '5', '7', '2', '8',
    5, 0, 0, 0, 'f', 'l', 'o', 'o', 'r'};
#define HELLO_CODE 1

int main(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    int ep = epoll_create1(EPOLL_CLOEXEC);
    int ls[LISTENERS];
    uint16_t port = 0;
    for (int i = 0; i < LISTENERS; i++) {
        ls[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        int one = 1;
        setsockopt(ls[i], SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
        setsockopt(ls[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* inherited by accepted sockets */
        struct sockaddr_in a;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_port = htons(port);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (bind(ls[i], (struct sockaddr *)&a, sizeof a) != 0 || listen(ls[i], 65535) != 0) {
            perror("store_floor: bind/listen");
            return 1;
        }
        if (i == 0) {
            socklen_t len = sizeof a;
            getsockname(ls[0], (struct sockaddr *)&a, &len);
            port = ntohs(a.sin_port);
        }
        struct epoll_event e = {.events = EPOLLIN, .data.u64 = LISTENER_TAG | (uint64_t)i};
        epoll_ctl(ep, EPOLL_CTL_ADD, ls[i], &e);
    }
    /* The abstract Unix socket gpucoll's clients on this host try before TCP. */
    int ux = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_un ua;
    memset(&ua, 0, sizeof ua);
    ua.sun_family = AF_UNIX;
    int nl = snprintf(ua.sun_path + 1, sizeof ua.sun_path - 1, "gpucoll-store/127.0.0.1:%u", port);
    if (ux >= 0 && bind(ux, (struct sockaddr *)&ua, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + nl)) == 0 &&
        listen(ux, 65535) == 0) {
        struct epoll_event e = {.events = EPOLLIN, .data.u64 = LISTENER_TAG | (uint64_t)LISTENERS};
        epoll_ctl(ep, EPOLL_CTL_ADD, ux, &e);
    }
    printf("%u\n", port);
    fflush(stdout);

    static unsigned char in[65536], out[65536];
    struct epoll_event evs[512];
    for (;;) {
        int n = epoll_wait(ep, evs, 512, -1);
        for (int k = 0; k < n; k++) {
            uint64_t d = evs[k].data.u64;
            if (d & LISTENER_TAG) {
                for (;;) {
                    int lfd = (d & 0xff) == LISTENERS ? ux : ls[d & 0xff];
                    int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                    if (fd < 0)
                        break;
                    struct epoll_event e = {.events = EPOLLIN, .data.u64 = (uint64_t)fd};
                    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e);
                }
                continue;
            }
            int fd = (int)d;
            ssize_t got = recv(fd, in, sizeof in, 0);
            if (got < 0 && (errno == EAGAIN || errno == EINTR))
                continue;
            if (got <= 0) {
                close(fd); /* also leaves the epoll set */
                continue;
            }
            /* The generator writes each request whole, and a client has one outstanding:
             * count the frames in this read and answer each. */
            size_t pos = 0, m = 0;
            while (pos + 5 <= (size_t)got && m + sizeof HELLO_REPLY <= sizeof out) {
                uint32_t len;
                memcpy(&len, in + pos, 4);
                if (in[pos + 4] == HELLO_CODE) {
                    memcpy(out + m, HELLO_REPLY, sizeof HELLO_REPLY);
                    m += sizeof HELLO_REPLY;
                } else {
                    memcpy(out + m, REPLY, sizeof REPLY);
                    m += sizeof REPLY;
                }
                pos += 4 + (size_t)len;
            }
            if (m)
                send(fd, out, m, MSG_NOSIGNAL);
        }
    }
}
