/* The floor of a store server, for bench/store_bench.py's rendezvous rows (--impl floor).
 *
 * It speaks just enough of gpucoll's store frames (gpucoll/store/_wire.py) for the load
 * generator's rendezvous script: every complete frame a client sends (HELLO, add, set,
 * wait) is answered at once with OK and one field, "1". It keeps no keys and parks no
 * wait, so a client's `wait` returns at once and no fan-out is needed. What is left is
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
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#define LISTENERS 8 /* as gpucoll's server: SO_REUSEPORT listeners, so no accept queue overflows */
#define LISTENER_TAG ((uint64_t)1 << 40)

/* A reply frame: length 6, status OK (0), one field of length 1: "1". */
static const unsigned char REPLY[10] = {6, 0, 0, 0, 0, 1, 0, 0, 0, '1'};

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
                    int fd = accept4(ls[d & 0xff], NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
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
            while (pos + 4 <= (size_t)got && (m + 1) * sizeof REPLY <= sizeof out) {
                uint32_t len;
                memcpy(&len, in + pos, 4);
                pos += 4 + (size_t)len;
                memcpy(out + m * sizeof REPLY, REPLY, sizeof REPLY);
                m++;
            }
            if (m)
                send(fd, out, m * sizeof REPLY, MSG_NOSIGNAL);
        }
    }
}
