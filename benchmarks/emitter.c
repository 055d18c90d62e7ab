/* A streaming server with an exactly known schedule, for measuring load generators (benchmarks/loadgen.py).

Speaks enough of the OpenAI API: POST /v1/completions and /v1/chat/completions (always streamed, SSE over
chunked HTTP/1.1 keep-alive), GET /v1/models, GET /health. Per request: the first chunk TTFT after the
request arrived, then one chunk every GAP, each carrying K tokens, until max_tokens (from the body, else -n)
are sent; the last content chunk has finish_reason "length" and is followed, in the same write, by a usage
chunk (choices: []) and [DONE]. With -u 1 every content chunk also carries cumulative `usage` (vLLM's
continuous_usage_stats). The first token's text is " @<seq>", every other token's " w", so a client that
keeps the text names the request, and whitespace-split words equal tokens.

Schedule and lateness, all on CLOCK_MONOTONIC (= Python's perf_counter_ns on Linux):
  rx      kernel receive time of the request's last segment (SO_TIMESTAMPNS, realtime converted to monotonic;
          the parse time when absent)
  parse   when the emitter had read the whole request
  due_i   parse + TTFT + i * GAP (i = 0 .. chunks-1): the schedule; never emitted early
  a_i     just before the write() of chunk i: the emission. a_0 - rx is the true TTFT.
A chunk a slow client has not drained is appended to its connection's buffer at a_i (its own delay is then
the client's). At SIGTERM/SIGINT each worker writes OUT/emitter-<worker>.txt:
  # ttft_ns gap_ns tokens_per_chunk usage_per_chunk
  seq rx_ns parse_ns max_tokens aborted a_0 a_1 ... (one line per request; aborted = client left early)

Build: gcc -O2 -o emitter emitter.c     Run: emitter -p PORT -t TTFT_MS -g GAP_MS -k K -o OUT [-n N] [-u 0|1] [-w W]
*/
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int64_t ns_t;

static ns_t ttft_ns, gap_ns, realtime_to_mono;
static int tokens_per_chunk = 1, usage_per_chunk = 0, default_tokens = 100, num_workers = 1, worker_id = 0;
static const char *out_dir = ".", *model = "emitter";
static volatile sig_atomic_t stopping = 0;

static ns_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (ns_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef struct { char *data; size_t len, cap; } buf_t;

static void buf_add(buf_t *b, const char *s, size_t n) {
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 4096;
        b->data = realloc(b->data, b->cap);
        if (!b->data) { perror("realloc"); exit(1); }
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
}

static void buf_printf(buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_printf(buf_t *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    buf_add(b, tmp, (size_t)n);
}

typedef struct {
    int fd, streaming, want_out, chat, heap_idx;
    buf_t in, out;
    long seq;
    ns_t rx, parse, next_due;
    int max_tokens, sent_tokens, prompt_tokens, num_chunks, chunk_idx;
    ns_t *emitted;  /* a_i per chunk */
} conn_t;

static int ep;
static buf_t log_buf;  /* finished requests, written at exit */
static long next_seq;

/* ---- min-heap of streaming connections by next_due ---- */
static conn_t **heap;
static int heap_len, heap_cap;

static void heap_swap(int i, int j) {
    conn_t *t = heap[i]; heap[i] = heap[j]; heap[j] = t;
    heap[i]->heap_idx = i; heap[j]->heap_idx = j;
}
static void heap_up(int i) {
    while (i > 0 && heap[(i - 1) / 2]->next_due > heap[i]->next_due) { heap_swap(i, (i - 1) / 2); i = (i - 1) / 2; }
}
static void heap_down(int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < heap_len && heap[l]->next_due < heap[m]->next_due) m = l;
        if (r < heap_len && heap[r]->next_due < heap[m]->next_due) m = r;
        if (m == i) return;
        heap_swap(i, m); i = m;
    }
}
static void heap_push(conn_t *c) {
    if (heap_len == heap_cap) { heap_cap = heap_cap * 2 + 1024; heap = realloc(heap, heap_cap * sizeof *heap); }
    heap[heap_len] = c; c->heap_idx = heap_len++; heap_up(c->heap_idx);
}
static void heap_remove(conn_t *c) {
    int i = c->heap_idx;
    c->heap_idx = -1;
    if (i < 0) return;
    heap_len--;
    if (i == heap_len) return;
    heap[i] = heap[heap_len]; heap[i]->heap_idx = i;
    heap_up(i); heap_down(heap[i]->heap_idx);
}

/* ---- output ---- */
static void set_out_interest(conn_t *c, int want) {
    if (c->want_out == want) return;
    c->want_out = want;
    struct epoll_event ev = {.events = EPOLLIN | (want ? EPOLLOUT : 0), .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
}

/* Write what is pending; -1 when the peer is gone. */
static int flush_out(conn_t *c) {
    size_t done = 0;
    while (done < c->out.len) {
        ssize_t n = send(c->fd, c->out.data + done, c->out.len - done, MSG_NOSIGNAL);
        if (n > 0) { done += (size_t)n; continue; }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        return -1;
    }
    memmove(c->out.data, c->out.data + done, c->out.len - done);
    c->out.len -= done;
    set_out_interest(c, c->out.len > 0);
    return 0;
}

static void add_http_chunk(buf_t *b, const char *s, size_t n) {
    buf_printf(b, "%zx\r\n", n);
    buf_add(b, s, n);
    buf_add(b, "\r\n", 2);
}

static void log_request(conn_t *c, int aborted) {
    buf_printf(&log_buf, "%ld %ld %ld %d %d", c->seq, (long)c->rx, (long)c->parse, c->max_tokens, aborted);
    for (int i = 0; i < c->chunk_idx; i++) buf_printf(&log_buf, " %ld", (long)c->emitted[i]);
    buf_add(&log_buf, "\n", 1);
}

static void close_conn(conn_t *c) {
    if (c->streaming) { log_request(c, 1); heap_remove(c); }
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c->in.data); free(c->out.data); free(c->emitted); free(c);
}

/* Emit chunk c->chunk_idx now; -1 when the peer is gone. */
static int emit_chunk(conn_t *c) {
    char text[4096], ev[8192];
    int n_tok = c->max_tokens - c->sent_tokens < tokens_per_chunk ? c->max_tokens - c->sent_tokens : tokens_per_chunk;
    size_t tl = 0;
    for (int t = 0; t < n_tok; t++)
        tl += c->sent_tokens + t == 0 ? (size_t)snprintf(text + tl, sizeof text - tl, " @%ld", c->seq)
                                      : (size_t)snprintf(text + tl, sizeof text - tl, " w");
    c->sent_tokens += n_tok;
    int last = c->sent_tokens >= c->max_tokens;
    const char *finish = last ? "\"length\"" : "null";
    char usage[160] = "";
    if (usage_per_chunk)
        snprintf(usage, sizeof usage, ",\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}",
                 c->prompt_tokens, c->sent_tokens, c->prompt_tokens + c->sent_tokens);
    int n = c->chat
        ? snprintf(ev, sizeof ev, "data: {\"id\":\"cmpl-%ld\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"%s\","
                   "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"%s\"},\"logprobs\":null,\"finish_reason\":%s}]%s}\n\n",
                   c->seq, model, text, finish, usage)
        : snprintf(ev, sizeof ev, "data: {\"id\":\"cmpl-%ld\",\"object\":\"text_completion\",\"created\":0,\"model\":\"%s\","
                   "\"choices\":[{\"index\":0,\"text\":\"%s\",\"logprobs\":null,\"finish_reason\":%s,\"stop_reason\":null}]%s}\n\n",
                   c->seq, model, text, finish, usage);
    add_http_chunk(&c->out, ev, (size_t)n);
    if (last) {
        n = snprintf(ev, sizeof ev, "data: {\"id\":\"cmpl-%ld\",\"object\":\"%s\",\"created\":0,\"model\":\"%s\",\"choices\":[],"
                     "\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\n",
                     c->seq, c->chat ? "chat.completion.chunk" : "text_completion", model, c->prompt_tokens,
                     c->sent_tokens, c->prompt_tokens + c->sent_tokens);
        add_http_chunk(&c->out, ev, (size_t)n);
        add_http_chunk(&c->out, "data: [DONE]\n\n", 14);
        buf_add(&c->out, "0\r\n\r\n", 5);
    }
    c->emitted[c->chunk_idx++] = now_ns(CLOCK_MONOTONIC);
    if (!c->want_out && flush_out(c) < 0) return -1;  /* else the buffer drains on EPOLLOUT */
    if (last) {
        log_request(c, 0);
        c->streaming = 0;
        free(c->emitted); c->emitted = NULL;
    }
    return 0;
}

/* ---- requests ---- */
static void send_simple(conn_t *c, const char *status, const char *body) {
    buf_printf(&c->out, "HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s", status,
               strlen(body), body);
    flush_out(c);
}

static int json_int(const char *body, size_t len, const char *key, int fallback) {
    char *p = memmem(body, len, key, strlen(key));
    if (!p) return fallback;
    p += strlen(key);
    while (p < body + len && (*p == ' ' || *p == ':' || *p == '"')) p++;
    return p < body + len && *p >= '0' && *p <= '9' ? atoi(p) : fallback;
}

static void start_stream(conn_t *c, const char *body, size_t body_len, int chat) {
    c->chat = chat;
    c->seq = worker_id + (long)num_workers * next_seq++;
    c->max_tokens = json_int(body, body_len, "\"max_tokens\"", json_int(body, body_len, "\"max_completion_tokens\"", default_tokens));
    if (c->max_tokens < 1) c->max_tokens = 1;
    c->prompt_tokens = (int)(body_len / 4);
    c->sent_tokens = 0;
    c->chunk_idx = 0;
    c->num_chunks = (c->max_tokens + tokens_per_chunk - 1) / tokens_per_chunk;
    c->emitted = malloc(sizeof(ns_t) * c->num_chunks);
    c->next_due = c->parse + ttft_ns;
    c->streaming = 1;
    buf_printf(&c->out, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                        "Transfer-Encoding: chunked\r\n\r\n");
    flush_out(c);
    heap_push(c);
}

/* Handle every complete request in c->in (one at a time: a stream must end before the next starts). */
static void handle_input(conn_t *c) {
    while (!c->streaming && c->in.len > 0) {
        char *end = memmem(c->in.data, c->in.len, "\r\n\r\n", 4);
        if (!end) return;
        size_t head_len = (size_t)(end - c->in.data) + 4, body_len = 0;
        for (char *p = c->in.data; p < end; p++)
            if ((p == c->in.data || p[-1] == '\n') && strncasecmp(p, "content-length:", 15) == 0) body_len = strtoul(p + 15, NULL, 10);
        if (c->in.len < head_len + body_len) return;
        char *body = c->in.data + head_len;
        if (strncmp(c->in.data, "POST /v1/completions ", 21) == 0) start_stream(c, body, body_len, 0);
        else if (strncmp(c->in.data, "POST /v1/chat/completions ", 26) == 0) start_stream(c, body, body_len, 1);
        else if (strncmp(c->in.data, "GET /v1/models ", 15) == 0) {
            char models[512];
            snprintf(models, sizeof models, "{\"object\":\"list\",\"data\":[{\"id\":\"%s\",\"object\":\"model\",\"created\":0,"
                     "\"owned_by\":\"emitter\",\"root\":\"%s\",\"max_model_len\":1000000}]}", model, model);
            send_simple(c, "200 OK", models);
        } else if (strncmp(c->in.data, "GET /health ", 12) == 0) send_simple(c, "200 OK", "{}");
        else send_simple(c, "404 Not Found", "{\"error\":\"not found\"}");
        memmove(c->in.data, c->in.data + head_len + body_len, c->in.len - head_len - body_len);
        c->in.len -= head_len + body_len;
    }
}

/* Read what arrived; -1 when the peer closed. rx: the kernel's timestamp of the last segment read. */
static int read_input(conn_t *c) {
    for (;;) {
        char data[65536], control[256];
        struct iovec iov = {data, sizeof data};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
        ssize_t n = recvmsg(c->fd, &msg, 0);
        if (n == 0) return -1;
        if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : errno == EINTR ? 0 : -1;
        ns_t parse = now_ns(CLOCK_MONOTONIC), rx = parse;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm))
            if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_TIMESTAMPNS) {
                struct timespec ts;
                memcpy(&ts, CMSG_DATA(cm), sizeof ts);
                rx = (ns_t)ts.tv_sec * 1000000000 + ts.tv_nsec - realtime_to_mono;
            }
        if (!c->streaming) { c->rx = rx < parse ? rx : parse; c->parse = parse; }
        buf_add(&c->in, data, (size_t)n);
        if (!c->streaming) handle_input(c);
    }
}

static void accept_all(int lfd) {
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
        if (fd < 0) return;
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        conn_t *c = calloc(1, sizeof *c);
        c->fd = fd; c->heap_idx = -1;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    }
}

static void on_signal(int sig) { (void)sig; stopping = 1; }

static void write_log(void) {
    char path[4096];
    snprintf(path, sizeof path, "%s/emitter-%d.txt", out_dir, worker_id);
    FILE *f = fopen(path, "w");
    if (!f) { perror(path); exit(1); }
    fprintf(f, "# ttft_ns=%ld gap_ns=%ld tokens_per_chunk=%d usage_per_chunk=%d\n", (long)ttft_ns, (long)gap_ns,
            tokens_per_chunk, usage_per_chunk);
    fwrite(log_buf.data, 1, log_buf.len, f);
    fclose(f);
}

static int serve(int port) {
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    setsockopt(lfd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
    setsockopt(lfd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);  /* accepted sockets inherit it */
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(lfd, 4096) < 0) { perror("bind/listen"); return 1; }
    prctl(PR_SET_TIMERSLACK, 1UL);  /* wake on time: the default 50 us slack would be lateness */
    ep = epoll_create1(0);
    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = &lfd}, tev = {.events = EPOLLIN, .data.ptr = &tfd};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &lev);
    epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &tev);
    struct epoll_event events[1024];
    while (!stopping) {
        ns_t now = now_ns(CLOCK_MONOTONIC);
        int emitted = 0;  /* when far behind, still look at sockets every 1024 chunks */
        while (heap_len > 0 && heap[0]->next_due <= now && emitted++ < 1024) {
            conn_t *c = heap[0];
            if (emit_chunk(c) < 0) { close_conn(c); continue; }
            now = now_ns(CLOCK_MONOTONIC);
            if (c->streaming) { c->next_due += gap_ns; heap_down(0); continue; }
            heap_remove(c);
            c->rx = c->parse = now;  /* a request already waiting on this connection starts now */
            handle_input(c);
        }
        if (heap_len > 0) {
            struct itimerspec its = {.it_value = {heap[0]->next_due / 1000000000, heap[0]->next_due % 1000000000}};
            timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
        }
        int n = epoll_wait(ep, events, 1024, -1);
        for (int i = 0; i < n; i++) {
            void *p = events[i].data.ptr;
            if (p == &lfd) { accept_all(lfd); continue; }
            if (p == &tfd) { uint64_t x; (void)!read(tfd, &x, sizeof x); continue; }
            conn_t *c = p;
            int gone = 0;
            if (events[i].events & EPOLLOUT) gone = flush_out(c) < 0;
            if (!gone && events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) gone = read_input(c) < 0;
            if (gone) close_conn(c);
        }
    }
    write_log();
    return 0;
}

int main(int argc, char **argv) {
    int port = 8000, opt;
    double ttft_ms = 50, gap_ms = 10;
    while ((opt = getopt(argc, argv, "p:t:g:k:n:u:w:o:m:")) != -1) {
        switch (opt) {
        case 'p': port = atoi(optarg); break;
        case 't': ttft_ms = atof(optarg); break;
        case 'g': gap_ms = atof(optarg); break;
        case 'k': tokens_per_chunk = atoi(optarg); break;
        case 'n': default_tokens = atoi(optarg); break;
        case 'u': usage_per_chunk = atoi(optarg); break;
        case 'w': num_workers = atoi(optarg); break;
        case 'o': out_dir = optarg; break;
        case 'm': model = optarg; break;
        default: fprintf(stderr, "usage: %s -p PORT -t TTFT_MS -g GAP_MS -k K -o OUT [-n N] [-u 0|1] [-w W] [-m MODEL]\n", argv[0]); return 2;
        }
    }
    if (tokens_per_chunk < 1 || tokens_per_chunk > 256 || num_workers < 1 || gap_ms < 0 || ttft_ms < 0) {
        fprintf(stderr, "emitter: need 1 <= k <= 256, w >= 1, gap and ttft >= 0\n");
        return 2;
    }
    ttft_ns = (ns_t)(ttft_ms * 1e6);
    gap_ns = (ns_t)(gap_ms * 1e6);
    realtime_to_mono = now_ns(CLOCK_REALTIME) - now_ns(CLOCK_MONOTONIC);
    struct sigaction sa = {.sa_handler = on_signal};  /* no SA_RESTART: epoll_wait returns EINTR */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (num_workers == 1) return serve(port);
    pid_t kids[num_workers];
    for (int w = 0; w < num_workers; w++)
        if ((kids[w] = fork()) == 0) { worker_id = w; return serve(port); }
    while (!stopping) pause();
    for (int w = 0; w < num_workers; w++) kill(kids[w], SIGTERM);
    for (int w = 0; w < num_workers; w++) waitpid(kids[w], NULL, 0);
    return 0;
}
