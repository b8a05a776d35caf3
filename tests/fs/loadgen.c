/* A small stand-in for fio's libaio engine, for tests/fs/bench_workers.py on machines without fio
 * (a lent GPU machine): NUMJOBS threads, each with its own O_DIRECT descriptor and its own Linux
 * AIO context (the raw syscalls, so no libaio), keep IODEPTH reads of BS bytes in flight for
 * SECONDS: random block-aligned offsets over the file (randread) or the file in order, wrapping
 * (read).  The SECONDS window starts once every job has opened the file and set up its context
 * and buffers, so setup is not counted.  Prints one JSON line with fio's read fields bw_bytes and
 * total_ios.  A short read, an I/O error or a completion that does not come within WAIT_S is one
 * line on stderr and exit 1, never counted.  Built static (libc only):
 * gcc -O2 -static -pthread -o loadgen loadgen.c
 *
 *   loadgen [--buffered] [--verify] FILE randread|read BS[k|m] IODEPTH NUMJOBS SECONDS
 *
 * --buffered drops O_DIRECT, for filesystems without it (tmpfs); without it BS must be a multiple
 * of 512.  --verify checks every block read holds the offset pattern (the byte at file offset O
 * is O mod 256, as the tests write it): a block that differs is one line and exit 1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/aio_abi.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define WAIT_S 30 /* the longest wait for one completion */

static const char *path;
static int random_offsets, direct = 1, verify, iodepth, numjobs;
static uint64_t bs, blocks;
static double seconds, start, deadline;
static pthread_barrier_t ready, go; /* every job set up; start and deadline taken */

struct job {
    pthread_t thread;
    int index;
    uint64_t ios;
};

static void fail(const char *fmt, ...) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    va_list ap;
    pthread_mutex_lock(&lock); /* one line, then exit: the first failure wins */
    fputs("loadgen: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t parse_size(const char *s) {
    char *end;
    int shift = 0;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end == 'k' || *end == 'K')
        shift = 10, end++;
    else if (*end == 'm' || *end == 'M')
        shift = 20, end++;
    if (*end || v == 0 || *s < '0' || *s > '9')
        fail("block size %s: want a positive number with an optional k or m", s);
    if (errno == ERANGE || v > (ULLONG_MAX >> shift))
        fail("block size %s: too large", s);
    v <<= shift;
    if (direct && v % 512)
        fail("block size %s: O_DIRECT wants a multiple of 512 (or --buffered)", s);
    return v;
}

static int parse_count(const char *s, const char *what) {
    char *end;
    long v = strtol(s, &end, 10);
    if (*end || v < 1 || v > 65536)
        fail("%s %s: want 1 to 65536", what, s);
    return (int)v;
}

static void check_pattern(const unsigned char *buf, uint64_t offset) {
    for (uint64_t i = 0; i < bs; i++)
        if (buf[i] != (unsigned char)(offset + i))
            fail("data at %llu: %u, the pattern wants %u", (unsigned long long)(offset + i),
                 buf[i], (unsigned)(unsigned char)(offset + i));
}

static void *run_job(void *arg) {
    struct job *job = arg;
    aio_context_t ctx = 0;
    struct iocb *cbs = calloc((size_t)iodepth, sizeof(*cbs));
    struct iocb **batch = calloc((size_t)iodepth, sizeof(*batch));
    struct io_event *events = calloc((size_t)iodepth, sizeof(*events));
    uint64_t next = 0, rng = 0x9E3779B97F4A7C15ULL * (uint64_t)(job->index + 1) ^ (uint64_t)time(0);
    int fd = open(path, O_RDONLY | (direct ? O_DIRECT : 0));
    if (fd < 0)
        fail("%s: %s%s", path, strerror(errno),
             errno == EINVAL && direct ? " (no O_DIRECT here: --buffered)" : "");
    if (!cbs || !batch || !events)
        fail("out of memory");
    if (syscall(SYS_io_setup, iodepth, &ctx) < 0)
        fail("io_setup(%d): %s", iodepth, strerror(errno));
    for (int i = 0; i < iodepth; i++) {
        void *buf;
        if (posix_memalign(&buf, 4096, bs))
            fail("out of memory");
        cbs[i].aio_fildes = (uint32_t)fd;
        cbs[i].aio_lio_opcode = IOCB_CMD_PREAD;
        cbs[i].aio_buf = (uint64_t)(uintptr_t)buf;
        cbs[i].aio_nbytes = bs;
        cbs[i].aio_data = (uint64_t)i;
    }
    pthread_barrier_wait(&ready);
    pthread_barrier_wait(&go); /* main has taken start and deadline */
    int queued = 0, inflight = 0;
    for (int i = 0; i < iodepth; i++)
        batch[queued++] = &cbs[i];
    while (queued || inflight) {
        for (int i = 0; i < queued; i++) {
            uint64_t block;
            if (random_offsets) {
                rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17; /* xorshift64 */
                block = rng % blocks;
            } else {
                block = next++ % blocks;
            }
            batch[i]->aio_offset = (int64_t)(block * bs);
        }
        for (int i = 0; i < queued; i++) { /* one io_submit a read, as fio's iodepth_batch=1 */
            long n = syscall(SYS_io_submit, ctx, 1L, batch + i);
            if (n != 1)
                fail("io_submit: %s", n < 0 ? strerror(errno) : "took none");
        }
        inflight += queued;
        queued = 0;
        struct timespec wait = {WAIT_S, 0};
        long n = syscall(SYS_io_getevents, ctx, 1L, (long)iodepth, events, &wait);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            fail("io_getevents: %s", strerror(errno));
        if (n == 0)
            fail("no read completed in %d s", WAIT_S);
        int more = now() < deadline;
        for (long i = 0; i < n; i++) {
            struct iocb *cb = (struct iocb *)(uintptr_t)events[i].obj;
            if (events[i].res < 0)
                fail("read at %lld: %s", (long long)cb->aio_offset, strerror((int)-events[i].res));
            if ((uint64_t)events[i].res != bs)
                fail("short read at %lld: %lld of %llu bytes", (long long)cb->aio_offset,
                     (long long)events[i].res, (unsigned long long)bs);
            if (verify)
                check_pattern((const unsigned char *)(uintptr_t)cb->aio_buf,
                              (uint64_t)cb->aio_offset);
            job->ios++;
            inflight--;
            if (more)
                batch[queued++] = cb;
        }
    }
    syscall(SYS_io_destroy, ctx);
    close(fd);
    return NULL;
}

int main(int argc, char **argv) {
    int a = 1;
    for (; a < argc && strncmp(argv[a], "--", 2) == 0; a++) {
        if (strcmp(argv[a], "--buffered") == 0)
            direct = 0;
        else if (strcmp(argv[a], "--verify") == 0)
            verify = 1;
        else
            fail("option %s: want --buffered or --verify", argv[a]);
    }
    if (argc - a != 6)
        fail("usage: loadgen [--buffered] [--verify] FILE randread|read BS[k|m] IODEPTH NUMJOBS "
             "SECONDS");
    path = argv[a];
    if (strcmp(argv[a + 1], "randread") == 0)
        random_offsets = 1;
    else if (strcmp(argv[a + 1], "read") != 0)
        fail("rw %s: want randread or read", argv[a + 1]);
    bs = parse_size(argv[a + 2]);
    iodepth = parse_count(argv[a + 3], "iodepth");
    numjobs = parse_count(argv[a + 4], "numjobs");
    char *end;
    seconds = strtod(argv[a + 5], &end);
    if (*end || end == argv[a + 5] || !isfinite(seconds) || !(seconds > 0))
        fail("seconds %s: want a positive finite number", argv[a + 5]);
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        fail("%s: %s", path, strerror(errno));
    off_t size = lseek(fd, 0, SEEK_END);
    close(fd);
    blocks = size > 0 ? (uint64_t)size / bs : 0;
    if (blocks == 0)
        fail("%s: %lld bytes, less than one block of %llu", path, (long long)size,
             (unsigned long long)bs);

    struct job *jobs = calloc((size_t)numjobs, sizeof(*jobs));
    if (!jobs)
        fail("out of memory");
    pthread_barrier_init(&ready, NULL, (unsigned)numjobs + 1);
    pthread_barrier_init(&go, NULL, (unsigned)numjobs + 1);
    for (int i = 0; i < numjobs; i++) {
        jobs[i].index = i;
        if (pthread_create(&jobs[i].thread, NULL, run_job, &jobs[i]))
            fail("cannot start job %d", i);
    }
    pthread_barrier_wait(&ready); /* a job that cannot set up exits the process instead */
    start = now();
    deadline = start + seconds;
    pthread_barrier_wait(&go);
    uint64_t ios = 0;
    for (int i = 0; i < numjobs; i++) {
        pthread_join(jobs[i].thread, NULL);
        ios += jobs[i].ios;
    }
    double elapsed = now() - start;
    printf("{\"generator\": \"loadgen\", \"rw\": \"%s\", \"bs\": %llu, \"iodepth\": %d, "
           "\"numjobs\": %d, \"direct\": %d, \"runtime_s\": %.3f, \"total_ios\": %llu, "
           "\"io_bytes\": %llu, \"bw_bytes\": %.0f, \"iops\": %.0f}\n",
           argv[a + 1], (unsigned long long)bs, iodepth, numjobs, direct, elapsed,
           (unsigned long long)ios, (unsigned long long)(ios * bs), (double)(ios * bs) / elapsed,
           (double)ios / elapsed);
    return 0;
}
